/* A private redis-server for tests, as hiredis's own test.sh does it: a mkdtemp
 * directory, a free port on 127.0.0.1, no persistence unless a test asks for AOF, and a
 * death signal tied to the parent so a crashed runner leaves no server behind. */
#include "tests/redis_fixture.h"
#include "tests/testutil.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ftw.h>
#include <netinet/in.h>
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

#include "config.h"

static int free_port(void)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t len = sizeof(a);
	int fd = socket(AF_INET, SOCK_STREAM, 0), port = -1;

	if (fd < 0)
		return -1;
	if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
	    getsockname(fd, (struct sockaddr *)&a, &len) == 0)
		port = ntohs(a.sin_port);
	(void)close(fd);
	return port;
}

static int spawn(struct ro_test_redis *r)
{
	char port[16];
	pid_t parent = getpid();
	pid_t pid;

	(void)snprintf(port, sizeof(port), "%d", r->port);
	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0) {
		const char *server = getenv("RO_REDIS_SERVER");

		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(1);
		if (!server || !*server)
			server = RO_REDIS_SERVER[0] ? RO_REDIS_SERVER : "redis-server";
		/* growing_aof: no RDB snapshots and no AOF rewrites, so the append-only file
		 * only grows and a simulated power loss can cut it back to an earlier length */
		execlp(server, server, "--port", port, "--bind", "127.0.0.1", "--dir", r->dir,
		       "--unixsocket", r->sock, "--unixsocketperm", "700", "--save", "",
		       "--appendonly", r->aof ? "yes" : "no", "--appendfsync",
		       r->everysec ? "everysec" : "always", "--auto-aof-rewrite-percentage",
		       r->growing_aof ? "0" : "100", "--aof-load-truncated", "yes", "--daemonize",
		       "no", "--logfile", r->log, "--protected-mode", "yes", "--databases", "4",
		       (char *)NULL);
		_exit(127);
	}
	r->pid = pid;
	/* ready when it answers PING (not LOADING: an AOF replay may take a while); a taken
	 * port shows as an early exit */
	for (int i = 0; i < 1500; i++) {
		redisContext *c;
		int st;

		if (waitpid(pid, &st, WNOHANG) == pid) {
			r->pid = 0;
			return -EADDRINUSE;
		}
		c = redisConnectWithTimeout("127.0.0.1", r->port, (struct timeval){0, 200000});
		if (c && !c->err) {
			redisReply *rep;

			(void)redisSetTimeout(c, (struct timeval){0, 500000});
			rep = redisCommand(c, "PING");
			bool ok =
			    rep && rep->type == REDIS_REPLY_STATUS && !strcmp(rep->str, "PONG");

			if (rep)
				freeReplyObject(rep);
			redisFree(c);
			if (ok)
				return 0;
		} else if (c) {
			redisFree(c);
		}
		ro_test_msleep(10);
	}
	return -ETIMEDOUT;
}

int ro_test_redis_start_opts(struct ro_test_redis *r, const struct ro_test_redis_opts *o)
{
	int ret = -EADDRINUSE;

	memset(r, 0, sizeof(*r));
	r->aof = o->aof;
	r->everysec = o->everysec;
	r->growing_aof = o->growing_aof;
	if (o->dir) {
		r->keep_dir = true;
		(void)snprintf(r->dir, sizeof(r->dir), "%s", o->dir);
		if (mkdir(r->dir, 0700) && errno != EEXIST)
			return -errno;
	} else {
		(void)snprintf(r->dir, sizeof(r->dir), "/tmp/ro-redis-XXXXXX");
		if (!mkdtemp(r->dir)) {
			(void)fprintf(stderr, "fixture: mkdtemp: %s\n", strerror(errno));
			return -errno;
		}
	}
	(void)snprintf(r->log, sizeof(r->log), "%s/redis.log", r->dir);
	if (strlen(r->dir) + sizeof("/redis.sock") > sizeof(((struct sockaddr_un *)0)->sun_path))
		return -ENAMETOOLONG; /* the unix socket's path would not fit */
	(void)snprintf(r->sock, sizeof(r->sock), "%s/redis.sock", r->dir);
	for (int tries = 0; tries < 8 && ret == -EADDRINUSE; tries++) {
		r->port = free_port();
		if (r->port < 0)
			return -EADDRNOTAVAIL;
		ret = spawn(r);
	}
	if (ret) {
		(void)fprintf(stderr, "fixture: redis-server did not start: %s\n", strerror(-ret));
		ro_test_redis_stop(r);
		return ret;
	}
	(void)snprintf(r->url, sizeof(r->url), "redis://127.0.0.1:%d/0", r->port);
	return 0;
}

int ro_test_redis_start(struct ro_test_redis *r, bool aof)
{
	return ro_test_redis_start_opts(r, &(struct ro_test_redis_opts){.aof = aof});
}

static void reap_child(struct ro_test_redis *r, int sig)
{
	if (r->pid <= 0)
		return;
	(void)kill(r->pid, SIGCONT); /* a SIGSTOPped server cannot act on SIGTERM */
	(void)kill(r->pid, sig);
	for (int i = 0; i < 500; i++) {
		if (waitpid(r->pid, NULL, WNOHANG) == r->pid) {
			r->pid = 0;
			return;
		}
		ro_test_msleep(10);
	}
	(void)kill(r->pid, SIGKILL);
	(void)waitpid(r->pid, NULL, 0);
	r->pid = 0;
}

void ro_test_redis_kill(struct ro_test_redis *r)
{
	reap_child(r, SIGKILL);
}

int ro_test_redis_restart(struct ro_test_redis *r)
{
	reap_child(r, SIGKILL);
	return spawn(r);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(path);
}

void ro_test_redis_stop(struct ro_test_redis *r)
{
	reap_child(r, SIGTERM);
	if (r->dir[0] && !r->keep_dir)
		(void)nftw(r->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
	r->dir[0] = '\0';
}

redisContext *ro_test_redis_connect(const char *url)
{
	int port = 6379;
	const char *p = strrchr(url, ':');

	if (p)
		port = atoi(p + 1);
	return redisConnect("127.0.0.1", port);
}

const char *ro_test_redis_url(void)
{
	const char *u = getenv("RO_TEST_REDIS_URL");

	if (!u) {
		(void)fprintf(stderr, "fixture: RO_TEST_REDIS_URL not set (no PRE_ALL hook?)\n");
		abort();
	}
	return u;
}

struct ro_queue *ro_test_queue(const char *url, const char *queue, const char *worker,
			       uint32_t max_attempts)
{
	struct ro_queue_opts o = {
	    .url = url,
	    .queue = queue,
	    .worker = worker,
	    .max_attempts = max_attempts,
	    .timeout_ms = 3000,
	    .retry_ms = 15000,
	};
	struct ro_queue *q = NULL;

	if (ro_queue_new(&o, &q))
		abort();
	return q;
}

const char *ro_test_name(const char *base, char *buf, size_t len)
{
	static unsigned counter;

	(void)snprintf(buf, len, "%s-%d-%u", base, (int)getpid(), counter++);
	return buf;
}

long long ro_test_int(redisContext *c, const char *fmt, ...)
{
	va_list ap;
	redisReply *rep;
	long long v = 0;

	va_start(ap, fmt);
	rep = redisvCommand(c, fmt, ap);
	va_end(ap);
	if (!rep || rep->type == REDIS_REPLY_ERROR) {
		(void)fprintf(stderr, "fixture: %s: %s\n", fmt, rep ? rep->str : c->errstr);
		abort();
	}
	if (rep->type == REDIS_REPLY_INTEGER)
		v = rep->integer;
	else if (rep->type == REDIS_REPLY_STRING)
		v = strtoll(rep->str, NULL, 10);
	else if (rep->type == REDIS_REPLY_ARRAY)
		v = (long long)rep->elements;
	freeReplyObject(rep);
	return v;
}

static bool transient(int r)
{
	return r == -EIO || r == -ETIMEDOUT || r == -EAGAIN;
}

void ro_test_enqueue(struct ro_queue *q, const char *prefix, int first, int count, unsigned n,
		     bool poison)
{
	struct ro_unit *u = calloc((size_t)count, sizeof(*u));
	struct ro_unit_bounds b;
	int *st = calloc((size_t)count, sizeof(*st));

	ro_unit_bounds_default(&b);
	for (int i = 0; i < count; i++) {
		char json[256];

		(void)snprintf(json, sizeof(json),
			       "{\"id\":\"%s-%d\",\"prompt\":[1,2,3],\"n\":%u,"
			       "\"max_new_tokens\":4%s}",
			       prefix, first + i, n, poison ? ",\"meta\":{\"poison\":true}" : "");
		if (ro_unit_parse(json, strlen(json), &b, &u[i], NULL, 0))
			abort();
	}
	if (ro_queue_enqueue(q, u, (size_t)count, st)) {
		(void)fprintf(stderr, "fixture: enqueue: %s\n", ro_queue_errmsg(q));
		abort();
	}
	for (int i = 0; i < count; i++)
		ro_unit_clear(&u[i]);
	free(u);
	free(st);
}

static bool finished(struct ro_queue *q, long total)
{
	struct ro_queue_stats s;
	bool done;

	if (ro_queue_stats(q, &s))
		return false;
	done = s.done + s.dead >= total;
	ro_queue_stats_clear(&s);
	return done;
}

static bool is_published(const struct ro_claim *c, uint32_t idx)
{
	for (uint32_t i = 0; i < c->n_published; i++) {
		if (c->published_idx[i] == idx)
			return true;
	}
	return false;
}

static const struct ro_progress *progress_of(const struct ro_claim *c, uint32_t idx)
{
	for (uint32_t i = 0; i < c->n_progress; i++) {
		if (c->progress[i].idx == idx)
			return &c->progress[i];
	}
	return NULL;
}

/* publish sample idx of c, retrying what could not be confirmed; -ESTALE: lease lost */
static int publish_one(struct ro_queue *q, const struct ro_claim *c, uint32_t idx, int64_t end)
{
	const struct ro_progress *p = progress_of(c, idx);
	int32_t tok[2] = {(int32_t)idx, (int32_t)c->attempt};
	float lp[2] = {-1.0f, -2.0f};
	struct ro_sample s = {.idx = idx,
			      .tokens = tok,
			      .logprobs = lp,
			      .len = 2,
			      .finish = "length",
			      .resumed_from = p ? p->len : 0};
	char ids[1][24];
	int r;

	do
		r = ro_queue_publish(q, c, &s, 1, false, ids, NULL);
	while (transient(r) && ro_test_mono_ms() < end);
	return r;
}

long ro_test_worker_run(const char *url, const char *queue, const char *worker, long total,
			int seconds, uint32_t lease_ms, bool die_on_poison)
{
	struct ro_queue *q = ro_test_queue(url, queue, worker, 3);
	int64_t end = ro_test_mono_ms() + seconds * 1000L;
	long completed = 0;

	while (ro_test_mono_ms() < end) {
		struct ro_claim *c = NULL;
		size_t n = 0;
		int r = ro_queue_claim(q, 4, lease_ms, &c, &n);

		if (transient(r))
			continue;
		if (r < 0) {
			(void)fprintf(stderr, "fixture: claim: %s\n", ro_queue_errmsg(q));
			abort();
		}
		if (n == 0) {
			bool woken;

			ro_claims_free(c, n);
			if (finished(q, total))
				break;
			(void)ro_queue_wait(q, 100, &woken);
			continue;
		}
		for (size_t i = 0; i < n; i++) {
			char gid[24];

			if (die_on_poison && strstr(c[i].body, "\"poison\""))
				(void)raise(SIGKILL);
			r = 0;
			for (uint32_t idx = 0; idx < c[i].n && !r; idx++) {
				if (!is_published(&c[i], idx))
					r = publish_one(q, &c[i], idx, end);
			}
			if (r)
				continue; /* lease lost (or time up): someone else finishes it */
			do
				r = ro_queue_complete(q, &c[i], gid);
			while (transient(r) && ro_test_mono_ms() < end);
			if (!r)
				completed++;
		}
		ro_claims_free(c, n);
	}
	ro_queue_free(q);
	return completed;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

static long scan_stream(redisContext *c, const char *queue, const char *which, char ***ret,
			long *ret_resumed)
{
	char from[64] = "-";
	char **keys = NULL;
	long n = 0, cap = 0, resumed = 0;

	for (;;) {
		redisReply *rep =
		    redisCommand(c, "XRANGE ro:{%s}:%s %s + COUNT 1000", queue, which, from);

		if (!rep || rep->type != REDIS_REPLY_ARRAY)
			abort();
		for (size_t i = 0; i < rep->elements; i++) {
			redisReply *f = rep->element[i]->element[1];
			const char *unit = "?", *idx = "";
			char *k;

			for (size_t j = 0; j + 1 < f->elements; j += 2) {
				if (!strcmp(f->element[j]->str, "unit"))
					unit = f->element[j + 1]->str;
				else if (!strcmp(f->element[j]->str, "idx"))
					idx = f->element[j + 1]->str;
				else if (!strcmp(f->element[j]->str, "resumed_from") &&
					 strcmp(f->element[j + 1]->str, "0"))
					resumed++;
			}
			if (n == cap) {
				cap = cap ? cap * 2 : 1024;
				keys = realloc(keys, (size_t)cap * sizeof(*keys));
			}
			if (asprintf(&k, "%s|%s", unit, idx) < 0)
				abort();
			keys[n++] = k;
			(void)snprintf(from, sizeof(from), "(%s", rep->element[i]->element[0]->str);
		}
		if (rep->elements < 1000) {
			freeReplyObject(rep);
			break;
		}
		freeReplyObject(rep);
	}
	qsort(keys, (size_t)n, sizeof(*keys), cmp_str);
	for (long i = 1; i < n; i++) {
		if (!strcmp(keys[i], keys[i - 1])) {
			(void)fprintf(stderr, "fixture: %s has %s twice\n", which, keys[i]);
			abort();
		}
	}
	*ret = keys;
	if (ret_resumed)
		*ret_resumed = resumed;
	return n;
}

long ro_test_verify_exactly_once(redisContext *c, const char *queue, long units, unsigned n)
{
	char **s = NULL, **g = NULL;
	long resumed = 0;
	long ns = scan_stream(c, queue, "samples", &s, &resumed);
	long ng = scan_stream(c, queue, "groups", &g, NULL);

	if (ns != units * (long)n || ng != units) {
		(void)fprintf(stderr, "fixture: %ld samples and %ld groups, want %ld and %ld\n", ns,
			      ng, units * (long)n, units);
		abort();
	}
	for (long i = 0; i < ns; i++)
		free(s[i]);
	for (long i = 0; i < ng; i++)
		free(g[i]);
	free(s);
	free(g);
	return resumed;
}
