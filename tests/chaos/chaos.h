/* The chaos soak's shared parts: the private redis-server that the driver crashes, pauses
 * and restarts (AOF, fsync always or everysec), the run record that the driver writes and
 * the checker reads, the fault kinds, a seeded generator and the tiny model both use.
 * tests/chaos/chaos.c injects the faults; tests/chaos/check.c judges what is left. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

/* ---- fault kinds (the names of --faults and of the checker's table) -------------------- */

enum ch_kind {
	CH_KILL,	  /* SIGKILL an agent, start a replacement (sometimes the same worker id) */
	CH_STOP,	  /* SIGSTOP past the lease, then SIGCONT: a zombie */
	CH_SPOT,	  /* spot interruption notice, deadline 5-120 s from now */
	CH_REBALANCE,	  /* rebalance recommendation (agents run with rebalance = drain) */
	CH_LIFECYCLE,	  /* ASG target lifecycle state -> Terminated */
	CH_SIGTERM,	  /* SIGTERM: drain within sigterm-grace-s */
	CH_CTL,		  /* rolloutctl drain --deadline S over the control socket */
	CH_REDIS_RESTART, /* SIGKILL redis-server, start again at once (AOF replayed) */
	CH_REDIS_PAUSE,	  /* SIGSTOP redis-server past the lease, SIGCONT (sometimes a drain in it) */
	CH_REDIS_DOWN,	  /* SIGKILL, connections refused a while, restart (sometimes a drain in it) */
	CH_IMDS,	  /* mock IMDS fault: delay | 500 | 429 | drop | badbody | notoken */
	CH_POISON,	  /* a poison unit written straight into Redis (body, n, stray fields) */
	CH_POISON_CKPT,	  /* a unit whose checkpoint holds a token outside the vocab or negative */
	CH_FLOOD,	  /* 64 idle control connections, a split command, junk lines */
	CH_SHORT_LEASE,	  /* run mode: every agent gets the short lease (long prompts meet it) */
	CH_NKINDS
};

extern const char *const ch_kind_name[CH_NKINDS];
int ch_kind_of(const char *name); /* -1: unknown */

/* poison variants (ch_poison_name[v]) and what the checker expects of each */
enum ch_poison {
	CH_PV_BADJSON,	   /* body is not JSON */
	CH_PV_N_UP,	   /* hash n = body n + 1 */
	CH_PV_N_DOWN,	   /* hash n = body n - 1 */
	CH_PV_STRAY_BODY,  /* body has an unknown field */
	CH_PV_STRAY_HASH,  /* unknown hash fields and an s:<idx> beyond n */
	CH_PV_CKPT_GARBAGE, /* p:<idx> is not JSON */
	CH_PV_CKPT_VOCAB,  /* p:0 holds a token >= vocab */
	CH_PV_CKPT_NEG,	   /* p:0 holds a negative token */
	CH_NPOISON
};
extern const char *const ch_poison_name[CH_NPOISON];
/* "dead" (must be dead-lettered with a reason) or "either" (dead with a reason, or done with
 * every sample bitwise the fault-free run's) */
const char *ch_poison_expect(int variant);

/* ---- the tiny model (both programs; the checker loads DIR/model) ----------------------- */


/* ---- the private redis-server: tests/redis_fixture.h's, with a growing AOF ------------ */

struct ro_test_redis;
/* The AOF file redis appends to now (Redis 7: the manifest's last incr file). */
int ch_aof_incr_path(const struct ro_test_redis *r, char *buf, size_t len);
long long ch_file_size(const char *path);

/* ---- seeded generator (splitmix64): the same seed gives the same schedule -------------- */

struct ch_rng {
	uint64_t s;
};
uint64_t ch_rng_next(struct ch_rng *g);
uint32_t ch_rng_range(struct ch_rng *g, uint32_t lo, uint32_t hi); /* in [lo, hi] */
double ch_rng_unit(struct ch_rng *g);				    /* in [0, 1) */

/* ---- the run record: DIR/run.log, one "type key=value ..." line per event -------------- */

/* Values have no spaces. false when the key is absent. */
bool ch_kv(const char *line, const char *key, char *out, size_t len);
long long ch_kv_ll(const char *line, const char *key, long long dflt);
bool ch_is(const char *line, const char *type);
