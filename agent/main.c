/* rolloutd: the node-resident rollout worker. Parses its settings, forks the ranks of a
 * local expert-parallel group when asked, loads the model, joins the EP group, starts the
 * IMDS watcher thread and hands over to the control plane (loop.c), which runs the engine
 * thread (engine.c) until the drain state machine (drain.c) says DRAINED. */
#include "config.h"

#include <dlfcn.h>
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
#include "agent/version.h"

static volatile sig_atomic_t sigterms, sigints;

static void on_signal(int sig)
{
	if (sig == SIGTERM)
		sigterms++;
	else
		sigints++;
}

/* A library's crash handlers put back to the default. libinfinipath (PSM's, which
 * Debian's libfabric loads with its psm provider) installs handlers for SIGSEGV, SIGBUS,
 * SIGILL, SIGFPE, SIGABRT, SIGINT and SIGTERM in its constructor, before main: each prints
 * a line and exits 1, so a crash left no core and no signal in systemd's record, and a
 * SIGTERM in the first ~0.2 s of a start (before main's own handler) exited 1 unlogged.
 * The crash signals go back to their default action; a sanitizer's own handlers, or any
 * other library's, are left alone. */
static void drop_library_crash_handlers(void)
{
	static const int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

	for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
		struct sigaction old;
		Dl_info di;
		void *h;

		if (sigaction(sigs[i], NULL, &old))
			continue;
		h = (old.sa_flags & SA_SIGINFO) ? (void *)old.sa_sigaction : (void *)old.sa_handler;
		if (h == (void *)SIG_DFL || h == (void *)SIG_IGN)
			continue;
		if (dladdr(h, &di) && di.dli_fname && strstr(di.dli_fname, "libinfinipath"))
			(void)signal(sigs[i], SIG_DFL);
	}
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

/* Rank i's metrics file: node_exporter's textfile collector reads only *.prom, so
 * rolloutd.prom becomes rolloutd-rank1.prom (another name gains -rank1 at its end). */
static char *rank_metrics(const char *s, uint32_t rank)
{
	size_t n = s ? strlen(s) : 0;
	char *r = NULL;

	if (!n)
		return strdup("");
	if (n > 5 && !strcmp(s + n - 5, ".prom")) {
		if (asprintf(&r, "%.*s-rank%u.prom", (int)(n - 5), s, rank) < 0)
			return NULL;
	} else if (asprintf(&r, "%s-rank%u", s, rank) < 0) {
		return NULL;
	}
	return r;
}

/* --ep-local-ranks N: fork the N ranks of one group on this host and wait for them. Rank 0
 * keeps the control socket, the metrics file and the IMDS watch; ranks 1.. take
 * <socket>.rank<i> and <metrics stem>-rank<i>.prom and learn of drains in band, from the
 * group. Signals are forwarded. This process is what systemd sees: it sends READY, WATCHDOG
 * and STOPPING for the group. Returns -1 in a child (which goes on as its rank), else the
 * exit status: 0 when every rank exited 0, else the first failure's. */
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
				     *mf = rank_metrics(a->cfg.metrics_file, i);

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
	o.group = a->cfg.ep_group;
	if (a->cfg.ep_secret && *a->cfg.ep_secret) {
		o.secret = (const uint8_t *)a->cfg.ep_secret;
		o.secret_len = strlen(a->cfg.ep_secret);
		if (o.secret_len < 16)
			ro_log(LOG_WARNING,
			       "expert parallelism: the EP secret has %zu bytes; use "
			       "16 or more random ones (openssl rand -hex 32)",
			       o.secret_len);
	} else {
		ro_log(LOG_WARNING,
		       "expert parallelism: rank cards in Redis are not authenticated "
		       "(whoever can write Redis can redirect this rank's traffic); set "
		       "ep-secret-file, the same on every rank");
	}
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
	if (r == -EPERM)
		return ro_log_errno(r, "expert parallelism: group %s refused: %s", a->cfg.ep_group,
				    ro_ep_errmsg(a->ep));
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

static void queue_opts(const struct ro_agent *a, struct ro_queue_opts *qo)
{
	*qo = (struct ro_queue_opts){0};
	qo->url = a->cfg.redis;
	qo->queue = a->cfg.queue;
	qo->prefix = a->cfg.prefix;
	qo->worker = a->worker;
	qo->timeout_ms = a->cfg.redis_timeout_ms;
	qo->password = a->cfg.redis_password;
	qo->sentinel_password = a->cfg.redis_sentinel_password;
	qo->tls_ca = a->cfg.redis_tls_ca;
	qo->tls_cert = a->cfg.redis_tls_cert;
	qo->tls_key = a->cfg.redis_tls_key;
	qo->tls_server_name = a->cfg.redis_tls_server_name;
	qo->cluster = (enum ro_redis_cluster)a->cfg.redis_cluster;
	qo->wait_replicas = a->cfg.redis_wait_replicas;
	qo->wait_timeout_ms = a->cfg.redis_wait_timeout_ms;
	qo->retry_ms = 2 * a->cfg.redis_timeout_ms; /* start-up calls (the EP rendezvous) */
	qo->max_attempts = a->cfg.max_attempts;
	qo->worker_ttl_ms = a->cfg.status_interval_ms * 4;
	qo->bounds = (struct ro_unit_bounds){a->cfg.max_prompt, a->cfg.max_n, a->cfg.max_new_tokens,
					     a->cfg.max_body};
}

int main(int argc, char **argv)
{
	static struct ro_agent ag;
	struct ro_agent *a = &ag;
	struct watcher wt = {.fd = {-1, -1}};
	struct sigaction sa = {.sa_handler = on_signal};
	struct ro_queue_opts qo;
	struct ro_model_opts mo = {0};
	sigset_t mask, startup_mask;
	char err[512] = "", redis_shown[1024];
	int r, rc = 0;

	/* first: a stop from here on is counted, and drains once the loop runs */
	(void)sigaction(SIGTERM, &sa, NULL);
	(void)sigaction(SIGINT, &sa, NULL);
	(void)signal(SIGPIPE, SIG_IGN);
	drop_library_crash_handlers();
	if (argc == 2 && !strcmp(argv[1], "--version")) {
		ro_version_print(stdout, "rolloutd");
		return 0;
	}
	r = ro_config_load(&a->cfg, argc, argv, stdout, stderr);
	if (r)
		return r > 0 ? 0 : 2;
	ro_log_level = (int)a->cfg.log_level;
	a->efd = -1;
	a->imds_fd = -1;
	(void)pthread_mutex_init(&a->mu, NULL);
	(void)pthread_cond_init(&a->cv, NULL);
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
	ro_policy_model_opts(a, &mo);
	/* Threads started before the loop's signalfd takes over (the model's pool here,
	 * libfabric's in ep_setup) must block SIGTERM and SIGINT for good: the kernel hands a
	 * process-directed signal to any thread that does not block it, so once the main thread
	 * blocks them below, a SIGTERM would run the start-up handler on a pool thread, be
	 * counted there and never start the drain (systemd and the kubelet would kill at the
	 * end of the grace period). The main thread keeps the handler until then. */
	(void)sigemptyset(&mask);
	(void)sigaddset(&mask, SIGTERM);
	(void)sigaddset(&mask, SIGINT);
	(void)pthread_sigmask(SIG_BLOCK, &mask, &startup_mask);
	r = ro_model_load(a->cfg.model, &mo, &a->m, err, sizeof(err));
	(void)pthread_sigmask(SIG_SETMASK, &startup_mask, NULL);
	if (r) {
		ro_log(LOG_ERR, "model %s: %s", a->cfg.model, err);
		ro_config_clear(&a->cfg);
		return 1;
	}
	ro_policy_log_weights(a->m, "model");
	a->vocab = ro_model_config(a->m)->vocab;
	a->policy_version = a->published_version = a->cfg.policy_version;
	queue_opts(a, &qo);
	r = ro_queue_new(&qo, &a->q);
	if (!r)
		r = ro_queue_new(&qo, &a->qw);
	ro_redis_url_redact(a->cfg.redis, redis_shown, sizeof(redis_shown));
	if (r) {
		/* a bad URL, queue name or TLS file: no retry can fix it */
		ro_log(LOG_ERR, "redis %s: %s", redis_shown, ro_queue_errmsg(NULL));
		rc = 2;
		goto out;
	}
	/* Wrong credentials, permissions, TLS trust, a db in a cluster, a server without
	 * functions: the start stops here, naming the cause. Redis merely unreachable is not
	 * a reason to stop: the daemon starts unready and its operations wait for Redis. */
	r = ro_queue_check(a->q, a->cfg.redis_timeout_ms * 2 > 5000 ? a->cfg.redis_timeout_ms * 2
								     : 5000);
	if (r && ro_queue_fatal(a->q)) {
		ro_log(LOG_ERR, "redis %s: %s", redis_shown, ro_queue_errmsg(a->q));
		rc = 2;
		goto out;
	} else if (r) {
		ro_log(LOG_WARNING, "redis %s: %s: starting unready, operations wait for it",
		       redis_shown, ro_queue_errmsg(a->q));
	}
	(void)pthread_sigmask(SIG_BLOCK, &mask, &startup_mask);
	r = a->cfg.ep_size > 1 ? ep_setup(a) : 0;
	(void)pthread_sigmask(SIG_SETMASK, &startup_mask, NULL);
	if (r) {
		rc = 3;
		goto out;
	}
	/* From here signals arrive through the loop (signalfd): blocked in every thread. One
	 * that came during start-up is raised again, to be read there. */
	(void)sigemptyset(&mask);
	(void)sigaddset(&mask, SIGTERM);
	(void)sigaddset(&mask, SIGINT);
	(void)sigprocmask(SIG_BLOCK, &mask, NULL);
	if (sigterms)
		(void)raise(SIGTERM);
	if (sigints)
		(void)raise(SIGINT);
	if (a->cfg.imds && watcher_start(a, &wt))
		ro_log(LOG_WARNING, "imds watcher did not start: interruption notices unseen");
	a->imds_fd = wt.running ? wt.fd[0] : -1;
	ro_log(LOG_INFO,
	       "rolloutd %s: worker %s, queue %s on %s (%s %s), model %s (%s, %s kernels, %u threads), "
	       "policy version %lld, prefill chunk %u",
	       PACKAGE_VERSION, a->worker, a->cfg.queue, redis_shown, ro_queue_mode(a->q), ro_queue_node(a->q), a->cfg.model,
	       ro_model_config(a->m)->arch == RO_ARCH_QWEN3_MOE ? "qwen3_moe" : "mixtral",
	       ro_model_kernels(a->m), ro_model_threads(a->m), (long long)a->policy_version,
	       a->cfg.prefill_chunk);
	rc = ro_loop_run(a);
	ro_log(LOG_INFO,
	       "exiting: %llu units completed, %llu requeued, %llu failed, %llu samples published",
	       (unsigned long long)a->n.completed, (unsigned long long)a->n.requeued,
	       (unsigned long long)a->n.failed, (unsigned long long)a->n.published);
out:
	if (a->ep && !a->ep_failed && !rc && a->q && ro_queue_connected(a->q)) {
		/* a quick, bounded call: the card is only a convenience for the next start */
		(void)ro_queue_ep_leave(a->q, a->cfg.ep_group, a->cfg.ep_rank);
	}
	a->ep = ro_ep_free(a->ep);
	watcher_stop(&wt);
	a->exiting = true;
	a->qw = ro_queue_free(a->qw);
	a->q = ro_queue_free(a->q); /* pending callbacks answered -ECANCELED */
	ro_units_free_all(a);
	ro_model_free(a->m);
	ro_config_clear(&a->cfg);
	return rc;
}
