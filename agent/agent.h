/* Private to rolloutd: the agent's state and who owns which part of it.
 *
 *   control plane (main thread, sd-event: loop.c, units.c, drain.c, control.c, metrics.c)
 *     owns the claims, leases, every Redis operation, the drain, the socket, the metrics;
 *   engine (its own thread: engine.c)
 *     owns the model, the KV caches and logits, and runs bounded steps: prefill chunks and
 *     decode tokens of every running sequence in one forward.
 *
 * They share the unit list and each sample's generated tokens under a->mu (held only for
 * bookkeeping, never across a forward or a Redis call). The control plane frees a unit
 * only after the engine has said it holds nothing of it (released). */
#pragma once

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <systemd/sd-event.h>

#include "agent/settings.h"
#include "imds/imds.h"
#include "kernels/model.h"
#include "queue/queue.h"

enum ro_state { RO_RUNNING, RO_DRAINING, RO_DRAINED };

struct unit_rt;

struct sample_rt {
	struct unit_rt *u;
	uint32_t idx;
	int64_t start_ms;
	/* engine only */
	struct ro_seq *kv;
	float *logits;
	uint32_t prefix_done; /* of the prefix to replay (tok[0..prefix_len)), tokens in kv */
	uint32_t prefix_len;  /* a resumed checkpoint's, or every token after a swap */
	bool ready;	      /* logits hold the distribution of token len */
	/* shared, under a->mu: the engine appends, the control plane reads */
	int32_t *tok;
	float *lp;
	uint32_t len, resumed_from;
	bool finished; /* waiting to be published */
	const char *finish;
	/* control plane, under a->mu (the engine reads ckpt_len: it runs at most
	 * checkpoint-tokens past the last confirmed checkpoint) */
	uint32_t ckpt_len; /* tokens Redis holds as this sample's checkpoint */
	int64_t ckpt_at;
	bool in_publish; /* part of the publish in flight */
	/* under a->mu: which policy version made which tokens (the engine appends a
	 * segment when it swaps weights under a running sample) */
	struct ro_pv pv[RO_MAX_PV];
	uint32_t n_pv;
};

/* The control plane's view of a unit's life. */
enum unit_cp {
	CP_HELD,	/* ours: decoding, publishing, checkpointing */
	CP_ENDING,	/* a final operation (complete, requeue, fail, dead-letter) in flight */
	CP_GONE,	/* no longer ours; freed once the engine released it */
};

enum unit_end { END_NONE, END_COMPLETE, END_REQUEUE, END_FAIL, END_DEAD, END_RELEASE };

struct unit_rt {
	struct unit_rt *next;
	struct ro_claim c;
	struct ro_unit u;
	uint64_t key;
	struct sample_rt **s; /* the samples this worker still owes, n_s of them */
	uint32_t n_s;
	/* engine only */
	int phase; /* 0 new, 1 prompt prefill, 2 running */
	struct ro_seq *base;
	float *base_logits;
	uint32_t prompt_done;
	struct ro_model *m; /* the weights it runs on (policy-swap finish keeps the old) */
	/* shared, under a->mu */
	bool cancel;	  /* control plane: stop working on it */
	bool released;	  /* engine: holds nothing of it any more */
	bool in_step;	  /* engine: decoding in the step now running (tokens not committed) */
	char failed[256]; /* engine: why it cannot run it ("" while it can) */
	/* control plane only */
	enum unit_cp cp;
	enum unit_end end;   /* the final operation wanted or in flight */
	char end_why[300];   /* its reason (fail, dead-letter) */
	int64_t lease_until; /* CLOCK_MONOTONIC ms until which the lease is known to hold */
	bool pub_busy, ckpt_busy, end_busy, in_renew;
	int64_t retry_at; /* transient failure: not before */
	uint32_t backoff_ms;
	uint32_t pub_errors;
};

struct ro_counters {
	uint64_t claimed, completed, requeued, dead, released, published, tokens, drains,
	    imds_errors, redis_errors, lease_losses, checkpoints, failed, resumed_held,
	    checkpoints_discarded, stale_refused, policy_swaps, policy_errors;
};

struct ro_control; /* control.c */

struct ro_agent {
	struct ro_config cfg;
	char worker[160];
	struct ro_queue *q;  /* every operation */
	struct ro_queue *qw; /* the idle wait on the wake-up marker (a blocking command) */
	struct ro_model *m;
	uint32_t vocab;
	/* policy weights (policy.c): the version m serves, the one Redis publishes, the next
	 * loaded beside m (handed to the engine under mu, which swaps at a step boundary), and
	 * the old one that policy-swap finish keeps until its last sequence ends */
	int64_t policy_version, published_version;
	struct ro_model *next_m, *old_m;
	int64_t next_version, old_version;
	bool policy_loading, policy_busy, loader_done, loader_started;
	pthread_t loader;
	int64_t policy_retry_ms, next_policy_ms, policy_read_log_ms;
	uint32_t policy_backoff_ms;
	char policy_error[300];
	volatile uint64_t policy_bytes_done, policy_bytes_total;
	volatile int policy_cancel;

	pthread_mutex_t mu;
	pthread_cond_t cv; /* the engine waits on it for work */
	struct unit_rt *units;
	uint32_t n_units;
	enum ro_state state; /* written by the control plane under mu */
	int64_t deadline_wall_ms; /* drain deadline (ms since the epoch) */
	int64_t hard_wall_ms;	  /* past it, exit even if Redis took nothing */
	/* the engine's figures, under mu */
	double step_ms, tokens_per_s;
	/* the last steps' times, for the swap's figures: the median before the last swap
	 * and the longest step from the swap until its caches were rebuilt (+8 steps) */
	float step_ring[256];
	uint32_t step_ring_n, swap_watch;
	double swap_median_ms, swap_max_ms;
	int64_t swap_at_ms, swap_first_token_ms;
	double prefill_tokens_per_s;
	/* the KV blocks all sequences hold, and the positions in them (each sample's whole
	 * length, a shared prompt once per sample): after each step */
	uint64_t kv_bytes, kv_tokens;
	int64_t engine_beat_ms; /* the start of its running step, else the end of its last */
	bool engine_working;
	uint64_t steps, prefill_tokens;
	bool engine_stop;
	/* from the engine's EP round, for the control plane (under mu) */
	bool group_drain;
	int64_t group_deadline_ms;
	uint32_t group_first;

	/* control plane */
	sd_event *ev;
	int efd; /* eventfd: the engine wakes the loop */
	sd_event_source *efd_src, *q_io, *q_timer, *qw_io, *qw_timer, *tick, *deadline_src;
	pthread_t engine;
	bool engine_started;
	bool stop_claiming, backpressure;
	bool claim_busy, wait_busy, renew_busy, hb_busy, backlog_busy, held_done, held_busy;
	/* the claim never answered (its request id) that a held rescan looked after */
	uint64_t held_for;
	bool exiting;
	bool hard_exit; /* the hard deadline ended the drain */
	bool redis_was_up;
	bool redis_fatal_said; /* this outage's permanent cause (credentials, TLS) logged */
	uint64_t published_since_backlog; /* samples published since the lag was asked */
	int64_t next_claim_ms, defer_until_ms, next_renew_ms, next_backlog_ms, next_status_ms,
	    next_metrics_ms, next_extend_ms, last_redis_ok_ms;
	int64_t drain_start_ms;
	double last_drain_s;
	char drain_reason[96];
	int64_t lag;
	int sigterms;
	int rc;
	struct ro_counters n;
	int64_t log_limit[12];
	struct ro_control *ctl;
	int imds_fd; /* the watcher's pipe, -1 without one */

	/* expert parallelism: every forward is a collective of the group (engine thread) */
	struct ro_ep *ep;
	bool ep_failed;	  /* the group broke: requeue everything, exit non-zero */
	bool group_busy;  /* some rank ran a forward in the last round */
	bool group_done;  /* every rank drained and holds nothing */
	int64_t group_ready;   /* the weights version every rank of the group has (last round) */
	uint64_t group_rounds; /* rounds of the group this rank took part in */
	bool local_group; /* a rank forked by --ep-local-ranks */
};

/* engine.c */
int ro_engine_start(struct ro_agent *a);
void ro_engine_stop(struct ro_agent *a);
/* Wake the engine (new work, a cancel, a drain); callers hold a->mu. */
void ro_engine_kick(struct ro_agent *a);
/* The model forward on m: alone, or as this rank's part of the EP group's collective. */
int ro_agent_forward(struct ro_agent *a, struct ro_model *m, struct ro_fwd_item *items,
		     size_t count);
/* Free a unit's caches and logits (engine thread, under mu): released, or rebuilt. */
void ro_engine_drop_caches(struct unit_rt *u);
/* Bytes a unit needs on this worker (its caches and the step's scratch). */
uint64_t ro_engine_unit_bytes(const struct ro_agent *a, const struct ro_unit *u, uint32_t owed);

/* units.c: the control plane's side of units */
void ro_units_claim(struct ro_agent *a);
void ro_units_held(struct ro_agent *a);
void ro_units_service(struct ro_agent *a); /* publish, checkpoint, end, free */
void ro_units_renew(struct ro_agent *a);
void ro_units_check_leases(struct ro_agent *a);
void ro_units_backlog(struct ro_agent *a);
void ro_units_free_all(struct ro_agent *a);
/* Units held and sequences in flight (callers hold a->mu). */
uint32_t ro_units_active(const struct ro_agent *a);
/* The most tokens any sequence would lose if killed now (callers hold a->mu). */
uint32_t ro_units_unckpt(const struct ro_agent *a);
/* End u with the given final operation (requeue with its checkpoints, fail, dead-letter);
 * the engine stops working on it at once. Callers hold a->mu. */
void ro_unit_end(struct ro_agent *a, struct unit_rt *u, enum unit_end end, const char *why);

/* policy.c: new weights while running */
/* Ask Redis for the published policy (on the status interval, and when woken). */
void ro_policy_check(struct ro_agent *a);
/* Join a finished loader, start one for a newer version; the loop's tick calls it. */
void ro_policy_tick(struct ro_agent *a);
void ro_policy_stop(struct ro_agent *a);
/* The engine, at a step boundary, under mu: swap to next_m if one is ready; free the old
 * weights (policy-swap finish) once their last sequence ended. */
void ro_policy_swap(struct ro_agent *a);
void ro_policy_gc(struct ro_agent *a);
/* The model options of the settings (threads, weights-hugepages, this EP rank), and one
 * log line on where the loaded weights live. */
void ro_policy_model_opts(const struct ro_agent *a, struct ro_model_opts *ret);
void ro_policy_log_weights(const struct ro_model *m, const char *what);

/* drain.c */
/* Begin (or tighten) a drain; deadline in ms since the epoch. */
void ro_drain_begin(struct ro_agent *a, int64_t deadline_wall_ms, const char *reason);
/* STOPPING=1 and EXTEND_TIMEOUT_USEC up to the hard deadline, to systemd. */
void ro_drain_notify(const struct ro_agent *a);
/* Requeue what cannot finish by the deadline (all of it once it passed); DRAINED when
 * nothing is left. */
void ro_drain_triage(struct ro_agent *a);
const char *ro_state_name(enum ro_state s);

/* control.c: the control socket (a line in, a JSON line out, many clients) */
int ro_control_open(struct ro_agent *a, const char *path);
void ro_control_close(struct ro_agent *a);
/* The status object (control socket, tests). */
void ro_status_json(struct ro_agent *a, char *buf, size_t len);
/* Ready for work: running, and Redis answered within redis-unready-ms (a worker that
 * cannot write, during a failover or an outage, is not ready). */
bool ro_ready(const struct ro_agent *a);

/* metrics.c */
void ro_metrics_write(struct ro_agent *a);
void ro_notify_status(struct ro_agent *a);
void ro_heartbeat(struct ro_agent *a);

/* loop.c */
int ro_loop_run(struct ro_agent *a);
/* (Re)arm the drain's deadline and hard deadline timers. */
void ro_loop_arm_deadlines(struct ro_agent *a);
/* Re-arm the queues' I/O sources after operations were submitted. */
void ro_loop_queue_changed(struct ro_agent *a);
int64_t ro_mono_ms(void);
