/* Private to rolloutd: the agent's state, shared by main.c (lifecycle, events, systemd,
 * metrics, control socket) and worker.c (claims, continuous batching, publish, checkpoint,
 * drain). */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "agent/settings.h"
#include "imds/imds.h"
#include "kernels/model.h"
#include "queue/queue.h"

enum ro_state { RO_RUNNING, RO_DRAINING, RO_DRAINED };

struct unit_rt;

struct sample_rt {
	struct unit_rt *u;
	uint32_t idx;
	struct ro_seq *kv;
	int32_t *tok;
	float *lp;
	uint32_t len, resumed_from, ckpt_len;
	int64_t ckpt_at, start_ms;
	float *logits;
	bool finished; /* waiting to be published */
	const char *finish;
};

struct unit_rt {
	struct ro_claim c;
	struct ro_unit u;
	uint64_t key;
	struct sample_rt **s; /* the samples this worker still owes, n_s of them */
	uint32_t n_s;
	struct unit_rt *next;
};

struct ro_counters {
	uint64_t claimed, completed, requeued, dead, released, published, tokens, drains,
	    imds_errors, redis_errors, lease_losses, checkpoints;
};

struct ro_agent {
	struct ro_config cfg;
	char worker[160];
	struct ro_queue *q;
	struct ro_model *m;
	uint32_t vocab;
	struct unit_rt *units;
	uint32_t n_units, n_active;
	enum ro_state state;
	bool stop_claiming, backpressure;
	int64_t deadline_wall_ms; /* drain deadline (ms since the epoch) */
	int64_t hard_wall_ms;	  /* past it, exit even if Redis took nothing */
	int64_t drain_start_ms;
	double last_drain_s;
	char drain_reason[96];
	double step_ms;	     /* EWMA of one decode step */
	double tokens_per_s; /* EWMA */
	int64_t next_claim_ms, next_renew_ms, next_backlog_ms, defer_until_ms;
	int64_t last_loop_ms;
	int64_t lag;
	struct ro_counters n;
	int64_t log_limit[8];
	/* expert parallelism: every forward is a collective of the group */
	struct ro_ep *ep;
	bool ep_failed;	 /* the group broke: requeue everything, exit non-zero */
	bool group_busy; /* some rank ran a forward in the last round */
	bool group_done; /* every rank drained and holds nothing */
	bool local_group; /* a rank forked by --ep-local-ranks */
};

/* worker.c */
/* The model forward: alone, or as this rank's part of the EP group's collective. */
int ro_agent_forward(struct ro_agent *a, struct ro_fwd_item *items, size_t count);
/* This rank's round of the group: join the forwards other ranks still make, tell them our
 * drain, take theirs (the earliest deadline wins). */
void ro_agent_ep_round(struct ro_agent *a);
int ro_worker_claim(struct ro_agent *a);
int ro_worker_step(struct ro_agent *a);
void ro_worker_housekeeping(struct ro_agent *a);
/* Begin (or tighten) a drain; deadline in ms since the epoch. */
void ro_drain_begin(struct ro_agent *a, int64_t deadline_wall_ms, const char *reason);
/* STOPPING=1 and EXTEND_TIMEOUT_USEC up to the hard deadline, to systemd. */
void ro_drain_notify(const struct ro_agent *a);
/* Requeue what cannot finish by the deadline (all of it once it passed). */
void ro_drain_triage(struct ro_agent *a);
void ro_worker_free_all(struct ro_agent *a);
const char *ro_state_name(enum ro_state s);
