/* The control plane's side of units: claims (and, at start, what this worker id still
 * holds), the checks a unit passes before the engine sees it, publishing each sample the
 * step it finishes, checkpoints every N tokens or T ms, lease renewal on its own timer, and
 * each unit's final operation (complete, requeue, fail, dead-letter, release). Every Redis
 * call here is asynchronous with its own deadline; its answer arrives in a callback. An
 * error is classified: a lost lease drops the unit, a unit whose record is inconsistent is
 * dead-lettered with the reason, anything else is transient and retried with backoff. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent/agent.h"
#include "agent/log.h"

/* ---- lifetime ------------------------------------------------------------------------ */

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

static void unit_free(struct unit_rt *u)
{
	for (uint32_t i = 0; i < u->n_s; i++)
		sample_free(u->s[i]);
	free(u->s);
	ro_seq_free(u->base);
	free(u->base_logits);
	ro_claim_clear(&u->c);
	ro_unit_clear(&u->u);
	free(u);
}

void ro_units_free_all(struct ro_agent *a)
{
	while (a->units) {
		struct unit_rt *u = a->units;

		a->units = u->next;
		unit_free(u);
	}
	a->n_units = 0;
}

static bool busy(const struct unit_rt *u)
{
	return u->pub_busy || u->ckpt_busy || u->end_busy || u->in_renew;
}

uint32_t ro_units_active(const struct ro_agent *a)
{
	uint32_t n = 0;

	for (const struct unit_rt *u = a->units; u; u = u->next)
		if (u->cp == CP_HELD)
			for (uint32_t i = 0; i < u->n_s; i++)
				if (u->s[i] && !u->s[i]->finished)
					n++;
	return n;
}

static uint32_t units_held(const struct ro_agent *a)
{
	uint32_t n = 0;

	for (const struct unit_rt *u = a->units; u; u = u->next)
		n += u->cp != CP_GONE;
	return n;
}

uint32_t ro_units_unckpt(const struct ro_agent *a)
{
	uint32_t m = 0;

	for (const struct unit_rt *u = a->units; u; u = u->next)
		for (uint32_t i = 0; i < u->n_s; i++)
			if (u->cp == CP_HELD && u->s[i] && !u->s[i]->finished &&
			    u->s[i]->len - u->s[i]->ckpt_len > m)
				m = u->s[i]->len - u->s[i]->ckpt_len;
	return m;
}

/* No longer ours: the engine lets go of it and it is freed once nothing refers to it. */
static void unit_gone(struct ro_agent *a, struct unit_rt *u)
{
	pthread_mutex_lock(&a->mu);
	u->cancel = true;
	u->cp = CP_GONE;
	ro_engine_kick(a);
	pthread_mutex_unlock(&a->mu);
}

void ro_unit_end(struct ro_agent *a, struct unit_rt *u, enum unit_end end, const char *why)
{
	if (u->cp != CP_HELD)
		return;
	u->cancel = true; /* the engine stops; what it committed is what we write */
	u->cp = CP_ENDING;
	u->end = end;
	u->retry_at = 0;
	u->backoff_ms = 0;
	(void)snprintf(u->end_why, sizeof(u->end_why), "%s", why ? why : "");
	ro_engine_kick(a);
}

static void end_unit(struct ro_agent *a, struct unit_rt *u, enum unit_end end, const char *why)
{
	pthread_mutex_lock(&a->mu);
	ro_unit_end(a, u, end, why);
	pthread_mutex_unlock(&a->mu);
}

static void lease_lost(struct ro_agent *a, struct unit_rt *u, const char *what)
{
	if (u->cp == CP_GONE)
		return;
	a->n.lease_losses++;
	ro_log(LOG_WARNING, "unit %s: lease lost (%s): dropping it", u->c.id, what);
	unit_gone(a, u);
}

static bool transient(int r)
{
	return r != -ESTALE && r != -ENOENT && r != -EBADMSG && r != -EINVAL && r != -EPROTO &&
	       r != -EBUSY;
}

/* A transient failure: not again before a jittered, doubling delay (bounded by 5 s). */
static void back_off(struct ro_agent *a, struct unit_rt *u, const char *what, const char *msg)
{
	a->n.redis_errors++;
	u->backoff_ms = u->backoff_ms ? (u->backoff_ms * 2 > 5000 ? 5000 : u->backoff_ms * 2) : 100;
	u->retry_at = ro_now_ms() + u->backoff_ms / 2 + (int64_t)(random() % (u->backoff_ms + 1));
	ro_log_limited(&a->log_limit[0], 5000, LOG_WARNING, "unit %s: %s: %s (will retry)", u->c.id,
		       what, msg && *msg ? msg : "failed");
}

/* ---- claiming ---------------------------------------------------------------------------- */

static int64_t lease_margin(const struct ro_agent *a)
{
	int64_t m = a->cfg.lease_ms / 10;

	return m < 50 ? 50 : m > 1000 ? 1000 : m;
}

static uint64_t mem_available(void)
{
	FILE *f = fopen("/proc/meminfo", "r");
	char line[256];
	uint64_t kb = 0, avail;

	if (f) {
		while (fgets(line, sizeof(line), f))
			if (sscanf(line, "MemAvailable: %llu kB", (unsigned long long *)&kb) == 1)
				break;
		(void)fclose(f);
	}
	avail = kb ? kb * 1024 : UINT64_MAX;
	/* a container's limit (cgroup v2) is the tighter one in a pod */
	f = fopen("/sys/fs/cgroup/memory.max", "r");
	if (f) {
		unsigned long long max = 0, cur = 0;

		if (fscanf(f, "%llu", &max) == 1) {
			FILE *g = fopen("/sys/fs/cgroup/memory.current", "r");

			if (g && fscanf(g, "%llu", &cur) == 1 && max > cur && max - cur < avail)
				avail = max - cur;
			if (g)
				(void)fclose(g);
		}
		(void)fclose(f);
	}
	return avail;
}

/* Memory a new unit may take: what the system has, less what units already admitted will
 * allocate once the engine starts them (a claim batch is admitted before any of it runs). */
static uint64_t room(struct ro_agent *a)
{
	uint64_t avail = mem_available(), pending = 0;

	pthread_mutex_lock(&a->mu);
	for (const struct unit_rt *u = a->units; u; u = u->next)
		if (u->cp == CP_HELD && u->phase < 2 &&
		    __builtin_add_overflow(pending, ro_engine_unit_bytes(a, &u->u, u->n_s),
					   &pending))
			pending = UINT64_MAX; /* saturated: no room */
	pthread_mutex_unlock(&a->mu);
	return avail > pending ? avail - pending : 0;
}

/* A checkpoint this model can resume from: every token in the vocabulary, the prefix inside
 * the unit's bound, every log-probability a finite number <= 0. */
static bool progress_ok(const struct ro_agent *a, const struct ro_unit *u,
			const struct ro_progress *p, char *why, size_t len)
{
	if (p->len >= u->max_new_tokens) {
		(void)snprintf(why, len, "prefix of %u tokens is not below max_new_tokens %u",
			       p->len, u->max_new_tokens);
		return false;
	}
	for (uint32_t i = 0; i < p->len; i++) {
		if (p->tokens[i] < 0 || (uint32_t)p->tokens[i] >= a->vocab) {
			(void)snprintf(why, len, "token %d at %u is outside the vocabulary (%u)",
				       p->tokens[i], i, a->vocab);
			return false;
		}
		if (!isfinite(p->logprobs[i]) || p->logprobs[i] > 1e-3f) {
			(void)snprintf(why, len, "log-probability %g at %u is not <= 0",
				       (double)p->logprobs[i], i);
			return false;
		}
	}
	return true;
}

static const struct ro_progress *progress_of(const struct ro_claim *c, uint32_t idx)
{
	for (uint32_t i = 0; i < c->n_progress; i++)
		if (c->progress[i].idx == idx)
			return &c->progress[i];
	return NULL;
}

static bool published(const struct ro_claim *c, uint32_t idx)
{
	for (uint32_t i = 0; i < c->n_published; i++)
		if (c->published_idx[i] == idx)
			return true;
	return false;
}

/* The unit as this worker can run it, or why not: its bounds, its tokens, its record. */
static bool unit_fits(struct ro_agent *a, struct unit_rt *u, char *why, size_t len)
{
	struct ro_unit_bounds b = {a->cfg.max_prompt, a->cfg.max_n, a->cfg.max_new_tokens,
				   a->cfg.max_body};

	if (ro_unit_parse(u->c.body, strlen(u->c.body), &b, &u->u, why, len))
		return false;
	if (!u->u.prompt_len) {
		(void)snprintf(why, len, "empty prompt");
		return false;
	}
	for (uint32_t i = 0; i < u->u.prompt_len; i++)
		if ((uint32_t)u->u.prompt[i] >= a->vocab) {
			(void)snprintf(why, len,
				       "prompt token %d is outside the model's vocab (%u)",
				       u->u.prompt[i], a->vocab);
			return false;
		}
	if ((uint64_t)u->u.prompt_len + u->u.max_new_tokens > ro_model_config(a->m)->max_pos) {
		(void)snprintf(why, len,
			       "prompt of %u tokens + max_new_tokens %u exceed the model's "
			       "max_position_embeddings (%u)",
			       u->u.prompt_len, u->u.max_new_tokens,
			       ro_model_config(a->m)->max_pos);
		return false;
	}
	if (u->c.n != u->u.n) {
		(void)snprintf(why, len, "the unit's record says n=%u, its body n=%u", u->c.n,
			       u->u.n);
		return false;
	}
	return true;
}

/* The samples still owed, each with its checkpointed prefix when that can be resumed. */
static int samples_owed(struct ro_agent *a, struct unit_rt *u)
{
	u->s = calloc(u->u.n + 1, sizeof(*u->s));
	if (!u->s)
		return -ENOMEM;
	for (uint32_t idx = 0; idx < u->u.n; idx++) {
		const struct ro_progress *p = progress_of(&u->c, idx);
		struct sample_rt *s;
		char why[200];

		if (published(&u->c, idx))
			continue;
		s = calloc(1, sizeof(*s));
		if (!s)
			return -ENOMEM;
		u->s[u->n_s++] = s;
		s->u = u;
		s->idx = idx;
		s->start_ms = ro_now_ms();
		s->ckpt_at = s->start_ms;
		s->tok = malloc((u->u.max_new_tokens + 1) * sizeof(*s->tok));
		s->lp = malloc((u->u.max_new_tokens + 1) * sizeof(*s->lp));
		if (!s->tok || !s->lp)
			return -ENOMEM;
		/* its tokens from here on: this worker's weights (an engine swap adds more) */
		s->pv[0] = (struct ro_pv){0, a->policy_version};
		s->n_pv = 1;
		if (!p || !p->len)
			continue;
		if (!progress_ok(a, &u->u, p, why, sizeof(why))) {
			/* unusable, not fatal: the sample starts over and comes out the same */
			a->n.checkpoints_discarded++;
			ro_log(LOG_WARNING, "unit %s sample %u: checkpoint discarded (%s)", u->c.id,
			       idx, why);
			continue;
		}
		memcpy(s->tok, p->tokens, p->len * sizeof(*s->tok));
		memcpy(s->lp, p->logprobs, p->len * sizeof(*s->lp));
		s->len = s->resumed_from = s->prefix_len = s->ckpt_len = p->len;
		/* the prefix keeps the versions that made it; what follows is ours */
		if (p->n_pv) {
			memcpy(s->pv, p->pv, p->n_pv * sizeof(p->pv[0]));
			s->n_pv = p->n_pv;
		} else {
			s->pv[0] = (struct ro_pv){0, p->policy_version};
			s->n_pv = 1;
		}
		if (s->pv[s->n_pv - 1].version != a->policy_version && s->n_pv < RO_MAX_PV)
			s->pv[s->n_pv++] = (struct ro_pv){p->len, a->policy_version};
	}
	return 0;
}

/* A claimed (or, at start, still held) unit: checked, then handed to the engine. */
static bool admit(struct ro_agent *a, struct ro_claim *c, int64_t sent_ms, bool held)
{
	struct unit_rt *u;
	char why[300] = "";
	enum unit_end end = END_NONE;
	uint64_t need, avail;
	int r;

	/* what is not taken here stays in the result, which frees it */
	for (const struct unit_rt *v = a->units; v; v = v->next)
		if (v->cp != CP_GONE && !strcmp(v->c.id, c->id) && !strcmp(v->c.token, c->token))
			return false; /* already here under this lease (a rescan, a retried claim) */
	u = calloc(1, sizeof(*u));
	if (!u)
		return false; /* its lease expires and a reaper gives it to another worker */
	u->c = *c;
	memset(c, 0, sizeof(*c)); /* moved */
	if (u->c.n_progress_dropped) {
		/* over the bound (left out by the server) or unreadable: not fatal, those
		 * samples start over and come out the same */
		a->n.checkpoints_discarded += u->c.n_progress_dropped;
		ro_log(LOG_WARNING,
		       "unit %s: %u checkpoint%s discarded (longer than any this worker can resume, "
		       "%zu bytes, or unreadable): %s over",
		       u->c.id, u->c.n_progress_dropped, u->c.n_progress_dropped == 1 ? "" : "s",
		       ro_progress_max_bytes(a->cfg.max_new_tokens),
		       u->c.n_progress_dropped == 1 ? "that sample starts" : "those samples start");
	}
	u->lease_until = sent_ms + a->cfg.lease_ms - lease_margin(a);
	u->cp = CP_HELD;
	a->n.claimed++;
	if (!unit_fits(a, u, why, sizeof(why))) {
		end = END_DEAD;
	} else if (u->u.min_policy_version > a->policy_version) {
		/* needs newer weights than ours: back to the queue for a worker that has
		 * them; we look again in a while */
		ro_log(LOG_NOTICE,
		       "unit %s needs policy version %lld, this worker has %lld: released", u->c.id,
		       (long long)u->u.min_policy_version, (long long)a->policy_version);
		a->defer_until_ms = ro_now_ms() + 1000;
		end = END_RELEASE;
	} else if ((r = samples_owed(a, u))) {
		(void)snprintf(why, sizeof(why), "could not start on this worker: %s",
			       strerror(-r));
		end = END_FAIL;
	} else if ((need = ro_engine_unit_bytes(a, &u->u, u->n_s)) > (avail = room(a))) {
		(void)snprintf(
		    why, sizeof(why),
		    "needs %.1f MiB for %u samples of %u + %u tokens, %.1f MiB available",
		    need / 1048576.0, u->n_s, u->u.prompt_len, u->u.max_new_tokens,
		    avail / 1048576.0);
		end = END_FAIL;
	} else if (!u->n_s) {
		end = END_COMPLETE; /* everything was published: only the completion was missing */
	}
	u->key = ro_sample_key(u->c.id);
	pthread_mutex_lock(&a->mu);
	u->next = a->units;
	a->units = u;
	a->n_units++;
	if (end != END_NONE) {
		u->phase = 2;
		ro_unit_end(a, u, end, why);
	} else {
		ro_engine_kick(a);
	}
	pthread_mutex_unlock(&a->mu);
	ro_log(LOG_DEBUG, "claimed %s: attempt %u, %u samples owed, %u resumed%s", u->c.id,
	       u->c.attempt, u->n_s, u->c.n_progress, held ? " (held by this worker id)" : "");
	return true;
}

struct claim_ctx {
	struct ro_agent *a;
	int64_t sent_ms;
	bool held;
	uint64_t unsure; /* held: looking for what that claim, never answered, leased here */
};

static void wait_marker(struct ro_agent *a);

static void on_claimed(void *arg, struct ro_queue_result *res)
{
	struct claim_ctx *x = arg;
	struct ro_agent *a = x->a;
	size_t taken = 0;

	if (x->held) {
		a->held_busy = false;
		a->held_done = res->r >= 0;
	} else
		a->claim_busy = false;
	if (res->r < 0) {
		if (res->r != -ECANCELED) {
			a->n.redis_errors++;
			ro_log_limited(&a->log_limit[1], 5000, LOG_WARNING, "%s: %s (%s)",
				       x->held ? "held units" : "claim", strerror(-res->r),
				       res->msg);
		}
		a->next_claim_ms = ro_now_ms() + 1000;
		free(x);
		return;
	}
	if (x->held && x->unsure)
		a->held_for = x->unsure;
	a->last_redis_ok_ms = ro_now_ms();
	/* units the queue dead-lettered instead of sending them here (over a bound) */
	for (size_t i = 0; i < res->n_refused; i++) {
		a->n.dead++;
		ro_log(LOG_WARNING, "unit %s: dead-lettered by the queue, never sent here",
		       res->refused[i]);
	}
	/* a claim sent again after a reconnect ran when it was last sent, not first */
	for (size_t i = 0; i < res->n_claims; i++)
		taken += admit(a, &res->claims[i],
			       res->sent_ms > x->sent_ms ? res->sent_ms : x->sent_ms, x->held);
	if (x->held && taken) {
		a->n.resumed_held += taken;
		ro_log(LOG_NOTICE, "this worker id still holds %zu units it did not know of (%s): "
		       "resuming them", taken, x->unsure ? "a claim never answered"
							     : "an earlier run");
		/* their leases run from their claim, not from this rescan: renewed now, not a
		 * third of a lease from now */
		a->next_renew_ms = 0;
	}
	/* nothing pending (a claim that only found units to refuse looks again at once) */
	if (!x->held && !res->n_claims && !res->n_refused)
		wait_marker(a);
	free(x);
}

static int claim_timeout(const struct ro_agent *a)
{
	return (int)(a->cfg.redis_timeout_ms * 2);
}

void ro_units_held(struct ro_agent *a)
{
	struct claim_ctx *x;
	struct ro_queue_cb cb;

	if (a->held_done || a->held_busy)
		return;
	x = calloc(1, sizeof(*x));
	cb = (struct ro_queue_cb){on_claimed, x, (uint32_t)claim_timeout(a)};
	if (!x)
		return;
	x->a = a;
	x->held = true;
	x->unsure = ro_queue_claim_unsure(a->q);
	x->sent_ms = ro_now_ms();
	if (ro_queue_held_async(a->q, &cb))
		free(x);
	else
		a->held_busy = true;
}

static void on_woken(void *arg, struct ro_queue_result *res)
{
	struct ro_agent *a = arg;

	a->wait_busy = false;
	if (res->r < 0 && res->r != -ECANCELED)
		a->next_claim_ms = ro_now_ms() + 500; /* Redis away: no hurry */
	else
		a->next_claim_ms = 0; /* woken, or a second passed: look again */
	if (res->r >= 0 && res->woken)
		a->next_policy_ms = 0; /* a new policy wakes idle workers too */
}

/* Idle: block (on the second connection) on the wake-up marker rather than poll. */
static void wait_marker(struct ro_agent *a)
{
	struct ro_queue_cb cb = {on_woken, a, 1000 + a->cfg.redis_timeout_ms * 2};

	/* on_woken sets the next claim; should its answer never come (a connection lost in
	 * a failover), claiming still goes on once the wait's own bound has passed */
	a->next_claim_ms = ro_now_ms() + 2000 + (int64_t)a->cfg.redis_timeout_ms * 2;
	if (a->wait_busy || ro_queue_wait_async(a->qw, 1000, &cb)) {
		if (!a->wait_busy)
			a->next_claim_ms = ro_now_ms() + 200;
		return;
	}
	a->wait_busy = true;
}

void ro_units_claim(struct ro_agent *a)
{
	int64_t now = ro_now_ms();
	struct claim_ctx *x;
	struct ro_queue_cb cb;
	uint32_t active;

	if (a->state != RO_RUNNING || a->stop_claiming || a->backpressure || a->claim_busy ||
	    !a->held_done || now < a->next_claim_ms || now < a->defer_until_ms)
		return;
	/* the staleness bound: too far behind the published policy, catch up first */
	if (a->cfg.max_policy_lag &&
	    a->published_version - a->policy_version > (int64_t)a->cfg.max_policy_lag)
		return;
	pthread_mutex_lock(&a->mu);
	active = ro_units_active(a);
	pthread_mutex_unlock(&a->mu);
	if (active >= a->cfg.max_inflight)
		return;
	x = calloc(1, sizeof(*x));
	if (!x)
		return;
	x->a = a;
	x->sent_ms = now;
	cb = (struct ro_queue_cb){on_claimed, x, (uint32_t)claim_timeout(a)};
	if (ro_queue_claim_async(a->q, a->cfg.claim_batch, a->cfg.lease_ms, &cb)) {
		free(x);
		return;
	}
	a->claim_busy = true;
}

/* ---- publish, checkpoint, end --------------------------------------------------------------- */

struct op_ctx {
	struct ro_agent *a;
	struct unit_rt *u;
	uint32_t k;
	uint32_t idx[64];
	uint32_t len[64];
};

static struct op_ctx *ctx_new(struct ro_agent *a, struct unit_rt *u)
{
	struct op_ctx *x = calloc(1, sizeof(*x));

	if (x) {
		x->a = a;
		x->u = u;
	}
	return x;
}

static struct sample_rt *sample_of(struct unit_rt *u, uint32_t idx)
{
	for (uint32_t i = 0; i < u->n_s; i++)
		if (u->s[i] && u->s[i]->idx == idx)
			return u->s[i];
	return NULL;
}

static uint32_t samples_left(const struct unit_rt *u)
{
	uint32_t n = 0;

	for (uint32_t i = 0; i < u->n_s; i++)
		n += u->s[i] != NULL;
	return n;
}

/* Non-transient refusals of a holder's write: the unit cannot be completed as it stands. */
static void refused(struct ro_agent *a, struct unit_rt *u, int r, const char *what, const char *msg)
{
	char why[300];

	if (r == -ESTALE || r == -ENOENT) {
		a->n.stale_refused++;
		lease_lost(a, u, what);
		return;
	}
	(void)snprintf(why, sizeof(why), "%s refused: %s", what, msg && *msg ? msg : strerror(-r));
	ro_log(LOG_ERR, "unit %s: %s", u->c.id, why);
	if (u->cp == CP_HELD) {
		end_unit(a, u, END_DEAD, why);
	} else {
		u->end = END_DEAD; /* even a requeue or fail of it was refused */
		(void)snprintf(u->end_why, sizeof(u->end_why), "%s", why);
	}
}

static void on_published(void *arg, struct ro_queue_result *res)
{
	struct op_ctx *x = arg;
	struct ro_agent *a = x->a;
	struct unit_rt *u = x->u;

	u->pub_busy = false;
	pthread_mutex_lock(&a->mu);
	for (uint32_t j = 0; j < x->k; j++) {
		struct sample_rt *s = sample_of(u, x->idx[j]);

		if (!s)
			continue;
		s->in_publish = false;
		if (res->r == 0) {
			for (uint32_t i = 0; i < u->n_s; i++)
				if (u->s[i] == s)
					u->s[i] = NULL;
			sample_free(s);
		}
	}
	pthread_mutex_unlock(&a->mu);
	if (res->r == 0) {
		a->last_redis_ok_ms = ro_now_ms();
		a->n.published += x->k;
		u->backoff_ms = 0;
		/* our own samples move the trainer's lag: look again soon after a quarter of
		 * the high-water mark, not only on the 1 s timer, so claims stop in time */
		a->published_since_backlog += x->k;
		if (a->published_since_backlog * 4 >= a->cfg.high_water)
			a->next_backlog_ms = 0;
		if (res->completed) {
			a->n.completed++;
			ro_log(LOG_DEBUG, "unit %s completed", u->c.id);
			unit_gone(a, u);
		}
	} else if (res->r == -ECANCELED) {
		/* exiting */
	} else if (transient(res->r)) {
		back_off(a, u, "publish", res->msg);
	} else {
		refused(a, u, res->r, "publish", res->msg);
	}
	free(x);
}

/* Publish the unit's finished samples in one call; the unit completes with the last. */
static void publish(struct ro_agent *a, struct unit_rt *u)
{
	struct ro_sample smp[64];
	struct op_ctx *x;
	struct ro_queue_cb cb;
	uint32_t left = 0;

	if (u->pub_busy)
		return;
	x = ctx_new(a, u);
	if (!x)
		return;
	pthread_mutex_lock(&a->mu);
	for (uint32_t i = 0; i < u->n_s; i++) {
		struct sample_rt *s = u->s[i];

		if (!s)
			continue;
		if (!s->finished || x->k == 64) {
			left++;
			continue;
		}
		s->in_publish = true;
		x->idx[x->k] = s->idx;
		smp[x->k++] = (struct ro_sample){
		    .idx = s->idx,
		    .tokens = s->tok,
		    .logprobs = s->lp,
		    .len = s->len,
		    .finish = s->finish,
		    .policy_version = s->n_pv ? s->pv[s->n_pv - 1].version : a->policy_version,
		    .resumed_from = s->resumed_from,
		    .gen_ms = (uint64_t)(ro_now_ms() - s->start_ms),
		    .pv = s->pv,
		    .n_pv = s->n_pv};
	}
	cb = (struct ro_queue_cb){on_published, x, a->cfg.redis_timeout_ms * 3};
	if (!x->k || ro_queue_publish_async(a->q, &u->c, smp, x->k, left == 0, &cb)) {
		for (uint32_t j = 0; j < x->k; j++)
			sample_of(u, x->idx[j])->in_publish = false;
		pthread_mutex_unlock(&a->mu);
		free(x);
		return;
	}
	pthread_mutex_unlock(&a->mu);
	u->pub_busy = true;
}

static void on_checkpointed(void *arg, struct ro_queue_result *res)
{
	struct op_ctx *x = arg;
	struct ro_agent *a = x->a;
	struct unit_rt *u = x->u;

	u->ckpt_busy = false;
	if (res->r >= 0) {
		int64_t now = ro_now_ms();

		a->last_redis_ok_ms = now;
		pthread_mutex_lock(&a->mu);
		for (uint32_t j = 0; j < x->k; j++) {
			struct sample_rt *s = sample_of(u, x->idx[j]);

			if (s) {
				s->ckpt_len = x->len[j];
				s->ckpt_at = now;
			}
		}
		/* a sample held at its checkpoint bound may go on now */
		ro_engine_kick(a);
		pthread_mutex_unlock(&a->mu);
		a->n.checkpoints += x->k;
	} else if (res->r != -ECANCELED && transient(res->r)) {
		/* the next one is due soon anyway; meanwhile its samples wait at the bound */
		a->n.redis_errors++;
		ro_log_limited(&a->log_limit[5], 5000, LOG_WARNING,
			       "unit %s: checkpoint: %s (its samples wait for it)", u->c.id,
			       res->msg);
	} else if (res->r != -ECANCELED) {
		refused(a, u, res->r, "checkpoint", res->msg);
	}
	free(x);
}

/* The progress of u's unfinished samples (all, or only those due); under mu. */
static uint32_t progress_of_unit(const struct ro_agent *a, struct unit_rt *u, struct ro_progress *p,
				 struct op_ctx *x, bool only_due, int64_t now)
{
	uint32_t k = 0;

	for (uint32_t i = 0; i < u->n_s && k < 64; i++) {
		struct sample_rt *s = u->s[i];

		if (!s || s->finished || s->len == s->ckpt_len)
			continue;
		if (only_due && s->len - s->ckpt_len < a->cfg.checkpoint_tokens &&
		    now - s->ckpt_at < (int64_t)a->cfg.checkpoint_ms)
			continue;
		p[k] = (struct ro_progress){
		    .idx = s->idx,
		    .len = s->len,
		    .tokens = s->tok,
		    .logprobs = s->lp,
		    .sampler_pos = s->len,
		    .policy_version = s->n_pv ? s->pv[s->n_pv - 1].version : a->policy_version};
		memcpy(p[k].pv, s->pv, s->n_pv * sizeof(s->pv[0]));
		p[k].n_pv = s->n_pv;
		if (x) {
			x->idx[k] = s->idx;
			x->len[k] = s->len;
		}
		k++;
	}
	return k;
}

static void checkpoint(struct ro_agent *a, struct unit_rt *u, int64_t now)
{
	struct ro_progress p[64];
	struct op_ctx *x;
	struct ro_queue_cb cb;

	if (u->ckpt_busy)
		return;
	x = ctx_new(a, u);
	if (!x)
		return;
	pthread_mutex_lock(&a->mu);
	x->k = progress_of_unit(a, u, p, x, true, now);
	cb = (struct ro_queue_cb){on_checkpointed, x, a->cfg.redis_timeout_ms * 2};
	if (!x->k || ro_queue_checkpoint_async(a->q, &u->c, p, x->k, &cb)) {
		pthread_mutex_unlock(&a->mu);
		free(x);
		return;
	}
	pthread_mutex_unlock(&a->mu);
	u->ckpt_busy = true;
}

static const char *end_name(enum unit_end e)
{
	switch (e) {
	case END_COMPLETE:
		return "complete";
	case END_REQUEUE:
		return "requeue";
	case END_FAIL:
		return "fail";
	case END_DEAD:
		return "dead-letter";
	case END_RELEASE:
		return "release";
	default:
		return "end";
	}
}

static void on_ended(void *arg, struct ro_queue_result *res)
{
	struct op_ctx *x = arg;
	struct ro_agent *a = x->a;
	struct unit_rt *u = x->u;

	u->end_busy = false;
	if (res->r == -ECANCELED) {
		free(x);
		return;
	}
	if (res->r >= 0) {
		a->last_redis_ok_ms = ro_now_ms();
		switch (u->end) {
		case END_COMPLETE:
			a->n.completed++;
			ro_log(LOG_DEBUG, "unit %s completed", u->c.id);
			break;
		case END_REQUEUE:
			a->n.requeued++;
			ro_log(LOG_INFO, "requeued %s with %u checkpointed samples", u->c.id, x->k);
			break;
		case END_FAIL:
			a->n.failed++;
			if (res->value == 2) {
				a->n.dead++;
				ro_log(LOG_WARNING, "unit %s dead-lettered: %s (its last attempt)",
				       u->c.id, u->end_why);
			} else {
				ro_log(
				    LOG_WARNING,
				    "unit %s cannot run on this worker (%s): attempt charged, back "
				    "in the queue",
				    u->c.id, u->end_why);
			}
			break;
		case END_DEAD:
			a->n.dead++;
			ro_log(LOG_WARNING, "unit %s dead-lettered: %s", u->c.id, u->end_why);
			break;
		case END_RELEASE:
			a->n.released++;
			break;
		default:
			break;
		}
		unit_gone(a, u);
	} else if (res->r == -EBUSY && u->end == END_COMPLETE) {
		/* INCOMPLETE: Redis counts fewer samples than we published. Not a success, and
		 * not surely the unit's fault either: a server that lost its last second of
		 * writes (AOF everysec) lost our publishes with it. Charged as a failed run: the
		 * next claim sees what Redis really holds and makes the missing samples again;
		 * a record that stays inconsistent (a stray sample field) ends dead-lettered. */
		u->end = END_FAIL;
		(void)snprintf(u->end_why, sizeof(u->end_why), "complete refused: %s", res->msg);
		ro_log(LOG_ERR, "unit %s: %s", u->c.id, u->end_why);
	} else if (res->r == -ESTALE || res->r == -ENOENT) {
		a->n.stale_refused++;
		lease_lost(a, u, end_name(u->end));
	} else if (!transient(res->r) && u->end != END_DEAD) {
		const char *what = end_name(u->end);

		u->end = END_DEAD;
		(void)snprintf(u->end_why, sizeof(u->end_why), "%s refused: %s", what, res->msg);
		ro_log(LOG_ERR, "unit %s: %s", u->c.id, u->end_why);
	} else if (!transient(res->r)) {
		/* even the dead-letter is refused: leave it to its lease and the reaper */
		ro_log(LOG_ERR, "unit %s: dead-letter refused: %s: left to the reaper", u->c.id,
		       res->msg);
		unit_gone(a, u);
	} else {
		back_off(a, u, end_name(u->end), res->msg);
	}
	free(x);
}

#define STEP_WAIT_MS 2000  /* the longest a requeue waits for the step holding its unit */
#define WRITE_BUDGET_MS 500 /* and never into the last this long before the hard deadline */

/* The unit's final operation. A requeue (drain) first publishes what finished. */
static void finish(struct ro_agent *a, struct unit_rt *u)
{
	struct ro_progress p[64];
	struct op_ctx *x;
	struct ro_queue_cb cb;
	int r = -EINVAL;
	bool finished = false;

	if (u->end_busy || u->pub_busy || u->ckpt_busy)
		return;
	pthread_mutex_lock(&a->mu);
	if (u->in_step && (u->end == END_REQUEUE || u->end == END_FAIL) &&
	    ro_now_ms() - a->engine_beat_ms < STEP_WAIT_MS &&
	    (a->state != RO_DRAINING || ro_wall_ms() + WRITE_BUDGET_MS < a->hard_wall_ms)) {
		/* A step that decodes it commits first: otherwise the tokens it draws land after
		 * the progress is written, and the worker that resumes the unit draws them again
		 * (drain_bench: one token of each of its 64 sequences, every run). The engine
		 * wakes the loop when the step ends; a step stuck for STEP_WAIT_MS (an EP
		 * exchange waiting on a dead peer), or a drain within WRITE_BUDGET_MS of its hard
		 * deadline, writes what is committed. */
		pthread_mutex_unlock(&a->mu);
		return;
	}
	for (uint32_t i = 0; i < u->n_s; i++)
		finished |= u->s[i] && u->s[i]->finished;
	pthread_mutex_unlock(&a->mu);
	if ((u->end == END_REQUEUE || u->end == END_COMPLETE) && finished) {
		publish(a, u);
		return;
	}
	x = ctx_new(a, u);
	if (!x)
		return;
	cb = (struct ro_queue_cb){on_ended, x, a->cfg.redis_timeout_ms * 2};
	if (a->state == RO_DRAINING && a->hard_wall_ms > ro_wall_ms()) {
		/* a drain's writes may use the time up to the hard deadline, no more */
		int64_t left = a->hard_wall_ms - ro_wall_ms();

		cb.timeout_ms = left < cb.timeout_ms ? (uint32_t)left : cb.timeout_ms;
	}
	pthread_mutex_lock(&a->mu);
	switch (u->end) {
	case END_COMPLETE:
		r = ro_queue_complete_async(a->q, &u->c, &cb);
		break;
	case END_REQUEUE:
		x->k = progress_of_unit(a, u, p, NULL, false, 0);
		r = ro_queue_requeue_async(a->q, &u->c, p, x->k, &cb);
		break;
	case END_FAIL:
		x->k = progress_of_unit(a, u, p, NULL, false, 0);
		r = ro_queue_fail_async(a->q, &u->c, u->end_why, p, x->k, &cb);
		break;
	case END_DEAD:
		r = ro_queue_dead_letter_async(a->q, &u->c, u->end_why, &cb);
		break;
	case END_RELEASE:
		r = ro_queue_release_async(a->q, &u->c, &cb);
		break;
	default:
		break;
	}
	pthread_mutex_unlock(&a->mu);
	if (r) {
		free(x);
		return;
	}
	u->end_busy = true;
}

/* Everything due for every unit: called after each engine step, each Redis answer and each
 * housekeeping tick. */
void ro_units_service(struct ro_agent *a)
{
	int64_t now = ro_now_ms();

	for (struct unit_rt **pp = &a->units, *u; (u = *pp);) {
		char failed[256];
		bool released, finished = false;

		pthread_mutex_lock(&a->mu);
		released = u->released;
		(void)snprintf(failed, sizeof(failed), "%s", u->failed);
		for (uint32_t i = 0; i < u->n_s; i++)
			finished |= u->s[i] && u->s[i]->finished && !u->s[i]->in_publish;
		pthread_mutex_unlock(&a->mu);
		if (u->cp == CP_GONE) {
			if (released && !busy(u)) {
				pthread_mutex_lock(&a->mu);
				*pp = u->next;
				a->n_units--;
				pthread_mutex_unlock(&a->mu);
				unit_free(u);
				continue;
			}
			pp = &u->next;
			continue;
		}
		if (now > u->lease_until) {
			/* its renewal was not confirmed in time: by now another worker may own
			 * it; we stop and write nothing more */
			lease_lost(a, u, "renewal not confirmed before expiry");
		} else if (u->cp == CP_HELD && failed[0]) {
			end_unit(a, u, a->ep_failed ? END_REQUEUE : END_FAIL, failed);
		} else if (u->cp == CP_HELD) {
			if (finished && now >= u->retry_at)
				publish(a, u);
			checkpoint(a, u, now);
			if (!samples_left(u) && !u->pub_busy)
				end_unit(a, u, END_COMPLETE, NULL);
		}
		if (u->cp == CP_ENDING && now >= u->retry_at)
			finish(a, u);
		pp = &u->next;
	}
}

void ro_units_check_leases(struct ro_agent *a)
{
	ro_units_service(a);
}

/* ---- leases ------------------------------------------------------------------------------ */

struct renew_ctx {
	struct ro_agent *a;
	int64_t sent_ms;
	size_t n;
	struct unit_rt *u[];
};

static void on_renewed(void *arg, struct ro_queue_result *res)
{
	struct renew_ctx *x = arg;
	struct ro_agent *a = x->a;

	a->renew_busy = false;
	for (size_t i = 0; i < x->n; i++)
		x->u[i]->in_renew = false;
	if (res->r < 0) {
		if (res->r != -ECANCELED) {
			a->n.redis_errors++;
			ro_log_limited(&a->log_limit[3], 5000, LOG_WARNING, "renew: %s", res->msg);
		}
	} else {
		int64_t sent = res->sent_ms > x->sent_ms ? res->sent_ms : x->sent_ms;

		a->last_redis_ok_ms = ro_now_ms();
		for (size_t i = 0; i < x->n; i++) {
			struct unit_rt *u = x->u[i];

			if (res->ok[i])
				u->lease_until = sent + a->cfg.lease_ms - lease_margin(a);
			else
				lease_lost(a, u, "renew refused");
		}
	}
	free(x);
}

/* One renewal for every lease held, every third of a lease, whatever the engine does. */
void ro_units_renew(struct ro_agent *a)
{
	const struct ro_claim **cs;
	struct renew_ctx *x;
	struct ro_queue_cb cb;
	size_t n = 0, cap = units_held(a);

	if (a->renew_busy || !cap)
		return;
	cs = calloc(cap, sizeof(*cs));
	x = calloc(1, sizeof(*x) + cap * sizeof(x->u[0]));
	if (!cs || !x) {
		free(cs);
		free(x);
		return;
	}
	for (struct unit_rt *u = a->units; u && n < cap; u = u->next)
		if (u->cp != CP_GONE) {
			x->u[n] = u;
			cs[n++] = &u->c;
		}
	x->a = a;
	x->n = n;
	x->sent_ms = ro_now_ms();
	cb = (struct ro_queue_cb){on_renewed, x, a->cfg.lease_ms / 3};
	if (ro_queue_renew_async(a->q, cs, n, a->cfg.lease_ms, &cb)) {
		free(x);
	} else {
		a->renew_busy = true;
		for (size_t i = 0; i < n; i++)
			x->u[i]->in_renew = true;
	}
	free(cs);
}

/* ---- backpressure: the trainer's lag on the samples stream ----------------------------------- */

static void on_backlog(void *arg, struct ro_queue_result *res)
{
	struct ro_agent *a = arg;

	a->backlog_busy = false;
	if (res->r < 0) {
		if (res->r != -ECANCELED)
			a->n.redis_errors++;
		return;
	}
	a->last_redis_ok_ms = ro_now_ms();
	{
		bool bp = res->lag + (int64_t)a->published_since_backlog > (int64_t)a->cfg.high_water;

		if (bp != a->backpressure)
			ro_log(LOG_NOTICE, "%s: trainer lag %lld, high-water %u",
			       bp ? "backpressure: claiming paused" : "backpressure over",
			       (long long)res->lag, a->cfg.high_water);
		a->backpressure = bp;
		a->lag = res->lag;
	}
}

void ro_units_backlog(struct ro_agent *a)
{
	const char *g = a->cfg.trainer_group && *a->cfg.trainer_group ? a->cfg.trainer_group : NULL;
	struct ro_queue_cb cb = {on_backlog, a, 1000 + a->cfg.redis_timeout_ms};

	if (a->backlog_busy)
		return;
	if (!ro_queue_backlog_async(a->q, g, &cb)) {
		a->backlog_busy = true;
		a->published_since_backlog = 0; /* the answer will count them */
	}
}
