/* Whatever is in Redis: anyone with write access to a queue's keys can put anything there.
 * A 300 MB unit body and a 40 MB checkpoint never reach the agent (its peak RSS stays
 * within twice its idle RSS plus max-body): the unit is dead-lettered with the reason, the
 * checkpoint discarded (its sample starts over), and nothing is lost. Keys of another type
 * than the schema's (worker heartbeats, the queue's lists, stats, policy, a dead unit's
 * record) are reported by rolloutctl, which still shows the rest, and cost the agent
 * nothing. A symlink planted at the metrics file's temporary name is never followed. */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/model.h"
#include "tests/agent_fixture.h"
#include "tests/agent_model.h"
#include "tests/redis_hooks.h"
#include "tests/testutil.h"

static char dir[64];
static char model[128];

static void setup(void)
{
	struct ro_make_model_opts o;
	char err[256];

	(void)snprintf(dir, sizeof(dir), "/tmp/ro-hostile-XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
	(void)snprintf(model, sizeof(model), "%s/model", dir);
	ro_test_agent_model(&o);
	cr_assert_eq(ro_make_model(&o, model, err, sizeof(err)), 0, "%s", err);
}

static void teardown(void)
{
	char cmd[128];

	(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	(void)system(cmd);
}

TestSuite(hostile, .init = setup, .fini = teardown, .timeout = 240);

static void start(struct ro_test_agent *ag, const char *name, const char *q,
		  const char *const *extra)
{
	ro_test_agent_start(ag, dir, model, ro_test_redis_url(), name, q, extra, NULL);
}

static void ok(redisContext *c, redisReply *r)
{
	cr_assert(r && r->type != REDIS_REPLY_ERROR, "redis: %s",
		  r ? r->str : c->errstr);
	freeReplyObject(r);
}

/* A unit record as ro_enqueue writes it, written directly (the way anyone with write access
 * could), not yet in pending. */
static void put_unit(redisContext *c, const char *q, const char *id, unsigned n, unsigned max_new)
{
	char body[256];

	(void)snprintf(body, sizeof(body),
		       "{\"id\":\"%s\",\"prompt\":[1,2,3],\"n\":%u,\"max_new_tokens\":%u,"
		       "\"sampling\":{\"temperature\":1.0,\"seed\":7}}",
		       id, n, max_new);
	ok(c, redisCommand(c,
			   "HSET ro:{%s}:unit:%s body %s n %u meta %s state pending attempt 1 "
			   "token 0 npub 0 enq_ms 0",
			   q, id, body, n, ""));
}

static void push_pending(redisContext *c, const char *q, const char *id)
{
	ok(c, redisCommand(c, "RPUSH ro:{%s}:pending %s", q, id));
	ok(c, redisCommand(c, "RPUSH ro:{%s}:marker 1", q));
}

/* APPEND to key count copies of pat, in chunks of about 1 MiB: the test never holds the
 * whole value. */
static void append_repeat(redisContext *c, const char *key, const char *pat, size_t count)
{
	size_t pl = strlen(pat), per = (1u << 20) / pl, done = 0;
	char *chunk = malloc(per * pl);

	cr_assert_not_null(chunk);
	for (size_t i = 0; i < per; i++)
		memcpy(chunk + i * pl, pat, pl);
	for (size_t round = 0; done < count && round < 100000; round++) {
		size_t k = count - done < per ? count - done : per;

		ok(c, redisCommand(c, "APPEND %s %b", key, chunk, k * pl));
		done += k;
	}
	free(chunk);
	cr_assert_eq(done, count);
}

static void append_str(redisContext *c, const char *key, const char *s)
{
	ok(c, redisCommand(c, "APPEND %s %s", key, s));
}

/* field of the hash hkey := the string at tmp (copied on the server), tmp deleted */
static void move_into(redisContext *c, const char *hkey, const char *field, const char *tmp)
{
	ok(c, redisCommand(c, "EVAL %s 2 %s %s %s",
			   "return redis.call('HSET', KEYS[1], ARGV[1], redis.call('GET', KEYS[2]))",
			   hkey, tmp, field));
	ok(c, redisCommand(c, "UNLINK %s", tmp));
}

static void move_into_field(redisContext *c, const char *q, const char *id, const char *field,
			    const char *tmp)
{
	char ukey[200];

	(void)snprintf(ukey, sizeof(ukey), "ro:{%s}:unit:%s", q, id);
	move_into(c, ukey, field, tmp);
}

/* kB of a field of /proc/<pid>/status (VmRSS, VmHWM), -1 if absent */
static long proc_kb(pid_t pid, const char *field)
{
	char path[64], line[256];
	size_t fl = strlen(field);
	long v = -1;
	FILE *f;

	(void)snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, field, fl) && line[fl] == ':')
			v = strtol(line + fl + 1, NULL, 10);
	(void)fclose(f);
	return v;
}

static char *hget(redisContext *c, const char *q, const char *id, const char *field)
{
	redisReply *r = redisCommand(c, "HGET ro:{%s}:unit:%s %s", q, id, field);
	char *s = strdup(r && r->type == REDIS_REPLY_STRING ? r->str : "");

	freeReplyObject(r);
	return s;
}

static bool in_list(redisContext *c, const char *q, const char *list, const char *id)
{
	redisReply *r = redisCommand(c, "LPOS ro:{%s}:%s %s", q, list, id);
	bool in = r && r->type == REDIS_REPLY_INTEGER;

	freeReplyObject(r);
	return in;
}

static bool is_done(redisContext *c, const char *q, const char *id)
{
	char *st = hget(c, q, id, "state");
	bool d = !strcmp(st, "done");

	free(st);
	return d;
}

/* Where a unit is: exactly one of pending, dead, done (results); else the test fails. */
static const char *where(redisContext *c, const char *q, const char *id)
{
	bool p = in_list(c, q, "pending", id), d = in_list(c, q, "dead", id),
	     r = is_done(c, q, id);

	cr_assert_eq(p + d + r, 1, "unit %s: pending %d, dead %d, done %d", id, p, d, r);
	return p ? "pending" : d ? "dead" : "done";
}

static bool wait_until_done(redisContext *c, const char *q, const char *const *ids, long ms)
{
	for (long t = 0; t < ms; t += 50) {
		size_t i = 0;

		while (ids[i] && is_done(c, q, ids[i]))
			i++;
		if (!ids[i])
			return true;
		ro_test_msleep(50);
	}
	return false;
}

/* (a) The peak RSS bound. The agent is measured idle (ready, one unit run, nothing held);
 * then a 300 MB body and a 40 MB checkpoint are put in its queue, followed by normal units.
 * Before: the body took the agent to 911 MiB (hiredis read it whole, then max-body refused
 * it), the checkpoint to 1,531 MiB (json-c parsed it before any length check). Now neither
 * crosses the wire. */
Test(hostile, huge_body_and_checkpoint_never_reach_the_agent)
{
	/* a server of its own: moving 300 MB through Redis blocks it for seconds on a loaded
	 * box (one EVAL copying it took 14 s), and the other tests of this file, run beside
	 * this one, share the file's server (rolloutctl status gave up after its 2 s) */
	static struct ro_test_redis r;
	redisContext *c;
	const char *const warm[] = {"warm", NULL}, *const after[] = {"ckpt", "after-0", "after-1",
								   "after-2", NULL};
	const long max_body = 1 << 20; /* the default max-body */
	const size_t body_pad = 300u * 1000 * 1000, ckpt_tokens = 5u * 1000 * 1000;
	char q[64], tmp[128], *why;
	struct ro_test_agent a;
	long idle_kb, hwm_kb;
	bool sanitized = getenv("RO_SANITIZED") && *getenv("RO_SANITIZED") == '1';

	cr_assert_eq(ro_test_redis_start(&r, false), 0);
	c = ro_test_redis_connect(r.url);
	ro_test_name("huge", q, sizeof(q));
	ro_test_agent_start(&a, dir, model, r.url, "a", q,
			    (const char *const[]){"--imds", "false", NULL}, NULL);
	put_unit(c, q, "warm", 2, 8);
	push_pending(c, q, "warm");
	if (!wait_until_done(c, q, warm, 60000))
		ro_test_agent_dump_log(&a);
	cr_assert(is_done(c, q, "warm"));
	for (int i = 0; i < 200 && ro_test_agent_field(&a, "units") != 0; i++)
		ro_test_msleep(50);
	cr_assert_eq(ro_test_agent_field(&a, "units"), 0);
	idle_kb = proc_kb(a.pid, "VmRSS");
	cr_assert_gt(idle_kb, 0);

	/* a policy whose manifest (20 MB) is longer than any reply the agent reads: refused by
	 * the connection's own guard each time the agent looks, never buffered whole */
	(void)snprintf(tmp, sizeof(tmp), "ro:{%s}:tmp-manifest", q);
	append_repeat(c, tmp, "m", 20u * 1000 * 1000);
	{
		char pkey[128];

		(void)snprintf(pkey, sizeof(pkey), "ro:{%s}:policy", q);
		ok(c, redisCommand(c, "HSET %s version 2 uri file:///nonexistent/", pkey));
		move_into(c, pkey, "manifest", tmp);
	}

	/* a valid unit whose meta pads it to 300 MB */
	(void)snprintf(tmp, sizeof(tmp), "ro:{%s}:tmp-body", q);
	append_str(c, tmp, "{\"id\":\"huge\",\"prompt\":[1,2],\"n\":1,\"max_new_tokens\":4,"
			   "\"meta\":{\"pad\":\"");
	append_repeat(c, tmp, "x", body_pad);
	append_str(c, tmp, "\"}}");
	put_unit(c, q, "huge", 1, 4);
	move_into_field(c, q, "huge", "body", tmp);
	/* a normal unit with a 40 MB checkpoint of the stored format for its sample 0 */
	(void)snprintf(tmp, sizeof(tmp), "ro:{%s}:tmp-ckpt", q);
	append_str(c, tmp, "{\"tokens\":[");
	append_repeat(c, tmp, "5,", ckpt_tokens);
	append_str(c, tmp, "5],\"logprobs\":[");
	append_repeat(c, tmp, "-0.25,", ckpt_tokens);
	append_str(c, tmp, "-0.25],\"pos\":5000001,\"pv\":0}");
	put_unit(c, q, "ckpt", 1, 8);
	move_into_field(c, q, "ckpt", "p:0", tmp);
	ok(c, redisCommand(c, "HSET ro:{%s}:unit:ckpt ckpt 1", q));
	cr_assert_geq(ro_test_int(c, "HSTRLEN ro:{%s}:unit:huge body", q), (long long)body_pad);
	cr_assert_geq(ro_test_int(c, "HSTRLEN ro:{%s}:unit:ckpt p:0", q), 40000000);
	for (int i = 0; i < 3; i++) {
		char id[16];

		(void)snprintf(id, sizeof(id), "after-%d", i);
		put_unit(c, q, id, 2, 8);
	}
	push_pending(c, q, "huge");
	push_pending(c, q, "ckpt");
	for (int i = 0; i < 3; i++) {
		char id[16];

		(void)snprintf(id, sizeof(id), "after-%d", i);
		push_pending(c, q, id);
	}

	if (!wait_until_done(c, q, after, 120000) || !in_list(c, q, "dead", "huge"))
		ro_test_agent_dump_log(&a);
	hwm_kb = proc_kb(a.pid, "VmHWM");
	cr_log_info("agent RSS idle %.1f MiB, peak %.1f MiB (bound %.1f MiB)", idle_kb / 1024.0,
		    hwm_kb / 1024.0, (2.0 * idle_kb + max_body / 1024) / 1024.0);
	(void)fprintf(stderr, "hostile: agent RSS idle %.1f MiB, peak (VmHWM) %.1f MiB\n",
		      idle_kb / 1024.0, hwm_kb / 1024.0);
	if (!sanitized)
		cr_expect_lt(hwm_kb, 2 * idle_kb + max_body / 1024,
			     "peak RSS %ld kB, idle %ld kB, max-body %ld kB", hwm_kb, idle_kb,
			     max_body / 1024);

	/* nothing lost: each unit in exactly one place */
	cr_expect_str_eq(where(c, q, "huge"), "dead");
	cr_expect_str_eq(where(c, q, "ckpt"), "done");
	cr_expect_str_eq(where(c, q, "warm"), "done");
	for (int i = 0; i < 3; i++) {
		char id[16];

		(void)snprintf(id, sizeof(id), "after-%d", i);
		cr_expect_str_eq(where(c, q, id), "done");
	}
	/* and the reasons say what happened */
	why = hget(c, q, "huge", "reason");
	cr_expect(strstr(why, "body of 300") && strstr(why, "over max-body (1048576 bytes)"), "%s",
		  why);
	free(why);
	why = hget(c, q, "ckpt", "hist");
	cr_expect(strstr(why, "checkpoint of sample 0 (") && strstr(why, "starts over"), "%s",
		  why);
	free(why);
	if (!ro_test_agent_log_has(&a, "unit huge: body of .* dead-lettered by the queue"))
		ro_test_agent_dump_log(&a);
	cr_expect(ro_test_agent_log_has(&a, "unit huge: body of .* dead-lettered by the queue"));
	cr_expect(ro_test_agent_log_has(&a, "unit ckpt: 1 checkpoint discarded"));
	cr_expect_eq(ro_test_agent_field(&a, "claimed"), 5,
		     "warm, ckpt and after-*: the huge unit was never claimed here");

	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	ok(c, redisCommand(c, "UNLINK ro:{%s}:unit:huge ro:{%s}:unit:ckpt ro:{%s}:policy", q, q,
			   q));
	redisFree(c);
	ro_test_redis_stop(&r);
}

static redisReply *fcall_claim(redisContext *c, const char *q, const char *reqid, const char *body,
			       const char *ckpt)
{
	char pfx[96];
	redisReply *r;

	(void)snprintf(pfx, sizeof(pfx), "ro:{%s}:", q);
	if (body)
		r = redisCommand(c, "FCALL ro_claim 1 %s w 4 10000 %s 3 30000 %s %s 64", pfx, reqid,
				 body, ckpt);
	else
		r = redisCommand(c, "FCALL ro_claim 1 %s w 4 10000 %s 3 30000", pfx, reqid);
	cr_assert(r && r->type == REDIS_REPLY_ARRAY, "claim: %s",
		  r && r->str ? r->str : c->errstr);
	return r;
}

/* The function library itself: a claim under bounds answers {id, reason} for a unit it
 * dead-lettered instead of sending it, and (idx, bytes) for each checkpoint it left out;
 * a retried claim (same request id, its reply lost) says both again; a caller without
 * bounds (an older agent) gets everything as before. */
Test(hostile, claim_bounds_in_the_library)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	struct ro_queue *qq;
	char q[64], pad[2048];
	redisReply *r;

	ro_test_name("lib", q, sizeof(q));
	qq = ro_test_queue(ro_test_redis_url(), q, "enq", 3);
	cr_assert_eq(ro_queue_policy_version(qq, &(int64_t){0}), 0); /* the library is loaded */
	memset(pad, 'x', sizeof(pad) - 1);
	pad[sizeof(pad) - 1] = '\0';
	put_unit(c, q, "big", 1, 4);
	ok(c, redisCommand(c, "HSET ro:{%s}:unit:big body %s", q, pad));
	put_unit(c, q, "ck", 1, 4);
	ok(c, redisCommand(c, "HSET ro:{%s}:unit:ck p:0 %s ckpt 1", q, pad));
	put_unit(c, q, "fine", 1, 4);
	ok(c, redisCommand(c, "RPUSH ro:{%s}:pending big ck fine", q));

	for (int round = 0; round < 2; round++) { /* the second: the same request again */
		const redisReply *big = NULL, *ck = NULL, *fine = NULL;

		r = fcall_claim(c, q, "req-1", "1024", "1024");
		cr_assert_eq(r->elements, 3, "round %d", round);
		for (size_t i = 0; i < r->elements; i++) {
			const redisReply *e = r->element[i];
			const char *id = e->element[0]->str;

			if (!strcmp(id, "big"))
				big = e;
			else if (!strcmp(id, "ck"))
				ck = e;
			else if (!strcmp(id, "fine"))
				fine = e;
		}
		cr_assert(big && ck && fine, "round %d", round);
		cr_expect_eq(big->elements, 2, "big: {id, reason}");
		cr_expect(strstr(big->element[1]->str,
				 "body of 2047 bytes is over max-body (1024 bytes)"),
			  "%s", big->element[1]->str);
		cr_assert_eq(ck->elements, 9);
		cr_expect_eq(ck->element[6]->elements, 0, "the checkpoint is not sent");
		cr_assert_eq(ck->element[8]->elements, 2);
		cr_expect_str_eq(ck->element[8]->element[0]->str, "0");
		cr_expect_eq(ck->element[8]->element[1]->integer, 2047);
		cr_expect_eq(fine->elements, 9);
		freeReplyObject(r);
	}
	cr_expect_str_eq(where(c, q, "big"), "dead");
	cr_expect_eq(ro_test_int(c, "ZCARD ro:{%s}:leases", q), 2);

	/* an older caller: no bounds, nothing checked */
	ok(c, redisCommand(c, "HSET ro:{%s}:unit:old body %s", q, pad));
	ok(c, redisCommand(c, "HSET ro:{%s}:unit:old n 1 state pending attempt 1 token 0 "
			      "p:0 %s ckpt 1", q, pad));
	ok(c, redisCommand(c, "RPUSH ro:{%s}:pending old", q));
	r = fcall_claim(c, q, "req-2", NULL, NULL);
	cr_assert_eq(r->elements, 1);
	cr_expect_eq(r->element[0]->elements, 8, "the reply shape an older agent parses");
	cr_expect_eq(r->element[0]->element[1]->len, 2047, "the body as it is");
	cr_expect_eq(r->element[0]->element[6]->elements, 2, "the checkpoint as it is");
	freeReplyObject(r);
	ro_queue_free(qq);
	redisFree(c);
}

/* the worker directory: a heartbeat key of any type under worker:<id>, listed in workers */
static void put_worker(redisContext *c, const char *q, const char *id, const char *type)
{
	if (!strcmp(type, "hash"))
		ok(c, redisCommand(c, "HSET ro:{%s}:worker:%s state running units 0", q, id));
	else if (!strcmp(type, "list"))
		ok(c, redisCommand(c, "RPUSH ro:{%s}:worker:%s a b", q, id));
	else
		ok(c, redisCommand(c, "SET ro:{%s}:worker:%s x", q, id));
	ok(c, redisCommand(c, "ZADD ro:{%s}:workers %lld %s", q, (long long)ro_test_wall_ms(), id));
}

/* (b) A worker key of the wrong type: status still lists every other worker, says what it
 * skipped, and exits 0 (before: WRONGTYPE, exit 1, nothing shown). */
Test(hostile, status_skips_a_worker_key_of_another_type)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	static char out[16384];
	char q[64];
	int rc;

	ro_test_name("wtype", q, sizeof(q));
	put_worker(c, q, "good1", "hash");
	put_worker(c, q, "bad", "list");
	put_worker(c, q, "str", "string");
	put_worker(c, q, "good2", "hash");
	/* and one whose hash holds a value longer than any reply rolloutctl reads (20 MB):
	 * refused by the connection, which then goes on with the next worker */
	put_worker(c, q, "big", "hash");
	{
		char tmp[128], wkey[128];

		(void)snprintf(tmp, sizeof(tmp), "ro:{%s}:tmp-pad", q);
		(void)snprintf(wkey, sizeof(wkey), "ro:{%s}:worker:big", q);
		append_repeat(c, tmp, "p", 20u * 1000 * 1000);
		move_into(c, wkey, "pad", tmp);
	}
	ok(c, redisCommand(c, "ZADD ro:{%s}:workers %lld zlast", q,
			   (long long)ro_test_wall_ms() + 1000));
	ok(c, redisCommand(c, "HSET ro:{%s}:worker:zlast state running", q));
	rc = ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue", q, "status",
			 NULL);
	cr_assert_eq(rc, 0, "%s", out);
	cr_expect(strstr(out, "workers  3\n"), "%s", out);
	cr_expect(strstr(out, "zlast"), "the worker after the refused one: %s", out);
	cr_expect(strstr(out, "worker:big: a value too long to read, skipped"), "%s", out);
	cr_expect(strstr(out, "good1") && strstr(out, "good2"), "%s", out);
	cr_expect(strstr(out, "worker:bad: not a hash (list), skipped"), "%s", out);
	cr_expect(strstr(out, "worker:str: not a hash (string), skipped"), "%s", out);
	rc = ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue", q, "status",
			 "--json", NULL);
	cr_assert_eq(rc, 0, "%s", out);
	cr_expect(strstr(out, "\"id\":\"good1\"") && strstr(out, "\"id\":\"good2\""), "%s", out);
	cr_expect(strstr(out, "\"warnings\":[\"worker:bad: not a hash (list), skipped\""), "%s",
		  out);
	ok(c, redisCommand(c, "UNLINK ro:{%s}:worker:big", q));
	redisFree(c);
}

/* (d) Every other key status reads, each of another type: each said and skipped, the rest
 * still counted, exit 0. A dead unit whose record is not a hash is listed with that as its
 * reason; a policy key that is not a hash is named. */
Test(hostile, status_and_dead_list_skip_every_key_of_another_type)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	static char out[16384];
	char q[64];
	int rc;

	ro_test_name("ktype", q, sizeof(q));
	ok(c, redisCommand(c, "SET ro:{%s}:pending x", q));
	ok(c, redisCommand(c, "SET ro:{%s}:leases x", q));
	ok(c, redisCommand(c, "RPUSH ro:{%s}:stats done", q));
	ok(c, redisCommand(c, "SET ro:{%s}:groups x", q));
	ok(c, redisCommand(c, "SET ro:{%s}:samples x", q));
	ok(c, redisCommand(c, "SET ro:{%s}:workers x", q));
	ok(c, redisCommand(c, "RPUSH ro:{%s}:dead u-1 u-2", q));
	ok(c, redisCommand(c, "SET ro:{%s}:unit:u-1 x", q));
	ok(c, redisCommand(c, "HSET ro:{%s}:unit:u-2 state dead reason because attempt 3", q));
	rc = ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue", q, "status",
			 NULL);
	cr_assert_eq(rc, 0, "%s", out);
	cr_expect(strstr(out, "dead     2\n"), "%s", out);
	cr_expect(strstr(out, "pending: not a list (string), skipped"), "%s", out);
	cr_expect(strstr(out, "leases: not a zset (string), skipped"), "%s", out);
	cr_expect(strstr(out, "stats: not a hash (list), skipped"), "%s", out);
	cr_expect(strstr(out, "groups: not a stream (string), skipped"), "%s", out);
	cr_expect(strstr(out, "samples: not a stream (string), skipped"), "%s", out);
	cr_expect(strstr(out, "workers: not a zset (string), skipped"), "%s", out);

	rc = ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue", q, "dead",
			 "list", NULL);
	cr_assert_eq(rc, 0, "%s", out);
	cr_expect(strstr(out, "u-1") && strstr(out, "is a string, not a hash"), "%s", out);
	cr_expect(strstr(out, "u-2") && strstr(out, "because"), "%s", out);
	rc = ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue", q, "dead",
			 "retry", "u-1", NULL);
	cr_expect_eq(rc, 1, "%s", out);
	cr_expect_eq(ro_test_int(c, "LLEN ro:{%s}:dead", q), 2, "a refused retry moves nothing");

	ok(c, redisCommand(c, "SET ro:{%s}:policy x", q));
	rc = ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue", q, "policy",
			 "show", NULL);
	cr_expect_eq(rc, 1, "%s", out);
	cr_expect(strstr(out, ":policy: WRONGTYPE"), "%s", out);
	redisFree(c);
}

/* (d) The agent itself, with its own heartbeat key, the worker directory, stats, the
 * wake-up marker and the policy all of another type: it replaces its own heartbeat key,
 * and its units still complete (before: every claim and renewal failed on WRONGTYPE). */
Test(hostile, agent_runs_with_its_keys_of_another_type)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	const char *const ids[] = {"u-0", "u-1", NULL};
	struct ro_test_agent a;
	char q[64];
	redisReply *r;

	ro_test_name("atype", q, sizeof(q));
	ok(c, redisCommand(c, "RPUSH ro:{%s}:worker:a x", q));
	ok(c, redisCommand(c, "SET ro:{%s}:workers x", q));
	ok(c, redisCommand(c, "RPUSH ro:{%s}:stats x", q));
	ok(c, redisCommand(c, "SET ro:{%s}:marker x", q));
	ok(c, redisCommand(c, "SET ro:{%s}:policy x", q));
	put_unit(c, q, "u-0", 2, 8);
	put_unit(c, q, "u-1", 2, 8);
	ok(c, redisCommand(c, "RPUSH ro:{%s}:pending u-0 u-1", q));
	start(&a, "a", q, (const char *const[]){"--imds", "false", NULL});
	if (!wait_until_done(c, q, ids, 60000))
		ro_test_agent_dump_log(&a);
	cr_expect_str_eq(where(c, q, "u-0"), "done");
	cr_expect_str_eq(where(c, q, "u-1"), "done");
	r = redisCommand(c, "TYPE ro:{%s}:worker:a", q);
	cr_expect(r && r->str && !strcmp(r->str, "hash"), "its heartbeat is a hash again");
	freeReplyObject(r);
	/* the policy key it cannot read is said in its log (checked at start) */
	for (int i = 0; i < 200 && !ro_test_agent_log_has(&a, "cannot read the published policy");
	     i++)
		ro_test_msleep(50);
	cr_expect(ro_test_agent_log_has(&a, "cannot read the published policy"));
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	redisFree(c);
}

static ino_t inode_of(const char *path)
{
	struct stat st;

	return lstat(path, &st) ? 0 : st.st_ino;
}

/* (c) A symlink planted at the metrics file's temporary name (<path>.<pid>.tmp, the name
 * the agent used to open with fopen "w") to a file of someone else's: the victim is never
 * written, and the metrics file is still rewritten in place (each rewrite is a rename, so
 * a new inode). */
Test(hostile, metrics_temp_symlink_is_not_followed)
{
	struct ro_test_agent a;
	char victim[160], link[200], q[64], buf[64];
	struct stat st;
	ino_t first;
	FILE *f;
	int changes = 0;

	ro_test_name("metrics", q, sizeof(q));
	(void)snprintf(victim, sizeof(victim), "%s/victim", dir);
	f = fopen(victim, "w");
	cr_assert_not_null(f);
	(void)fputs("precious\n", f);
	(void)fclose(f);
	start(&a, "m", q, (const char *const[]){"--imds", "false", NULL});
	(void)snprintf(link, sizeof(link), "%s.%d.tmp", a.metrics, (int)a.pid);
	cr_assert_eq(symlink(victim, link), 0, "%s", strerror(errno));
	/* two rewrites after the symlink was planted (100 x 200 ms intervals at most) */
	first = inode_of(a.metrics);
	for (int i = 0; i < 400 && changes < 2; i++) {
		ino_t now = inode_of(a.metrics);

		if (now && now != first) {
			changes++;
			first = now;
		}
		ro_test_msleep(50);
	}
	cr_expect_eq(changes, 2, "the metrics file was rewritten");
	f = fopen(victim, "r");
	cr_assert_not_null(f);
	cr_expect(fgets(buf, sizeof(buf), f) && !strcmp(buf, "precious\n"), "victim: %s", buf);
	cr_expect(!fgets(buf, sizeof(buf), f), "victim grew");
	(void)fclose(f);
	cr_expect(lstat(link, &st) == 0 && S_ISLNK(st.st_mode), "the symlink was left alone");
	cr_expect(lstat(a.metrics, &st) == 0 && S_ISREG(st.st_mode),
		  "the metrics file is a regular file");
	f = fopen(a.metrics, "r");
	cr_assert_not_null(f);
	{
		char line[512], want[256];
		bool found = false, labelled = false, build = false;

		(void)snprintf(want, sizeof(want), ",queue=\"%s\"}", q);
		while (fgets(line, sizeof(line), f)) {
			found |= !strncmp(line, "rolloutd_units_claimed_total", 28);
			labelled |= !strncmp(line, "rolloutd_units_claimed_total{", 29) &&
				    strstr(line, want);
			build |= !strncmp(line, "rolloutd_build_info{", 20) &&
				 strstr(line, "version=\"" PACKAGE_VERSION "\"") && strstr(line, "} 1\n");
		}
		cr_expect(found, "the metrics file holds the metrics");
		cr_expect(labelled, "every series carries the queue label");
		cr_expect(build, "rolloutd_build_info{version=...} 1");
	}
	(void)fclose(f);
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
}
