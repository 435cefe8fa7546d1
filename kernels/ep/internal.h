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

/* Open an RDM endpoint on provider (NULL: best available) with a region of region_len
 * bytes that peers may write and a send area of send_len bytes (both zeroed, lazily
 * backed). With direct and the shm provider, the region is shareable: peers of this host
 * map it and store into it (ro_fab_peer_region), the fabric only signals. */
int ro_fab_open(const char *provider, size_t region_len, size_t send_len, bool direct,
		struct ro_fab **ret, char *err, size_t errlen);
struct ro_fab *ro_fab_close(struct ro_fab *f);
const char *ro_fab_provider(const struct ro_fab *f);
void *ro_fab_region(struct ro_fab *f);
void *ro_fab_send(struct ro_fab *f);
/* Bytes one RMA write carries at most: longer messages go in chunks, each with its own CQ
 * data (no ordering between them is assumed). Same for every rank of a provider. */
size_t ro_fab_chunk(const struct ro_fab *f);

int ro_fab_card(struct ro_fab *f, void *buf, size_t *ret_len);
int ro_fab_connect(struct ro_fab *f, uint32_t rank, uint32_t world, const void *const *cards,
		   const size_t *lens, char *err, size_t errlen);

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
