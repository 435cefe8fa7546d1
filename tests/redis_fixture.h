/* Test fixture: a private redis-server on a free loopback port in a temporary directory,
 * started per test binary (or per test, for tests that kill and restart it) and always
 * stopped: by the POST_ALL hook, and by PR_SET_PDEATHSIG if the runner itself dies. */
#pragma once

#include <hiredis/hiredis.h>
#include <stdbool.h>
#include <sys/types.h>

#include "queue/queue.h"

struct ro_test_redis {
	pid_t pid;
	int port;
	bool aof;
	bool everysec;	  /* appendfsync everysec (else always) */
	bool growing_aof; /* no AOF rewrites, a truncated AOF loaded: a test may cut it back */
	bool keep_dir;	  /* the caller's directory: left in place by stop */
	char dir[200];
	char url[96];
	char sock[256];
	char log[240];
};

struct ro_test_redis_opts {
	bool aof, everysec, growing_aof;
	const char *dir; /* created if missing and kept; NULL: a new temporary one, removed */
};

int ro_test_redis_start(struct ro_test_redis *r, bool aof);
int ro_test_redis_start_opts(struct ro_test_redis *r, const struct ro_test_redis_opts *o);
/* SIGKILL (a stopped server is continued first), keeping the data directory. */
void ro_test_redis_kill(struct ro_test_redis *r);
/* Start again (killing it first if it runs) on the same port and directory (AOF
 * replayed); waits, bounded, until it answers PING. */
int ro_test_redis_restart(struct ro_test_redis *r);
/* SIGTERM (then SIGKILL), and the directory removed unless it is the caller's. */
void ro_test_redis_stop(struct ro_test_redis *r);

redisContext *ro_test_redis_connect(const char *url);
/* The binary's shared server (RO_TEST_REDIS_URL set by the hooks). */
const char *ro_test_redis_url(void);

/* A queue client for tests; queue names are made unique per process. */
struct ro_queue *ro_test_queue(const char *url, const char *queue, const char *worker,
			       uint32_t max_attempts);
/* "name-<pid>-<counter>" */
const char *ro_test_name(const char *base, char *buf, size_t len);

/* Run a command on a context, abort the test on error; returns the integer or length. */
long long ro_test_int(redisContext *c, const char *fmt, ...);

/* Include tests/redis_hooks.h (once, in a test file) to start the binary's redis-server
 * before the tests and stop it after them. */

/* A test worker: claims, publishes every missing sample one by one (tokens {idx, attempt}),
 * completes; retries what Redis could not confirm. Stops when done + dead reaches total or
 * after seconds. With die_on_poison, a unit whose meta has "poison" kills the process (a
 * worker that dies on that unit every time). Returns the units it completed. */
long ro_test_worker_run(const char *url, const char *queue, const char *worker, long total,
			int seconds, uint32_t lease_ms, bool die_on_poison);

/* Enqueue units "<prefix>-<i>" with n samples each (plus, with poison, their meta marks
 * them so die_on_poison workers die on them). */
void ro_test_enqueue(struct ro_queue *q, const char *prefix, int first, int count, unsigned n,
		     bool poison);

/* Every (unit, idx) of the samples stream exactly once, units*n entries in all, and one
 * groups entry per completed unit; aborts the test with a message otherwise. Returns the
 * number of samples that say they were resumed from a prefix. */
long ro_test_verify_exactly_once(redisContext *c, const char *queue, long units, unsigned n);
