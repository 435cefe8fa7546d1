/* Private to kernels/ep/: the libfabric transport (fabric.c) under the dispatch/combine
 * protocol (dispatch.c). One RDM endpoint, one registered region peers write into, one
 * registered send area, RMA writes that carry 4 bytes of remote CQ data. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* Monotonic time for deadlines (ms) and timings (fractional ms). */
static inline int64_t ro_ep_mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline double ro_ep_mono_msf(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct ro_fab;

/* ---- the rendezvous card ---- *
 * What a rank publishes (through Redis) so that its peers can reach it: the fabric
 * address, the region's address and key, and for the same-host direct path the pid and
 * fd of the region's memfd. Whoever can write the card in Redis must not be able to make
 * a rank store into an arbitrary file, so a card is (1) signed, with the group secret, by
 * HMAC-SHA256 over every byte before `mac`, and (2) its fd is only mapped once the file
 * behind it proved to be this peer's sealed region memfd of the right name and size.
 * Fixed layout, no padding, host byte order (a group runs one build on one architecture). */
#define RO_FAB_CARD_MAGIC 0x43454f52u	  /* "ROEC" in memory on little-endian hosts */
#define RO_FAB_CARD_OLD_MAGIC 0x524f4550u /* the unversioned card before version 2 */
#define RO_FAB_CARD_VERSION 2u
#define RO_FAB_CARD_SIGNED 1u /* flags: mac is HMAC-SHA256(secret, bytes before it) */
#define RO_FAB_MAC_LEN 32

struct ro_fab_card {
	uint32_t magic, version;
	uint32_t rank, world;
	uint32_t name_len, flags;
	uint64_t base, key, len; /* the region: address (FI_MR_VIRT_ADDR) or 0, key, length */
	uint64_t group_tag;	 /* the first 8 bytes of SHA-256(group id) */
	uint64_t nonce;		 /* random per endpoint: part of the memfd's name */
	int32_t pid, fd;	 /* the region's memfd as /proc/<pid>/fd/<fd>; fd -1: none */
	uint8_t name[256];	 /* fabric address (fi_getname), name_len bytes */
	char host[96];		 /* "<boot id>:<pid namespace>", NUL terminated */
	uint8_t mac[RO_FAB_MAC_LEN];
};

/* Everything about a card that needs no live peer: length, magic and version, the
 * signature (with a secret: present and right; without: absent), name_len, region length,
 * the host string's NUL, the pid/fd and rank/world ranges. 0, or -EPROTO (not a card of
 * this build) / -EPERM (signature) with a message about "card ..." in err. */
int ro_fab_card_check(const void *buf, size_t len, const uint8_t *secret, size_t secret_len,
		      size_t region_len, char *err, size_t errlen);
/* Set flags and mac of a card in place (tests forge cards with it). */
int ro_fab_card_sign(struct ro_fab_card *c, const uint8_t *secret, size_t secret_len);
/* The memfd name the region of (rank, world, group_tag, nonce) carries. */
void ro_fab_region_name(char *buf, size_t len, uint32_t rank, uint32_t world, uint64_t group_tag,
			uint64_t nonce);
uint64_t ro_fab_group_tag(const char *group);

/* Who this endpoint is: its rank of the group (named by group, any string) and the
 * secret that signs the cards (secret_len 0: unsigned cards). */
struct ro_fab_id {
	uint32_t rank, world;
	const char *group;
	const uint8_t *secret;
	size_t secret_len;
};

/* Open an RDM endpoint on provider (NULL: best available) with a region of region_len
 * bytes that peers may write and a send area of send_len bytes (both zeroed, lazily
 * backed). With direct and the shm provider, the region is shareable: peers of this host
 * map it and store into it (ro_fab_peer_region), the fabric only signals. */
int ro_fab_open(const char *provider, size_t region_len, size_t send_len, bool direct,
		const struct ro_fab_id *id, struct ro_fab **ret, char *err, size_t errlen);
struct ro_fab *ro_fab_close(struct ro_fab *f);
const char *ro_fab_provider(const struct ro_fab *f);
void *ro_fab_region(struct ro_fab *f);
void *ro_fab_send(struct ro_fab *f);
/* Bytes one RMA write carries at most: longer messages go in chunks, each with its own CQ
 * data (no ordering between them is assumed). Same for every rank of a provider. */
size_t ro_fab_chunk(const struct ro_fab *f);

/* This rank's card (signed when the endpoint has a secret) into buf (RO_EP_CARD_MAX). */
int ro_fab_card(struct ro_fab *f, void *buf, size_t *ret_len);
/* Every rank's card, by rank: each must pass ro_fab_card_check and name its own rank,
 * world and group. A same-host peer's region is mapped only after its fd proved to be that
 * peer's region (see verify_region in fabric.c); -EPERM, naming the rank and the reason,
 * when it is something else: a hostile card. */
int ro_fab_connect(struct ro_fab *f, const void *const *cards, const size_t *lens, char *err,
		   size_t errlen);

/* Write len bytes (len may be 0) from the send area at soff into peer's region at roff,
 * in chunks, each chunk delivering `data` to the peer's completion queue. Writes to this
 * rank itself are a memcpy, their arrival seen by the next poll. */
int ro_fab_write(struct ro_fab *f, uint32_t peer, size_t soff, size_t len, size_t roff,
		 uint32_t data, char *err, size_t errlen);
/* Same host, shm: the peer's region mapped here (write rows into it, then ro_fab_signal),
 * or NULL when the data must go through the fabric. */
void *ro_fab_peer_region(struct ro_fab *f, uint32_t peer);
/* Announce len bytes already stored into the peer's mapped region: the signals (one per
 * chunk, as a write of that length would) carry data, after a release fence. */
int ro_fab_signal(struct ro_fab *f, uint32_t peer, size_t len, uint32_t data, char *err,
		  size_t errlen);
/* The arrival of a message to this rank itself whose len bytes are already in place (the
 * packer wrote them into the region directly). */
int ro_fab_signal_self(struct ro_fab *f, size_t len, uint32_t data);
/* Wait until every posted write has completed locally (its source may be reused), up to
 * the timeout. Arrivals seen meanwhile wait for the next ro_fab_poll. */
int ro_fab_drain_tx(struct ro_fab *f, char *err, size_t errlen);
/* Progress the completion queue: every remote CQ data entry goes to on_data. Returns the
 * number of entries handled, or -errno with the message (naming the peer) in err. */
typedef void (*ro_fab_data_fn)(void *arg, uint32_t data);
int ro_fab_poll(struct ro_fab *f, ro_fab_data_fn on_data, void *arg, char *err, size_t errlen);
/* How long a write may wait for the provider to accept it (default 10 s). */
void ro_fab_set_timeout(struct ro_fab *f, uint32_t ms);
