/* Fuzz target: the checkpoint format (queue/progress.c) as read back from the unit hash,
 * where anything may have been written. A decoded checkpoint must encode, and that text
 * must decode to the same checkpoint (encode(decode(x)) is a fixed point). */
#include "tests/fuzz/fuzz.h"

#include <errno.h>

#include "queue/queue.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *s = fuzz_cstr(data, size), *e1, *e2;
	struct ro_progress p, q;
	int r;

	r = ro_progress_decode(s, 1, &p);
	free(s);
	if (r) {
		FUZZ_ASSERT(r == -EINVAL || r == -ENOMEM);
		return 0;
	}
	FUZZ_ASSERT(p.idx == 1 && p.n_pv <= RO_MAX_PV);
	for (uint32_t i = 0; i < p.n_pv; i++)
		FUZZ_ASSERT(p.pv[i].start <= p.len && (!i || p.pv[i].start >= p.pv[i - 1].start));
	e1 = ro_progress_encode(&p);
	FUZZ_ASSERT(e1);
	r = ro_progress_decode(e1, 1, &q);
	if (r)
		(void)fprintf(stderr, "encoded checkpoint refused: %s\n", e1);
	FUZZ_ASSERT(r == 0);
	FUZZ_ASSERT(q.len == p.len && q.sampler_pos == p.sampler_pos && q.n_pv == p.n_pv);
	FUZZ_ASSERT(!memcmp(q.tokens, p.tokens, p.len * sizeof(*p.tokens)));
	e2 = ro_progress_encode(&q);
	FUZZ_ASSERT(e2);
	if (strcmp(e1, e2))
		(void)fprintf(stderr, "not a fixed point:\n  %s\n  %s\n", e1, e2);
	FUZZ_ASSERT(!strcmp(e1, e2));
	free(e1);
	free(e2);
	ro_progress_clear(&p);
	ro_progress_clear(&q);
	return 0;
}
