/* probe_bench: how long the Kubernetes probes (`rolloutctl status --local --ready/--live`:
 * connect to the control socket, send "status\n", read the JSON line) take while the agent
 * is busy, idle-ish, flooded with 64 idle control connections, cut off from Redis
 * (SIGSTOP), and in the middle of a 30,000-token prefill. Beside it in the same run: the
 * floor (the same round trip to an in-process unix-socket echo server) and, with
 * --baseline, another rolloutd binary (given only flags every version knows).
 *
 *   probe_bench [--rolloutd PATH] [--baseline PATH] [--probes N] [--interval-ms MS]
 *               [--timeout-ms MS] [--window-ms MS] [--phase-s S] [--prompt TOKENS]
 *               [--redis-pause-ms MS] [--rss-limit-mb MB] [--keep]
 *
 * Everything is bounded: a probe gives up after --timeout-ms (counted, and its time taken
 * as the timeout, so percentiles are lower bounds when the column says ">"), a condition
 * stops starting probes after --phase-s, every wait for the daemon has a limit, and a
 * daemon that grows past --rss-limit-mb during the prefill is killed. Loopback only. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/model.h"
#include "tests/agent_model.h"
#include "tests/redis_fixture.h"
#include "tests/testutil.h"

#define FLOOD 64

struct opts {
	const char *daemon, *baseline;
	int probes, interval_ms, timeout_ms, window_ms, phase_s, redis_pause_ms, rss_limit_mb;
	unsigned prompt;
	bool keep;
};

/* One condition's probes, in microseconds; timeouts are stored as the timeout. */
struct row {
	const char *cond;
	long *us;
	int n, sent, timeouts, errors;
	bool measured;
	long samples;	     /* samples the stream got in the condition's window, -1: not counted */
	int flood_reopened;  /* flood connections the daemon closed and we opened again */
	double loop_age_max; /* the largest "loop_age_ms" the answers carried (--live's input) */
	char note[160];
};

static struct ro_test_redis rs;
static pid_t daemon_pid;
static bool redis_stopped;
static char dir[] = "/tmp/ro-probebench-XXXXXX";

static int64_t mono_us(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Whatever happens, Redis is not left stopped and no daemon outlives the bench. */
static void cleanup(void)
{
	if (redis_stopped)
		(void)kill(rs.pid, SIGCONT);
	if (daemon_pid > 0) {
		(void)kill(daemon_pid, SIGKILL);
		(void)waitpid(daemon_pid, NULL, 0);
	}
}

/* ---- the probe ------------------------------------------------------------------------- */

/* A unix-socket connect that never blocks longer than until deadline: a full backlog makes a
 * non-blocking connect fail with EAGAIN (unix sockets have no EINPROGRESS), so retry. */
static int connect_until(const char *path, int64_t deadline_us)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd;

	(void)snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	for (;;) {
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
		if (fd < 0)
			return -errno;
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
			return fd;
		(void)close(fd);
		if (errno != EAGAIN || mono_us() >= deadline_us)
			return errno == EAGAIN ? -ETIMEDOUT : -errno;
		(void)usleep(500);
	}
}

/* connect, "status\n", read up to the newline. Returns the round trip in us, -ETIMEDOUT
 * past timeout_ms, another -errno when the server closed or refused; the reply in buf. */
static long probe(const char *path, int timeout_ms, char *buf, size_t len)
{
	int64_t t0 = mono_us(), deadline = t0 + (int64_t)timeout_ms * 1000;
	size_t got = 0, off = 0;
	static const char req[] = "status\n";
	long r = -ETIMEDOUT;
	int fd = connect_until(path, deadline);

	buf[0] = '\0';
	if (fd < 0)
		return fd;
	for (;;) {
		int64_t now = mono_us();
		struct pollfd p = {.fd = fd, .events = off < sizeof(req) - 1 ? POLLOUT : POLLIN};
		ssize_t n;

		if (now >= deadline)
			break;
		if (poll(&p, 1, (int)((deadline - now + 999) / 1000)) <= 0)
			continue;
		if (off < sizeof(req) - 1) {
			n = send(fd, req + off, sizeof(req) - 1 - off, MSG_NOSIGNAL);
			if (n < 0 && errno != EAGAIN) {
				r = -errno;
				break;
			}
			off += n > 0 ? (size_t)n : 0;
			continue;
		}
		n = read(fd, buf + got, len - 1 - got);
		if (n < 0 && errno == EAGAIN)
			continue;
		if (n <= 0) {
			r = n < 0 ? -errno : -ECONNRESET;
			break;
		}
		got += (size_t)n;
		buf[got] = '\0';
		if (memchr(buf, '\n', got) || got == len - 1) {
			r = (long)(mono_us() - t0);
			break;
		}
	}
	(void)close(fd);
	return r;
}

/* ---- the floor: an in-process echo of a status-sized line ------------------------------ */

static char floor_path[108];
static char floor_reply[1024];

static void *floor_serve(void *arg)
{
	int lfd = *(int *)arg;

	for (;;) {
		char in[64];
		size_t got = 0;
		int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);

		if (fd < 0)
			continue;
		while (got < sizeof(in)) {
			ssize_t n = read(fd, in + got, sizeof(in) - got);

			if (n <= 0)
				break;
			got += (size_t)n;
			if (memchr(in, '\n', got)) {
				(void)!write(fd, floor_reply, strlen(floor_reply));
				break;
			}
		}
		(void)close(fd);
	}
	return NULL;
}

static int floor_start(size_t reply_len)
{
	static int lfd;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	pthread_t t;

	(void)snprintf(floor_path, sizeof(floor_path), "%s/floor.sock", dir);
	(void)snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", floor_path);
	if (reply_len < 16 || reply_len >= sizeof(floor_reply))
		reply_len = 700;
	memset(floor_reply, 'x', reply_len);
	memcpy(floor_reply, "{\"state\":\"", 10);
	memcpy(floor_reply + reply_len - 3, "\"}\n", 3);
	floor_reply[reply_len] = '\0';
	lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(lfd, 128))
		return -errno;
	return -pthread_create(&t, NULL, floor_serve, &lfd);
}

/* ---- the daemon ------------------------------------------------------------------------ */

static void start_daemon(const char *bin, const char *tag, const char *q, const char *model,
			 const char *sock)
{
	char log[160];
	pid_t parent = getpid();

	(void)snprintf(log, sizeof(log), "%s/%s.log", dir, tag);
	daemon_pid = fork();
	if (daemon_pid < 0) {
		perror("fork");
		exit(1);
	}
	if (daemon_pid == 0) {
		int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);

		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(1);
		(void)dup2(fd, 1);
		(void)dup2(fd, 2);
		/* only settings every version of the daemon knows */
		execl(bin, bin, "--redis", rs.url, "--queue", q, "--model", model, "--worker-id",
		      tag, "--control-socket", sock, "--imds", "false", "--threads", "1",
		      "--max-inflight", "16", "--claim-batch", "4", "--log-level", "info",
		      "--status-interval-ms", "1000", (char *)NULL);
		_exit(127);
	}
}

/* SIGINT (requeue at once and exit), then SIGKILL if it has not gone within ms: what it
 * leaves in Redis does not matter here, each condition has its own queue. */
static void stop_daemon(long ms)
{
	int st;

	if (daemon_pid <= 0)
		return;
	(void)kill(daemon_pid, SIGINT);
	for (long t = 0; t < ms; t += 20) {
		if (waitpid(daemon_pid, &st, WNOHANG) == daemon_pid) {
			daemon_pid = 0;
			return;
		}
		ro_test_msleep(20);
	}
	(void)kill(daemon_pid, SIGKILL);
	(void)waitpid(daemon_pid, &st, 0);
	daemon_pid = 0;
}

static long rss_mb(pid_t pid)
{
	char path[64];
	long pages = 0, rss = 0;
	FILE *f;

	(void)snprintf(path, sizeof(path), "/proc/%d/statm", (int)pid);
	f = fopen(path, "r");
	if (!f)
		return 0;
	if (fscanf(f, "%ld %ld", &pages, &rss) != 2)
		rss = 0;
	(void)fclose(f);
	return rss * (sysconf(_SC_PAGESIZE) / 1024) / 1024;
}

/* ---- Redis views (never while Redis is stopped) ----------------------------------------- */

static long long r_int(redisContext *c, const char *fmt, const char *q, const char *arg)
{
	redisReply *r = redisCommand(c, fmt, q, arg);
	long long v = -1;

	if (r && r->type == REDIS_REPLY_INTEGER)
		v = r->integer;
	else if (r && r->type == REDIS_REPLY_STRING)
		v = strtoll(r->str, NULL, 10);
	else if (r && r->type == REDIS_REPLY_NIL)
		v = -1;
	if (r)
		freeReplyObject(r);
	return v;
}

/* Samples the stream got between two wall-clock ms (entry ids are the server's ms). */
static long samples_between(redisContext *c, const char *q, int64_t from, int64_t to)
{
	redisReply *r =
	    redisCommand(c, "XRANGE ro:{%s}:samples %lld %lld", q, (long long)from, (long long)to);
	long n = r && r->type == REDIS_REPLY_ARRAY ? (long)r->elements : -1;

	if (r)
		freeReplyObject(r);
	return n;
}

static void enqueue(const char *q, const char *id, unsigned prompt_len, unsigned n,
		    unsigned max_new, unsigned seed)
{
	/* one connection per queue, not per unit (4,000 units: 4,000 sockets in TIME_WAIT) */
	static struct ro_queue *qq;
	static char qq_name[64];
	size_t cap = (size_t)prompt_len * 6 + 256, off;
	char *js = malloc(cap), why[256];
	struct ro_unit u = {0};
	int st;

	if (!qq || strcmp(qq_name, q)) {
		if (qq)
			ro_queue_free(qq);
		qq = ro_test_queue(rs.url, q, "enq", 3);
		(void)snprintf(qq_name, sizeof(qq_name), "%s", q);
	}
	off = (size_t)snprintf(js, cap, "{\"id\":\"%s\",\"prompt\":[", id);
	for (unsigned i = 0; i < prompt_len; i++)
		off += (size_t)snprintf(js + off, cap - off, "%s%u", i ? "," : "",
					(i * 37 + seed) % 1000 + 1);
	(void)snprintf(js + off, cap - off,
		       "],\"n\":%u,\"max_new_tokens\":%u,\"sampling\":{\"temperature\":1.0,"
		       "\"seed\":%u}}",
		       n, max_new, seed);
	if (ro_unit_parse(js, strlen(js), &(struct ro_unit_bounds){1 << 24, 64, 1 << 24, 1 << 30},
			  &u, why, sizeof(why)) ||
	    ro_queue_enqueue(qq, &u, 1, &st)) {
		(void)fprintf(stderr, "probe_bench: enqueue %s: %s\n", id, why);
		exit(1);
	}
	ro_unit_clear(&u);
	free(js);
}

/* ---- the flood: FLOOD idle connections, reopened when the daemon closes one ------------ */

struct flood {
	int fd[FLOOD];
	int reopened;
};

static void flood_fill(struct flood *f, const char *sock, bool count)
{
	for (int i = 0; i < FLOOD; i++) {
		if (f->fd[i] >= 0) {
			struct pollfd p = {.fd = f->fd[i], .events = POLLIN};
			char b[256];

			/* readable means closed (or an answer nobody asked for) */
			if (poll(&p, 1, 0) == 1 && read(f->fd[i], b, sizeof(b)) <= 0) {
				(void)close(f->fd[i]);
				f->fd[i] = -1;
			} else {
				continue;
			}
		}
		f->fd[i] = connect_until(sock, 0);
		if (f->fd[i] >= 0 && count)
			f->reopened++;
		if (f->fd[i] < 0)
			f->fd[i] = -1;
	}
}

static int flood_open(const struct flood *f)
{
	int n = 0;

	for (int i = 0; i < FLOOD; i++)
		n += f->fd[i] >= 0;
	return n;
}

static void flood_close(struct flood *f)
{
	for (int i = 0; i < FLOOD; i++)
		if (f->fd[i] >= 0)
			(void)close(f->fd[i]);
}

/* ---- one condition ----------------------------------------------------------------------- */

/* Probes every interval until o->probes were sent or the phase's time is up; with a flood,
 * the flood is refilled between probes; with a pid, its RSS is watched. */
static void measure(const struct opts *o, struct row *w, const char *sock, int phase_ms,
		    struct flood *fl, const char *fl_sock, pid_t watch, bool *ret_rss_hit)
{
	int64_t t0 = mono_us(), end = t0 + (int64_t)phase_ms * 1000;
	char buf[4096];

	w->us = calloc((size_t)o->probes, sizeof(long));
	w->measured = true;
	for (int i = 0; i < o->probes && mono_us() < end; i++) {
		int64_t next = t0 + (int64_t)(i + 1) * o->interval_ms * 1000;
		long r = probe(sock, o->timeout_ms, buf, sizeof(buf));

		w->sent++;
		if (r >= 0) {
			const char *a = strstr(buf, "\"loop_age_ms\":");

			w->us[w->n++] = r;
			if (a && strtod(a + 14, NULL) > w->loop_age_max)
				w->loop_age_max = strtod(a + 14, NULL);
		} else if (r == -ETIMEDOUT) {
			w->timeouts++;
			w->us[w->n++] = (long)o->timeout_ms * 1000;
		} else {
			w->errors++;
		}
		if (fl)
			flood_fill(fl, fl_sock, true);
		if (watch > 0 && o->rss_limit_mb && rss_mb(watch) > o->rss_limit_mb) {
			*ret_rss_hit = true;
			break;
		}
		while (mono_us() < next)
			(void)usleep((useconds_t)(next - mono_us()));
	}
}

static int cmp_long(const void *a, const void *b)
{
	long x = *(const long *)a, y = *(const long *)b;

	return (x > y) - (x < y);
}

/* nearest rank, ms */
static double pct(const struct row *w, double p)
{
	size_t k;

	if (!w->n)
		return -1;
	k = (size_t)(p * w->n + 0.999999);
	k = k ? k - 1 : 0;
	if (k >= (size_t)w->n)
		k = (size_t)w->n - 1;
	return (double)w->us[k] / 1000.0;
}

/* ---- one daemon through the four conditions -------------------------------------------- */

enum { C_IDLE, C_FLOOD, C_REDIS, C_PREFILL, C_N };
static const char *cond_name[C_N] = {"(a) idle-ish decode", "(b) 64 idle conns",
				     "(c) Redis SIGSTOPped", "(d) N-token prefill"};
static char prefill_name[32];

static bool wait_for(redisContext *c, const char *what, long ms,
		     bool (*ok)(redisContext *, const char *, const char *), const char *q,
		     const char *arg)
{
	for (long t = 0; t < ms; t += 50) {
		if (ok(c, q, arg))
			return true;
		if (daemon_pid > 0 && waitpid(daemon_pid, NULL, WNOHANG) == daemon_pid) {
			(void)fprintf(
			    stderr, "probe_bench: the daemon exited while waiting for %s\n", what);
			daemon_pid = 0;
			return false;
		}
		ro_test_msleep(50);
	}
	(void)fprintf(stderr, "probe_bench: no %s after %ld ms\n", what, ms);
	return false;
}

static bool has_samples(redisContext *c, const char *q, const char *arg)
{
	return r_int(c, "XLEN ro:{%s}:samples", q, NULL) >= strtoll(arg, NULL, 10);
}

static bool is_leased(redisContext *c, const char *q, const char *id)
{
	return r_int(c, "ZSCORE ro:{%s}:leases %s", q, id) > 0;
}

static void run_daemon(const struct opts *o, const char *bin, const char *tag, const char *model,
		       redisContext *c, struct row rows[C_N], size_t *ret_reply_len)
{
	char q[64], sock[160], buf[4096], need[32];
	struct flood fl;
	int64_t w0;
	long len0;
	bool rss_hit = false;

	for (int i = 0; i < C_N; i++) {
		rows[i].cond = cond_name[i];
		rows[i].samples = -1;
	}
	(void)snprintf(sock, sizeof(sock), "%s/%s.sock", dir, tag);

	/* (a)-(c): plenty of short units, so the daemon decodes through every window: 4,000
	 * (16,000 samples) where 400 ran dry inside (a) once the kernels made ~1,600 samples in
	 * its 5 s, and (b) and (c) then measured an idle daemon ("NOT publishing 60 s after
	 * SIGCONT": nothing was left to publish) */
	(void)snprintf(q, sizeof(q), "probe-%s", tag);
	for (int i = 0; i < 4000; i++) {
		char id[32];

		(void)snprintf(id, sizeof(id), "u-%d", i);
		enqueue(q, id, 3, 4, 48, (unsigned)i);
	}
	start_daemon(bin, tag, q, model, sock);
	if (!wait_for(c, "first samples", 60000, has_samples, q, "8")) {
		stop_daemon(3000);
		return;
	}
	if (probe(sock, 2000, buf, sizeof(buf)) > 0 && ret_reply_len)
		*ret_reply_len = strlen(buf);

	w0 = ro_test_wall_ms();
	measure(o, &rows[C_IDLE], sock, o->window_ms, NULL, NULL, 0, &rss_hit);
	while (ro_test_wall_ms() < w0 + o->window_ms)
		ro_test_msleep(10);
	rows[C_IDLE].samples = samples_between(c, q, w0, w0 + o->window_ms - 1);

	memset(&fl, 0xff, sizeof(fl));
	fl.reopened = 0;
	flood_fill(&fl, sock, false);
	(void)snprintf(rows[C_FLOOD].note, sizeof(rows[C_FLOOD].note), "%d of %d connected at once",
		       flood_open(&fl), FLOOD);
	w0 = ro_test_wall_ms();
	measure(o, &rows[C_FLOOD], sock, o->window_ms, &fl, sock, 0, &rss_hit);
	while (ro_test_wall_ms() < w0 + o->window_ms) {
		flood_fill(&fl, sock, true);
		ro_test_msleep(10);
	}
	rows[C_FLOOD].samples = samples_between(c, q, w0, w0 + o->window_ms - 1);
	rows[C_FLOOD].flood_reopened = fl.reopened;
	{
		size_t n = strlen(rows[C_FLOOD].note);

		(void)snprintf(rows[C_FLOOD].note + n, sizeof(rows[C_FLOOD].note) - n,
			       "; %d reopened after the daemon closed them", fl.reopened);
	}
	flood_close(&fl);

	/* (c): probes from the SIGSTOP on for the whole pause, which outlasts the daemon's
	 * Redis deadlines (2 s by default), so its timeouts and reconnects fall inside it */
	len0 = (long)r_int(c, "XLEN ro:{%s}:samples", q, NULL);
	{
		struct opts oc = *o;

		oc.probes = o->redis_pause_ms / (o->interval_ms ? o->interval_ms : 1) + 1;
		(void)kill(rs.pid, SIGSTOP);
		redis_stopped = true;
		measure(&oc, &rows[C_REDIS], sock, o->redis_pause_ms, NULL, NULL, 0, &rss_hit);
		(void)kill(rs.pid, SIGCONT);
		redis_stopped = false;
	}
	{
		int64_t t = ro_test_mono_ms();

		(void)snprintf(need, sizeof(need), "%ld", len0 + 16);
		if (wait_for(c, "samples after SIGCONT", 60000, has_samples, q, need))
			(void)snprintf(rows[C_REDIS].note, sizeof(rows[C_REDIS].note),
				       "Redis stopped %d ms; 16 more samples %lld ms after SIGCONT",
				       o->redis_pause_ms, (long long)(ro_test_mono_ms() - t));
		else
			(void)snprintf(rows[C_REDIS].note, sizeof(rows[C_REDIS].note),
				       "NOT publishing 60 s after SIGCONT");
	}
	stop_daemon(3000);

	/* (d): one unit with a long prompt ahead of short ones, a fresh daemon */
	(void)snprintf(q, sizeof(q), "prefill-%s", tag);
	enqueue(q, "big", o->prompt, 1, 4, 7);
	for (int i = 0; i < 40; i++) {
		char id[32];

		(void)snprintf(id, sizeof(id), "s-%d", i);
		enqueue(q, id, 3, 4, 48, (unsigned)i);
	}
	start_daemon(bin, tag, q, model, sock);
	if (!wait_for(c, "lease on the long unit", 60000, is_leased, q, "big")) {
		stop_daemon(3000);
		return;
	}
	ro_test_msleep(3000); /* a few seconds in: chunks are no longer the cheap first ones */
	w0 = ro_test_wall_ms();
	measure(o, &rows[C_PREFILL], sock, o->phase_s * 1000, NULL, NULL, daemon_pid, &rss_hit);
	rows[C_PREFILL].samples =
	    samples_between(c, q, w0, ro_test_wall_ms()); /* the short units' */
	{
		redisReply *r = redisCommand(c, "HEXISTS ro:{%s}:unit:big s:0", q);
		bool done = r && r->type == REDIS_REPLY_INTEGER && r->integer;

		if (r)
			freeReplyObject(r);
		(void)snprintf(rows[C_PREFILL].note, sizeof(rows[C_PREFILL].note),
			       "%s; RSS %ld MiB%s",
			       done ? "the long unit FINISHED inside the window"
				    : "long prefill still running at the end",
			       daemon_pid > 0 ? rss_mb(daemon_pid) : 0,
			       rss_hit ? " (over --rss-limit-mb: stopped early)" : "");
	}
	stop_daemon(3000);
}

/* ---- the table --------------------------------------------------------------------------- */

static void fmt_ms(char *out, size_t len, const struct row *w, double v)
{
	if (v < 0)
		(void)snprintf(out, len, "-");
	else
		(void)snprintf(out, len, "%s%.2f", w->timeouts ? ">" : "", v);
}

static void print_row(const char *who, const struct row *w, const struct row *fl,
		      const struct row *base)
{
	char p50[24], p99[24], mx[24], xf[24] = "-", xb[24] = "-", smp[24] = "-";
	double f99 = pct(fl, 0.99), v99 = pct(w, 0.99);

	if (!w->measured) {
		(void)printf("%-24s %-9s %s\n", w->cond, who, "not measured (see above)");
		return;
	}
	fmt_ms(p50, sizeof(p50), w, pct(w, 0.50));
	fmt_ms(p99, sizeof(p99), w, v99);
	fmt_ms(mx, sizeof(mx), w, w->n ? (double)w->us[w->n - 1] / 1000.0 : -1);
	if (v99 >= 0 && f99 > 0)
		(void)snprintf(xf, sizeof(xf), "%.1f", v99 / f99);
	if (base && base->measured && v99 > 0 && pct(base, 0.99) > 0)
		(void)snprintf(xb, sizeof(xb), "%s%.4f", base->timeouts ? "<" : "",
			       v99 / pct(base, 0.99));
	if (w->samples >= 0)
		(void)snprintf(smp, sizeof(smp), "%ld", w->samples);
	(void)printf("%-24s %-9s %4d/%-4d %4d %3d %9s %9s %9s %9s %9s %7s\n", w->cond, who,
		     w->n - w->timeouts, w->sent, w->timeouts, w->errors, p50, p99, mx, xf, xb,
		     smp);
}

int main(int argc, char **argv)
{
	static const struct option lo[] = {{"rolloutd", required_argument, NULL, 'd'},
					   {"baseline", required_argument, NULL, 'b'},
					   {"probes", required_argument, NULL, 'n'},
					   {"interval-ms", required_argument, NULL, 'i'},
					   {"timeout-ms", required_argument, NULL, 't'},
					   {"window-ms", required_argument, NULL, 'w'},
					   {"phase-s", required_argument, NULL, 'p'},
					   {"prompt", required_argument, NULL, 'P'},
					   {"rss-limit-mb", required_argument, NULL, 'r'},
					   {"redis-pause-ms", required_argument, NULL, 'R'},
					   {"keep", no_argument, NULL, 'k'},
					   {0}};
	struct opts o = {.daemon = "./rolloutd",
			 .probes = 200,
			 .interval_ms = 10,
			 .timeout_ms = 2000,
			 .window_ms = 5000,
			 .phase_s = 20,
			 .redis_pause_ms = 5000,
			 .prompt = 30000,
			 .rss_limit_mb = 4096};
	struct row nw[C_N] = {0}, bl[C_N] = {0},
		   fl = {.cond = "floor (echo server)", .samples = -1};
	struct ro_make_model_opts mo;
	char model[96], err[256], buf[4096];
	size_t reply_len = 0;
	redisContext *c;
	int ch;

	while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		switch (ch) {
		case 'd':
			o.daemon = optarg;
			break;
		case 'b':
			o.baseline = optarg;
			break;
		case 'n':
			o.probes = atoi(optarg);
			break;
		case 'i':
			o.interval_ms = atoi(optarg);
			break;
		case 't':
			o.timeout_ms = atoi(optarg);
			break;
		case 'w':
			o.window_ms = atoi(optarg);
			break;
		case 'p':
			o.phase_s = atoi(optarg);
			break;
		case 'P':
			o.prompt = (unsigned)atoi(optarg);
			break;
		case 'r':
			o.rss_limit_mb = atoi(optarg);
			break;
		case 'R':
			o.redis_pause_ms = atoi(optarg);
			break;
		case 'k':
			o.keep = true;
			break;
		default:
			return 2;
		}
	}
	if (o.probes < 1 || o.probes > 100000 || o.interval_ms < 0 || o.timeout_ms < 1 ||
	    o.window_ms < 100 || o.phase_s < 1 || o.redis_pause_ms < 100 ||
	    o.redis_pause_ms > 600000 || o.prompt < 1 || o.prompt > 32768) {
		(void)fprintf(stderr, "probe_bench: a setting out of range\n");
		return 2;
	}
	(void)snprintf(prefill_name, sizeof(prefill_name), "(d) %u-token prefill", o.prompt);
	cond_name[C_PREFILL] = prefill_name;
	(void)signal(SIGPIPE, SIG_IGN);
	if (!mkdtemp(dir) || ro_test_redis_start(&rs, false))
		return 1;
	(void)atexit(cleanup);
	/* the agent tests' model: a few hundred tokens a second at batch 16 on one thread */
	(void)snprintf(model, sizeof(model), "%s/model", dir);
	ro_test_agent_model(&mo);
	if (ro_make_model(&mo, model, err, sizeof(err))) {
		(void)fprintf(stderr, "probe_bench: %s\n", err);
		return 1;
	}
	c = redisConnectWithTimeout("127.0.0.1", rs.port, (struct timeval){2, 0});
	if (!c || c->err)
		return 1;
	(void)redisSetTimeout(c, (struct timeval){5, 0});

	run_daemon(&o, o.daemon, "new", model, c, nw, &reply_len);
	if (o.baseline)
		run_daemon(&o, o.baseline, "baseline", model, c, bl, NULL);
	if (floor_start(reply_len))
		return 1;
	measure(&o, &fl, floor_path, o.phase_s * 1000, NULL, NULL, 0, &(bool){false});
	(void)probe(floor_path, 1000, buf, sizeof(buf));

	qsort(fl.us, (size_t)fl.n, sizeof(long), cmp_long);
	for (int i = 0; i < C_N; i++) {
		if (nw[i].us)
			qsort(nw[i].us, (size_t)nw[i].n, sizeof(long), cmp_long);
		if (bl[i].us)
			qsort(bl[i].us, (size_t)bl[i].n, sizeof(long), cmp_long);
	}
	(void)printf("probe_bench: connect + \"status\\n\" + the JSON line (%zu bytes) over the "
		     "control socket; %d probes, one every %d ms, timeout %d ms, at most %d s a "
		     "condition ((a),(b): %d ms windows; (c): probes through a %d ms pause); "
		     "rolloutd --threads 1 --max-inflight 16; the agent tests' model\n",
		     reply_len, o.probes, o.interval_ms, o.timeout_ms, o.phase_s, o.window_ms,
		     o.redis_pause_ms);
	(void)printf("new: %s   baseline: %s\n\n", o.daemon, o.baseline ? o.baseline : "(none)");
	(void)printf("%-24s %-9s %9s %4s %3s %9s %9s %9s %9s %9s %7s\n", "condition", "daemon",
		     "ok/sent", "tmo", "err", "p50 ms", "p99 ms", "max ms", "p99/floor", "p99/base",
		     "samples");
	print_row("-", &fl, &fl, NULL);
	for (int i = 0; i < C_N; i++) {
		print_row("new", &nw[i], &fl, o.baseline ? &bl[i] : NULL);
		if (o.baseline)
			print_row("baseline", &bl[i], &fl, NULL);
	}
	(void)printf(
	    "\n\">\": some probes timed out and count as %d ms, so the figure is a lower "
	    "bound; p99/base: new p99 over the baseline's (\"<\": the baseline's is a lower "
	    "bound). samples: entries the samples stream got in the condition's window "
	    "((d): the short units' beside the long prefill).\n",
	    o.timeout_ms);
	for (int i = 0; i < C_N; i++) {
		(void)printf("new      %s: max loop_age_ms %.0f%s%s\n", cond_name[i],
			     nw[i].loop_age_max, nw[i].note[0] ? "; " : "", nw[i].note);
		if (o.baseline)
			(void)printf("baseline %s: max loop_age_ms %.0f%s%s\n", cond_name[i],
				     bl[i].loop_age_max, bl[i].note[0] ? "; " : "", bl[i].note);
	}
	(void)printf("\ngoal: p99 < 100 ms in (b), (c), (d) with the new daemon:");
	for (int i = C_FLOOD; i < C_N; i++)
		(void)printf(" %c %s", "bcd"[i - 1],
			     nw[i].measured && nw[i].n == nw[i].sent && !nw[i].timeouts &&
				     pct(&nw[i], 0.99) < 100
				 ? "met"
				 : "NOT met");
	(void)printf("\nflood vs idle samples (same %d ms window): new %ld vs %ld", o.window_ms,
		     nw[C_FLOOD].samples, nw[C_IDLE].samples);
	if (o.baseline)
		(void)printf(", baseline %ld vs %ld", bl[C_FLOOD].samples, bl[C_IDLE].samples);
	(void)printf("\n");
	redisFree(c);
	ro_test_redis_stop(&rs);
	if (o.keep) {
		(void)printf("logs kept in %s\n", dir);
	} else {
		char cmd[128];

		(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
		(void)system(cmd);
	}
	return 0;
}
