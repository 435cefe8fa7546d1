/* rolloutd: the node-resident rollout worker. Loads the model, connects to the queue, and
 * runs one loop: events (signals, IMDS notices from the watcher thread, the control
 * socket), claims, one decode step over every active sequence, housekeeping (checkpoints,
 * leases, backpressure), systemd notifications and the metrics textfile. A notice, a
 * SIGTERM or `rolloutctl drain` turns RUNNING into DRAINING; once nothing is left it is
 * DRAINED and the process exits 0. */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/log.h"

static volatile sig_atomic_t sigterms, sigints;

static void on_signal(int sig)
{
	if (sig == SIGTERM)
		sigterms++;
	else
		sigints++;
}

/* ---- the IMDS watcher thread: events into a pipe the loop reads ------------------------- */

struct watcher {
	struct ro_imds *m;
	struct ro_imds_watch *w;
	pthread_t th;
	int fd[2];
	atomic_bool stop;
	bool running;
};

static void *watch_thread(void *arg)
{
	struct watcher *wt = arg;

	while (!atomic_load(&wt->stop)) {
		struct ro_imds_event e;

		if (ro_imds_watch_next(wt->w, 200, &e) == 0)
			(void)!write(wt->fd[1], &e, sizeof(e));
	}
	return NULL;
}

static int watcher_start(struct ro_agent *a, struct watcher *wt)
{
	struct ro_imds_opts io;
	struct ro_imds_watch_opts wo;
	int r;

	ro_imds_opts_default(&io);
	io.endpoint = a->cfg.imds_endpoint;
	io.v1_fallback = a->cfg.imds_v1_fallback;
	ro_imds_watch_opts_default(&wo);
	wo.interval_ms = a->cfg.imds_poll_ms;
	wo.slow_interval_ms = a->cfg.imds_slow_poll_ms;
	r = ro_imds_new(&io, &wt->m);
	if (!r)
		r = ro_imds_watch_new(wt->m, &wo, &wt->w);
	if (!r && pipe2(wt->fd, O_CLOEXEC | O_NONBLOCK))
		r = -errno;
	if (!r && pthread_create(&wt->th, NULL, watch_thread, wt))
		r = -EAGAIN;
	wt->running = !r;
	return r;
}

static void watcher_stop(struct watcher *wt)
{
	if (wt->running) {
		atomic_store(&wt->stop, true);
		(void)pthread_join(wt->th, NULL);
		(void)close(wt->fd[0]);
		(void)close(wt->fd[1]);
	}
	ro_imds_watch_free(wt->w);
	ro_imds_free(wt->m);
}

static void on_imds(struct ro_agent *a, const struct ro_imds_event *e)
{
	char line[1024] = "";
	int64_t lead = (int64_t)a->cfg.notice_s * 1000;

	(void)ro_imds_event_json(e, line, sizeof(line));
	ro_log(e->kind == RO_IMDS_EV_UNREACHABLE ? LOG_WARNING : LOG_NOTICE, "imds: %s", line);
	switch (e->kind) {
	case RO_IMDS_EV_INTERRUPTION:
		ro_drain_begin(a, e->deadline_ms - a->cfg.drain_margin_ms, "spot interruption");
		break;
	case RO_IMDS_EV_LIFECYCLE:
		if (strcmp(e->state, "InService") && strncmp(e->state, "Pending", 7))
			ro_drain_begin(a, e->at_ms + lead - a->cfg.drain_margin_ms,
				       "auto scaling lifecycle");
		break;
	case RO_IMDS_EV_REBALANCE:
		if (a->cfg.rebalance == RO_REBALANCE_DRAIN)
			ro_drain_begin(a, e->at_ms + lead - a->cfg.drain_margin_ms,
				       "rebalance recommendation");
		else if (a->cfg.rebalance == RO_REBALANCE_STOP_CLAIMING && !a->stop_claiming) {
			a->stop_claiming = true;
			ro_log(LOG_NOTICE, "rebalance recommendation: no new claims");
		}
		break;
	case RO_IMDS_EV_UNREACHABLE:
		a->n.imds_errors++;
		break;
	default:
		break;
	}
}

/* ---- control socket ---------------------------------------------------------------------- */

static int control_open(const char *path)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd;
	mode_t old;

	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	(void)strcpy(sa.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return -errno;
	(void)unlink(path);
	old = umask(0177); /* 0600: the socket drains the node */
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) || listen(fd, 8)) {
		int r = -errno;

		(void)umask(old);
		(void)close(fd);
		return r;
	}
	(void)umask(old);
	return fd;
}

static void status_json(const struct ro_agent *a, char *buf, size_t len)
{
	int64_t now = ro_wall_ms();
	uint32_t unckpt = 0; /* the most tokens any sequence would lose if killed now */

	for (const struct unit_rt *u = a->units; u; u = u->next)
		for (uint32_t i = 0; i < u->n_s; i++)
			if (u->s[i] && !u->s[i]->finished && u->s[i]->len - u->s[i]->ckpt_len > unckpt)
				unckpt = u->s[i]->len - u->s[i]->ckpt_len;

	(void)snprintf(buf, len,
		       "{\"state\":\"%s\",\"worker\":\"%s\",\"units\":%u,\"in_flight\":%u,"
		       "\"tokens_per_s\":%.1f,\"step_ms\":%.2f,\"backpressure\":%s,\"lag\":%lld,"
		       "\"stop_claiming\":%s,\"deadline_in_s\":%.3f,\"drain_reason\":\"%s\","
		       "\"loop_age_ms\":%lld,\"claimed\":%llu,\"completed\":%llu,\"requeued\":%llu,"
		       "\"published\":%llu,\"uncheckpointed_max\":%u",
		       ro_state_name(a->state), a->worker, a->n_units, a->n_active, a->tokens_per_s,
		       a->step_ms, a->backpressure ? "true" : "false", (long long)a->lag,
		       a->stop_claiming ? "true" : "false",
		       a->state == RO_RUNNING ? -1.0 : (double)(a->deadline_wall_ms - now) / 1000.0,
		       a->drain_reason, (long long)(ro_now_ms() - a->last_loop_ms),
		       (unsigned long long)a->n.claimed, (unsigned long long)a->n.completed,
		       (unsigned long long)a->n.requeued, (unsigned long long)a->n.published, unckpt);
	if (a->ep) {
		struct ro_ep_stats st;
		size_t n = strlen(buf);

		ro_ep_stats(a->ep, &st);
		(void)snprintf(buf + n, len - n,
			       ",\"ep\":{\"group\":\"%s\",\"rank\":%u,\"size\":%u,\"provider\":\"%s\","
			       "\"failed\":%s,\"exchanges\":%llu,\"low_latency\":%llu,"
			       "\"dispatch_bytes\":%llu,\"combine_bytes\":%llu,\"dispatch_ms\":%.1f,"
			       "\"combine_ms\":%.1f,\"sync_ms\":%.1f}",
			       a->cfg.ep_group, ro_ep_rank(a->ep), ro_ep_world(a->ep),
			       ro_ep_provider(a->ep), a->ep_failed ? "true" : "false",
			       (unsigned long long)st.exchanges, (unsigned long long)st.ll_exchanges,
			       (unsigned long long)st.dispatch_bytes,
			       (unsigned long long)st.combine_bytes, st.dispatch_ms, st.combine_ms,
			       st.sync_ms);
	}
	{
		size_t n = strlen(buf);

		(void)snprintf(buf + n, len - n, "}\n");
	}
}

static void control_serve(struct ro_agent *a, int lfd)
{
	for (int i = 0; i < 4; i++) {
		char req[256] = "", rep[2048];
		struct pollfd p;
		ssize_t n;
		int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);

		if (fd < 0)
			return;
		p = (struct pollfd){.fd = fd, .events = POLLIN};
		if (poll(&p, 1, 200) == 1 && (n = read(fd, req, sizeof(req) - 1)) > 0) {
			req[n] = '\0';
			req[strcspn(req, "\r\n")] = '\0';
			if (!strncmp(req, "drain", 5)) {
				double s = req[5] ? strtod(req + 5, NULL) : a->cfg.sigterm_grace_s;

				if (!(s >= 0) || s > 86400)
					s = a->cfg.sigterm_grace_s;
				ro_drain_begin(a, ro_wall_ms() + (int64_t)(s * 1000), "rolloutctl drain");
				status_json(a, rep, sizeof(rep));
			} else if (!strcmp(req, "status")) {
				status_json(a, rep, sizeof(rep));
			} else {
				(void)snprintf(rep, sizeof(rep), "{\"error\":\"unknown command\"}\n");
			}
			(void)!write(fd, rep, strlen(rep));
		}
		(void)close(fd);
	}
}

/* ---- metrics textfile -------------------------------------------------------------------- */

static void write_metrics(const struct ro_agent *a)
{
	const char *path = a->cfg.metrics_file;
	char tmp[4200];
	FILE *f;

	if (!path || !*path)
		return;
	(void)snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid());
	f = fopen(tmp, "w");
	if (!f)
		return;
#define M(type, name, help, fmt, v)                                                               \
	(void)fprintf(f, "# HELP rolloutd_" name " " help "\n# TYPE rolloutd_" name " " type      \
			 "\nrolloutd_" name "{worker=\"%s\"} " fmt "\n",                          \
		      a->worker, v)
#define C(name, help, v) M("counter", name, help, "%llu", (unsigned long long)(v))
#define G(name, help, fmt, v) M("gauge", name, help, fmt, v)
	C("units_claimed_total", "Units claimed.", a->n.claimed);
	C("units_completed_total", "Units completed by this worker.", a->n.completed);
	C("units_requeued_total", "Units requeued (drain).", a->n.requeued);
	C("units_dead_lettered_total", "Units dead-lettered by this worker.", a->n.dead);
	C("units_released_total", "Units released (policy too old here).", a->n.released);
	C("samples_published_total", "Samples published.", a->n.published);
	C("tokens_generated_total", "Tokens generated.", a->n.tokens);
	C("checkpoints_total", "Sample checkpoints written.", a->n.checkpoints);
	C("drains_total", "Drains begun.", a->n.drains);
	C("imds_errors_total", "Times IMDS became unreachable.", a->n.imds_errors);
	C("redis_errors_total", "Redis operations that failed.", a->n.redis_errors);
	C("lease_losses_total", "Units whose lease was lost.", a->n.lease_losses);
	G("decode_tokens_per_second", "Decode rate (EWMA).", "%.3f", a->tokens_per_s);
	G("inflight_sequences", "Sequences being decoded.", "%u", a->n_active);
	G("inflight_units", "Units held.", "%u", a->n_units);
	G("backpressure", "1 while the trainer's lag stops claims.", "%d", a->backpressure ? 1 : 0);
	G("trainer_lag", "Trainer lag on the samples stream.", "%lld", (long long)a->lag);
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
		(void)fprintf(f, "rolloutd_state{worker=\"%s\",state=\"%s\"} %d\n", a->worker,
			      ro_state_name((enum ro_state)s), a->state == (enum ro_state)s);
#undef C
#undef G
#undef M
	if (fclose(f) == 0)
		(void)rename(tmp, path); /* atomic: the collector never reads half a file */
	else
		(void)unlink(tmp);
}

static void notify_status(const struct ro_agent *a)
{
	char s[512];

	if (a->state == RO_RUNNING)
		(void)snprintf(s, sizeof(s),
			       "STATUS=running: %u units, %u sequences, %.0f tok/s%s%s", a->n_units,
			       a->n_active, a->tokens_per_s,
			       a->backpressure ? ", backpressure (trainer behind)" : "",
			       a->stop_claiming ? ", not claiming (rebalance)" : "");
	else
		(void)snprintf(s, sizeof(s), "STATUS=%s (%s): %u units, deadline in %.1f s",
			       ro_state_name(a->state), a->drain_reason, a->n_units,
			       (double)(a->deadline_wall_ms - ro_wall_ms()) / 1000.0);
	(void)sd_notify(0, s);
}

static void heartbeat(struct ro_agent *a)
{
	char units[16], act[16], tps[32], comp[24];
	const char *kv[] = {"state", ro_state_name(a->state), "units", units, "in_flight", act,
			    "tokens_per_s", tps, "completed", comp};

	(void)snprintf(units, sizeof(units), "%u", a->n_units);
	(void)snprintf(act, sizeof(act), "%u", a->n_active);
	(void)snprintf(tps, sizeof(tps), "%.1f", a->tokens_per_s);
	(void)snprintf(comp, sizeof(comp), "%llu", (unsigned long long)a->n.completed);
	if (ro_queue_heartbeat(a->q, kv, 10))
		a->n.redis_errors++;
}

static void worker_id(struct ro_agent *a)
{
	struct ro_imds_identity id;
	struct ro_imds_opts io;
	struct ro_imds *m = NULL;

	if (a->cfg.worker_id && *a->cfg.worker_id) {
		if (a->cfg.ep_size > 1) /* ranks of a group are workers of their own */
			(void)snprintf(a->worker, sizeof(a->worker), "%s-r%u", a->cfg.worker_id,
				       a->cfg.ep_rank);
		else
			(void)snprintf(a->worker, sizeof(a->worker), "%s", a->cfg.worker_id);
		return;
	}
	ro_imds_opts_default(&io);
	io.endpoint = a->cfg.imds_endpoint;
	io.retries = 0;
	if (a->cfg.imds && !ro_imds_new(&io, &m) && !ro_imds_identity(m, &id)) {
		(void)snprintf(a->worker, sizeof(a->worker), "%s-r%u", id.instance_id,
			       a->cfg.ep_rank);
	} else {
		char h[128] = "localhost";

		(void)gethostname(h, sizeof(h) - 1);
		if (a->cfg.ep_size > 1)
			(void)snprintf(a->worker, sizeof(a->worker), "%s-r%u", h, a->cfg.ep_rank);
		else
			(void)snprintf(a->worker, sizeof(a->worker), "%s", h);
	}
	ro_imds_free(m);
}

/* ---- expert parallelism: local ranks, the rendezvous, the group round ------------------ */

static char *with_suffix(const char *s, uint32_t rank)
{
	char *r = NULL;

	if (!s || !*s)
		return strdup("");
	if (asprintf(&r, "%s.rank%u", s, rank) < 0)
		return NULL;
	return r;
}

/* --ep-local-ranks N: fork the N ranks of one group on this host and wait for them. Rank 0
 * keeps the control socket, the metrics file and the IMDS watch; ranks 1.. take
 * <path>.rank<i> and learn of drains in band, from the group. Signals are forwarded. This
 * process is what systemd sees: it sends READY, WATCHDOG and STOPPING for the group.
 * Returns -1 in a child (which goes on as its rank), else the exit status: 0 when every
 * rank exited 0, else the first failure's. */
static int run_local_ranks(struct ro_agent *a)
{
	const uint32_t n = a->cfg.ep_local_ranks;
	pid_t pid[64];
	uint32_t alive = 0;
	int rc = 0, fwd_terms = 0, fwd_ints = 0;
	int64_t next_wd = 0;
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	if (!*a->cfg.ep_group) {
		char h[64] = "host";

		(void)gethostname(h, sizeof(h) - 1);
		free(a->cfg.ep_group);
		if (asprintf(&a->cfg.ep_group, "local-%s-%d-%lld", h, (int)getpid(),
			     (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000) < 0)
			return 1;
	}
	for (uint32_t i = 0; i < n; i++) {
		pid[i] = fork();
		if (pid[i] < 0) {
			ro_log(LOG_ERR, "fork rank %u: %s", i, strerror(errno));
			for (uint32_t k = 0; k < i; k++)
				(void)kill(pid[k], SIGTERM);
			rc = 1;
			break;
		}
		if (pid[i] == 0) {
			(void)prctl(PR_SET_PDEATHSIG, SIGTERM);
			(void)unsetenv("NOTIFY_SOCKET"); /* the parent speaks to systemd */
			a->cfg.ep_rank = i;
			a->cfg.ep_size = n;
			a->cfg.ep_local_ranks = 0;
			a->local_group = true;
			if (i > 0) {
				char *cs = with_suffix(a->cfg.control_socket, i),
				     *mf = with_suffix(a->cfg.metrics_file, i);

				free(a->cfg.control_socket);
				free(a->cfg.metrics_file);
				a->cfg.control_socket = cs;
				a->cfg.metrics_file = mf;
				a->cfg.imds = false;
			}
			return -1;
		}
		alive++;
	}
	ro_log(LOG_INFO, "running %u ranks of expert-parallel group %s", alive, a->cfg.ep_group);
	(void)sd_notify(0, "READY=1\nSTATUS=expert-parallel ranks running");
	while (alive) {
		int st;
		pid_t w = waitpid(-1, &st, WNOHANG);

		if (w > 0) {
			uint32_t i = 0;

			while (i < n && pid[i] != w)
				i++;
			alive--;
			if (i < n)
				pid[i] = 0;
			if ((!WIFEXITED(st) || WEXITSTATUS(st)) && !rc) {
				rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
				ro_log(LOG_ERR, "rank %u exited with status %d", i, rc);
			}
			continue;
		}
		if (sigterms != fwd_terms || sigints != fwd_ints) {
			int sig = sigints != fwd_ints ? SIGINT : SIGTERM;

			(void)sd_notify(0, "STOPPING=1\nSTATUS=draining the group");
			for (uint32_t i = 0; i < n; i++)
				if (pid[i] > 0)
					(void)kill(pid[i], sig);
			fwd_terms = sigterms;
			fwd_ints = sigints;
		}
		if (ro_now_ms() >= next_wd) {
			(void)sd_notify(0, "WATCHDOG=1");
			next_wd = ro_now_ms() + 10000;
		}
		(void)usleep(50000);
	}
	return rc;
}

/* Join the group: an endpoint sized for the model and the unit bounds, this rank's card
 * under the group key, every rank's card, one first round as the handshake. */
static int ep_setup(struct ro_agent *a)
{
	const struct ro_model_config *mc = ro_model_config(a->m);
	struct ro_ep_opts o;
	struct ro_ep_group g;
	uint8_t card[RO_EP_CARD_MAX];
	void *cards[64] = {0};
	size_t len, lens[64];
	char err[256];
	int r;

	ro_ep_opts_default(&o);
	o.provider = a->cfg.fabric_provider;
	o.rank = a->cfg.ep_rank;
	o.world = a->cfg.ep_size;
	o.hidden = mc->hidden;
	o.top_k = mc->top_k;
	o.experts = mc->experts;
	o.max_tokens = a->cfg.ep_max_tokens;
	o.ll_tokens = a->cfg.max_inflight < o.max_tokens ? a->cfg.max_inflight : o.max_tokens;
	o.mode = (enum ro_ep_mode)a->cfg.ep_mode;
	o.dispatch_dtype = (enum ro_ep_dtype)a->cfg.ep_dtype;
	o.combine_dtype = (enum ro_ep_dtype)a->cfg.ep_combine_dtype;
	o.timeout_ms = a->cfg.ep_timeout_ms;
	o.fabric_only = !a->cfg.ep_direct;
	o.combine_sum = a->cfg.ep_combine == 1;
	if (strcmp(a->cfg.fabric_provider, "auto")) {
		r = ro_ep_new(&o, &a->ep, err, sizeof(err));
	} else {
		/* auto: shared memory for ranks on one host, EFA across hosts, else whatever
		 * libfabric ranks first */
		const char *try[] = {a->local_group ? "shm" : "efa", NULL};

		for (size_t i = 0; i < 2; i++) {
			o.provider = try[i];
			r = ro_ep_new(&o, &a->ep, err, sizeof(err));
			if (!r)
				break;
		}
	}
	if (r)
		return ro_log_errno(r, "expert parallelism: %s", err);
	r = ro_ep_card(a->ep, card, &len);
	if (r)
		return ro_log_errno(r, "expert parallelism: %s", ro_ep_errmsg(a->ep));
	/* wait for the whole group, a while at a time, so that a signal still stops us */
	for (int64_t until = ro_now_ms() + 600000;;) {
		r = ro_queue_ep_rendezvous(a->q, a->cfg.ep_group, o.rank, o.world, card, len, 2000,
					   cards, lens);
		if (!r || r != -ETIMEDOUT || sigterms || sigints || ro_now_ms() > until)
			break;
		ro_log_limited(&a->log_limit[6], 10000, LOG_NOTICE, "%s (waiting)",
			       ro_queue_errmsg(a->q));
		(void)sd_notify(0, "WATCHDOG=1");
	}
	if (r)
		return ro_log_errno(r, "expert parallelism: %s", ro_queue_errmsg(a->q));
	r = ro_ep_connect(a->ep, (const void *const *)cards, lens);
	for (uint32_t i = 0; i < o.world; i++)
		free(cards[i]);
	if (r)
		return ro_log_errno(r, "expert parallelism: %s", ro_ep_errmsg(a->ep));
	ro_ep_attach(a->ep, a->m);
	r = ro_ep_round_end(a->ep, NULL, &g);
	if (r)
		return ro_log_errno(r, "expert parallelism: first round: %s", ro_ep_errmsg(a->ep));
	ro_log(LOG_INFO, "expert parallelism: rank %u of %u in group %s over %s (%s mode)", o.rank,
	       o.world, a->cfg.ep_group, ro_ep_provider(a->ep),
	       o.mode == RO_EP_AUTO ? "auto" : o.mode == RO_EP_LOW_LATENCY ? "low-latency"
									 : "throughput");
	return 0;
}

int main(int argc, char **argv)
{
	static struct ro_agent ag;
	struct ro_agent *a = &ag;
	struct watcher wt = {.fd = {-1, -1}};
	struct sigaction sa = {.sa_handler = on_signal};
	struct ro_queue_opts qo = {0};
	struct ro_model_opts mo = {0};
	char err[512] = "";
	int r, lfd = -1, seen_terms = 0, seen_ints = 0, rc = 0;
	uint64_t wd_usec = 0;
	int64_t next_status = 0, next_metrics = 0, next_wd = 0, next_extend = 0;

	r = ro_config_load(&a->cfg, argc, argv, stdout, stderr);
	if (r)
		return r > 0 ? 0 : 2;
	ro_log_level = (int)a->cfg.log_level;
	(void)sigaction(SIGTERM, &sa, NULL);
	(void)sigaction(SIGINT, &sa, NULL);
	(void)signal(SIGPIPE, SIG_IGN);
	if (a->cfg.ep_local_ranks > 1) {
		rc = run_local_ranks(a);
		if (rc >= 0) {
			ro_config_clear(&a->cfg);
			return rc;
		}
		rc = 0;
	} else if (a->cfg.ep_local_ranks == 1) {
		a->cfg.ep_size = 1;
	}
	if (a->cfg.ep_size > 1 && (!*a->cfg.ep_group || a->cfg.ep_rank >= a->cfg.ep_size)) {
		ro_log(LOG_ERR, "ep-size %u needs ep-group (a group id) and ep-rank below it (is %u)",
		       a->cfg.ep_size, a->cfg.ep_rank);
		ro_config_clear(&a->cfg);
		return 2;
	}
	worker_id(a);
	mo.threads = a->cfg.threads;
	r = ro_model_load(a->cfg.model, &mo, &a->m, err, sizeof(err));
	if (r) {
		ro_log(LOG_ERR, "model %s: %s", a->cfg.model, err);
		ro_config_clear(&a->cfg);
		return 1;
	}
	a->vocab = ro_model_config(a->m)->vocab;
	qo.url = a->cfg.redis;
	qo.queue = a->cfg.queue;
	qo.prefix = a->cfg.prefix;
	qo.worker = a->worker;
	qo.timeout_ms = 5000;
	qo.retry_ms = 2000; /* the loop retries; a step must not stall for long */
	qo.worker_ttl_ms = a->cfg.status_interval_ms * 4;
	qo.bounds = (struct ro_unit_bounds){a->cfg.max_prompt, a->cfg.max_n, a->cfg.max_new_tokens,
					    a->cfg.max_body};
	/* Redis may not be up yet: keep trying (a signal still stops us) */
	while ((r = ro_queue_new(&qo, &a->q)) && !sigterms && !sigints) {
		ro_log_limited(&a->log_limit[5], 10000, LOG_WARNING, "redis %s: %s (retrying)",
			       a->cfg.redis, ro_queue_errmsg(NULL));
		(void)usleep(500000);
	}
	if (r) {
		rc = 0;
		goto out;
	}
	if (a->cfg.ep_size > 1 && ep_setup(a)) {
		rc = 3;
		goto out;
	}
	if (a->cfg.imds && watcher_start(a, &wt))
		ro_log(LOG_WARNING, "imds watcher did not start: interruption notices unseen");
	if (a->cfg.control_socket && *a->cfg.control_socket) {
		lfd = control_open(a->cfg.control_socket);
		if (lfd < 0)
			ro_log(LOG_WARNING, "control socket %s: %s", a->cfg.control_socket,
			       strerror(-lfd));
	}
	ro_log(LOG_INFO,
	       "rolloutd %s: worker %s, queue %s on %s, model %s (%s, %s kernels, %u threads), "
	       "policy version %lld",
	       PACKAGE_VERSION, a->worker, a->cfg.queue, a->cfg.redis, a->cfg.model,
	       ro_model_config(a->m)->arch == RO_ARCH_QWEN3_MOE ? "qwen3_moe" : "mixtral",
	       ro_model_kernels(a->m), ro_model_threads(a->m), (long long)a->cfg.policy_version);
	{
		int64_t pv;

		if (ro_queue_policy_version(a->q, &pv) == 0 && pv > a->cfg.policy_version)
			ro_log(LOG_WARNING,
			       "queue policy version is %lld, these weights are %lld: reloading "
			       "weights is not supported yet; units needing newer weights are "
			       "released to other workers",
			       (long long)pv, (long long)a->cfg.policy_version);
	}
	(void)sd_notify(0, "READY=1\nSTATUS=running");
	if (sd_watchdog_enabled(0, &wd_usec) <= 0)
		wd_usec = 0;
	for (;;) {
		int64_t now = ro_now_ms();
		struct ro_imds_event e;

		a->last_loop_ms = now;
		/* signals: the first SIGTERM drains within the grace; a second, or SIGINT, cuts
		 * the drain short, still requeueing everything */
		if (sigterms != seen_terms) {
			if (seen_terms == 0 && sigterms == 1)
				ro_drain_begin(a, ro_wall_ms() + (int64_t)a->cfg.sigterm_grace_s * 1000,
					       "SIGTERM");
			else
				ro_drain_begin(a, ro_wall_ms(), "second SIGTERM");
			seen_terms = sigterms;
		}
		if (sigints != seen_ints) {
			ro_drain_begin(a, ro_wall_ms(), "SIGINT");
			seen_ints = sigints;
		}
		while (wt.running && read(wt.fd[0], &e, sizeof(e)) == (ssize_t)sizeof(e))
			on_imds(a, &e);
		if (lfd >= 0)
			control_serve(a, lfd);
		if (a->state == RO_DRAINING) {
			if (now >= next_extend) {
				ro_drain_notify(a);
				next_extend = now + 1000;
				notify_status(a);
			}
			ro_drain_triage(a);
			if (a->state == RO_DRAINING && ro_wall_ms() >= a->hard_wall_ms) {
				ro_log(LOG_ERR,
				       "drain: hard deadline passed with %u units not requeued (Redis "
				       "unreachable?): their leases expire and they are reaped",
				       a->n_units);
				a->state = RO_DRAINED;
			}
		}
		/* a rank of a group leaves with the group: until every rank is done, it still
		 * owes its part of their forwards */
		if (a->state == RO_DRAINED && (!a->ep || a->ep_failed || a->group_done))
			break;
		(void)ro_worker_claim(a);
		(void)ro_worker_step(a);
		ro_worker_housekeeping(a);
		ro_agent_ep_round(a);
		if (a->ep_failed && !rc) {
			/* a peer is gone or late: everything we hold goes back to the queue with
			 * its checkpoints, and the supervisor restarts us */
			rc = 3;
			ro_drain_begin(a, ro_wall_ms(), "expert-parallel group failed");
		}
		now = ro_now_ms();
		if (wd_usec && now >= next_wd) {
			(void)sd_notify(0, "WATCHDOG=1");
			next_wd = now + (int64_t)(wd_usec / 2000);
		}
		if (now >= next_status) {
			notify_status(a);
			heartbeat(a);
			next_status = now + a->cfg.status_interval_ms;
		}
		if (now >= next_metrics) {
			write_metrics(a);
			next_metrics = now + a->cfg.metrics_interval_ms;
		}
		if (a->ep && !a->ep_failed && a->group_busy)
			continue; /* others are decoding: do not hold them up */
		if (a->ep && !a->ep_failed && !a->n_active && !a->n_units) {
			(void)usleep(a->state == RO_RUNNING ? 20000 : 5000);
			continue;
		}
		if (!a->n_active && !a->n_units) {
			bool woken = false;

			/* idle: block on the wake-up marker rather than poll */
			if (a->state == RO_RUNNING && !a->stop_claiming && !a->backpressure &&
			    now >= a->defer_until_ms) {
				if (ro_queue_wait(a->q, 200, &woken))
					(void)usleep(200000);
				if (woken)
					a->next_claim_ms = 0;
			} else {
				(void)usleep(100000);
			}
		}
	}
	(void)sd_notify(0, "STOPPING=1\nSTATUS=drained");
	heartbeat(a);
	write_metrics(a);
	ro_log(LOG_INFO, "exiting: %llu units completed, %llu requeued, %llu samples published",
	       (unsigned long long)a->n.completed, (unsigned long long)a->n.requeued,
	       (unsigned long long)a->n.published);
out:
	if (a->ep && !a->ep_failed && !rc)
		(void)ro_queue_ep_leave(a->q, a->cfg.ep_group, a->cfg.ep_rank);
	a->ep = ro_ep_free(a->ep);
	watcher_stop(&wt);
	if (lfd >= 0) {
		(void)close(lfd);
		(void)unlink(a->cfg.control_socket);
	}
	ro_worker_free_all(a);
	ro_queue_free(a->q);
	ro_model_free(a->m);
	ro_config_clear(&a->cfg);
	return rc;
}
