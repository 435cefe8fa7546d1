/* The chaos soak's driver: a real redis-server (AOF, fsync always or everysec), a mock IMDS
 * per agent, a tiny model, K rolloutd processes over M units (a few with long prompts),
 * and a seeded schedule of faults fired while the work runs: agents killed, stopped past
 * their lease, drained five ways; Redis crashed, paused and refused; IMDS faults; poison
 * units and checkpoints written straight into Redis; control-socket floods. It records
 * what it did in DIR/run.log, then runs tests/chaos/check on the result.
 *
 * Every wait is for an event (a process exit, a Redis state) and has a bound; each fault
 * fires when a seeded share of the units is finished, or at its time slot if the work
 * stalls, so a slow machine still gets its faults mid-run. Same seed, same schedule. */
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/model.h"
#include "queue/queue.h"
#include "tests/agent_model.h"
#include "tests/chaos/chaos.h"
#include "tests/redis_fixture.h"
#include "tests/mock_fixture.h"
#include "tests/testutil.h"

#define MAX_AGENTS 16
#define MAX_FAULTS 4096
#define MAX_HELPERS 64

/* The CI run's default: every kind and every poison (the daemon before the event-loop
 * rewrite survived only kill, stop, the drains, redis_restart, imds and four of the
 * poisons: see tests/chaos/README.md). */
static const char *const ci_kinds = "kill,stop,spot,rebalance,lifecycle,sigterm,ctl,"
				    "redis_restart,redis_pause,redis_down,imds,poison,"
				    "poison_ckpt,flood,short_lease";
static const char *const ci_poisons = "badjson,n_up,n_down,stray_body,stray_hash,"
				      "ckpt_garbage,ckpt_vocab,ckpt_neg";

struct opts {
	uint64_t seed;
	unsigned units, agents, faults;
	unsigned n_min, n_max, new_min, new_max;
	unsigned long_prompts, long_min, long_max;
	bool kind[CH_NKINDS], poison[CH_NPOISON];
	bool everysec, power_loss, keep, quiet;
	unsigned lease_ms, short_lease_ms, margin_ms, grace_s, notice_s, deadline_min_s,
	    deadline_max_s;
	unsigned window_s, timeout_s, stall_s;
	const char *rolloutd, *rolloutctl, *check, *dir;
	const char *agent_arg[64];
	unsigned n_agent_arg;
	const char *agent_opt[32]; /* NAME=VALUE: passed when the daemon has the setting */
	unsigned n_agent_opt;
};

/* SL_START: until its control socket exists (signal handlers are in place by then) */
enum slot_state { SL_START, SL_RUN, SL_STOPPED, SL_DRAINING, SL_DOWN };

struct slot {
	int idx, gen;
	pid_t pid;
	char name[32], worker[48], sock[200], log[200], metrics[200];
	enum slot_state st;
	int64_t cont_at;     /* SL_STOPPED: SIGCONT then (mono) */
	int64_t restart_at;  /* SL_DOWN: start a replacement then (mono) */
	int64_t overrun_at;  /* SL_DRAINING: SIGKILL if still there (mono) */
	int64_t ready_by;    /* SL_START: a start that takes longer is recorded */
	const char *cause;   /* why the driver expects the exit: kill, drain, final */
	bool next_same_id;
	struct ro_test_mock mk;
};

struct fault {
	int id, kind, slot;
	double frac;	    /* fire once this share of the units is finished ... */
	int64_t slot_ms;    /* ... or this long after the start, whichever comes first */
	uint32_t dur_ms;    /* stop, pause, down, flood, imds fault */
	uint32_t deadline_s; /* spot notice, rolloutctl drain */
	uint32_t variant;   /* poison variant, imds fault kind */
	uint32_t restart_ms; /* delay before the replacement */
	bool same_id, with_drain;
	int state; /* 0 waiting, 1 fired, 2 skipped */
	int64_t waiting_since;
};

struct helper {
	pid_t pid;
	int64_t kill_at;
	char what[48];
};

enum redis_state { RS_UP, RS_PAUSED, RS_DOWN };

static struct run {
	struct opts o;
	char dir[128], model[160], queue[64];
	FILE *rec;
	struct ro_test_redis redis;
	enum redis_state rs;
	int64_t rs_until, rs_drain_at; /* mono */
	int64_t rs_up_since;	       /* a redis fault waits for Redis to be up a while */
	int rs_fault;		       /* the redis fault in progress, -1 none */
	redisContext *c;
	int64_t c_retry;
	struct slot slot[MAX_AGENTS];
	struct fault f[MAX_FAULTS];
	unsigned nf, next_fault;
	struct helper h[MAX_HELPERS];
	long total, finished, done, dead, samples;
	int64_t start, last_fire, last_change, next_observe, next_aof;
	char aof[300];
	long long aof_size[64]; /* ring of (mono ms, size) samples for the simulated loss */
	int64_t aof_at[64];
	unsigned aof_n;
	unsigned poisons, flood_n;
	char optional_flags[4096]; /* rolloutd --help, to see which settings exist */
} R;

static int64_t wall(void)
{
	return ro_test_wall_ms();
}

static int64_t mono(void)
{
	return ro_test_mono_ms();
}

static void say(const char *fmt, ...)
{
	va_list ap;

	if (R.o.quiet)
		return;
	va_start(ap, fmt);
	(void)fprintf(stderr, "chaos [%6.1fs] ", (double)(mono() - R.start) / 1000.0);
	(void)vfprintf(stderr, fmt, ap);
	(void)fputc('\n', stderr);
	va_end(ap);
}

static void rec(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	(void)vfprintf(R.rec, fmt, ap);
	(void)fputc('\n', R.rec);
	(void)fflush(R.rec);
	va_end(ap);
}

static void die(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	(void)fprintf(stderr, "chaos: ");
	(void)vfprintf(stderr, fmt, ap);
	(void)fputc('\n', stderr);
	va_end(ap);
	exit(99); /* automake: a hard error, not a failed check */
}

/* ---- options --------------------------------------------------------------------------- */

static void usage(FILE *f)
{
	(void)fprintf(
	    f,
	    "usage: chaos [--long] [--seed S] [--units M] [--agents K] [--faults N]\n"
	    "  [--kinds all|ci|kill,stop,...] [--poisons all|ci|badjson,...]\n"
	    "  [--aof always|everysec] [--no-power-loss] [--lease-ms L] [--short-lease-ms L]\n"
	    "  [--n MIN-MAX] [--max-new MIN-MAX] [--long-prompts P] [--long-len MIN-MAX]\n"
	    "  [--deadline MIN-MAX] [--window-s W] [--timeout-s T] [--stall-s S]\n"
	    "  [--agent-arg ARG]... [--agent-opt NAME=VALUE]... [--dir D] [--keep] [--quiet]\n"
	    "  [--rolloutd PATH] [--rolloutctl PATH] [--check PATH]\n"
	    "kinds: ");
	for (int k = 0; k < CH_NKINDS; k++)
		(void)fprintf(f, "%s%s", k ? "," : "", ch_kind_name[k]);
	(void)fprintf(f, "\npoisons: ");
	for (int v = 0; v < CH_NPOISON; v++)
		(void)fprintf(f, "%s%s", v ? "," : "", ch_poison_name[v]);
	(void)fprintf(f, "\nci kinds: %s\nci poisons: %s\n", ci_kinds, ci_poisons);
}

static void set_list(const char *s, bool *out, int n, const char *const *names,
		     const char *all_name)
{
	char buf[1024], *save = NULL;

	for (int i = 0; i < n; i++)
		out[i] = !strcmp(s, "all");
	if (!strcmp(s, "all"))
		return;
	(void)snprintf(buf, sizeof(buf), "%s", s);
	for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		int i = 0;

		while (i < n && strcmp(t, names[i]))
			i++;
		if (i == n)
			die("unknown %s \"%s\" (see --help)", all_name, t);
		out[i] = true;
	}
}

static void range(const char *s, unsigned *lo, unsigned *hi)
{
	if (sscanf(s, "%u-%u", lo, hi) != 2) {
		if (sscanf(s, "%u", lo) != 1)
			die("bad range \"%s\"", s);
		*hi = *lo;
	}
	if (*hi < *lo)
		die("bad range \"%s\"", s);
}

static const char *env_or(const char *env, const char *dflt)
{
	const char *v = getenv(env);

	return v && *v ? v : dflt;
}

static void parse_opts(int argc, char **argv)
{
	struct opts *o = &R.o;
	bool is_long = false;
	const char *kinds = NULL, *poisons = NULL;
	static char check_path[PATH_MAX];

	for (int i = 1; i < argc; i++)
		if (!strcmp(argv[i], "--long"))
			is_long = true;
	/* CI size: about two minutes on a busy 2-core machine; --long: an hour's soak */
	*o = (struct opts){
	    .seed = 0,
	    .units = is_long ? 300 : 24,
	    .agents = 3,
	    .faults = is_long ? 120 : 12,
	    .n_min = 2,
	    .n_max = 4,
	    .new_min = is_long ? 64 : 128,
	    .new_max = is_long ? 512 : 448,
	    .long_prompts = is_long ? 12 : 3,
	    .long_min = 2000,
	    .long_max = 3000,
	    .power_loss = true,
	    .lease_ms = 20000,
	    .short_lease_ms = 2000,
	    .margin_ms = 2000,
	    .grace_s = is_long ? 30 : 6,
	    .notice_s = is_long ? 60 : 10,
	    .deadline_min_s = is_long ? 5 : 6,
	    .deadline_max_s = is_long ? 120 : 15,
	    .window_s = is_long ? 1800 : 80,
	    .timeout_s = is_long ? 3600 : 170,
	    .stall_s = is_long ? 90 : 25,
	    .rolloutd = env_or("RO_ROLLOUTD", "./rolloutd"),
	    .rolloutctl = env_or("RO_ROLLOUTCTL", "./rolloutctl"),
	};
	{
		struct timespec ts;

		(void)clock_gettime(CLOCK_REALTIME, &ts);
		o->seed = ((uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 20) ^
			   (uint64_t)ts.tv_sec) % 1000000000ull;
	}
	{
		char self[PATH_MAX];

		(void)snprintf(self, sizeof(self), "%s", argv[0]);
		(void)snprintf(check_path, sizeof(check_path), "%s/check", dirname(self));
	}
	o->check = check_path;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		bool used = true;

		if (!strcmp(a, "--long") || !strcmp(a, "--keep") || !strcmp(a, "--quiet") ||
		    !strcmp(a, "--no-power-loss") || !strcmp(a, "--help")) {
			if (!strcmp(a, "--keep"))
				o->keep = true;
			else if (!strcmp(a, "--quiet"))
				o->quiet = true;
			else if (!strcmp(a, "--no-power-loss"))
				o->power_loss = false;
			else if (!strcmp(a, "--help")) {
				usage(stdout);
				exit(0);
			}
			continue;
		}
		if (!v)
			die("%s needs a value", a);
		if (!strcmp(a, "--seed"))
			o->seed = strtoull(v, NULL, 0);
		else if (!strcmp(a, "--units"))
			o->units = (unsigned)atoi(v);
		else if (!strcmp(a, "--agents"))
			o->agents = (unsigned)atoi(v);
		else if (!strcmp(a, "--faults"))
			o->faults = (unsigned)atoi(v);
		else if (!strcmp(a, "--kinds"))
			kinds = v;
		else if (!strcmp(a, "--poisons"))
			poisons = v;
		else if (!strcmp(a, "--aof")) {
			if (strcmp(v, "always") && strcmp(v, "everysec"))
				die("--aof always|everysec");
			o->everysec = !strcmp(v, "everysec");
		} else if (!strcmp(a, "--lease-ms"))
			o->lease_ms = (unsigned)atoi(v);
		else if (!strcmp(a, "--short-lease-ms"))
			o->short_lease_ms = (unsigned)atoi(v);
		else if (!strcmp(a, "--n"))
			range(v, &o->n_min, &o->n_max);
		else if (!strcmp(a, "--max-new"))
			range(v, &o->new_min, &o->new_max);
		else if (!strcmp(a, "--long-prompts"))
			o->long_prompts = (unsigned)atoi(v);
		else if (!strcmp(a, "--long-len"))
			range(v, &o->long_min, &o->long_max);
		else if (!strcmp(a, "--deadline"))
			range(v, &o->deadline_min_s, &o->deadline_max_s);
		else if (!strcmp(a, "--window-s"))
			o->window_s = (unsigned)atoi(v);
		else if (!strcmp(a, "--timeout-s"))
			o->timeout_s = (unsigned)atoi(v);
		else if (!strcmp(a, "--stall-s"))
			o->stall_s = (unsigned)atoi(v);
		else if (!strcmp(a, "--agent-arg") && o->n_agent_arg < 64)
			o->agent_arg[o->n_agent_arg++] = v;
		else if (!strcmp(a, "--agent-opt") && o->n_agent_opt < 32)
			o->agent_opt[o->n_agent_opt++] = v;
		else if (!strcmp(a, "--dir"))
			o->dir = v;
		else if (!strcmp(a, "--rolloutd"))
			o->rolloutd = v;
		else if (!strcmp(a, "--rolloutctl"))
			o->rolloutctl = v;
		else if (!strcmp(a, "--check"))
			o->check = v;
		else
			used = false;
		if (!used) {
			usage(stderr);
			die("unknown option %s", a);
		}
		i++;
	}
	if (!kinds)
		kinds = is_long ? "all" : "ci";
	if (!poisons)
		poisons = is_long ? "all" : "ci";
	set_list(!strcmp(kinds, "ci") ? ci_kinds : kinds, o->kind, CH_NKINDS, ch_kind_name, "kind");
	set_list(!strcmp(poisons, "ci") ? ci_poisons : poisons, o->poison, CH_NPOISON,
		 ch_poison_name, "poison");
	if (!o->agents || o->agents > MAX_AGENTS || !o->units || o->faults > MAX_FAULTS ||
	    o->n_min < 1 || o->new_min < 1 || o->lease_ms < 300 || o->deadline_min_s < 1)
		die("bad sizes (agents 1-%d, units > 0, faults <= %d)", MAX_AGENTS, MAX_FAULTS);
	if (o->long_prompts > o->units)
		o->long_prompts = o->units;
}

/* ---- processes ------------------------------------------------------------------------- */

/* rolloutd --help, once: settings the daemon does not have are not passed (the harness
 * runs against today's daemon and the rewrite alike). */
static bool daemon_has(const char *name)
{
	char pat[128];

	(void)snprintf(pat, sizeof(pat), "  --%s ", name);
	return strstr(R.optional_flags, pat) != NULL;
}

static void read_daemon_help(void)
{
	char cmd[1024];
	FILE *p;
	size_t n;

	(void)snprintf(cmd, sizeof(cmd), "%s --help 2>&1", R.o.rolloutd);
	p = popen(cmd, "r");
	if (!p)
		die("cannot run %s", R.o.rolloutd);
	n = fread(R.optional_flags, 1, sizeof(R.optional_flags) - 1, p);
	R.optional_flags[n] = '\0';
	(void)pclose(p);
	if (!strstr(R.optional_flags, "--lease-ms"))
		die("%s --help does not look like rolloutd's", R.o.rolloutd);
}

static pid_t spawn(const char *const *av, const char *out)
{
	pid_t parent = getpid();
	pid_t pid = fork();

	if (pid < 0)
		die("fork: %s", strerror(errno));
	if (pid == 0) {
		int fd = out ? open(out, O_WRONLY | O_CREAT | O_APPEND, 0644) : -1;

		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(1);
		if (fd >= 0) {
			(void)dup2(fd, 1);
			(void)dup2(fd, 2);
		}
		(void)signal(SIGPIPE, SIG_DFL); /* an ignored signal would stay so across exec */
		execv(av[0], (char *const *)av);
		_exit(127);
	}
	return pid;
}

static bool lease_short(void)
{
	return R.o.kind[CH_SHORT_LEASE];
}

static void agent_start(struct slot *s)
{
	const char *av[160];
	char lease[16], margin[16], grace[16], notice[16];
	size_t n = 0;

	s->gen++;
	(void)snprintf(s->name, sizeof(s->name), "a%d.%d", s->idx, s->gen);
	if (!s->next_same_id || !s->worker[0])
		(void)snprintf(s->worker, sizeof(s->worker), "w%d.%d", s->idx, s->gen);
	s->next_same_id = false;
	(void)snprintf(s->sock, sizeof(s->sock), "%s/%s.sock", R.dir, s->name);
	(void)snprintf(s->log, sizeof(s->log), "%s/%s.log", R.dir, s->name);
	(void)snprintf(s->metrics, sizeof(s->metrics), "%s/%s.prom", R.dir, s->name);
	(void)snprintf(lease, sizeof(lease), "%u", lease_short() ? R.o.short_lease_ms : R.o.lease_ms);
	(void)snprintf(margin, sizeof(margin), "%u", R.o.margin_ms);
	(void)snprintf(grace, sizeof(grace), "%u", R.o.grace_s);
	(void)snprintf(notice, sizeof(notice), "%u", R.o.notice_s);
	av[n++] = R.o.rolloutd;
	av[n++] = "--redis";
	av[n++] = R.redis.url;
	av[n++] = "--queue";
	av[n++] = R.queue;
	av[n++] = "--model";
	av[n++] = R.model;
	av[n++] = "--worker-id";
	av[n++] = s->worker;
	av[n++] = "--control-socket";
	av[n++] = s->sock;
	av[n++] = "--metrics-file";
	av[n++] = s->metrics;
	av[n++] = "--metrics-interval-ms";
	av[n++] = "200";
	av[n++] = "--status-interval-ms";
	av[n++] = "500";
	av[n++] = "--threads";
	av[n++] = "1";
	av[n++] = "--max-inflight";
	av[n++] = "16";
	av[n++] = "--claim-batch";
	av[n++] = "2";
	av[n++] = "--lease-ms";
	av[n++] = lease;
	av[n++] = "--checkpoint-tokens";
	av[n++] = "8";
	av[n++] = "--checkpoint-ms";
	av[n++] = "500";
	av[n++] = "--imds-endpoint";
	av[n++] = s->mk.url;
	av[n++] = "--imds-poll-ms";
	av[n++] = "200";
	av[n++] = "--imds-slow-poll-ms";
	av[n++] = "500";
	av[n++] = "--drain-margin-ms";
	av[n++] = margin;
	av[n++] = "--sigterm-grace-s";
	av[n++] = grace;
	av[n++] = "--notice-s";
	av[n++] = notice;
	av[n++] = "--rebalance";
	av[n++] = "drain";
	av[n++] = "--log-level";
	av[n++] = "debug";
	for (unsigned i = 0; i < R.o.n_agent_opt && n < 150; i++) {
		static char buf[32][160];
		char *eq;

		(void)snprintf(buf[i], sizeof(buf[i]), "--%s", R.o.agent_opt[i]);
		eq = strchr(buf[i], '=');
		if (!eq)
			die("--agent-opt %s: NAME=VALUE", R.o.agent_opt[i]);
		*eq = '\0';
		if (!daemon_has(buf[i] + 2))
			continue;
		av[n++] = buf[i];
		av[n++] = eq + 1;
	}
	for (unsigned i = 0; i < R.o.n_agent_arg && n < 158; i++)
		av[n++] = R.o.agent_arg[i];
	av[n] = NULL;
	s->pid = spawn(av, s->log);
	s->st = SL_START;
	s->ready_by = mono() + 60000;
	s->cause = NULL;
	rec("agent name=%s slot=%d worker=%s pid=%d at=%lld log=%s metrics=%s lease_ms=%s", s->name,
	    s->idx, s->worker, (int)s->pid, (long long)wall(), s->log, s->metrics, lease);
	say("start %s (worker %s, pid %d)", s->name, s->worker, (int)s->pid);
}

static void helper_add(pid_t pid, int64_t limit_ms, const char *what)
{
	for (int i = 0; i < MAX_HELPERS; i++)
		if (!R.h[i].pid) {
			R.h[i] = (struct helper){pid, mono() + limit_ms, ""};
			(void)snprintf(R.h[i].what, sizeof(R.h[i].what), "%s", what);
			return;
		}
	(void)kill(pid, SIGKILL);
	(void)waitpid(pid, NULL, 0);
}

static bool helpers_running(void)
{
	for (int i = 0; i < MAX_HELPERS; i++)
		if (R.h[i].pid)
			return true;
	return false;
}

static void helpers_reap(bool all)
{
	for (int i = 0; i < MAX_HELPERS; i++) {
		struct helper *h = &R.h[i];
		int st;

		if (!h->pid)
			continue;
		if (waitpid(h->pid, &st, WNOHANG) == h->pid) {
			if (!WIFEXITED(st) || WEXITSTATUS(st))
				rec("helper what=%s rc=%d", h->what,
				    WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
			h->pid = 0;
		} else if (all || mono() >= h->kill_at) {
			(void)kill(h->pid, SIGKILL);
			(void)waitpid(h->pid, NULL, 0);
			rec("helper what=%s rc=killed", h->what);
			h->pid = 0;
		}
	}
}

/* ---- Redis observations (the driver's own connection, short timeouts) ---------------- */

static redisReply *cmd(const char *fmt, ...)
{
	va_list ap;
	redisReply *rep;

	if (R.rs != RS_UP)
		return NULL;
	if (!R.c) {
		if (mono() < R.c_retry)
			return NULL;
		R.c = redisConnectWithTimeout("127.0.0.1", R.redis.port, (struct timeval){0, 300000});
		if (!R.c || R.c->err) {
			redisFree(R.c);
			R.c = NULL;
			R.c_retry = mono() + 200;
			return NULL;
		}
		(void)redisSetTimeout(R.c, (struct timeval){1, 0});
	}
	va_start(ap, fmt);
	rep = redisvCommand(R.c, fmt, ap);
	va_end(ap);
	if (!rep) {
		redisFree(R.c);
		R.c = NULL;
		R.c_retry = mono() + 200;
	}
	return rep;
}

static long long cmd_int(const char *fmt, const char *arg)
{
	redisReply *rep = cmd(fmt, arg);
	long long v = -1;

	if (rep && rep->type == REDIS_REPLY_INTEGER)
		v = rep->integer;
	else if (rep && rep->type == REDIS_REPLY_STRING)
		v = strtoll(rep->str, NULL, 10);
	else if (rep && rep->type == REDIS_REPLY_NIL)
		v = 0;
	if (rep)
		freeReplyObject(rep);
	return v;
}

static void observe(void)
{
	long long d, x, s;

	if (mono() < R.next_observe || R.rs != RS_UP)
		return;
	R.next_observe = mono() + 250;
	d = cmd_int("HGET ro:{%s}:stats done", R.queue);
	x = cmd_int("LLEN ro:{%s}:dead", R.queue);
	s = cmd_int("XLEN ro:{%s}:samples", R.queue);
	if (d < 0 || x < 0 || s < 0)
		return;
	if (d != R.done || x != R.dead || s != R.samples)
		R.last_change = mono();
	R.done = d;
	R.dead = x;
	R.samples = s;
	R.finished = d + x;
}

/* everysec: keep the AOF's length over the last seconds, so that a crash can lose what a
 * power cut would (the writes of the last second were not fsynced) */
static void aof_sample(void)
{
	long long sz;

	if (!R.o.everysec || !R.o.power_loss || mono() < R.next_aof || R.rs == RS_DOWN)
		return;
	R.next_aof = mono() + 100;
	if (!R.aof[0] && ch_aof_incr_path(&R.redis, R.aof, sizeof(R.aof)))
		return;
	sz = ch_file_size(R.aof);
	if (sz < 0)
		return;
	R.aof_size[R.aof_n % 64] = sz;
	R.aof_at[R.aof_n % 64] = mono();
	R.aof_n++;
}

/* Cut the AOF back to its length of a second ago (what everysec had surely fsynced). */
static long long power_loss(void)
{
	long long keep = -1, now_sz;
	int64_t t = mono() - 1000;

	if (!R.o.everysec || !R.o.power_loss || !R.aof[0])
		return 0;
	for (unsigned i = 0; i < R.aof_n && i < 64; i++) {
		unsigned k = (R.aof_n - 1 - i) % 64;

		if (R.aof_at[k] <= t) {
			keep = R.aof_size[k];
			break;
		}
	}
	now_sz = ch_file_size(R.aof);
	if (keep < 0 || now_sz <= keep)
		return 0;
	if (truncate(R.aof, keep))
		return 0;
	R.aof_n = 0;
	return now_sz - keep;
}

/* ---- units --------------------------------------------------------------------------------- */

static char *unit_json(struct ch_rng *g, const char *id, unsigned plen, unsigned n,
		       unsigned max_new, const char *extra)
{
	static const double temps[] = {1.0, 1.0, 0.7, 0.0};
	size_t cap = (size_t)plen * 6 + 512, off = 0;
	char *s = malloc(cap);
	double t = temps[ch_rng_range(g, 0, 3)];
	unsigned top_k = ch_rng_range(g, 0, 3) == 0 ? 40 : 0;
	double top_p = ch_rng_range(g, 0, 3) == 0 ? 0.9 : 1.0;

	if (!s)
		die("out of memory");
	off += (size_t)snprintf(s + off, cap - off, "{\"id\":\"%s\",\"prompt\":[", id);
	for (unsigned i = 0; i < plen; i++)
		off += (size_t)snprintf(s + off, cap - off, i ? ",%u" : "%u", ch_rng_range(g, 0, 1023));
	(void)snprintf(s + off, cap - off,
		       "],\"n\":%u,\"max_new_tokens\":%u,\"sampling\":{\"temperature\":%.1f,"
		       "\"top_p\":%.1f,\"top_k\":%u,\"seed\":%u},\"stop\":[%u,%u]%s}",
		       n, max_new, t, top_p, top_k, ch_rng_range(g, 0, 1u << 30),
		       ch_rng_range(g, 0, 1023), ch_rng_range(g, 0, 1023), extra ? extra : "");
	return s;
}

static void enqueue_units(struct ch_rng *g, FILE *uf)
{
	struct ro_queue_opts qo = {.url = R.redis.url, .queue = R.queue, .worker = "chaos",
				   .timeout_ms = 5000, .retry_ms = 10000};
	struct ro_queue *q = NULL;
	struct ro_unit_bounds b;
	unsigned *is_long = calloc(R.o.units, sizeof(*is_long));

	ro_unit_bounds_default(&b);
	if (ro_queue_new(&qo, &q))
		die("queue: %s", ro_queue_errmsg(NULL));
	/* the long prompts at seeded places in the queue */
	for (unsigned k = 0; k < R.o.long_prompts; k++) {
		unsigned at;

		do
			at = ch_rng_range(g, 0, R.o.units - 1);
		while (is_long[at]);
		is_long[at] = 1;
	}
	for (unsigned i = 0; i < R.o.units; i++) {
		char id[32], why[256];
		struct ro_unit u = {0};
		unsigned plen = is_long[i] ? ch_rng_range(g, R.o.long_min, R.o.long_max)
					   : ch_rng_range(g, 3, 48);
		char *js;
		int st;

		(void)snprintf(id, sizeof(id), "u-%04u", i);
		js = unit_json(g, id, plen, ch_rng_range(g, R.o.n_min, R.o.n_max),
			       ch_rng_range(g, R.o.new_min, R.o.new_max), NULL);
		if (ro_unit_parse(js, strlen(js), &b, &u, why, sizeof(why)))
			die("unit %s: %s", id, why);
		if (ro_queue_enqueue(q, &u, 1, &st) || st != 1)
			die("enqueue %s: %s", id, ro_queue_errmsg(q));
		(void)fprintf(uf, "%s\tdone\thealthy\t%s\n", id, js);
		ro_unit_clear(&u);
		free(js);
	}
	(void)fflush(uf);
	free(is_long);
	ro_queue_free(q);
	R.total = R.o.units;
}

/* A poison unit written straight into the unit hash and the pending list, as a buggy
 * producer, an old version or a bit flip would leave it; the unit's JSON (when it has a
 * usable body) goes to units.tsv so that the checker can run it fault-free. */
static int poison_inject(struct ch_rng *g, int fid, int variant)
{
	char id[32], n_s[8], *js, *body;
	unsigned n = 2, hn;
	const char *extra_f[8];
	const char *extra_v[8];
	int ne = 0;
	redisReply *rep;
	FILE *uf;
	char path[300], vbuf[128];

	(void)snprintf(id, sizeof(id), "p-%d-%s", fid, ch_poison_name[variant]);
	if (variant == CH_PV_N_DOWN)
		n = 3;
	js = unit_json(g, id, ch_rng_range(g, 3, 16), n, ch_rng_range(g, 8, 24),
		       variant == CH_PV_STRAY_BODY ? ",\"colour\":\"blue\"" : NULL);
	body = js;
	hn = n;
	if (variant == CH_PV_BADJSON)
		js[strlen(js) / 2] = '\0'; /* cut in the middle */
	if (variant == CH_PV_N_UP)
		hn = n + 1;
	if (variant == CH_PV_N_DOWN)
		hn = n - 1;
	if (variant == CH_PV_STRAY_HASH) {
		extra_f[ne] = "x-stray";
		extra_v[ne++] = "1";
		extra_f[ne] = "s:9";
		extra_v[ne++] = "0-1";
		extra_f[ne] = "p:x";
		extra_v[ne++] = "{}";
	}
	if (variant == CH_PV_CKPT_GARBAGE) {
		extra_f[ne] = "p:1";
		extra_v[ne++] = "{\"tokens\":[1,2";
		extra_f[ne] = "ckpt";
		extra_v[ne++] = "1";
	}
	if (variant == CH_PV_CKPT_VOCAB || variant == CH_PV_CKPT_NEG) {
		(void)snprintf(vbuf, sizeof(vbuf),
			       "{\"tokens\":[%u,%d],\"logprobs\":[-1.5,-2.5],\"pos\":2,\"pv\":0}",
			       ch_rng_range(g, 0, 1023),
			       variant == CH_PV_CKPT_VOCAB ? 5000 + (int)ch_rng_range(g, 0, 9)
							   : -7);
		extra_f[ne] = "p:0";
		extra_v[ne++] = vbuf;
		extra_f[ne] = "ckpt";
		extra_v[ne++] = "1";
	}
	(void)snprintf(n_s, sizeof(n_s), "%u", hn);
	{
		const char *argv[40];
		size_t alen[40];
		int k = 0;
		char key[128], now_s[24];

		(void)snprintf(key, sizeof(key), "ro:{%s}:unit:%s", R.queue, id);
		(void)snprintf(now_s, sizeof(now_s), "%lld", (long long)wall());
		argv[k++] = "HSET";
		argv[k++] = key;
		argv[k++] = "body";
		argv[k++] = body;
		argv[k++] = "n";
		argv[k++] = n_s;
		argv[k++] = "meta";
		argv[k++] = "";
		argv[k++] = "state";
		argv[k++] = "pending";
		argv[k++] = "attempt";
		argv[k++] = "1";
		argv[k++] = "token";
		argv[k++] = "0";
		argv[k++] = "npub";
		argv[k++] = "0";
		argv[k++] = "enq_ms";
		argv[k++] = now_s;
		for (int i = 0; i < ne; i++) {
			argv[k++] = extra_f[i];
			argv[k++] = extra_v[i];
		}
		for (int i = 0; i < k; i++)
			alen[i] = strlen(argv[i]);
		rep = cmd("PING");
		if (!rep) {
			free(js);
			return -EAGAIN;
		}
		freeReplyObject(rep);
		rep = redisCommandArgv(R.c, k, argv, alen);
		if (!rep || rep->type == REDIS_REPLY_ERROR) {
			if (rep)
				freeReplyObject(rep);
			free(js);
			return -EIO;
		}
		freeReplyObject(rep);
	}
	rep = cmd("RPUSH ro:{%s}:pending %s", R.queue, id);
	if (rep)
		freeReplyObject(rep);
	rep = cmd("RPUSH ro:{%s}:marker 1", R.queue);
	if (rep)
		freeReplyObject(rep);
	(void)snprintf(path, sizeof(path), "%s/units.tsv", R.dir);
	uf = fopen(path, "a");
	if (uf) {
		/* the checker's reference needs a body it can parse: the stray-body unit's
		 * would be refused, the cut one is not JSON */
		bool usable = variant != CH_PV_BADJSON && variant != CH_PV_STRAY_BODY;

		(void)fprintf(uf, "%s\t%s\t%s\t%s\n", id, ch_poison_expect(variant),
			      ch_poison_name[variant], usable ? js : "");
		(void)fclose(uf);
	}
	rec("poison id=%s variant=%s expect=%s fault=%d at=%lld", id, ch_poison_name[variant],
	    ch_poison_expect(variant), fid, (long long)wall());
	R.total++;
	R.poisons++;
	free(js);
	return 0;
}

/* ---- control-socket flood (a child: the driver's loop goes on) -------------------------- */

static int uconnect(const char *path, bool nonblock)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | (nonblock ? SOCK_NONBLOCK : 0), 0);

	if (fd < 0)
		return -1;
	(void)snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) && errno != EINPROGRESS) {
		(void)close(fd);
		return -1;
	}
	return fd;
}

/* Read one reply line within ms; "" when none came. */
static void read_reply(int fd, char *buf, size_t len, int ms)
{
	size_t got = 0;
	int64_t end = mono() + ms;

	buf[0] = '\0';
	while (got + 1 < len && mono() < end) {
		struct timeval tv = {0, 100000};
		fd_set rf;
		ssize_t n;

		FD_ZERO(&rf);
		FD_SET(fd, &rf);
		if (select(fd + 1, &rf, NULL, NULL, &tv) != 1)
			continue;
		n = read(fd, buf + got, len - got - 1);
		if (n <= 0)
			break;
		got += (size_t)n;
		buf[got] = '\0';
		if (strchr(buf, '\n'))
			break;
	}
	buf[strcspn(buf, "\n")] = '\0';
	for (char *p = buf; *p; p++)
		if (*p == ' ' || (unsigned char)*p < 0x20)
			*p = '_';
}

static bool is_status(const char *s)
{
	return !strncmp(s, "{\"state\":", 9);
}

/* Hold up to 64 idle connections for hold_ms: the daemon accepts them, gets nothing and
 * closes them; each one it closes is opened again, so its listen backlog stays full. */
static void flood_idle(const char *sock, uint32_t hold_ms, int *ret_max, long *ret_total)
{
	int fd[64];
	int64_t end = mono() + hold_ms;

	for (int i = 0; i < 64; i++)
		fd[i] = -1;
	*ret_max = 0;
	*ret_total = 0;
	while (mono() < end) {
		int open_now = 0;

		for (int i = 0; i < 64; i++) {
			char b[64];

			if (fd[i] >= 0) {
				ssize_t n = recv(fd[i], b, sizeof(b), MSG_DONTWAIT);

				if (n == 0 || (n < 0 && errno != EAGAIN)) {
					(void)close(fd[i]);
					fd[i] = -1;
				}
			}
			if (fd[i] < 0) {
				fd[i] = uconnect(sock, true);
				*ret_total += fd[i] >= 0;
			}
			open_now += fd[i] >= 0;
		}
		if (open_now > *ret_max)
			*ret_max = open_now;
		ro_test_msleep(20); /* a pace for the top-up, not a wait for an event */
	}
	for (int i = 0; i < 64; i++)
		if (fd[i] >= 0)
			(void)close(fd[i]);
}

static void flood_child(const char *sock, const char *out, uint32_t hold_ms)
{
	char split[2048] = "", after[2048] = "", junk[256] = "", jd[2048] = "";
	bool gone = false;
	int64_t split_ms = -1, after_ms = -1;
	int idle_max = 0, fd, p[2], st;
	long idle_total = 0;
	pid_t idler;
	FILE *f;

	/* a command in two writes 300 ms apart, on a quiet socket: the daemon accepts it at
	 * once and has only the first half when it reads */
	fd = uconnect(sock, false);
	if (fd >= 0) {
		int64_t ts = mono();

		(void)!write(fd, "sta", 3);
		ro_test_msleep(300); /* the gap between the two halves is the fault itself */
		(void)!write(fd, "tus\n", 4);
		read_reply(fd, split, sizeof(split), 15000);
		split_ms = mono() - ts;
		(void)close(fd);
	}
	if (pipe(p))
		_exit(1);
	idler = fork();
	if (idler == 0) {
		(void)close(p[0]);
		flood_idle(sock, hold_ms, &idle_max, &idle_total);
		(void)!write(p[1], &idle_max, sizeof(idle_max));
		(void)!write(p[1], &idle_total, sizeof(idle_total));
		_exit(0);
	}
	(void)close(p[1]);
	ro_test_msleep(300); /* let the idle connections fill the backlog first */
	/* junk lines, one connection each (none starts with "drain": that is a command) */
	for (int i = 0; i < 4; i++) {
		static const char *const j[] = {"\x01\x02\xff\xfe garbage\n", "\n",
						"status please\n", NULL};
		char r[512], big[8192];

		fd = uconnect(sock, false);
		if (fd < 0)
			continue;
		if (j[i]) {
			(void)!write(fd, j[i], strlen(j[i]));
		} else {
			memset(big, 'x', sizeof(big) - 1);
			big[sizeof(big) - 1] = '\n';
			(void)!write(fd, big, sizeof(big));
		}
		read_reply(fd, r, sizeof(r), 3000);
		(void)snprintf(junk + strlen(junk), sizeof(junk) - strlen(junk), "%s%s",
			       i ? "," : "", r[0] ? (strstr(r, "error") ? "e" : "r") : "-");
		(void)close(fd);
	}
	(void)waitpid(idler, &st, 0); /* the hold is over */
	if (read(p[0], &idle_max, sizeof(idle_max)) != sizeof(idle_max) ||
	    read(p[0], &idle_total, sizeof(idle_total)) != sizeof(idle_total))
		idle_max = -1;
	(void)close(p[0]);
	/* afterwards the daemon still answers (unless it is gone: another fault ended it) */
	fd = uconnect(sock, false);
	if (fd >= 0) {
		int64_t ts = mono();

		(void)!write(fd, "status\n", 7);
		read_reply(fd, after, sizeof(after), 15000);
		after_ms = mono() - ts;
		(void)close(fd);
	} else {
		gone = true;
	}
	/* last, since it may end the agent: a junk line that only starts with "drain" */
	fd = uconnect(sock, false);
	if (fd >= 0) {
		(void)!write(fd, "drainage-is-not-a-command\n", 26);
		read_reply(fd, jd, sizeof(jd), 15000);
		(void)close(fd);
	}
	f = fopen(out, "w");
	if (f) {
		(void)fprintf(f,
			      "flood idle_max=%d idle_total=%ld split_ok=%d split_ms=%lld after_ok=%d "
			      "after_ms=%lld junk=%s junk_drained=%d split_reply=%.120s\n",
			      idle_max, idle_total, is_status(split), (long long)split_ms,
			      gone ? -1 : is_status(after), (long long)after_ms, junk[0] ? junk : "none",
			      strstr(jd, "\"state\":\"drain") != NULL, split[0] ? split : "none");
		(void)fclose(f);
	}
}

/* ---- faults ------------------------------------------------------------------------------ */

static const char *const imds_faults[] = {"delay", "500", "429", "drop", "badbody", "notoken"};

static void make_schedule(struct ch_rng *g)
{
	int kinds[CH_NKINDS], nk = 0;

	for (int k = 0; k < CH_NKINDS; k++)
		if (R.o.kind[k] && k != CH_SHORT_LEASE)
			kinds[nk++] = k;
	unsigned nth[CH_NKINDS] = {0}, offset = ch_rng_range(g, 0, CH_NPOISON - 1);

	R.nf = nk ? R.o.faults : 0;
	for (unsigned i = 0; i < R.nf; i++) {
		struct fault *f = &R.f[i];
		uint32_t lease = lease_short() ? R.o.short_lease_ms : R.o.lease_ms;
		int pv[CH_NPOISON], np = 0;

		/* every selected kind once (in seeded order), then at random */
		f->kind = kinds[ch_rng_range(g, 0, (uint32_t)nk - 1)];
		if (i < (unsigned)nk) {
			int j = (int)i + (int)ch_rng_range(g, 0, (uint32_t)(nk - 1 - (int)i));
			int t = kinds[i];

			kinds[i] = kinds[j];
			kinds[j] = t;
			f->kind = kinds[i];
		}
		f->id = (int)i;
		f->slot = (int)ch_rng_range(g, 0, R.o.agents - 1);
		f->frac = 0.03 + 0.85 * ch_rng_unit(g);
		f->dur_ms = ch_rng_range(g, 1000, 3000);
		f->deadline_s = ch_rng_range(g, R.o.deadline_min_s, R.o.deadline_max_s);
		f->restart_ms = ch_rng_range(g, 0, 1000);
		f->same_id = ch_rng_range(g, 0, 1);
		f->with_drain = ch_rng_range(g, 0, 1);
		f->variant = 0;
		switch (f->kind) {
		case CH_STOP:
		case CH_REDIS_PAUSE:
			f->dur_ms += lease; /* past the lease */
			break;
		case CH_REDIS_DOWN:
			f->dur_ms = ch_rng_range(g, 2000, 6000);
			break;
		case CH_FLOOD:
			f->dur_ms = ch_rng_range(g, 2000, 6000);
			break;
		case CH_IMDS:
			f->dur_ms = ch_rng_range(g, 2000, 10000);
			f->variant = ch_rng_range(g, 0, 5);
			break;
		case CH_POISON:
		case CH_POISON_CKPT:
			for (int v = 0; v < CH_NPOISON; v++)
				if (R.o.poison[v] && (f->kind == CH_POISON_CKPT) ==
							 (v == CH_PV_CKPT_VOCAB || v == CH_PV_CKPT_NEG))
					pv[np++] = v;
			if (!np) /* the kind asked for, with no variant of it selected */
				pv[np++] = f->kind == CH_POISON_CKPT ? CH_PV_CKPT_VOCAB : CH_PV_BADJSON;
			/* each selected variant in turn, from a seeded start */
			f->variant = (uint32_t)pv[(nth[f->kind]++ + offset) % (unsigned)np];
			break;
		default:
			break;
		}
	}
	/* fire in order of their share of the work; the time slots spread over the window */
	for (unsigned i = 1; i < R.nf; i++)
		for (unsigned j = i; j > 0 && R.f[j].frac < R.f[j - 1].frac; j--) {
			struct fault t = R.f[j];

			R.f[j] = R.f[j - 1];
			R.f[j - 1] = t;
		}
	for (unsigned i = 0; i < R.nf; i++) {
		R.f[i].id = (int)i;
		R.f[i].slot_ms = (int64_t)R.o.window_s * 1000 * (i + 1) / (R.nf + 1);
	}
}

static void describe(const struct fault *f, char *buf, size_t len)
{
	switch (f->kind) {
	case CH_KILL:
		(void)snprintf(buf, len, "slot=%d same_id=%d restart_ms=%u", f->slot, f->same_id,
			       f->restart_ms);
		break;
	case CH_STOP:
	case CH_FLOOD:
		(void)snprintf(buf, len, "slot=%d for_ms=%u", f->slot, f->dur_ms);
		break;
	case CH_SPOT:
	case CH_CTL:
		(void)snprintf(buf, len, "slot=%d deadline_s=%u", f->slot, f->deadline_s);
		break;
	case CH_REDIS_PAUSE:
	case CH_REDIS_DOWN:
		(void)snprintf(buf, len, "for_ms=%u drain_in_it=%d slot=%d", f->dur_ms, f->with_drain,
			       f->slot);
		break;
	case CH_IMDS:
		(void)snprintf(buf, len, "slot=%d imds=%s for_ms=%u", f->slot, imds_faults[f->variant],
			       f->dur_ms);
		break;
	case CH_POISON:
	case CH_POISON_CKPT:
		(void)snprintf(buf, len, "variant=%s", ch_poison_name[f->variant]);
		break;
	default:
		(void)snprintf(buf, len, "slot=%d", f->slot);
	}
}

static struct slot *running_slot(int want)
{
	for (unsigned k = 0; k < R.o.agents; k++) {
		struct slot *s = &R.slot[(want + (int)k) % (int)R.o.agents];

		if (s->st == SL_RUN && s->pid > 0)
			return s;
	}
	return NULL;
}

static void drain_record(struct slot *s, const char *how, int fid, int64_t posted,
			 int64_t deadline)
{
	rec("drain name=%s how=%s fault=%d posted=%lld deadline=%lld", s->name, how, fid,
	    (long long)posted, (long long)deadline);
	s->st = SL_DRAINING;
	s->cause = "drain";
	s->overrun_at = mono() + (deadline - wall()) + 30000;
}

static void ctl_drain(struct slot *s, unsigned deadline_s, int fid, const char *how)
{
	char d[16];
	const char *av[] = {R.o.rolloutctl, "drain", "--deadline", d, "--socket", s->sock, NULL};
	int64_t t = wall();
	char log[240];

	(void)snprintf(d, sizeof(d), "%u", deadline_s);
	(void)snprintf(log, sizeof(log), "%s/ctl-%d.log", R.dir, fid);
	helper_add(spawn(av, log), 60000, "rolloutctl-drain");
	drain_record(s, how, fid, t, t + (int64_t)deadline_s * 1000 + R.o.margin_ms);
}

/* Fire f now if it can be; false: try again later. */
static bool fire(struct fault *f, struct ch_rng *g)
{
	char what[400], ctl[160];
	struct slot *s = NULL;
	int64_t t = wall();
	bool agent_kind = f->kind != CH_REDIS_RESTART && f->kind != CH_REDIS_PAUSE &&
			  f->kind != CH_REDIS_DOWN && f->kind != CH_POISON &&
			  f->kind != CH_POISON_CKPT;

	if (agent_kind) {
		s = running_slot(f->slot);
		if (!s)
			return false;
	} else if (f->kind != CH_POISON && f->kind != CH_POISON_CKPT) {
		/* one Redis fault at a time, with Redis up for a third of the lease between */
		if (R.rs != RS_UP || R.rs_fault >= 0 ||
		    mono() - R.rs_up_since < (int64_t)(lease_short() ? R.o.short_lease_ms
								    : R.o.lease_ms) / 3)
			return false;
	} else if (R.rs != RS_UP) {
		return false;
	}
	describe(f, what, sizeof(what));
	switch (f->kind) {
	case CH_KILL:
		(void)kill(s->pid, SIGKILL);
		s->cause = "kill";
		s->next_same_id = f->same_id;
		s->restart_at = -1; /* set when the exit is seen */
		break;
	case CH_STOP:
		(void)kill(s->pid, SIGSTOP);
		s->st = SL_STOPPED;
		s->cont_at = mono() + f->dur_ms;
		break;
	case CH_SPOT: {
		int64_t term = (t / 1000 + 1 + f->deadline_s) * 1000; /* whole seconds, as EC2 */

		(void)snprintf(ctl, sizeof(ctl), "spot?in=0&time=%lld", (long long)(term / 1000));
		free(ro_test_mock_ctl(&s->mk, ctl));
		drain_record(s, "spot", f->id, t, term);
		break;
	}
	case CH_REBALANCE:
	case CH_LIFECYCLE:
		free(ro_test_mock_ctl(&s->mk, f->kind == CH_REBALANCE ? "rebalance?in=0"
								  : "lifecycle?state=Terminated"));
		/* the agent's deadline counts from when its watcher saw it: within a slow poll */
		drain_record(s, ch_kind_name[f->kind], f->id, t,
			     t + 500 + (int64_t)R.o.notice_s * 1000);
		break;
	case CH_SIGTERM:
		(void)kill(s->pid, SIGTERM);
		drain_record(s, "sigterm", f->id, t,
			     t + (int64_t)R.o.grace_s * 1000 + R.o.margin_ms);
		break;
	case CH_CTL:
		ctl_drain(s, f->deadline_s, f->id, "ctl");
		break;
	case CH_REDIS_RESTART: {
		long long lost;

		ro_test_redis_kill(&R.redis);
		lost = power_loss();
		rec("redis event=crash at=%lld lost_bytes=%lld fault=%d", (long long)wall(), lost,
		    f->id);
		if (ro_test_redis_restart(&R.redis))
			die("redis-server did not restart (see %s)", R.redis.log);
		rec("redis event=up at=%lld fault=%d", (long long)wall(), f->id);
		R.rs_up_since = mono();
		(void)snprintf(what + strlen(what), sizeof(what) - strlen(what), " lost_bytes=%lld",
			       lost);
		redisFree(R.c);
		R.c = NULL;
		break;
	}
	case CH_REDIS_PAUSE:
		(void)kill(R.redis.pid, SIGSTOP);
		R.rs = RS_PAUSED;
		R.rs_until = mono() + f->dur_ms;
		R.rs_fault = f->id;
		R.rs_drain_at = f->with_drain ? mono() + 300 : -1;
		rec("redis event=pause at=%lld fault=%d", (long long)wall(), f->id);
		break;
	case CH_REDIS_DOWN: {
		long long lost;

		ro_test_redis_kill(&R.redis);
		lost = power_loss();
		R.rs = RS_DOWN;
		R.rs_until = mono() + f->dur_ms;
		R.rs_fault = f->id;
		R.rs_drain_at = f->with_drain ? mono() + 300 : -1;
		rec("redis event=crash at=%lld lost_bytes=%lld fault=%d", (long long)wall(), lost,
		    f->id);
		redisFree(R.c);
		R.c = NULL;
		break;
	}
	case CH_IMDS:
		(void)snprintf(ctl, sizeof(ctl), "fault?kind=%s&for=%.1f", imds_faults[f->variant],
			       f->dur_ms / 1000.0);
		free(ro_test_mock_ctl(&s->mk, ctl));
		break;
	case CH_POISON:
	case CH_POISON_CKPT:
		if (poison_inject(g, f->id, (int)f->variant))
			return false;
		break;
	case CH_FLOOD: {
		char out[240];
		pid_t pid;

		(void)snprintf(out, sizeof(out), "%s/flood-%d.rec", R.dir, f->id);
		pid = fork();
		if (pid == 0) {
			(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
			flood_child(s->sock, out, f->dur_ms);
			_exit(0);
		}
		if (pid > 0)
			helper_add(pid, f->dur_ms + 60000, "flood");
		(void)snprintf(what + strlen(what), sizeof(what) - strlen(what), " rec=%s", out);
		break;
	}
	default:
		break;
	}
	rec("fault id=%d kind=%s target=%s at=%lld %s", f->id, ch_kind_name[f->kind],
	    s ? s->name : "-", (long long)t, what);
	say("fault %d: %s %s %s (done %ld/%ld)", f->id, ch_kind_name[f->kind], s ? s->name : "",
	    what, R.finished, R.total);
	f->state = 1;
	R.last_fire = R.last_change = mono();
	if (f->kind == CH_KILL)
		s->restart_at = f->restart_ms; /* a delay, turned into a time at the exit */
	return true;
}

/* ---- the loop's duties ----------------------------------------------------------------- */

static void agents_reap(void)
{
	for (unsigned i = 0; i < R.o.agents; i++) {
		struct slot *s = &R.slot[i];
		int st;

		if (s->pid <= 0 || waitpid(s->pid, &st, WNOHANG) != s->pid)
			continue;
		rec("exit name=%s pid=%d rc=%d sig=%d at=%lld cause=%s", s->name, (int)s->pid,
		    WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st) ? WTERMSIG(st) : 0,
		    (long long)wall(), s->cause ? s->cause : "none");
		say("exit %s: %s %d (%s)", s->name, WIFEXITED(st) ? "rc" : "signal",
		    WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), s->cause ? s->cause : "unasked");
		s->pid = 0;
		/* its notice would drain the replacement too */
		free(ro_test_mock_ctl(&s->mk, "clear?all=1"));
		s->st = SL_DOWN;
		s->restart_at = mono() + (s->cause && !strcmp(s->cause, "kill") && s->restart_at >= 0
					      ? s->restart_at
					      : 200);
	}
}

static void timers(void)
{
	int64_t now = mono();

	for (unsigned i = 0; i < R.o.agents; i++) {
		struct slot *s = &R.slot[i];
		struct stat st;

		if (s->st == SL_START && s->pid > 0 && !stat(s->sock, &st)) {
			s->st = SL_RUN;
			R.last_change = now; /* stalls count from here */
			rec("ready name=%s at=%lld", s->name, (long long)wall());
		} else if (s->st == SL_START && s->pid > 0 && now >= s->ready_by) {
			rec("slow_start name=%s at=%lld", s->name, (long long)wall());
			s->ready_by = now + 60000;
		}
		if (s->st == SL_STOPPED && now >= s->cont_at) {
			(void)kill(s->pid, SIGCONT);
			rec("cont name=%s at=%lld", s->name, (long long)wall());
			say("SIGCONT %s", s->name);
			s->st = SL_RUN;
		}
		if (s->st == SL_DOWN && now >= s->restart_at)
			agent_start(s);
		if (s->st == SL_DRAINING && s->pid > 0 && now >= s->overrun_at) {
			rec("overrun name=%s at=%lld", s->name, (long long)wall());
			s->cause = "overrun";
			(void)kill(s->pid, SIGCONT);
			(void)kill(s->pid, SIGKILL);
		}
	}
	if (R.rs != RS_UP && R.rs_drain_at >= 0 && now >= R.rs_drain_at) {
		struct slot *s = running_slot(R.f[R.rs_fault].slot);

		R.rs_drain_at = -1;
		if (s)
			ctl_drain(s, ch_rng_range(&(struct ch_rng){(uint64_t)R.rs_fault}, 1, 3),
				  R.rs_fault, R.rs == RS_PAUSED ? "ctl_in_pause" : "ctl_in_down");
	}
	if (R.rs == RS_PAUSED && now >= R.rs_until) {
		(void)kill(R.redis.pid, SIGCONT);
		rec("redis event=cont at=%lld fault=%d", (long long)wall(), R.rs_fault);
		say("redis SIGCONT");
		R.rs = RS_UP;
		R.rs_fault = -1;
		R.rs_up_since = R.last_change = now;
	}
	if (R.rs == RS_DOWN && now >= R.rs_until) {
		if (ro_test_redis_restart(&R.redis))
			die("redis-server did not restart (see %s)", R.redis.log);
		rec("redis event=up at=%lld fault=%d", (long long)wall(), R.rs_fault);
		say("redis up again");
		R.rs = RS_UP;
		R.rs_fault = -1;
		R.rs_up_since = R.last_change = now;
	}
}

static bool all_running(void)
{
	for (unsigned i = 0; i < R.o.agents; i++)
		if (R.slot[i].st != SL_RUN)
			return false;
	return R.rs == RS_UP;
}

static void finish_agents(void)
{
	int64_t end = mono() + ((int64_t)R.o.grace_s * 1000 + R.o.margin_ms) + 15000;

	for (unsigned i = 0; i < R.o.agents; i++) {
		struct slot *s = &R.slot[i];
		int64_t t = wall();

		if (s->pid <= 0)
			continue;
		if (s->st == SL_STOPPED) {
			(void)kill(s->pid, SIGCONT);
			rec("cont name=%s at=%lld", s->name, (long long)wall());
		}
		if (s->st != SL_DRAINING) {
			(void)kill(s->pid, SIGTERM);
			drain_record(s, "final", -1, t,
				     t + (int64_t)R.o.grace_s * 1000 + R.o.margin_ms);
		}
		s->cause = "final";
	}
	for (;;) {
		bool any = false;

		for (unsigned i = 0; i < R.o.agents; i++) {
			struct slot *s = &R.slot[i];
			int st;

			if (s->pid <= 0)
				continue;
			if (waitpid(s->pid, &st, WNOHANG) == s->pid) {
				rec("exit name=%s pid=%d rc=%d sig=%d at=%lld cause=final", s->name,
				    (int)s->pid, WIFEXITED(st) ? WEXITSTATUS(st) : -1,
				    WIFSIGNALED(st) ? WTERMSIG(st) : 0, (long long)wall());
				s->pid = 0;
				continue;
			}
			any = true;
			if (mono() >= end) {
				rec("overrun name=%s at=%lld", s->name, (long long)wall());
				(void)kill(s->pid, SIGKILL);
				(void)waitpid(s->pid, &st, 0);
				rec("exit name=%s pid=%d rc=-1 sig=9 at=%lld cause=overrun", s->name,
				    (int)s->pid, (long long)wall());
				s->pid = 0;
			}
		}
		if (!any)
			break;
		ro_test_msleep(20);
	}
}

static int run_check(void)
{
	const char *av[] = {R.o.check, "--dir", R.dir, NULL};
	pid_t pid = spawn(av, NULL);
	int st;

	/* the checker writes to our stdout and stderr */
	(void)pid;
	if (pid <= 0)
		return 99;
	(void)waitpid(pid, &st, 0);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 99;
}

int main(int argc, char **argv)
{
	struct ro_make_model_opts mo;
	struct ch_rng g, gsched;
	char err[256], path[300], rdir[260];
	FILE *uf;
	const char *end_reason = "done";
	int rc;

	(void)setvbuf(stdout, NULL, _IOLBF, 0);
	(void)signal(SIGPIPE, SIG_IGN); /* the daemon closes control connections on us */
	parse_opts(argc, argv);
	R.start = mono();
	R.rs_fault = -1;
	read_daemon_help();
	if (R.o.dir) {
		(void)snprintf(R.dir, sizeof(R.dir), "%s", R.o.dir);
		if (mkdir(R.dir, 0700) && errno != EEXIST)
			die("%s: %s", R.dir, strerror(errno));
	} else {
		(void)snprintf(R.dir, sizeof(R.dir), "/tmp/ro-chaos-XXXXXX");
		if (!mkdtemp(R.dir))
			die("mkdtemp: %s", strerror(errno));
	}
	(void)snprintf(R.queue, sizeof(R.queue), "chaos");
	(void)snprintf(path, sizeof(path), "%s/run.log", R.dir);
	R.rec = fopen(path, "w");
	if (!R.rec)
		die("%s: %s", path, strerror(errno));
	(void)printf("chaos: seed %llu (reproduce the schedule with --seed %llu), run in %s\n",
		     (unsigned long long)R.o.seed, (unsigned long long)R.o.seed, R.dir);
	/* the model */
	(void)snprintf(R.model, sizeof(R.model), "%s/model", R.dir);
	ro_test_agent_model(&mo);
	if (ro_make_model(&mo, R.model, err, sizeof(err)))
		die("model: %s", err);
	/* redis */
	(void)snprintf(rdir, sizeof(rdir), "%s/redis", R.dir);
	if (ro_test_redis_start_opts(&R.redis, &(struct ro_test_redis_opts){
						   .aof = true,
						   .everysec = R.o.everysec,
						   .growing_aof = true,
						   .dir = rdir}))
		die("redis-server did not start (see %s)", R.redis.log);
	{
		char kinds[512] = "", poisons[256] = "", opts[1024] = "";

		for (int k = 0; k < CH_NKINDS; k++)
			if (R.o.kind[k])
				(void)snprintf(kinds + strlen(kinds), sizeof(kinds) - strlen(kinds),
					       "%s%s", kinds[0] ? "," : "", ch_kind_name[k]);
		for (int v = 0; v < CH_NPOISON; v++)
			if (R.o.poison[v])
				(void)snprintf(poisons + strlen(poisons),
					       sizeof(poisons) - strlen(poisons), "%s%s",
					       poisons[0] ? "," : "", ch_poison_name[v]);
		for (unsigned i = 0; i < R.o.n_agent_opt; i++) {
			char name[96];

			(void)snprintf(name, sizeof(name), "%s", R.o.agent_opt[i]);
			name[strcspn(name, "=")] = '\0';
			(void)snprintf(opts + strlen(opts), sizeof(opts) - strlen(opts), "%s%s%s",
				       opts[0] ? "," : "", R.o.agent_opt[i],
				       daemon_has(name) ? "" : "(absent)");
		}
		rec("config seed=%llu aof=%s power_loss=%d queue=%s redis=%s agents=%u units=%u "
		    "faults=%u kinds=%s poisons=%s lease_ms=%u short_lease=%d margin_ms=%u "
		    "grace_s=%u notice_s=%u model=%s agent_opts=%s",
		    (unsigned long long)R.o.seed, R.o.everysec ? "everysec" : "always",
		    R.o.everysec && R.o.power_loss, R.queue, R.redis.url, R.o.agents, R.o.units,
		    R.o.faults, kinds[0] ? kinds : "none", poisons[0] ? poisons : "none", R.o.lease_ms,
		    lease_short(), R.o.margin_ms, R.o.grace_s, R.o.notice_s, R.model,
		    opts[0] ? opts : "none");
		(void)printf("chaos: kinds %s; poisons %s; aof %s%s; %u agents, %u units, %u faults\n",
			     kinds, poisons, R.o.everysec ? "everysec" : "always",
			     R.o.everysec && R.o.power_loss ? " (crashes lose the last second)" : "",
			     R.o.agents, R.o.units, R.o.faults);
	}
	/* units and schedule: two streams of the seed, so that a change to one keeps the other */
	g.s = R.o.seed * 2 + 1;
	gsched.s = R.o.seed * 2 + 2;
	(void)snprintf(path, sizeof(path), "%s/units.tsv", R.dir);
	uf = fopen(path, "w");
	if (!uf)
		die("%s: %s", path, strerror(errno));
	enqueue_units(&g, uf);
	(void)fclose(uf);
	make_schedule(&gsched);
	for (unsigned i = 0; i < R.nf; i++) {
		char what[160];

		describe(&R.f[i], what, sizeof(what));
		(void)printf("chaos: schedule %2u: %-13s at %3.0f%% of the units or %5.1f s  %s\n", i,
			     ch_kind_name[R.f[i].kind], R.f[i].frac * 100, R.f[i].slot_ms / 1000.0,
			     what);
	}
	/* agents, each with its own mock IMDS so that a notice reaches one of them */
	for (unsigned i = 0; i < R.o.agents; i++) {
		struct slot *s = &R.slot[i];

		s->idx = (int)i;
		if (ro_test_mock_start(&s->mk, 0, NULL))
			die("mock IMDS did not start");
		agent_start(s);
	}
	R.start = mono();
	R.last_change = mono();
	R.last_fire = mono();
	for (;;) {
		int64_t now = mono();
		bool faults_left = R.next_fault < R.nf;

		agents_reap();
		helpers_reap(false);
		timers();
		observe();
		aof_sample();
		if (faults_left && now - R.last_fire >= 2000) {
			struct fault *f = &R.f[R.next_fault];

			if (!f->waiting_since)
				f->waiting_since = now;
			if (R.finished >= (long)(f->frac * (double)R.total) ||
			    now - R.start >= f->slot_ms) {
				if (fire(f, &gsched)) {
					R.next_fault++;
				} else if (now - f->waiting_since > 30000) {
					rec("fault id=%d kind=%s skipped=1 at=%lld", f->id,
					    ch_kind_name[f->kind], (long long)wall());
					say("fault %d (%s) skipped: no target for 30 s", f->id,
					    ch_kind_name[f->kind]);
					f->state = 2;
					R.next_fault++;
				}
			}
		}
		if (!faults_left && all_running() && !helpers_running()) {
			if (R.finished >= R.total)
				break;
			if (now - R.last_change > (int64_t)R.o.stall_s * 1000) {
				end_reason = "stalled";
				break;
			}
		}
		if (now - R.start > (int64_t)R.o.timeout_s * 1000) {
			end_reason = "timeout";
			break;
		}
		ro_test_msleep(20);
	}
	say("work over (%s): %ld of %ld units finished, %ld samples", end_reason, R.finished,
	    R.total, R.samples);
	if (R.rs == RS_PAUSED)
		(void)kill(R.redis.pid, SIGCONT);
	if (R.rs == RS_DOWN && ro_test_redis_restart(&R.redis))
		die("redis-server did not restart (see %s)", R.redis.log);
	if (R.rs != RS_UP)
		rec("redis event=%s at=%lld fault=%d", R.rs == RS_PAUSED ? "cont" : "up",
		    (long long)wall(), R.rs_fault);
	R.rs = RS_UP;
	for (int64_t until = mono() + 30000; helpers_running() && mono() < until;) {
		helpers_reap(false);
		ro_test_msleep(20);
	}
	finish_agents();
	helpers_reap(true);
	for (unsigned i = 0; i < R.o.agents; i++)
		ro_test_mock_stop(&R.slot[i].mk);
	rec("end at=%lld reason=%s finished=%ld total=%ld elapsed_ms=%lld", (long long)wall(),
	    end_reason, R.finished, R.total, (long long)(mono() - R.start));
	(void)fclose(R.rec);
	redisFree(R.c);
	R.c = NULL;
	(void)printf("chaos: work over (%s) after %.1f s; checking\n", end_reason,
		     (mono() - R.start) / 1000.0);
	rc = run_check();
	ro_test_redis_stop(&R.redis);
	if (rc == 0 && !R.o.keep) {
		char cmd_rm[300];

		(void)snprintf(cmd_rm, sizeof(cmd_rm), "rm -rf '%s'", R.dir);
		(void)!system(cmd_rm);
	} else {
		(void)printf("chaos: run kept in %s (re-check: %s --dir %s; seed %llu)\n", R.dir,
			     R.o.check, R.dir, (unsigned long long)R.o.seed);
	}
	return rc;
}
