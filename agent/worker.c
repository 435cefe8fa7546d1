/* The worker: claims units while there is room and the trainer keeps up, prefills each
 * unit's prompt once and forks it for its n samples (resuming checkpointed ones from their
 * prefix, skipping published ones), decodes every active sample of every unit as one batch
 * per step, publishes each sample the step it finishes, checkpoints the rest every N tokens
 * or T ms, renews leases, and drains: what cannot finish by the deadline is checkpointed
 * and requeued at once, so other workers take it while this one finishes the rest. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <systemd/sd-daemon.h>

#include "agent/agent.h"
#include "agent/log.h"

const char *ro_state_name(enum ro_state s)
{
	return s == RO_RUNNING ? "running" : s == RO_DRAINING ? "draining" : "drained";
}

static void sample_free(struct sample_rt *s)
{
	if (!s)
		return;
	ro_seq_free(s->kv);
	free(s->tok);
	free(s->lp);
	free(s->logits);
	free(s);
}

static void unit_free(struct ro_agent *a, struct unit_rt *u)
{
	for (uint32_t i = 0; i < u->n_s; i++) {
		if (u->s[i] && !u->s[i]->finished)
			a->n_active--;
		sample_free(u->s[i]);
	}
	free(u->s);
	ro_claim_clear(&u->c);
	ro_unit_clear(&u->u);
	free(u);
}

/* Unlink and free u. */
static void unit_drop(struct ro_agent *a, struct unit_rt *u)
{
	for (struct unit_rt **p = &a->units; *p; p = &(*p)->next)
		if (*p == u) {
			*p = u->next;
			break;
		}
	a->n_units--;
	unit_free(a, u);
}

void ro_worker_free_all(struct ro_agent *a)
{
	while (a->units)
		unit_drop(a, a->units);
}

/* What this rank tells its group each step: its drain and whether it is done. */
static struct ro_ep_note ep_note(const struct ro_agent *a)
{
	return (struct ro_ep_note){.draining = a->state != RO_RUNNING,
				   .done = a->state == RO_DRAINED && !a->units,
				   .deadline_ms = a->deadline_wall_ms};
}

/* A failed exchange leaves the group unusable: said once, and the loop requeues and exits. */
static void ep_failed(struct ro_agent *a)
{
	if (!a->ep_failed)
		ro_log(LOG_ERR, "expert-parallel group failed: %s", ro_ep_errmsg(a->ep));
	a->ep_failed = true;
}

int ro_agent_forward(struct ro_agent *a, struct ro_fwd_item *items, size_t count)
{
	struct ro_ep_note note = ep_note(a);
	int r;

	if (!a->ep)
		return ro_model_forward(a->m, items, count);
	if (a->ep_failed)
		return -EPIPE;
	r = ro_ep_forward(a->ep, items, count, &note);
	if (r && ro_ep_broken(a->ep))
		ep_failed(a);
	return r;
}

void ro_agent_ep_round(struct ro_agent *a)
{
	struct ro_ep_note note = ep_note(a);
	struct ro_ep_group g;

	if (!a->ep || a->ep_failed)
		return;
	if (ro_ep_round_end(a->ep, &note, &g)) {
		ep_failed(a);
		return;
	}
	a->group_busy = g.busy;
	a->group_done = g.all_done;
	if (g.draining && a->state != RO_DRAINED &&
	    (a->state == RO_RUNNING || g.deadline_ms < a->deadline_wall_ms)) {
		char why[64];

		(void)snprintf(why, sizeof(why), "group drain from rank %u", g.first_draining);
		ro_drain_begin(a, g.deadline_ms, why);
	}
}

static bool transient(int r)
{
	return r == -EIO || r == -ETIMEDOUT || r == -ECONNREFUSED || r == -ECONNRESET ||
	       r == -EAGAIN;
}

/* A failed queue call: count it, and forget a unit whose lease is gone (fencing refused
 * the write; whoever holds it now owns every sample of it). */
static void queue_failed(struct ro_agent *a, struct unit_rt *u, int r, const char *what)
{
	if (r == -ESTALE || r == -ENOENT) {
		a->n.lease_losses++;
		ro_log(LOG_WARNING, "unit %s: lease lost (%s refused): dropping it", u->c.id, what);
		unit_drop(a, u);
		return;
	}
	a->n.redis_errors++;
	ro_log_limited(&a->log_limit[0], 5000, LOG_WARNING, "unit %s: %s: %s (will retry)",
		       u->c.id, what, ro_queue_errmsg(a->q));
}

static int dead_letter(struct ro_agent *a, struct unit_rt *u, const char *why)
{
	int r = ro_queue_dead_letter(a->q, &u->c, why);

	if (r && transient(r))
		return r; /* kept: the lease expires and a reaper retries it elsewhere */
	if (!r) {
		a->n.dead++;
		ro_log(LOG_WARNING, "unit %s dead-lettered: %s", u->c.id, why);
	}
	unit_drop(a, u);
	return 0;
}

static bool published(const struct ro_claim *c, uint32_t idx)
{
	for (uint32_t i = 0; i < c->n_published; i++)
		if (c->published_idx[i] == idx)
			return true;
	return false;
}

static const struct ro_progress *progress_of(const struct ro_claim *c, uint32_t idx)
{
	for (uint32_t i = 0; i < c->n_progress; i++)
		if (c->progress[i].idx == idx)
			return &c->progress[i];
	return NULL;
}

/* Check a claimed unit against this worker's bounds and model; a reason when it breaks. */
static bool unit_fits(struct ro_agent *a, struct unit_rt *u, char *why, size_t len)
{
	struct ro_unit_bounds b = {a->cfg.max_prompt, a->cfg.max_n, a->cfg.max_new_tokens,
				   a->cfg.max_body};

	if (ro_unit_parse(u->c.body, strlen(u->c.body), &b, &u->u, why, len))
		return false;
	for (uint32_t i = 0; i < u->u.prompt_len; i++)
		if ((uint32_t)u->u.prompt[i] >= a->vocab) {
			(void)snprintf(why, len, "prompt token %d is outside the model's vocab (%u)",
				       u->u.prompt[i], a->vocab);
			return false;
		}
	if (!u->u.prompt_len) {
		(void)snprintf(why, len, "empty prompt");
		return false;
	}
	return true;
}

/* Prefill the prompt once, fork it for every sample still owed; resumed samples then run
 * their checkpointed prefix, so their next token is drawn exactly as it would have been. */
static int unit_start(struct ro_agent *a, struct unit_rt *u)
{
	const size_t V = a->vocab;
	const uint32_t max = u->u.prompt_len + u->u.max_new_tokens + 1;
	struct ro_seq *base = NULL;
	float *base_logits = malloc(V * sizeof(float));
	int r;

	u->s = calloc(u->u.n, sizeof(*u->s));
	if (!u->s || !base_logits) {
		free(base_logits);
		return -ENOMEM;
	}
	r = ro_seq_new(a->m, max, &base);
	if (!r) {
		struct ro_fwd_item it = {base, u->u.prompt, u->u.prompt_len, base_logits, false};

		r = ro_agent_forward(a, &it, 1);
	}
	for (uint32_t idx = 0; !r && idx < u->u.n; idx++) {
		const struct ro_progress *p = progress_of(&u->c, idx);
		struct sample_rt *s;

		if (published(&u->c, idx))
			continue;
		s = calloc(1, sizeof(*s));
		if (!s) {
			r = -ENOMEM;
			break;
		}
		u->s[u->n_s++] = s;
		s->u = u;
		s->idx = idx;
		s->start_ms = ro_now_ms();
		s->tok = malloc((u->u.max_new_tokens + 1) * sizeof(*s->tok));
		s->lp = malloc((u->u.max_new_tokens + 1) * sizeof(*s->lp));
		s->logits = malloc(V * sizeof(float));
		if (!s->tok || !s->lp || !s->logits) {
			r = -ENOMEM;
			break;
		}
		r = ro_seq_fork(base, &s->kv);
		if (r)
			break;
		a->n_active++;
		if (p && p->len && p->len < u->u.max_new_tokens) {
			struct ro_fwd_item it = {s->kv, p->tokens, p->len, s->logits, false};

			memcpy(s->tok, p->tokens, p->len * sizeof(*s->tok));
			memcpy(s->lp, p->logprobs, p->len * sizeof(*s->lp));
			s->len = s->resumed_from = s->ckpt_len = p->len;
			r = ro_agent_forward(a, &it, 1);
		} else {
			memcpy(s->logits, base_logits, V * sizeof(float));
		}
		s->ckpt_at = ro_now_ms();
	}
	ro_seq_free(base);
	free(base_logits);
	return r;
}

int ro_worker_claim(struct ro_agent *a)
{
	struct ro_claim *c = NULL;
	size_t n = 0;
	int64_t now = ro_now_ms();
	uint32_t k;
	int r;

	if (a->state != RO_RUNNING || a->stop_claiming || a->backpressure ||
	    a->n_active >= a->cfg.max_inflight || now < a->next_claim_ms || now < a->defer_until_ms)
		return 0;
	k = a->cfg.claim_batch;
	r = ro_queue_claim(a->q, k, a->cfg.lease_ms, &c, &n);
	if (r < 0) {
		a->n.redis_errors++;
		ro_log_limited(&a->log_limit[1], 5000, LOG_WARNING, "claim: %s (%s)",
			       strerror(-r), ro_queue_errmsg(a->q));
		a->next_claim_ms = now + 1000;
		return r;
	}
	r = 0;
	if (!n)
		a->next_claim_ms = now + 100; /* the idle wait blocks on the wake-up marker */
	for (size_t i = 0; i < n; i++) {
		struct unit_rt *u = calloc(1, sizeof(*u));
		char why[256] = "";

		if (!u) {
			r = -ENOMEM;
			break;
		}
		u->c = c[i];
		memset(&c[i], 0, sizeof(c[i])); /* moved */
		u->next = a->units;
		a->units = u;
		a->n_units++;
		a->n.claimed++;
		if (!unit_fits(a, u, why, sizeof(why))) {
			(void)dead_letter(a, u, why);
			continue;
		}
		if (u->u.min_policy_version > a->cfg.policy_version) {
			/* needs newer weights than ours: back to the queue for a worker that
			 * has them; we look again in a while */
			ro_log(LOG_NOTICE,
			       "unit %s needs policy version %lld, this worker has %lld: released",
			       u->c.id, (long long)u->u.min_policy_version,
			       (long long)a->cfg.policy_version);
			r = ro_queue_release(a->q, &u->c);
			if (!r)
				a->n.released++;
			a->defer_until_ms = now + 1000;
			unit_drop(a, u);
			continue;
		}
		u->key = ro_sample_key(u->c.id);
		r = unit_start(a, u);
		if (r) {
			(void)snprintf(why, sizeof(why), "could not start on this worker: %s",
				       strerror(-r));
			ro_log(LOG_ERR, "unit %s: %s", u->c.id, why);
			/* not the unit's fault: back to the queue, attempt not charged */
			(void)ro_queue_release(a->q, &u->c);
			unit_drop(a, u);
			r = 0;
			continue;
		}
		ro_log(LOG_DEBUG, "claimed %s: attempt %u, %u samples owed, %u resumed", u->c.id,
		       u->c.attempt, u->n_s, u->c.n_progress);
		if (!u->n_s) { /* everything was published: only the completion was missing */
			char gid[24];

			r = ro_queue_complete(a->q, &u->c, gid);
			if (!r)
				a->n.completed++;
			unit_drop(a, u);
			r = 0;
		}
	}
	ro_claims_free(c, n);
	return r;
}

/* Publish the unit's finished samples in one call; the unit completes with the last.
 * true: u is gone (completed, or dropped with its lease). */
static bool publish_finished(struct ro_agent *a, struct unit_rt *u)
{
	struct ro_sample smp[64];
	uint32_t k = 0, left = 0;
	char (*ids)[24];
	bool completed = false;
	int r;

	for (uint32_t i = 0; i < u->n_s; i++) {
		struct sample_rt *s = u->s[i];

		if (!s)
			continue;
		if (!s->finished || k == 64) {
			left++;
			continue;
		}
		smp[k++] = (struct ro_sample){s->idx,	      s->tok,
					      s->lp,	      s->len,
					      s->finish,      a->cfg.policy_version,
					      s->resumed_from, (uint64_t)(ro_now_ms() - s->start_ms)};
	}
	if (!k)
		return false;
	ids = calloc(k, sizeof(*ids));
	if (!ids)
		return false;
	r = ro_queue_publish(a->q, &u->c, smp, k, left == 0, ids, &completed);
	free(ids);
	if (r) {
		queue_failed(a, u, r, "publish");
		return r == -ESTALE || r == -ENOENT;
	}
	a->n.published += k;
	for (uint32_t i = 0; i < u->n_s; i++) {
		struct sample_rt *s = u->s[i];

		if (s && s->finished) {
			sample_free(s);
			u->s[i] = NULL;
		}
	}
	if (left == 0) {
		if (!completed) { /* every sample is in: complete on its own */
			char gid[24];

			r = ro_queue_complete(a->q, &u->c, gid);
			if (r && r != -EBUSY) {
				queue_failed(a, u, r, "complete");
				return r == -ESTALE || r == -ENOENT;
			}
		}
		a->n.completed++;
		ro_log(LOG_DEBUG, "unit %s completed", u->c.id);
		unit_drop(a, u);
		return true;
	}
	return false;
}

static bool is_stop(const struct ro_unit *u, int32_t t)
{
	for (uint32_t i = 0; i < u->stop_len; i++)
		if (u->stop[i] == t)
			return true;
	return false;
}

int ro_worker_step(struct ro_agent *a)
{
	struct ro_fwd_item *items = NULL;
	size_t k = 0;
	int64_t t0;
	int r = 0;

	if (!a->n_active)
		goto publish;
	items = calloc(a->n_active, sizeof(*items));
	if (!items)
		return -ENOMEM;
	for (struct unit_rt *u = a->units; u; u = u->next) {
		struct ro_sampling sp = {u->u.temperature, u->u.top_p, u->u.top_k, u->u.seed};

		for (uint32_t i = 0; i < u->n_s; i++) {
			struct sample_rt *s = u->s[i];
			int32_t t;

			if (!s || s->finished)
				continue;
			t = ro_sample(s->logits, a->vocab, &sp, u->key, s->idx, s->len, &s->lp[s->len]);
			s->tok[s->len++] = t;
			a->n.tokens++;
			if (is_stop(&u->u, t) || s->len >= u->u.max_new_tokens) {
				s->finished = true;
				s->finish = is_stop(&u->u, t) ? "stop" : "length";
				a->n_active--;
				continue;
			}
			if (k < a->n_active)
				items[k++] = (struct ro_fwd_item){s->kv, &s->tok[s->len - 1], 1,
								  s->logits, false};
		}
	}
	t0 = ro_now_ms();
	if (k)
		r = ro_agent_forward(a, items, k);
	if (k && !r) {
		double ms = (double)(ro_now_ms() - t0);

		if (ms < 0.01)
			ms = 0.01;
		a->step_ms = a->step_ms > 0 ? 0.8 * a->step_ms + 0.2 * ms : ms;
		a->tokens_per_s = k * 1000.0 / a->step_ms;
	}
	free(items);
	if (r)
		ro_log_limited(&a->log_limit[2], 5000, LOG_ERR, "decode step: %s", strerror(-r));
publish:
	/* finished samples go out now, not at the end of their unit */
	for (struct unit_rt *u = a->units, *next; u; u = next) {
		next = u->next;
		(void)publish_finished(a, u);
	}
	return r;
}

static int progress_of_unit(const struct ro_agent *a, struct unit_rt *u, struct ro_progress *p,
			    bool only_due, int64_t now)
{
	int k = 0;

	for (uint32_t i = 0; i < u->n_s; i++) {
		struct sample_rt *s = u->s[i];

		if (!s || s->finished || s->len == s->ckpt_len)
			continue;
		if (only_due && s->len - s->ckpt_len < a->cfg.checkpoint_tokens &&
		    now - s->ckpt_at < (int64_t)a->cfg.checkpoint_ms)
			continue;
		p[k++] = (struct ro_progress){s->idx, s->len, s->tok, s->lp, s->len,
					      a->cfg.policy_version};
	}
	return k;
}

static void mark_checkpointed(struct unit_rt *u, const struct ro_progress *p, int k, int64_t now)
{
	for (int j = 0; j < k; j++)
		for (uint32_t i = 0; i < u->n_s; i++)
			if (u->s[i] && u->s[i]->idx == p[j].idx) {
				u->s[i]->ckpt_len = p[j].len;
				u->s[i]->ckpt_at = now;
			}
}

void ro_worker_housekeeping(struct ro_agent *a)
{
	int64_t now = ro_now_ms();

	/* checkpoints: every N tokens or T ms per sample */
	for (struct unit_rt *u = a->units, *next; u; u = next) {
		struct ro_progress *p = calloc(u->n_s + 1, sizeof(*p));
		int k, r;

		next = u->next;
		if (!p)
			continue;
		k = progress_of_unit(a, u, p, true, now);
		if (k) {
			r = ro_queue_checkpoint(a->q, &u->c, p, (size_t)k);
			if (r < 0) {
				free(p);
				queue_failed(a, u, r, "checkpoint");
				continue;
			}
			a->n.checkpoints += (uint64_t)k;
			mark_checkpointed(u, p, k, now);
		}
		free(p);
	}
	/* leases: renewed every third of their length */
	if (a->n_units && now >= a->next_renew_ms) {
		const struct ro_claim **cs = calloc(a->n_units, sizeof(*cs));
		struct unit_rt **us = calloc(a->n_units, sizeof(*us));
		bool *ok = calloc(a->n_units, sizeof(*ok));
		size_t n = 0;

		if (cs && us && ok) {
			for (struct unit_rt *u = a->units; u; u = u->next) {
				us[n] = u;
				cs[n++] = &u->c;
			}
			if (ro_queue_renew(a->q, cs, n, a->cfg.lease_ms, ok)) {
				a->n.redis_errors++;
				ro_log_limited(&a->log_limit[3], 5000, LOG_WARNING, "renew: %s",
					       ro_queue_errmsg(a->q));
			} else {
				for (size_t i = 0; i < n; i++)
					if (!ok[i]) {
						a->n.lease_losses++;
						ro_log(LOG_WARNING, "unit %s: lease lost: dropping it",
						       us[i]->c.id);
						unit_drop(a, us[i]);
					}
				a->next_renew_ms = now + a->cfg.lease_ms / 3;
			}
		}
		free(cs);
		free(us);
		free(ok);
	}
	/* backpressure: the trainer's lag on the samples stream */
	if (now >= a->next_backlog_ms) {
		int64_t len = 0, lag = 0;
		const char *g = a->cfg.trainer_group && *a->cfg.trainer_group ? a->cfg.trainer_group
									       : NULL;

		if (ro_queue_backlog(a->q, g, &len, &lag) == 0) {
			bool bp = lag > (int64_t)a->cfg.high_water;

			if (bp != a->backpressure)
				ro_log(LOG_NOTICE, "%s: trainer lag %lld, high-water %u",
				       bp ? "backpressure: claiming paused" : "backpressure over",
				       (long long)lag, a->cfg.high_water);
			a->backpressure = bp;
			a->lag = lag;
		} else {
			a->n.redis_errors++;
		}
		a->next_backlog_ms = now + 1000;
	}
}

/* ---- drain ------------------------------------------------------------------------------ */

void ro_drain_notify(const struct ro_agent *a)
{
	char s[96];
	int64_t left = a->hard_wall_ms - ro_wall_ms();

	(void)snprintf(s, sizeof(s), "STOPPING=1\nEXTEND_TIMEOUT_USEC=%lld",
		       (long long)((left > 0 ? left : 0) + 5000) * 1000);
	(void)sd_notify(0, s);
}

void ro_drain_begin(struct ro_agent *a, int64_t deadline, const char *reason)
{
	if (a->state == RO_DRAINED)
		return;
	if (a->state == RO_DRAINING && deadline >= a->deadline_wall_ms)
		return;
	if (a->state == RO_RUNNING) {
		a->drain_start_ms = ro_now_ms();
		a->n.drains++;
	}
	a->state = RO_DRAINING;
	a->deadline_wall_ms = deadline;
	a->hard_wall_ms = deadline + a->cfg.drain_margin_ms;
	(void)snprintf(a->drain_reason, sizeof(a->drain_reason), "%s", reason);
	ro_log(LOG_NOTICE, "draining (%s): deadline in %.1f s, %u units and %u sequences in flight",
	       reason, (double)(deadline - ro_wall_ms()) / 1000.0, a->n_units, a->n_active);
	ro_drain_notify(a); /* at once: the stop may take until the hard deadline */
	ro_drain_triage(a);
}

static int requeue(struct ro_agent *a, struct unit_rt *u)
{
	struct ro_progress *p = calloc(u->n_s + 1, sizeof(*p));
	int k, r;

	if (!p)
		return -ENOMEM;
	/* finished but unpublished samples are worth a try first */
	if (publish_finished(a, u)) {
		free(p);
		return 0;
	}
	k = progress_of_unit(a, u, p, false, 0);
	r = ro_queue_requeue(a->q, &u->c, p, (size_t)k);
	free(p);
	if (r) {
		if (r == -ESTALE || r == -ENOENT) {
			queue_failed(a, u, r, "requeue");
			return 0;
		}
		a->n.redis_errors++;
		ro_log_limited(&a->log_limit[4], 2000, LOG_WARNING, "requeue %s: %s (retrying)",
			       u->c.id, ro_queue_errmsg(a->q));
		return r;
	}
	a->n.requeued++;
	ro_log(LOG_INFO, "requeued %s with %d checkpointed samples", u->c.id, k);
	unit_drop(a, u);
	return 0;
}

void ro_drain_triage(struct ro_agent *a)
{
	int64_t now = ro_wall_ms();
	/* before the first measured step, assume a slow one: requeueing early costs nothing */
	double step = a->step_ms > 0 ? a->step_ms : 200.0;

	if (a->state != RO_DRAINING)
		return;
	for (struct unit_rt *u = a->units, *next; u; u = next) {
		uint32_t rest = 0;

		next = u->next;
		for (uint32_t i = 0; i < u->n_s; i++)
			if (u->s[i] && !u->s[i]->finished && u->u.max_new_tokens - u->s[i]->len > rest)
				rest = u->u.max_new_tokens - u->s[i]->len;
		/* keep a unit only if its longest remaining sample fits, at the step rate
		 * measured now, with a 25% cushion */
		if (now >= a->deadline_wall_ms || now + (int64_t)(rest * step * 1.25) > a->deadline_wall_ms)
			(void)requeue(a, u);
	}
	if (!a->units && a->state == RO_DRAINING) {
		a->state = RO_DRAINED;
		a->last_drain_s = (double)(ro_now_ms() - a->drain_start_ms) / 1000.0;
		ro_log(LOG_NOTICE, "drained in %.2f s (%s)", a->last_drain_s, a->drain_reason);
	}
}
