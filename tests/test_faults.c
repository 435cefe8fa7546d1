/* Faults between worker and Redis: a reply lost because the connection died right after
 * the command ran (CLIENT KILL), and a redis-server killed and restarted mid-run with AOF
 * on. The idempotent functions and the reconnecting client must lose nothing and
 * duplicate nothing. Each test runs its own server, since these tests kill connections. */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <time.h>
#include <unistd.h>

#include "tests/redis_fixture.h"
#include "tests/testutil.h"

static struct ro_test_redis S;
static redisContext *R;

static void setup(void)
{
	cr_assert_eq(ro_test_redis_start(&S, true), 0);
	R = ro_test_redis_connect(S.url);
	cr_assert(R && !R->err);
}

static void teardown(void)
{
	if (R)
		redisFree(R);
	ro_test_redis_stop(&S);
}

TestSuite(faults, .init = setup, .fini = teardown, .timeout = 120);

/* After the watched function was sent: wait until its effect is visible (so it did run),
 * then kill the sender's connection with CLIENT KILL. The server may have written the
 * reply before the kill landed, so the client's socket is also swapped for a dead one:
 * the reply is lost for certain, as when a connection dies in flight. */
struct killer {
	const char *fn;	  /* FCALL function to intercept */
	const char *when; /* command whose integer reply turns >= 1 once it ran */
	const char *client;
	int fired;
};

static void kill_after_send(void *arg, const char *fn, int fd)
{
	struct killer *k = arg;
	redisContext *c;
	redisReply *rep;
	char *line, *save = NULL;

	if (k->fired || strcmp(fn, k->fn))
		return;
	k->fired = 1;
	c = ro_test_redis_connect(S.url);
	for (int i = 0; i < 200 && ro_test_int(c, k->when) < 1; i++)
		ro_test_msleep(5);
	rep = redisCommand(c, "CLIENT LIST");
	for (line = strtok_r(rep->str, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char name[160];

		(void)snprintf(name, sizeof(name), "name=rolloutd:%s ", k->client);
		if (strstr(line, name)) {
			long long id = strtoll(line + 3, NULL, 10);

			freeReplyObject(redisCommand(c, "CLIENT KILL ID %lld", id));
			k->fired = 2;
		}
	}
	freeReplyObject(rep);
	redisFree(c);
	{
		int dead = socket(AF_INET, SOCK_STREAM, 0);

		(void)dup2(dead, fd);
		(void)close(dead);
	}
}

static struct ro_queue *queue_with_killer(struct killer *k)
{
	struct ro_queue_opts o = {.url = S.url,
				  .queue = "lr",
				  .worker = k->client,
				  .after_send = kill_after_send,
				  .after_send_arg = k};
	struct ro_queue *q;

	cr_assert_eq(ro_queue_new(&o, &q), 0);
	return q;
}

Test(faults, lost_publish_reply_creates_no_duplicate)
{
	struct killer k = {
	    .fn = "ro_publish", .when = "HEXISTS ro:{lr}:unit:lr-0 s:0", .client = "w-lost"};
	struct ro_queue *q = queue_with_killer(&k);
	struct ro_claim *c;
	size_t n;
	int32_t tok[1] = {4};
	float lp[1] = {-0.25f};
	struct ro_sample s = {.idx = 0, .tokens = tok, .logprobs = lp, .len = 1, .finish = "stop"};
	char ids[1][24];
	redisReply *rep;

	ro_test_enqueue(q, "lr", 0, 1, 2, false);
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	cr_assert_eq(ro_queue_connects(q), 1);
	cr_assert_eq(ro_queue_publish(q, c, &s, 1, false, ids, NULL), 0, "%s", ro_queue_errmsg(q));
	cr_assert_eq(k.fired, 2, "the connection was not killed");
	cr_assert_eq(ro_queue_connects(q), 2, "the client did not reconnect (%llu connects)",
		     (unsigned long long)ro_queue_connects(q));
	cr_assert_eq(ro_test_int(R, "XLEN ro:{lr}:samples"), 1);
	rep = redisCommand(R, "HGET ro:{lr}:unit:lr-0 s:0");
	cr_assert_str_eq(rep->str, ids[0], "the retry returned another entry id");
	freeReplyObject(rep);
	ro_claims_free(c, n);
	ro_queue_free(q);
}

Test(faults, lost_claim_reply_returns_the_same_units)
{
	struct killer k = {.fn = "ro_claim", .when = "ZCARD ro:{lr}:leases", .client = "w-claim"};
	struct ro_queue *q = queue_with_killer(&k);
	struct ro_claim *c;
	size_t n;

	ro_test_enqueue(q, "lr", 0, 3, 1, false);
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1, "%s", ro_queue_errmsg(q));
	cr_assert_eq(k.fired, 2);
	cr_assert_str_eq(c[0].id, "lr-0");
	/* counter 1, then the claim's request id */
	cr_assert(!strncmp(c[0].token, "1-", 2) && strlen(c[0].token) == 18, "%s", c[0].token);
	cr_assert_eq(ro_test_int(R, "ZCARD ro:{lr}:leases"), 1, "the retry claimed a second unit");
	cr_assert_eq(ro_test_int(R, "LLEN ro:{lr}:pending"), 2);
	ro_claims_free(c, n);
	ro_queue_free(q);
}

/* A claim written while the server stood still (SIGSTOP) and given up before it answered:
 * the server runs it once it goes on, leasing units to a worker that never heard of them.
 * The next claim must take those (and make their leases new), not more: otherwise each
 * such lease expires unused and charges its unit an attempt. */
Test(faults, unanswered_claim_is_taken_by_the_next_one)
{
	/* 2 s: what a claim into the stopped server waits; the server answers the later ones
	 * within it (on a busy sanitizer box too) */
	struct ro_queue_opts o = {.url = S.url, .queue = "lr", .worker = "w-late", .retry_ms = 2000};
	struct ro_queue *q;
	struct ro_claim *c = NULL;
	size_t n = 0;
	redisReply *rep;
	long long exp0, exp1;

	cr_assert_eq(ro_queue_new(&o, &q), 0);
	ro_test_enqueue(q, "lr", 0, 3, 1, false);
	cr_assert_eq(kill(S.pid, SIGSTOP), 0);
	cr_assert_lt(ro_queue_claim(q, 1, 10000, &c, &n), 0, "a stopped server answered");
	cr_assert_eq(n, 0);
	cr_assert_eq(kill(S.pid, SIGCONT), 0);
	/* the claim is in the server's socket: it runs now, for nobody */
	for (int i = 0; i < 2000 && ro_test_int(R, "ZCARD ro:{lr}:leases") < 1; i++)
		ro_test_msleep(5);
	cr_assert_eq(ro_test_int(R, "ZCARD ro:{lr}:leases"), 1, "the late claim never ran");
	exp0 = ro_test_int(R, "ZSCORE ro:{lr}:leases lr-0");
	ro_test_msleep(20);

	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1, "%s", ro_queue_errmsg(q));
	cr_assert_str_eq(c[0].id, "lr-0", "the next claim took another unit");
	rep = redisCommand(R, "HGET ro:{lr}:unit:lr-0 token");
	cr_assert_str_eq(c[0].token, rep->str);
	freeReplyObject(rep);
	cr_assert_eq(ro_test_int(R, "ZCARD ro:{lr}:leases"), 1, "a second unit was leased");
	cr_assert_eq(ro_test_int(R, "LLEN ro:{lr}:pending"), 2);
	exp1 = ro_test_int(R, "ZSCORE ro:{lr}:leases lr-0");
	cr_assert_gt(exp1, exp0, "the lease runs from the first claim, not from this one");
	cr_assert_eq(ro_test_int(R, "HGET ro:{lr}:unit:lr-0 exp"), exp1);
	ro_claims_free(c, n);

	/* answered: the one after takes a new unit */
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1, "%s", ro_queue_errmsg(q));
	cr_assert_str_eq(c[0].id, "lr-1");
	cr_assert_eq(ro_test_int(R, "ZCARD ro:{lr}:leases"), 2);
	ro_claims_free(c, n);
	ro_queue_free(q);
}

/* The same, with an outage longer than the worker's heartbeat TTL: the server forgets the
 * worker (its heartbeat hash expires) before the retry comes, but not its claim, which it
 * keeps for as long as the leases that claim handed out. The retry used to find nothing,
 * take another unit, and leave the first to wait out its lease (one agent test in ten
 * failed on this when its reconnect took longer than the 0.8 s TTL). */
Test(faults, unanswered_claim_outlives_the_heartbeat)
{
	struct ro_queue_opts o = {.url = S.url,
				  .queue = "lt",
				  .worker = "w-gone",
				  .retry_ms = 2000,
				  .worker_ttl_ms = 200};
	struct ro_queue *q;
	struct ro_claim *c = NULL;
	size_t n = 0;

	cr_assert_eq(ro_queue_new(&o, &q), 0);
	ro_test_enqueue(q, "lt", 0, 3, 1, false);
	cr_assert_eq(kill(S.pid, SIGSTOP), 0);
	cr_assert_lt(ro_queue_claim(q, 1, 10000, &c, &n), 0, "a stopped server answered");
	cr_assert_eq(kill(S.pid, SIGCONT), 0);
	for (int i = 0; i < 2000 && ro_test_int(R, "ZCARD ro:{lt}:leases") < 1; i++)
		ro_test_msleep(5);
	cr_assert_eq(ro_test_int(R, "ZCARD ro:{lt}:leases"), 1, "the late claim never ran");
	/* the heartbeat hash is gone (its TTL passed), the lease is not */
	for (int i = 0; i < 2000 && ro_test_int(R, "EXISTS ro:{lt}:worker:w-gone"); i++)
		ro_test_msleep(5);
	cr_assert_eq(ro_test_int(R, "EXISTS ro:{lt}:worker:w-gone"), 0);

	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1, "%s", ro_queue_errmsg(q));
	cr_assert_str_eq(c[0].id, "lt-0", "the retry took another unit");
	cr_assert_eq(ro_test_int(R, "ZCARD ro:{lt}:leases"), 1, "a second unit was leased");
	cr_assert_eq(ro_test_int(R, "LLEN ro:{lt}:pending"), 2);
	ro_claims_free(c, n);
	ro_queue_free(q);
}

Test(faults, lost_complete_reply_completes_once)
{
	struct killer k = {.fn = "ro_complete", .when = "XLEN ro:{lr}:groups", .client = "w-done"};
	struct ro_queue *q = queue_with_killer(&k);
	struct ro_claim *c;
	size_t n;
	int32_t tok[1] = {4};
	float lp[1] = {-0.25f};
	struct ro_sample s = {.idx = 0, .tokens = tok, .logprobs = lp, .len = 1, .finish = "stop"};
	char ids[1][24], gid[24];

	ro_test_enqueue(q, "lr", 0, 1, 1, false);
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	cr_assert_eq(ro_queue_publish(q, c, &s, 1, false, ids, NULL), 0);
	cr_assert_eq(ro_queue_complete(q, c, gid), 0, "%s", ro_queue_errmsg(q));
	cr_assert_eq(k.fired, 2);
	cr_assert_eq(ro_test_int(R, "XLEN ro:{lr}:groups"), 1);
	cr_assert_eq(ro_test_int(R, "HGET ro:{lr}:stats done"), 1);
	ro_claims_free(c, n);
	ro_queue_free(q);
}

Test(faults, redis_restart_mid_run_loses_nothing)
{
	const long units = 300;
	struct ro_queue *q = ro_test_queue(S.url, "rs", "producer", 3);
	pid_t pid[3];
	int restarted = 0;

	ro_test_enqueue(q, "rs", 0, (int)units, 2, false);
	ro_queue_free(q);
	for (int i = 0; i < 3; i++) {
		pid[i] = fork();
		if (pid[i] == 0) {
			char w[16];

			(void)snprintf(w, sizeof(w), "w%d", i);
			(void)ro_test_worker_run(S.url, "rs", w, units, 90, 10000, false);
			_exit(0);
		}
	}
	/* once the run is well under way, kill the server and bring it back from its AOF */
	for (int i = 0; i < 2000 && !restarted; i++) {
		redisContext *c = ro_test_redis_connect(S.url);
		redisReply *rep = c && !c->err ? redisCommand(c, "HGET ro:{rs}:stats done") : NULL;
		long long done = rep && rep->type == REDIS_REPLY_STRING ? atoll(rep->str) : 0;

		if (rep)
			freeReplyObject(rep);
		if (c)
			redisFree(c);
		if (done >= units / 4) {
			cr_assert_lt(done, units, "the run ended before the restart");
			ro_test_redis_kill(&S);
			ro_test_msleep(700);
			cr_assert_eq(ro_test_redis_restart(&S), 0);
			restarted = 1;
		} else {
			ro_test_msleep(5);
		}
	}
	cr_assert(restarted);
	for (int i = 0; i < 3; i++) {
		int st;

		cr_assert_eq(waitpid(pid[i], &st, 0), pid[i]);
		cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d failed", i);
	}
	redisFree(R);
	R = ro_test_redis_connect(S.url);
	cr_assert_eq(ro_test_int(R, "HGET ro:{rs}:stats done"), units);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{rs}:pending"), 0);
	cr_assert_eq(ro_test_int(R, "ZCARD ro:{rs}:leases"), 0);
	(void)ro_test_verify_exactly_once(R, "rs", units, 2);
}
