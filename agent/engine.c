/* The engine: rolloutd's own thread for the model. Each step is bounded: it decodes one
 * token of every running sequence and prefills at most prefill-chunk prompt tokens (a new
 * unit's prompt, or a resumed sample's checkpointed prefix) in the same forward, as vLLM and
 * SGLang interleave chunked prefill with decode, so no step holds anything for seconds and
 * decode latency stays flat while a long prompt comes in. It never talks to Redis: the
 * control plane hands it units and reads what it generated (agent.h says who owns what). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/log.h"

/* ---- the forward, alone or as this rank's part of the EP group ------------------------- */

/* What this rank tells its group each step: its drain and whether it is done (under mu). */
static struct ro_ep_note ep_note(const struct ro_agent *a)
{
	return (struct ro_ep_note){.draining = a->state != RO_RUNNING,
				   .done = a->state == RO_DRAINED && !a->units,
				   .deadline_ms = a->deadline_wall_ms,
				   .ready = a->next_m ? a->next_version : a->policy_version};
}

/* A failed exchange leaves the group unusable: said once; the control plane requeues and
 * exits. */
static void ep_failed(struct ro_agent *a)
{
	if (!a->ep_failed)
		ro_log(LOG_ERR, "expert-parallel group failed: %s", ro_ep_errmsg(a->ep));
	a->ep_failed = true;
}

static struct ro_ep_note note_now(struct ro_agent *a)
{
	struct ro_ep_note n;

	pthread_mutex_lock(&a->mu);
	n = ep_note(a);
	pthread_mutex_unlock(&a->mu);
	return n;
}

int ro_agent_forward(struct ro_agent *a, struct ro_model *m, struct ro_fwd_item *items,
		     size_t count)
{
	struct ro_ep_note note;
	int r;

	if (!a->ep)
		return ro_model_forward(m, items, count);
	if (a->ep_failed)
		return -EPIPE;
	note = note_now(a);
	r = ro_ep_forward(a->ep, items, count, &note);
	if (r && ro_ep_broken(a->ep))
		ep_failed(a);
	return r;
}

/* This rank's round of the group: join the forwards other ranks still make, tell them our
 * drain, take theirs (the earliest deadline wins; the control plane acts on it). */
static void ep_round(struct ro_agent *a)
{
	struct ro_ep_note note;
	struct ro_ep_group g;

	if (!a->ep || a->ep_failed)
		return;
	note = note_now(a);
	if (ro_ep_round_end(a->ep, &note, &g)) {
		ep_failed(a);
		return;
	}
	pthread_mutex_lock(&a->mu);
	a->group_busy = g.busy;
	a->group_done = g.all_done;
	a->group_ready = g.ready;
	a->group_rounds++;
	if (g.draining && a->state != RO_DRAINED &&
	    (a->state == RO_RUNNING || g.deadline_ms < a->deadline_wall_ms)) {
		a->group_drain = true;
		a->group_deadline_ms = g.deadline_ms;
		a->group_first = g.first_draining;
	}
	pthread_mutex_unlock(&a->mu);
}

/* ---- memory ------------------------------------------------------------------------------ */

uint64_t ro_engine_unit_bytes(const struct ro_agent *a, const struct ro_unit *u, uint32_t owed)
{
	uint64_t len = (uint64_t)u->prompt_len + u->max_new_tokens + 1;
	uint64_t caches = ro_model_forks_bytes(a->m, u->prompt_len,
					       len > UINT32_MAX ? UINT32_MAX : (uint32_t)len, owed),
		 fwd = ro_model_forward_bytes(a->m, a->cfg.prefill_chunk + a->cfg.max_inflight),
		 total;

	/* the prompt's cache once (its samples share its blocks), each sample's own blocks,
	 * and the step's scratch for a chunk; saturating: a checkpoint's sizes must not wrap
	 * admission control into a yes */
	if (__builtin_add_overflow(caches, fwd, &total) ||
	    __builtin_add_overflow(total, ((uint64_t)owed + 1) * a->vocab * sizeof(float), &total))
		return UINT64_MAX;
	return total;
}

/* ---- one step ------------------------------------------------------------------------------ */

enum job_kind { J_PROMPT, J_PREFIX, J_DECODE, J_FINISH };

/* The weights a unit runs on: its own (policy-swap finish) or the serving ones. */
static struct ro_model *unit_model(const struct ro_agent *a, const struct unit_rt *u)
{
	return u->m ? u->m : a->m;
}

struct job {
	enum job_kind kind;
	struct unit_rt *u;
	struct sample_rt *s;
	uint32_t n;	  /* tokens run */
	uint32_t seq_len; /* the sequence's length before the forward (to undo a failure) */
	int32_t tok;	  /* decode: the token drawn */
	float lp;
	bool stop;
	int item; /* index in the forward's items, -1 none */
	int r;
	int bad; /* decode: the sampler's error (non-finite logits), the unit fails */
};

struct step {
	struct job *jobs;
	size_t n_jobs, cap;
	struct ro_fwd_item *items;
	size_t n_items;
};

static struct job *job_add(struct step *st)
{
	if (st->n_jobs == st->cap) {
		size_t cap = st->cap ? st->cap * 2 : 64;
		struct job *j = realloc(st->jobs, cap * sizeof(*j));
		struct ro_fwd_item *it = j ? realloc(st->items, cap * sizeof(*it)) : NULL;

		if (j)
			st->jobs = j;
		if (!it)
			return NULL;
		st->items = it;
		st->cap = cap;
	}
	memset(&st->jobs[st->n_jobs], 0, sizeof(st->jobs[0]));
	st->jobs[st->n_jobs].item = -1;
	return &st->jobs[st->n_jobs++];
}

void ro_engine_drop_caches(struct unit_rt *u)
{
	for (uint32_t i = 0; i < u->n_s; i++) {
		struct sample_rt *s = u->s[i];

		if (!s)
			continue;
		s->kv = ro_seq_free(s->kv);
		free(s->logits);
		s->logits = NULL;
		s->ready = false;
	}
	u->base = ro_seq_free(u->base);
	free(u->base_logits);
	u->base_logits = NULL;
}

static void unit_release(struct unit_rt *u)
{
	ro_engine_drop_caches(u);
	u->released = true;
}

static void unit_fail(struct unit_rt *u, const char *what, int r)
{
	if (!u->failed[0])
		(void)snprintf(u->failed, sizeof(u->failed), "%s: %s", what, strerror(-r));
}

/* Under mu: what this step does. Decode tokens are drawn after mu is dropped. */
static void plan(struct ro_agent *a, struct step *st)
{
	uint32_t budget = a->cfg.prefill_chunk;

	/* while a swap rebuilds caches, prefill goes in smaller pieces: every sequence is
	 * rebuilding at once, and the steps stay near a decode step's length. Auto (0): as many
	 * tokens as there are sequences, so that a step carries at most twice a decode step's
	 * tokens whatever the batch (a fixed count is most of a step at batch 8 and nothing at
	 * 256) */
	if (a->swap_watch) {
		uint32_t rb = a->cfg.policy_rebuild_chunk;

		if (!rb) {
			/* (not ro_units_active: it reads the control plane's cp, which the
			 * engine may not; these are the engine's own flags, under mu) */
			for (const struct unit_rt *u = a->units; u; u = u->next)
				if (!u->released && !u->cancel && !u->failed[0])
					for (uint32_t i = 0; i < u->n_s; i++)
						rb += !u->s[i] || !u->s[i]->finished;
			if (!rb)
				rb = 1;
		}
		if (rb < budget)
			budget = rb;
	}

	for (struct unit_rt *u = a->units; u; u = u->next) {
		struct job *j;

		if (u->released)
			continue;
		if (u->cancel) {
			unit_release(u);
			continue;
		}
		if (u->failed[0])
			continue;
		if (u->phase == 0) {
			int r = 0;

			if (u->n_s) {
				r = ro_seq_new(unit_model(a, u),
					       u->u.prompt_len + u->u.max_new_tokens + 1, &u->base);
				u->base_logits = r ? NULL : malloc(a->vocab * sizeof(float));
				if (!r && !u->base_logits)
					r = -ENOMEM;
			}
			if (r) {
				unit_fail(u, "could not allocate its prompt cache", r);
				continue;
			}
			u->phase = u->n_s ? 1 : 2;
		}
		if (u->phase == 1) {
			if (!budget)
				continue;
			j = job_add(st);
			if (!j)
				return;
			j->kind = J_PROMPT;
			j->u = u;
			j->n = u->u.prompt_len - u->prompt_done;
			if (j->n > budget)
				j->n = budget;
			budget -= j->n;
			continue;
		}
		for (uint32_t i = 0; i < u->n_s; i++) {
			struct sample_rt *s = u->s[i];

			if (!s || s->finished || !s->kv)
				continue;
			if (s->prefix_done < s->prefix_len) {
				if (!budget)
					continue;
				j = job_add(st);
				if (!j)
					return;
				j->kind = J_PREFIX;
				j->u = u;
				j->s = s;
				j->n = s->prefix_len - s->prefix_done;
				if (j->n > budget)
					j->n = budget;
				budget -= j->n;
			} else if (s->ready && s->len - s->ckpt_len < a->cfg.checkpoint_tokens) {
				/* a sample at checkpoint-tokens past its confirmed checkpoint
				 * waits for it: a kill never loses more than that */
				j = job_add(st);
				if (!j)
					return;
				j->kind = J_DECODE;
				j->u = u;
				j->s = s;
				j->n = 1;
			}
		}
	}
}

static bool is_stop(const struct ro_unit *u, int32_t t)
{
	for (uint32_t i = 0; i < u->stop_len; i++)
		if (u->stop[i] == t)
			return true;
	return false;
}

/* Outside mu: draw the decode tokens and lay out the forward's items. The engine alone
 * writes len, kv and logits, so it reads them here without the lock. A token is appended
 * (under mu, in commit) only once the forward that consumes it succeeded, so a failed step
 * leaves every sequence as it was. */
static void build(struct ro_agent *a, struct step *st)
{
	st->n_items = 0;
	for (size_t k = 0; k < st->n_jobs; k++) {
		struct job *j = &st->jobs[k];
		struct unit_rt *u = j->u;
		struct ro_fwd_item *it = &st->items[st->n_items];

		switch (j->kind) {
		case J_PROMPT:
			j->seq_len = ro_seq_len(u->base);
			*it = (struct ro_fwd_item){u->base, u->u.prompt + u->prompt_done, j->n,
						   u->base_logits, false};
			break;
		case J_PREFIX:
			j->seq_len = ro_seq_len(j->s->kv);
			*it = (struct ro_fwd_item){j->s->kv, j->s->tok + j->s->prefix_done, j->n,
						   j->s->logits, false};
			break;
		case J_DECODE: {
			struct ro_sampling sp = {u->u.temperature, u->u.top_p, u->u.top_k,
						 u->u.seed};
			struct sample_rt *s = j->s;

			j->tok =
			    ro_sample(s->logits, a->vocab, &sp, u->key, s->idx, s->len, &j->lp);
			if (j->tok < 0) {
				j->bad = j->tok;
				continue; /* no item: commit fails the unit */
			}
			j->stop = is_stop(&u->u, j->tok);
			if (j->stop || s->len + 1 >= u->u.max_new_tokens) {
				j->kind = J_FINISH; /* its last token: nothing to run */
				continue;
			}
			j->seq_len = ro_seq_len(s->kv);
			*it = (struct ro_fwd_item){s->kv, &j->tok, 1, s->logits, false};
			break;
		}
		case J_FINISH:
			continue;
		}
		j->item = (int)st->n_items++;
	}
}

static struct ro_seq *job_seq(const struct job *j)
{
	return j->kind == J_PROMPT ? j->u->base : j->s->kv;
}

/* A batch failed: undo every sequence and run each unit's items alone, so that only the
 * unit that cannot run is charged for it (the results are bitwise what the batch would have
 * given). In an EP group a forward is a collective: the whole batch fails together. */
static void isolate(struct ro_agent *a, struct step *st, int r)
{
	for (size_t k = 0; k < st->n_jobs; k++)
		if (st->jobs[k].item >= 0)
			ro_seq_truncate(job_seq(&st->jobs[k]), st->jobs[k].seq_len);
	if (a->ep) {
		for (size_t k = 0; k < st->n_jobs; k++)
			if (st->jobs[k].item >= 0)
				st->jobs[k].r = r;
		return;
	}
	for (size_t k = 0; k < st->n_jobs; k++) {
		struct unit_rt *u = st->jobs[k].u;
		struct ro_fwd_item one[64];
		size_t idx[64], n = 0;
		int rr;

		if (st->jobs[k].item < 0 || st->jobs[k].r)
			continue;
		/* this unit's items (the first 64: a unit's samples beyond go one by one) */
		for (size_t m = k; m < st->n_jobs && n < 64; m++)
			if (st->jobs[m].u == u && st->jobs[m].item >= 0 && !st->jobs[m].r) {
				idx[n] = m;
				one[n++] = st->items[st->jobs[m].item];
			}
		rr = ro_agent_forward(a, unit_model(a, u), one, n);
		for (size_t m = 0; m < n; m++) {
			if (rr)
				ro_seq_truncate(job_seq(&st->jobs[idx[m]]),
						st->jobs[idx[m]].seq_len);
			st->jobs[idx[m]].r = rr ? rr : 1; /* 1: done, ran alone */
		}
	}
	for (size_t k = 0; k < st->n_jobs; k++)
		if (st->jobs[k].r == 1)
			st->jobs[k].r = 0;
}

/* The prompt is in: every sample owed gets its copy of the cache; a resumed one then runs
 * its checkpointed prefix (in later steps, as prefill chunks), so its next token is drawn
 * exactly as it would have been. */
static void prompt_done(struct ro_agent *a, struct unit_rt *u)
{
	for (uint32_t i = 0; i < u->n_s; i++) {
		struct sample_rt *s = u->s[i];
		int r;

		if (!s || s->finished)
			continue;
		s->logits = malloc(a->vocab * sizeof(float));
		r = s->logits ? ro_seq_fork(u->base, &s->kv) : -ENOMEM;
		if (r) {
			unit_fail(u, "could not allocate a sample's cache", r);
			return;
		}
		s->prefix_done = 0;
		s->ready = !s->prefix_len;
		if (s->ready)
			memcpy(s->logits, u->base_logits, a->vocab * sizeof(float));
	}
	u->base = ro_seq_free(u->base);
	free(u->base_logits);
	u->base_logits = NULL;
	u->phase = 2;
}

/* Under mu: what the step produced becomes visible to the control plane. */
static uint32_t commit(struct ro_agent *a, struct step *st)
{
	uint32_t decoded = 0;

	for (size_t k = 0; k < st->n_jobs; k++) {
		struct job *j = &st->jobs[k];
		struct unit_rt *u = j->u;
		struct sample_rt *s = j->s;

		u->in_step = false;
		if (j->r) {
			unit_fail(u, "the forward failed", j->r);
			continue;
		}
		if (j->bad) {
			unit_fail(u,
				  j->bad == -EDOM ? "sampling failed (the logits are not finite)"
						  : "sampling failed",
				  j->bad);
			continue;
		}
		switch (j->kind) {
		case J_PROMPT:
			u->prompt_done += j->n;
			a->prefill_tokens += j->n;
			if (u->prompt_done == u->u.prompt_len)
				prompt_done(a, u);
			break;
		case J_PREFIX:
			s->prefix_done += j->n;
			a->prefill_tokens += j->n;
			if (s->prefix_done == s->prefix_len)
				s->ready = true;
			break;
		case J_DECODE:
		case J_FINISH:
			s->tok[s->len] = j->tok;
			s->lp[s->len] = j->lp;
			s->len++;
			decoded++;
			if (j->kind == J_FINISH) {
				s->finished = true;
				s->finish = j->stop ? "stop" : "length";
			}
			break;
		}
	}
	a->n.tokens += decoded;
	return decoded;
}

/* Under mu: the KV cache's bytes (every model's blocks: a swap's old weights may still
 * hold some) and the positions the held sequences cover, for status and metrics. */
static void kv_note(struct ro_agent *a)
{
	struct ro_model *ms[2] = {a->m, a->old_m};
	uint64_t bytes = 0, tokens = 0;

	for (int i = 0; i < 2; i++)
		if (ms[i] && (i == 0 || ms[i] != ms[0])) {
			struct ro_kv_stats k;

			ro_model_kv_stats(ms[i], &k);
			bytes += k.bytes;
		}
	for (const struct unit_rt *u = a->units; u; u = u->next) {
		if (u->released)
			continue;
		if (u->base)
			tokens += ro_seq_len(u->base);
		for (uint32_t i = 0; i < u->n_s; i++)
			if (u->s[i] && u->s[i]->kv)
				tokens += ro_seq_len(u->s[i]->kv);
	}
	a->kv_bytes = bytes;
	a->kv_tokens = tokens;
}

/* Under mu: a step's time for the swap's figures. After a swap, the watch runs until no
 * sequence is rebuilding its cache any more, and eight steps beyond. */
static void note_step(struct ro_agent *a, const struct step *st, double ms)
{
	bool rebuilding = false, decoded_new = false;

	a->step_ring[a->step_ring_n++ % 256] = (float)ms;
	if (!a->swap_watch)
		return;
	for (size_t k = 0; k < st->n_jobs; k++) {
		rebuilding |= st->jobs[k].kind == J_PROMPT || st->jobs[k].kind == J_PREFIX;
		decoded_new |= st->jobs[k].kind == J_DECODE || st->jobs[k].kind == J_FINISH;
	}
	if (ms > a->swap_max_ms)
		a->swap_max_ms = ms;
	if (decoded_new && !a->swap_first_token_ms)
		a->swap_first_token_ms = ro_now_ms();
	if (rebuilding)
		a->swap_watch = 1;
	else if (++a->swap_watch > 8)
		a->swap_watch = 0;
}

/* The step's forward: one batch, or (while policy-swap finish keeps old weights for the
 * sequences that began on them) one batch per set of weights. */
static int forward(struct ro_agent *a, struct step *st)
{
	struct ro_model *old = a->old_m; /* the engine alone changes it */
	struct ro_fwd_item *part;
	size_t n_old = 0, n_new = 0;
	int r;

	if (!old)
		return ro_agent_forward(a, a->m, st->items, st->n_items);
	part = malloc(st->n_items * sizeof(*part));
	if (!part)
		return -ENOMEM;
	for (int pass = 0; pass < 2; pass++)
		for (size_t k = 0; k < st->n_jobs; k++) {
			const struct job *j = &st->jobs[k];
			bool is_old = unit_model(a, j->u) == old;

			if (j->item < 0 || is_old != (pass == 0))
				continue;
			part[n_old + n_new] = st->items[j->item];
			if (pass == 0)
				n_old++;
			else
				n_new++;
		}
	r = n_old ? ro_agent_forward(a, old, part, n_old) : 0;
	if (!r && n_new)
		r = ro_agent_forward(a, a->m, part + n_old, n_new);
	free(part);
	return r;
}

static void wake_loop(struct ro_agent *a)
{
	uint64_t one = 1;

	(void)!write(a->efd, &one, sizeof(one));
}

static void *engine_main(void *arg)
{
	struct ro_agent *a = arg;
	struct step st = {0};

	for (;;) {
		double t0;
		uint32_t decoded;
		uint64_t prefilled;
		int r = 0;

		pthread_mutex_lock(&a->mu);
		if (a->engine_stop) {
			pthread_mutex_unlock(&a->mu);
			break;
		}
		if (a->ep && (a->group_done || a->ep_failed)) {
			/* every rank saw "all done" in the same round and stops there: one more
			 * round would wait for ranks that have left */
			struct timespec ts;

			(void)clock_gettime(CLOCK_REALTIME, &ts);
			ts.tv_sec += 1;
			(void)pthread_cond_timedwait(&a->cv, &a->mu, &ts);
			pthread_mutex_unlock(&a->mu);
			wake_loop(a);
			continue;
		}
		/* new weights swap in between two steps (policy.c) */
		ro_policy_swap(a);
		ro_policy_gc(a);
		st.n_jobs = 0;
		plan(a, &st);
		for (size_t k = 0; k < st.n_jobs; k++) /* (a prefill commits no token) */
			if (st.jobs[k].kind == J_DECODE || st.jobs[k].kind == J_FINISH)
				st.jobs[k].u->in_step = true;
		a->engine_working = st.n_jobs > 0;
		if (st.n_jobs)
			a->engine_beat_ms = ro_now_ms(); /* the age counts from this step's start */
		if (!st.n_jobs && !a->ep) {
			struct timespec ts;
			bool released = false;

			for (struct unit_rt *u = a->units; u; u = u->next)
				released |= u->released;
			a->engine_beat_ms = ro_now_ms();
			kv_note(a); /* what ended since the last step let its blocks go */
			if (released)
				wake_loop(a);
			(void)clock_gettime(CLOCK_REALTIME, &ts);
			ts.tv_sec += 1;
			(void)pthread_cond_timedwait(&a->cv, &a->mu, &ts);
			pthread_mutex_unlock(&a->mu);
			continue;
		}
		pthread_mutex_unlock(&a->mu);

		build(a, &st);
		/* at the clock's resolution: a step of a small model or batch takes well under a
		 * millisecond, and in whole ones (ro_now_ms) it measured 0, clamped to 0.01, so
		 * tokens_per_s read 78,000-237,000 in scripts/demo where 5,000-10,000 were made
		 * and step_ms, which the drain's triage uses, fell toward 0.01 */
		t0 = ro_now_ms_f();
		if (st.n_items) {
			r = forward(a, &st);
			if (r)
				isolate(a, &st, r);
		}
		if (a->ep)
			ep_round(a);

		pthread_mutex_lock(&a->mu);
		prefilled = a->prefill_tokens;
		decoded = commit(a, &st);
		prefilled = a->prefill_tokens - prefilled;
		kv_note(a);
		if (st.n_items && !r) {
			double ms = ro_now_ms_f() - t0;

			note_step(a, &st, ms);

			if (ms < 0.01)
				ms = 0.01;
			a->step_ms = a->step_ms > 0 ? 0.8 * a->step_ms + 0.2 * ms : ms;
			if (decoded)
				a->tokens_per_s =
				    a->tokens_per_s > 0
					? 0.8 * a->tokens_per_s + 0.2 * decoded * 1000.0 / ms
					: decoded * 1000.0 / ms;
			if (prefilled)
				a->prefill_tokens_per_s = a->prefill_tokens_per_s > 0
							      ? 0.8 * a->prefill_tokens_per_s +
								    0.2 * prefilled * 1000.0 / ms
							      : prefilled * 1000.0 / ms;
		}
		a->steps++;
		a->engine_beat_ms = ro_now_ms();
		if (a->ep && !st.n_jobs && !a->group_busy) {
			/* idle in a group: others may still need us in their forwards soon */
			struct timespec ts;
			long ns = a->state == RO_RUNNING ? 20000000L : 5000000L;

			(void)clock_gettime(CLOCK_REALTIME, &ts);
			ts.tv_nsec += ns;
			if (ts.tv_nsec >= 1000000000L) {
				ts.tv_sec++;
				ts.tv_nsec -= 1000000000L;
			}
			(void)pthread_cond_timedwait(&a->cv, &a->mu, &ts);
		}
		pthread_mutex_unlock(&a->mu);
		if (r)
			ro_log_limited(&a->log_limit[2], 5000, LOG_ERR, "engine step: %s",
				       strerror(-r));
		wake_loop(a);
	}
	free(st.jobs);
	free(st.items);
	return NULL;
}

void ro_engine_kick(struct ro_agent *a)
{
	(void)pthread_cond_signal(&a->cv);
}

int ro_engine_start(struct ro_agent *a)
{
	if (pthread_create(&a->engine, NULL, engine_main, a))
		return -EAGAIN;
	a->engine_started = true;
	return 0;
}

void ro_engine_stop(struct ro_agent *a)
{
	if (!a->engine_started)
		return;
	pthread_mutex_lock(&a->mu);
	a->engine_stop = true;
	(void)pthread_cond_signal(&a->cv);
	pthread_mutex_unlock(&a->mu);
	(void)pthread_join(a->engine, NULL);
	a->engine_started = false;
	/* what the engine held goes with it */
	pthread_mutex_lock(&a->mu);
	for (struct unit_rt *u = a->units; u; u = u->next)
		if (!u->released)
			unit_release(u);
	pthread_mutex_unlock(&a->mu);
}
