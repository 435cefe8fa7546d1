/* The checkpoint format of an unfinished sample, as stored in the unit hash (p:<idx>):
 * {"tokens":[...],"logprobs":[...],"pos":N,"pv":V}. pos is the counter-based sampler's
 * position, so a sample resumed from its prefix continues exactly where it stopped. */
#include "queue/queue.h"
#include "queue/internal.h"

#include <errno.h>
#include <math.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t put_ints(char *s, size_t cap, const int32_t *v, uint32_t n)
{
	size_t off = 0;

	s[off++] = '[';
	for (uint32_t i = 0; i < n; i++)
		off += (size_t)snprintf(s + off, cap - off, i ? ",%d" : "%d", v[i]);
	s[off++] = ']';
	s[off] = '\0';
	return off;
}

/* %.9g round-trips every float32; -0.0 is spelled so a JSON parser keeps its sign, and a
 * non-finite value (never a sampled token's logprob) becomes the most negative float */
static size_t put_floats(char *s, size_t cap, const float *v, uint32_t n)
{
	size_t off = 0;

	s[off++] = '[';
	for (uint32_t i = 0; i < n; i++) {
		float x = isfinite(v[i]) ? v[i] : -3.40282347e38f;

		if (i)
			s[off++] = ',';
		if (x == 0 && signbit(x))
			off += (size_t)snprintf(s + off, cap - off, "-0.0");
		else
			off += (size_t)snprintf(s + off, cap - off, "%.9g", (double)x);
	}
	s[off++] = ']';
	s[off] = '\0';
	return off;
}

char *ro_json_ints(const int32_t *v, uint32_t n)
{
	size_t cap = (size_t)n * 12 + 3;
	char *s = malloc(cap);

	if (s)
		(void)put_ints(s, cap, v, n);
	return s;
}

char *ro_json_floats(const float *v, uint32_t n)
{
	size_t cap = (size_t)n * 18 + 3;
	char *s = malloc(cap);

	if (s)
		(void)put_floats(s, cap, v, n);
	return s;
}

char *ro_progress_encode(const struct ro_progress *p)
{
	size_t cap = (size_t)p->len * 30 + 96, off = 0;
	char *s = malloc(cap);

	if (!s)
		return NULL;
	off += (size_t)snprintf(s + off, cap - off, "{\"tokens\":");
	off += put_ints(s + off, cap - off, p->tokens, p->len);
	off += (size_t)snprintf(s + off, cap - off, ",\"logprobs\":");
	off += put_floats(s + off, cap - off, p->logprobs, p->len);
	(void)snprintf(s + off, cap - off, ",\"pos\":%" PRIu64 ",\"pv\":%" PRId64 "}",
		       p->sampler_pos, p->policy_version);
	return s;
}

void ro_progress_clear(struct ro_progress *p)
{
	free(p->tokens);
	free(p->logprobs);
	memset(p, 0, sizeof(*p));
}

int ro_progress_decode(const char *s, uint32_t idx, struct ro_progress *ret)
{
	struct json_object *o = json_tokener_parse(s), *t, *l, *pos, *pv;
	struct ro_progress p = {.idx = idx};
	int r = -EINVAL;
	size_t n;

	if (!o || !json_object_object_get_ex(o, "tokens", &t) ||
	    !json_object_object_get_ex(o, "logprobs", &l) ||
	    !json_object_object_get_ex(o, "pos", &pos) ||
	    !json_object_is_type(t, json_type_array) || !json_object_is_type(l, json_type_array))
		goto out;
	n = json_object_array_length(t);
	if (json_object_array_length(l) != n || n > UINT32_MAX)
		goto out;
	p.len = (uint32_t)n;
	p.tokens = calloc(n + 1, sizeof(*p.tokens));
	p.logprobs = calloc(n + 1, sizeof(*p.logprobs));
	if (!p.tokens || !p.logprobs) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < n; i++) {
		p.tokens[i] = json_object_get_int(json_object_array_get_idx(t, i));
		p.logprobs[i] = (float)json_object_get_double(json_object_array_get_idx(l, i));
	}
	p.sampler_pos = (uint64_t)json_object_get_int64(pos);
	if (json_object_object_get_ex(o, "pv", &pv))
		p.policy_version = json_object_get_int64(pv);
	*ret = p;
	memset(&p, 0, sizeof(p));
	r = 0;
out:
	ro_progress_clear(&p);
	json_object_put(o);
	return r;
}
