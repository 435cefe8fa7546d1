/* libFuzzer target: the EP rendezvous card as it comes out of Redis, where whoever can
 * write Redis decides its bytes. ro_fab_card_check must refuse anything but a card of this
 * build for this region, signed with the group secret, without reading past the input,
 * and never accept a card it was not given the secret of. Seeds: corpus/ep_card/ (cards
 * signed with FUZZ_SECRET for a FUZZ_REGION-byte region, and broken ones). */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ep/internal.h"

#define FUZZ_SECRET "rolloutd-fuzz-ep-card-secret"
#define FUZZ_REGION ((size_t)1 << 20)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const uint8_t *key = (const uint8_t *)FUZZ_SECRET;
	const size_t klen = sizeof(FUZZ_SECRET) - 1;
	char err[256];
	uint8_t *copy;
	int keyed, bare;

	/* an exact-size heap copy: a read past the input is an overflow the sanitizer sees */
	copy = malloc(size ? size : 1);
	if (!copy)
		return 0;
	if (size)
		memcpy(copy, data, size);
	keyed = ro_fab_card_check(copy, size, key, klen, FUZZ_REGION, err, sizeof(err));
	if (keyed && (keyed != -EPROTO && keyed != -EPERM && keyed != -EIO))
		abort();
	if (keyed && !memchr(err, 0, sizeof(err)))
		abort();
	/* no secret: a signed card is refused, so a card cannot pass both ways */
	bare = ro_fab_card_check(copy, size, NULL, 0, FUZZ_REGION, err, sizeof(err));
	if (!keyed && !bare)
		abort();
	/* what passed is what ro_fab_connect will read */
	if (!keyed) {
		struct ro_fab_card c;

		if (size != sizeof(c))
			abort();
		memcpy(&c, copy, sizeof(c));
		if (c.len != FUZZ_REGION || c.name_len > sizeof(c.name) || c.rank >= c.world ||
		    !memchr(c.host, 0, sizeof(c.host)) || !(c.flags & RO_FAB_CARD_SIGNED))
			abort();
	}
	free(copy);
	return 0;
}
