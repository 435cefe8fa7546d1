/* New policy weights while running. The control plane asks Redis for the published policy
 * (ro:{q}:policy) every status interval and when woken; a newer version is made available
 * (a file:// policy read in place, every file checked against the manifest) and loaded
 * beside the serving weights by a loader thread while the engine keeps decoding; the
 * engine swaps at a step boundary (ro_policy_swap, policy-swap recompute or finish). A
 * failure of any kind keeps the serving weights, is said once per attempt with its cause,
 * counted, and tried again after a backoff. Peak memory: two sets of weights. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/fetch.h"
#include "agent/log.h"

struct load {
	struct ro_agent *a;
	int64_t version;
	char *uri, *manifest;
};

/* The same shapes, or the running sequences could not go on with it. */
static bool same_shapes(const struct ro_model_config *x, const struct ro_model_config *y,
			char *why, size_t len)
{
#define SAME(f)                                                                              \
	if (x->f != y->f) {                                                                  \
		(void)snprintf(why, len, "%s is %llu, the running model's %llu", #f,        \
			       (unsigned long long)y->f, (unsigned long long)x->f);          \
		return false;                                                                \
	}
	SAME(arch) SAME(vocab) SAME(hidden) SAME(layers) SAME(heads) SAME(kv_heads) SAME(head_dim)
	SAME(experts) SAME(top_k) SAME(expert_ffn) SAME(dense_ffn) SAME(sparse_step)
	SAME(dense_layers)
#undef SAME
	return true;
}

void ro_policy_model_opts(const struct ro_agent *a, struct ro_model_opts *ret)
{
	*ret = (struct ro_model_opts){
	    .threads = a->cfg.threads,
	    .hugepages = a->cfg.weights_hugepages,
	    .ep_rank = a->cfg.ep_size > 1 ? a->cfg.ep_rank : 0,
	    .ep_world = a->cfg.ep_size > 1 ? a->cfg.ep_size : 1,
	};
}

void ro_policy_log_weights(const struct ro_model *m, const char *what)
{
	struct ro_model_pin p;

	ro_model_pinned(m, &p);
	if (p.bytes)
		ro_log(LOG_INFO,
		       "%s weights: %.3f GB copied into huge pages (%.3f GB of them backed by 2 MiB "
		       "pages)%s%s",
		       what, p.bytes / 1e9, p.huge_bytes / 1e9, p.why[0] ? "; " : "", p.why);
	else
		ro_log(LOG_INFO, "%s weights: read in place from the mapped files (huge pages: %s)",
		       what, p.why[0] ? p.why : "nothing to copy");
}

static void *loader_main(void *arg)
{
	struct load *l = arg;
	struct ro_agent *a = l->a;
	struct ro_model_opts mo;
	struct ro_model *m = NULL;
	char dir[4096], err[4608] = "", why[256];
	int r;

	struct ro_fetch_opts fo = {
	    .cache_dir = a->cfg.weights_cache,
	    .region = *a->cfg.s3_region ? a->cfg.s3_region : NULL,
	    .s3_endpoint = *a->cfg.s3_endpoint ? a->cfg.s3_endpoint : NULL,
	    .imds_endpoint = a->cfg.imds_endpoint,
	    .cancel = &a->policy_cancel,
	    .bytes_done = &a->policy_bytes_done,
	    .bytes_total = &a->policy_bytes_total,
	};
	struct ro_policy_manifest man = {0};

	ro_policy_model_opts(a, &mo);

	/* every file checked against the manifest: in place (file://) or as it downloads */
	r = ro_policy_manifest_parse(l->manifest ? l->manifest : "", &man, err, sizeof(err));
	if (!r)
		r = ro_policy_fetch(&fo, l->uri, l->version, &man, dir, sizeof(dir), err,
				    sizeof(err));
	ro_policy_manifest_clear(&man);
	if (!r)
		r = ro_model_load(dir, &mo, &m, err, sizeof(err));
	if (!r && !same_shapes(ro_model_config(a->m), ro_model_config(m), why, sizeof(why))) {
		(void)snprintf(err, sizeof(err), "%s: %s", dir, why);
		m = ro_model_free(m);
		r = -EINVAL;
	}
	if (!r)
		ro_policy_log_weights(m, "policy");
	pthread_mutex_lock(&a->mu);
	if (!r && !a->policy_cancel) {
		if (a->next_m) /* an older one never swapped in: this one replaces it */
			(void)ro_model_free(a->next_m);
		a->next_m = m;
		a->next_version = l->version;
		m = NULL;
		ro_engine_kick(a);
	} else if (!r) {
		r = -ECANCELED;
	}
	if (r)
		(void)snprintf(a->policy_error, sizeof(a->policy_error), "%s",
			       err[0] ? err : strerror(-r));
	a->loader_done = true;
	pthread_mutex_unlock(&a->mu);
	ro_model_free(m);
	if (r && r != -ECANCELED)
		ro_log(LOG_ERR, "policy version %lld from %s: %s (version %lld serves on)",
		       (long long)l->version, l->uri, err[0] ? err : strerror(-r),
		       (long long)a->policy_version);
	else if (!r)
		ro_log(LOG_INFO, "policy version %lld loaded from %s: swapping at the next step",
		       (long long)l->version, l->uri);
	{
		uint64_t one = 1;

		(void)!write(a->efd, &one, sizeof(one)); /* the loop joins us */
	}
	free(l->uri);
	free(l->manifest);
	free(l);
	return NULL;
}

static void on_policy(void *arg, struct ro_queue_result *res)
{
	struct ro_agent *a = arg;
	struct ro_policy_info *p = res->policy;
	struct load *l;

	a->policy_busy = false;
	/* what the server answered (not a lost connection, which the connection says) */
	if ((res->r == -EPROTO || res->r == -EMSGSIZE || res->r == -EBADMSG ||
	     res->r == -EINVAL || res->r == -ENOTSUP) &&
	    ro_now_ms() >= a->policy_read_log_ms) {
		/* a policy key of another type, a manifest over the reply cap: said, once a
		 * minute, and the running weights kept */
		ro_log(LOG_WARNING, "policy: cannot read the published policy: %s",
		       res->msg && *res->msg ? res->msg : strerror(-res->r));
		a->policy_read_log_ms = ro_now_ms() + 60000;
	}
	if (res->r < 0 || !p)
		return;
	a->published_version = p->version;
	if (p->version <= a->policy_version || a->policy_loading || !p->uri ||
	    ro_now_ms() < a->policy_retry_ms || a->state != RO_RUNNING)
		return;
	pthread_mutex_lock(&a->mu);
	if (a->next_m && a->next_version >= p->version) {
		pthread_mutex_unlock(&a->mu);
		return; /* loaded, waiting for the engine's next step */
	}
	pthread_mutex_unlock(&a->mu);
	l = calloc(1, sizeof(*l));
	if (!l)
		return;
	l->a = a;
	l->version = p->version;
	l->uri = p->uri;
	l->manifest = p->manifest;
	p->uri = p->manifest = NULL;
	a->loader_done = false;
	a->policy_loading = true;
	if (pthread_create(&a->loader, NULL, loader_main, l)) {
		a->policy_loading = false;
		free(l->uri);
		free(l->manifest);
		free(l);
		return;
	}
	a->loader_started = true;
	ro_log(LOG_NOTICE, "policy version %lld published (%s): loading beside version %lld",
	       (long long)l->version, l->uri, (long long)a->policy_version);
}

void ro_policy_check(struct ro_agent *a)
{
	struct ro_queue_cb cb = {on_policy, a, a->cfg.redis_timeout_ms * 2};

	if (a->policy_busy)
		return;
	if (!ro_queue_policy_get_async(a->q, &cb))
		a->policy_busy = true;
}

void ro_policy_tick(struct ro_agent *a)
{
	int64_t now = ro_now_ms();
	bool done;

	if (a->state != RO_RUNNING)
		a->policy_cancel = 1; /* a drain waits for no download */
	pthread_mutex_lock(&a->mu);
	done = a->loader_done;
	pthread_mutex_unlock(&a->mu);
	if (a->loader_started && done) {
		(void)pthread_join(a->loader, NULL);
		a->loader_started = false;
		a->policy_loading = false;
		pthread_mutex_lock(&a->mu);
		if (a->policy_error[0]) {
			a->n.policy_errors++;
			a->policy_backoff_ms = a->policy_backoff_ms ? a->policy_backoff_ms * 2 : 1000;
			if (a->policy_backoff_ms > 60000)
				a->policy_backoff_ms = 60000;
			a->policy_retry_ms = now + a->policy_backoff_ms;
			a->policy_error[0] = '\0';
		} else {
			a->policy_backoff_ms = 0;
		}
		pthread_mutex_unlock(&a->mu);
	}
	if (now >= a->next_policy_ms) {
		ro_policy_check(a);
		a->next_policy_ms = now + a->cfg.status_interval_ms;
	}
}

void ro_policy_stop(struct ro_agent *a)
{
	a->policy_cancel = 1;
	if (a->loader_started)
		(void)pthread_join(a->loader, NULL);
	a->loader_started = false;
	a->next_m = ro_model_free(a->next_m);
	a->old_m = ro_model_free(a->old_m);
}

/* ---- the swap (engine thread, under mu, between two steps) ------------------------------ */

/* Every unfinished sample of u's gets a segment for the new version from its next token. */
static void add_segment(struct unit_rt *u, int64_t version)
{
	for (uint32_t i = 0; i < u->n_s; i++) {
		struct sample_rt *s = u->s[i];

		if (!s || s->finished)
			continue;
		if (s->n_pv && s->pv[s->n_pv - 1].start == s->len)
			s->pv[s->n_pv - 1].version = version; /* no token of the last one yet */
		else if (s->n_pv < RO_MAX_PV)
			s->pv[s->n_pv++] = (struct ro_pv){s->len, version};
		else
			s->pv[RO_MAX_PV - 1].version = version; /* a sample swapped 16 times */
	}
}

/* recompute: the unit's caches go; its prompt and every sample's tokens are prefilled
 * again with the new weights (in chunks, beside the decode of the others) before its next
 * token, which is then drawn from the new policy. */
static void recompute(struct unit_rt *u)
{
	ro_engine_drop_caches(u);
	for (uint32_t i = 0; i < u->n_s; i++) {
		struct sample_rt *s = u->s[i];

		if (!s)
			continue;
		s->prefix_done = 0;
		s->prefix_len = s->len;
	}
	u->prompt_done = 0;
	u->phase = 0;
}

void ro_policy_swap(struct ro_agent *a)
{
	struct ro_model *old = a->m;
	bool keep_old = false;

	bool finish = a->cfg.policy_swap == 1 && !a->ep; /* a group always recomputes */

	if (!a->next_m)
		return;
	/* a group swaps together: once its last round said every rank has this version */
	if (a->ep && a->group_ready < a->next_version)
		return;
	if (finish && a->old_m) {
		/* finish: the previous old weights are still in use; swap after they go */
		return;
	}
	for (struct unit_rt *u = a->units; u; u = u->next) {
		if (u->released)
			continue;
		if (finish && u->phase != 0) {
			keep_old = true; /* finish: it ends on the weights it began with */
			u->m = old;
			continue;
		}
		if (u->phase != 0)
			recompute(u);
		add_segment(u, a->next_version);
		u->m = NULL;
	}
	a->m = a->next_m;
	a->next_m = NULL;
	if (a->ep)
		ro_ep_attach(a->ep, a->m); /* its experts now answer the group's exchanges */
	{
		/* the figures of this swap: the median step before it, the longest after */
		uint32_t n = a->step_ring_n < 256 ? a->step_ring_n : 256;
		float v[256];

		memcpy(v, a->step_ring, n * sizeof(v[0]));
		for (uint32_t i = 1; i < n; i++)
			for (uint32_t j = i; j > 0 && v[j - 1] > v[j]; j--) {
				float t = v[j];

				v[j] = v[j - 1];
				v[j - 1] = t;
			}
		a->swap_median_ms = n ? v[n / 2] : 0;
		a->swap_max_ms = 0;
		a->swap_watch = 1;
		a->swap_at_ms = ro_now_ms();
		a->swap_first_token_ms = 0;
	}
	if (keep_old) {
		a->old_m = old;
		a->old_version = a->policy_version;
	} else {
		ro_model_free(old);
	}
	if (a->ep)
		ro_log(LOG_NOTICE,
		       "policy version %lld serving (was %lld, caches rebuilt): rank %u at group "
		       "round %llu",
		       (long long)a->next_version, (long long)a->policy_version, ro_ep_rank(a->ep),
		       (unsigned long long)a->group_rounds);
	else
		ro_log(LOG_NOTICE, "policy version %lld serving (was %lld, %s)",
		       (long long)a->next_version, (long long)a->policy_version,
		       keep_old ? "running sequences finish on the old weights" : "caches rebuilt");
	a->policy_version = a->next_version;
	a->n.policy_swaps++;
}

void ro_policy_gc(struct ro_agent *a)
{
	if (!a->old_m)
		return;
	for (struct unit_rt *u = a->units; u; u = u->next)
		if (!u->released && u->m == a->old_m)
			return;
	a->old_m = ro_model_free(a->old_m);
	ro_log(LOG_INFO, "policy version %lld freed: its last sequence ended",
	       (long long)a->old_version);
}
