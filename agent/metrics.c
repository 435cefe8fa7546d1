/* What rolloutd tells the world about itself: the Prometheus textfile (rewritten atomically
 * every metrics interval for node_exporter's textfile collector), systemd's STATUS= line,
 * and the worker heartbeat hash in Redis (sent asynchronously; a Redis outage only delays
 * it). */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/log.h"
#include "kernels/model.h"

/* A new temporary file beside path, for the rename into place. The directory may be one
 * others can write to (a textfile collector's): whatever is already at a candidate name (a
 * symlink to a file of someone else's, a file) is never followed, truncated or removed:
 * O_EXCL refuses any existing name, O_NOFOLLOW and O_EXCL any symlink. The first candidate
 * is <path>.<pid>.tmp, each later one has a random suffix. tmp gets the name. */
static FILE *open_tmp(const char *path, char *tmp, size_t len)
{
	for (int i = 0; i < 8; i++) {
		uint64_t rnd = 0;
		int fd;
		FILE *f;

		if (!i)
			(void)snprintf(tmp, len, "%s.%d.tmp", path, (int)getpid());
		else if (getrandom(&rnd, sizeof(rnd), GRND_NONBLOCK) == (ssize_t)sizeof(rnd))
			(void)snprintf(tmp, len, "%s.%d.%016llx.tmp", path, (int)getpid(),
				       (unsigned long long)rnd);
		else
			return NULL;
		fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
		if (fd < 0 && errno == EEXIST)
			continue;
		if (fd < 0)
			return NULL;
		/* 0644 whatever the umask (the unit's UMask=0077): node_exporter, another user,
		 * reads the file; it holds counters, nothing secret */
		(void)fchmod(fd, 0644);
		f = fdopen(fd, "w");
		if (!f) {
			(void)close(fd);
			(void)unlink(tmp);
		}
		return f;
	}
	return NULL;
}

/* A Prometheus label value: backslash, double quote and newline escaped, cut to fit. */
static void label_value(const char *s, char *out, size_t len)
{
	size_t o = 0;

	for (; s && *s && o + 3 < len; s++) {
		if (*s == '\\' || *s == '"' || *s == '\n') {
			out[o++] = '\\';
			out[o++] = *s == '\n' ? 'n' : *s;
		} else {
			out[o++] = *s;
		}
	}
	out[o] = 0;
}

void ro_metrics_write(struct ro_agent *a)
{
	const char *path = a->cfg.metrics_file;
	char tmp[4200], wl[512], ql[512], gl[256];
	uint32_t active, held = 0;
	double tps;
	uint64_t tokens, kv_bytes, kv_tokens;
	FILE *f;

	if (!path || !*path)
		return;
	pthread_mutex_lock(&a->mu);
	active = ro_units_active(a);
	for (const struct unit_rt *u = a->units; u; u = u->next)
		held += u->cp != CP_GONE;
	tps = a->tokens_per_s;
	tokens = a->n.tokens;
	kv_bytes = a->kv_bytes;
	kv_tokens = a->kv_tokens;
	pthread_mutex_unlock(&a->mu);
	f = open_tmp(path, tmp, sizeof(tmp));
	if (!f) {
		static int64_t last_warned; /* the control plane's thread only */

		ro_log_limited(&last_warned, 60000, LOG_WARNING,
			       "metrics file %s: no temporary file beside it: %m", path);
		return;
	}
	label_value(a->worker, wl, sizeof(wl));
	label_value(a->cfg.queue, ql, sizeof(ql));
	/* the build, as Prometheus's *_build_info convention has it: labels, value 1 */
	label_value(RO_GIT_DESCRIBE, gl, sizeof(gl));
	(void)fprintf(f,
		      "# HELP rolloutd_build_info The build of rolloutd: version, git describe, "
		      "CUDA backend.\n# TYPE rolloutd_build_info gauge\n"
		      "rolloutd_build_info{worker=\"%s\",queue=\"%s\",version=\"%s\",git=\"%s\","
		      "cuda=\"%s\"} 1\n",
		      wl, ql, PACKAGE_VERSION, gl, ro_kernels_cuda_built() ? "yes" : "no");
#define M(type, name, help, fmt, v)                                                       \
	(void)fprintf(f,                                                                  \
		      "# HELP rolloutd_" name " " help "\n# TYPE rolloutd_" name " " type \
		      "\nrolloutd_" name "{worker=\"%s\",queue=\"%s\"} " fmt "\n",       \
		      wl, ql, v)
#define C(name, help, v) M("counter", name, help, "%llu", (unsigned long long)(v))
#define G(name, help, fmt, v) M("gauge", name, help, fmt, v)
	C("units_claimed_total", "Units claimed (and, at start, still held).", a->n.claimed);
	C("units_completed_total", "Units completed by this worker.", a->n.completed);
	C("units_requeued_total", "Units requeued (drain).", a->n.requeued);
	C("units_dead_lettered_total", "Units dead-lettered by this worker.", a->n.dead);
	C("units_released_total", "Units released (policy too old here).", a->n.released);
	C("units_failed_total", "Units this worker could not run (an attempt charged).",
	  a->n.failed);
	C("samples_published_total", "Samples published.", a->n.published);
	C("tokens_generated_total", "Tokens generated.", tokens);
	C("checkpoints_total", "Sample checkpoints written.", a->n.checkpoints);
	C("checkpoints_discarded_total", "Checkpoints found unusable (the sample restarts).",
	  a->n.checkpoints_discarded);
	C("drains_total", "Drains begun.", a->n.drains);
	C("imds_errors_total", "Times IMDS became unreachable.", a->n.imds_errors);
	C("redis_errors_total", "Redis operations that failed.", a->n.redis_errors);
	C("lease_losses_total", "Units whose lease was lost (refused, or not confirmed in time).",
	  a->n.lease_losses);
	C("stale_writes_refused_total", "Writes Redis refused because the lease was not ours.",
	  a->n.stale_refused);
	G("decode_tokens_per_second",
	  "Decode rate, an EWMA gauge; rate(rolloutd_tokens_generated_total[1m]) is the "
	  "conventional rate.",
	  "%.3f", tps);
	G("inflight_sequences", "Sequences being decoded.", "%u", active);
	G("inflight_units", "Units held.", "%u", held);
	G("kv_cache_bytes",
	  "Bytes of KV cache blocks held (a prompt's blocks once for its samples).", "%llu",
	  (unsigned long long)kv_bytes);
	G("kv_cache_positions",
	  "Positions the held sequences cover (each sample's prompt and tokens); "
	  "kv_cache_bytes / kv_cache_positions is the KV bytes per in-flight token.",
	  "%llu", (unsigned long long)kv_tokens);
	G("backpressure", "1 while the trainer's lag stops claims.", "%d", a->backpressure ? 1 : 0);
	G("trainer_lag", "Trainer lag on the samples stream.", "%lld", (long long)a->lag);
	G("redis_up", "1 while the Redis connection is established.", "%d",
	  ro_queue_connected(a->q) ? 1 : 0);
	G("policy_version", "Policy version the engine serves.", "%lld",
	  (long long)a->policy_version);
	G("policy_published_version", "Policy version published in Redis.", "%lld",
	  (long long)a->published_version);
	C("policy_swaps_total", "Policy weights swapped in while running.", a->n.policy_swaps);
	C("policy_errors_total", "Policy loads that failed (the old weights serve on).",
	  a->n.policy_errors);
	G("policy_download_bytes", "Bytes of the policy being made available so far.", "%llu",
	  (unsigned long long)a->policy_bytes_done);
	G("ready", "1 while running and Redis answers (the readiness probe).", "%d",
	  ro_ready(a) ? 1 : 0);
	C("redis_redirects_total", "Redirections followed (Cluster MOVED, a failover).",
	  (unsigned long long)ro_queue_redirects(a->q));
	G("last_drain_duration_seconds", "Duration of the last drain.", "%.3f", a->last_drain_s);
	if (a->ep) {
		struct ro_ep_stats st;

		ro_ep_stats(a->ep, &st);
		C("ep_exchanges_total", "Expert-parallel exchanges (MoE layer passes).",
		  st.exchanges);
		C("ep_dispatch_bytes_total", "Payload bytes dispatched.", st.dispatch_bytes);
		C("ep_combine_bytes_total", "Payload bytes combined back.", st.combine_bytes);
		M("counter", "ep_dispatch_seconds_total", "Time in dispatch.", "%.3f",
		  st.dispatch_ms / 1e3);
		M("counter", "ep_combine_seconds_total", "Time in combine.", "%.3f",
		  st.combine_ms / 1e3);
		M("counter", "ep_group_step_seconds_total", "Time in the group's step all-gathers.",
		  "%.3f", st.sync_ms / 1e3);
		G("ep_failed", "1 once the group failed.", "%d", a->ep_failed ? 1 : 0);
	}
	(void)fprintf(f, "# HELP rolloutd_state Current state.\n# TYPE rolloutd_state gauge\n");
	for (int s = RO_RUNNING; s <= RO_DRAINED; s++)
		(void)fprintf(f, "rolloutd_state{worker=\"%s\",queue=\"%s\",state=\"%s\"} %d\n", wl,
			      ql, ro_state_name((enum ro_state)s), a->state == (enum ro_state)s);
#undef C
#undef G
#undef M
	if (fclose(f) == 0)
		(void)rename(tmp, path); /* atomic: the collector never reads half a file */
	else
		(void)unlink(tmp);
}

void ro_notify_status(struct ro_agent *a)
{
	char s[512];
	uint32_t held = 0, active;
	double tps;

	pthread_mutex_lock(&a->mu);
	for (const struct unit_rt *u = a->units; u; u = u->next)
		held += u->cp != CP_GONE;
	active = ro_units_active(a);
	tps = a->tokens_per_s;
	pthread_mutex_unlock(&a->mu);
	if (a->state == RO_RUNNING)
		(void)snprintf(
		    s, sizeof(s), "STATUS=running: %u units, %u sequences, %.0f tok/s%s%s%s", held,
		    active, tps, a->backpressure ? ", backpressure (trainer behind)" : "",
		    a->stop_claiming ? ", not claiming (rebalance)" : "",
		    ro_queue_connected(a->q) ? "" : ", redis unreachable");
	else
		(void)snprintf(s, sizeof(s), "STATUS=%s (%s): %u units, deadline in %.1f s",
			       ro_state_name(a->state), a->drain_reason, held,
			       (double)(a->deadline_wall_ms - ro_wall_ms()) / 1000.0);
	(void)sd_notify(0, s);
}

static void on_heartbeat(void *arg, struct ro_queue_result *res)
{
	struct ro_agent *a = arg;

	a->hb_busy = false;
	if (res->r < 0 && res->r != -ECANCELED)
		a->n.redis_errors++;
	else if (!res->r)
		a->last_redis_ok_ms = ro_now_ms();
}

void ro_heartbeat(struct ro_agent *a)
{
	char units[16], act[16], tps[32], comp[24], pv[24];
	const char *kv[] = {"state",	 ro_state_name(a->state), "units",	    units,
			    "in_flight", act,			  "tokens_per_s",   tps,
			    "completed", comp,			  "policy_version", pv};
	struct ro_queue_cb cb = {on_heartbeat, a, a->cfg.status_interval_ms};
	uint32_t held = 0;

	if (a->hb_busy)
		return;
	pthread_mutex_lock(&a->mu);
	for (const struct unit_rt *u = a->units; u; u = u->next)
		held += u->cp != CP_GONE;
	(void)snprintf(units, sizeof(units), "%u", held);
	(void)snprintf(act, sizeof(act), "%u", ro_units_active(a));
	(void)snprintf(tps, sizeof(tps), "%.1f", a->tokens_per_s);
	pthread_mutex_unlock(&a->mu);
	(void)snprintf(comp, sizeof(comp), "%llu", (unsigned long long)a->n.completed);
	(void)snprintf(pv, sizeof(pv), "%lld", (long long)a->policy_version);
	if (!ro_queue_heartbeat_async(a->q, kv, 12, &cb))
		a->hb_busy = true;
}
