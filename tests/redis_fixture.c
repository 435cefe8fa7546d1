/* A private redis-server for tests, as hiredis's own test.sh does it: a mkdtemp
 * directory, a free port on 127.0.0.1, no persistence unless a test asks for AOF, and a
 * death signal tied to the parent so a crashed runner leaves no server behind. */
#include "tests/redis_fixture.h"

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

static void msleep(long ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};

	(void)nanosleep(&ts, NULL);
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
		char log[128];
		const char *server = getenv("RO_REDIS_SERVER");

		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(1);
		(void)snprintf(log, sizeof(log), "%s/redis.log", r->dir);
		if (!server || !*server)
			server = RO_REDIS_SERVER[0] ? RO_REDIS_SERVER : "redis-server";
		execlp(server, server, "--port", port, "--bind", "127.0.0.1", "--dir", r->dir,
		       "--unixsocket", r->sock, "--unixsocketperm", "700", "--save", "",
		       "--appendonly", r->aof ? "yes" : "no", "--appendfsync", "always",
		       "--daemonize", "no", "--logfile", log, "--protected-mode", "yes",
		       "--databases", "4", (char *)NULL);
		_exit(127);
	}
	r->pid = pid;
	/* ready when it answers PING; a taken port shows as an early exit */
	for (int i = 0; i < 500; i++) {
		redisContext *c;
		int st;

		if (waitpid(pid, &st, WNOHANG) == pid) {
			r->pid = 0;
			return -EADDRINUSE;
		}
		c = redisConnect("127.0.0.1", r->port);
		if (c && !c->err) {
			redisReply *rep = redisCommand(c, "PING");
			bool ok = rep && rep->type == REDIS_REPLY_STATUS && !strcmp(rep->str, "PONG");

			if (rep)
				freeReplyObject(rep);
			redisFree(c);
			if (ok)
				return 0;
		} else if (c) {
			redisFree(c);
		}
		msleep(10);
	}
	return -ETIMEDOUT;
}

int ro_test_redis_start(struct ro_test_redis *r, bool aof)
{
	int ret = -EADDRINUSE;

	memset(r, 0, sizeof(*r));
	r->aof = aof;
	(void)snprintf(r->dir, sizeof(r->dir), "/tmp/ro-redis-XXXXXX");
	if (!mkdtemp(r->dir)) {
		(void)fprintf(stderr, "fixture: mkdtemp: %s\n", strerror(errno));
		return -errno;
	}
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

static void reap_child(struct ro_test_redis *r, int sig)
{
	if (r->pid <= 0)
		return;
	(void)kill(r->pid, sig);
	for (int i = 0; i < 500; i++) {
		if (waitpid(r->pid, NULL, WNOHANG) == r->pid) {
			r->pid = 0;
			return;
		}
		msleep(10);
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
	if (r->dir[0])
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
