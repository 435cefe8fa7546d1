/* Every queue operation against a real redis-server: claim, renew, publish (idempotent),
 * checkpoint, complete, requeue, release, reap, dead letters, wake-ups, backlog, and the
 * fencing rule that a worker whose lease is gone writes nothing. */
#include <criterion/criterion.h>
#include <criterion/hooks.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/redis_hooks.h"
#include "tests/testutil.h"

static redisContext *R;
static char Q[96];

static void setup(void)
{
	R = ro_test_redis_connect(ro_test_redis_url());
	cr_assert(R && !R->err);
	ro_test_name("q", Q, sizeof(Q));
}

static void teardown(void)
{
	redisFree(R);
}

TestSuite(queue, .init = setup, .fini = teardown, .timeout = 60);

static struct ro_queue *open_q(const char *worker)
{
	return ro_test_queue(ro_test_redis_url(), Q, worker, 3);
}

static void enqueue(struct ro_queue *q, const char *id, unsigned n)
{
	char json[256], why[128];
	struct ro_unit u;
	int st = 9;

	(void)snprintf(json, sizeof(json),
		       "{\"id\":\"%s\",\"prompt\":[1,2,3],\"n\":%u,\"max_new_tokens\":8,"
		       "\"meta\":{\"src\":\"t\"}}",
		       id, n);
	cr_assert_eq(ro_unit_parse(json, strlen(json), &(struct ro_unit_bounds){64, 64, 64, 4096},
				   &u, why, sizeof(why)),
		     0, "%s", why);
	cr_assert_eq(ro_queue_enqueue(q, &u, 1, &st), 0, "%s", ro_queue_errmsg(q));
	cr_assert_eq(st, 1);
	ro_unit_clear(&u);
}

static struct ro_sample sample(uint32_t idx)
{
	static const int32_t tok[3] = {5, 6, 7};
	static const float lp[3] = {-0.5f, -1.25f, -2.0f};

	return (struct ro_sample){.idx = idx,
				  .tokens = tok,
				  .logprobs = lp,
				  .len = 3,
				  .finish = "stop",
				  .policy_version = 4};
}

static long long xlen(const char *what)
{
	return ro_test_int(R, "XLEN ro:{%s}:%s", Q, what);
}

static char *hget(const char *id, const char *field)
{
	redisReply *rep = redisCommand(R, "HGET ro:{%s}:unit:%s %s", Q, id, field);
	char *s = rep && rep->type == REDIS_REPLY_STRING ? strdup(rep->str) : NULL;

	freeReplyObject(rep);
	return s;
}

static void assert_field(const char *id, const char *field, const char *want)
{
	char *v = hget(id, field);

	cr_assert(v && !strcmp(v, want), "%s.%s = %s, want %s", id, field, v ? v : "(nil)", want);
	free(v);
}

Test(queue, full_cycle)
{
	struct ro_queue *q = open_q("w1");
	struct ro_claim *c;
	size_t n;
	char ids[2][24], gid[24];
	struct ro_sample s0 = sample(0), s1 = sample(1);
	bool completed = true;

	enqueue(q, "u1", 2);
	cr_assert_eq(ro_queue_claim(q, 4, 10000, &c, &n), 1);
	cr_assert_eq(n, 1);
	cr_assert_str_eq(c[0].id, "u1");
	cr_assert(strstr(c[0].body, "\"prompt\":[1,2,3]"));
	cr_assert_eq(c[0].attempt, 1);
	cr_assert_eq(c[0].n, 2);
	cr_assert_eq(c[0].n_published, 0);
	/* counter 1, then the claim's request id */
	cr_assert(!strncmp(c[0].token, "1-", 2) && strlen(c[0].token) == 18, "%s", c[0].token);
	assert_field("u1", "state", "leased");
	assert_field("u1", "owner", "w1");

	cr_assert_eq(ro_queue_publish(q, &c[0], &s0, 1, true, ids, &completed), 0);
	cr_assert_not(completed, "completed with one sample of two");
	cr_assert_eq(ro_queue_complete(q, &c[0], gid), -EBUSY);
	cr_assert(strstr(ro_queue_errmsg(q), "1 of 2"), "%s", ro_queue_errmsg(q));
	cr_assert_eq(ro_queue_publish(q, &c[0], &s1, 1, false, ids + 1, NULL), 0);
	cr_assert_eq(xlen("samples"), 2);
	cr_assert_eq(ro_queue_complete(q, &c[0], gid), 0);
	cr_assert_eq(xlen("groups"), 1);
	assert_field("u1", "state", "done");
	cr_assert_eq(ro_test_int(R, "ZCARD ro:{%s}:leases", Q), 0);
	/* complete again by the same holder: the same group entry, nothing new */
	{
		char gid2[24];

		cr_assert_eq(ro_queue_complete(q, &c[0], gid2), 0);
		cr_assert_str_eq(gid, gid2);
		cr_assert_eq(xlen("groups"), 1);
	}
	/* the entry carries what the sample said plus unit, worker, attempt, meta */
	{
		redisReply *rep =
		    redisCommand(R, "XRANGE ro:{%s}:samples %s %s", Q, ids[0], ids[0]);
		redisReply *f = rep->element[0]->element[1];
		char all[1024] = "";

		for (size_t i = 0; i < f->elements; i++) {
			strcat(all, f->element[i]->str);
			strcat(all, "|");
		}
		cr_assert(strstr(all, "unit|u1|idx|0|worker|w1|attempt|1|"), "%s", all);
		cr_assert(strstr(all, "tokens|[5,6,7]|logprobs|[-0.5,-1.25,-2]|finish|stop|"
				      "policy_version|4|resumed_from|0|"),
			  "%s", all);
		cr_assert(strstr(all, "meta|{\"src\":\"t\"}|"), "%s", all);
		freeReplyObject(rep);
	}
	ro_claims_free(c, n);
	cr_assert_eq(ro_queue_claim(q, 4, 10000, &c, &n), 0);
	ro_claims_free(c, n);
	ro_queue_free(q);
}

Test(queue, publish_with_complete_finishes_the_unit)
{
	struct ro_queue *q = open_q("w1");
	struct ro_claim *c;
	size_t n;
	struct ro_sample s[3] = {sample(0), sample(1), sample(2)};
	char ids[3][24];
	bool completed = false;

	enqueue(q, "u1", 3);
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	cr_assert_eq(ro_queue_publish(q, c, s, 3, true, ids, &completed), 0);
	cr_assert(completed);
	cr_assert_eq(xlen("samples"), 3);
	cr_assert_eq(xlen("groups"), 1);
	assert_field("u1", "state", "done");
	ro_claims_free(c, n);
	ro_queue_free(q);
}

Test(queue, enqueue_is_idempotent_and_detects_conflicts)
{
	struct ro_queue *q = open_q("w1");
	struct ro_unit u[2];
	const char *a = "{\"id\":\"x\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1}";
	const char *b = "{\"id\":\"x\",\"prompt\":[2],\"n\":1,\"max_new_tokens\":1}";
	struct ro_unit_bounds bd;
	int st[2];

	ro_unit_bounds_default(&bd);
	cr_assert_eq(ro_unit_parse(a, strlen(a), &bd, &u[0], NULL, 0), 0);
	cr_assert_eq(ro_unit_parse(a, strlen(a), &bd, &u[1], NULL, 0), 0);
	cr_assert_eq(ro_queue_enqueue(q, u, 2, st), 0);
	cr_assert_eq(st[0], 1);
	cr_assert_eq(st[1], 0, "the same unit twice is queued once");
	ro_unit_clear(&u[1]);
	cr_assert_eq(ro_unit_parse(b, strlen(b), &bd, &u[1], NULL, 0), 0);
	cr_assert_eq(ro_queue_enqueue(q, &u[1], 1, st), 0);
	cr_assert_eq(st[0], -EEXIST);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s}:pending", Q), 1);
	assert_field("x", "body", u[0].body);
	ro_unit_clear(&u[0]);
	ro_unit_clear(&u[1]);
	ro_queue_free(q);
}

Test(queue, double_publish_writes_one_entry)
{
	struct ro_queue *q = open_q("w1");
	struct ro_claim *c;
	size_t n;
	struct ro_sample s = sample(1);
	char id1[1][24], id2[1][24];

	enqueue(q, "u1", 2);
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	cr_assert_eq(ro_queue_publish(q, c, &s, 1, false, id1, NULL), 0);
	cr_assert_eq(ro_queue_publish(q, c, &s, 1, false, id2, NULL), 0);
	cr_assert_str_eq(id1[0], id2[0]);
	cr_assert_eq(xlen("samples"), 1);
	assert_field("u1", "npub", "1");
	/* out of range index: refused, as a unit whose record disagrees with its body */
	s.idx = 2;
	cr_assert_eq(ro_queue_publish(q, c, &s, 1, false, id2, NULL), -EBADMSG);
	cr_assert_eq(xlen("samples"), 1);
	ro_claims_free(c, n);
	ro_queue_free(q);
}

Test(queue, stale_token_is_refused_and_writes_nothing)
{
	struct ro_queue *a = open_q("A"), *b = open_q("B");
	struct ro_claim *ca, *cb;
	size_t na, nb;
	struct ro_sample s = sample(0);
	int32_t tok[1] = {9};
	float lp[1] = {-1};
	struct ro_progress p = {.idx = 1, .len = 1, .tokens = tok, .logprobs = lp};
	char ids[1][24];
	bool ok = true;
	const struct ro_claim *pa;

	enqueue(a, "u1", 2);
	cr_assert_eq(ro_queue_claim(a, 1, 150, &ca, &na), 1);
	ro_test_msleep(300);
	/* B's claim reaps the expired lease and takes the unit on attempt 2 */
	cr_assert_eq(ro_queue_claim(b, 1, 10000, &cb, &nb), 1);
	cr_assert_str_eq(cb[0].id, "u1");
	cr_assert_eq(cb[0].attempt, 2);
	cr_assert_str_neq(cb[0].token, ca[0].token);

	cr_assert_eq(ro_queue_publish(a, ca, &s, 1, true, ids, NULL), -ESTALE);
	cr_assert_eq(ro_queue_checkpoint(a, ca, &p, 1), -ESTALE);
	cr_assert_eq(ro_queue_requeue(a, ca, &p, 1), -ESTALE);
	cr_assert_eq(ro_queue_release(a, ca), -ESTALE);
	cr_assert_eq(ro_queue_complete(a, ca, ids[0]), -ESTALE);
	cr_assert_eq(ro_queue_dead_letter(a, ca, "nope"), -ESTALE);
	pa = ca;
	cr_assert_eq(ro_queue_renew(a, &pa, 1, 10000, &ok), 0);
	cr_assert_not(ok);
	cr_assert_eq(xlen("samples"), 0);
	cr_assert_eq(ro_test_int(R, "HEXISTS ro:{%s}:unit:u1 p:1", Q), 0);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s}:pending", Q), 0);
	assert_field("u1", "owner", "B");
	assert_field("u1", "state", "leased");
	/* B still can */
	cr_assert_eq(ro_queue_publish(b, cb, &s, 1, false, ids, NULL), 0);
	cr_assert_eq(xlen("samples"), 1);
	ro_claims_free(ca, na);
	ro_claims_free(cb, nb);
	ro_queue_free(a);
	ro_queue_free(b);
}

Test(queue, expired_lease_refuses_writes_before_any_reaper)
{
	struct ro_queue *a = open_q("A");
	struct ro_claim *c;
	size_t n;
	struct ro_sample s = sample(0);
	char ids[1][24];

	enqueue(a, "u1", 1);
	cr_assert_eq(ro_queue_claim(a, 1, 100, &c, &n), 1);
	ro_test_msleep(250);
	cr_assert_eq(ro_queue_publish(a, c, &s, 1, true, ids, NULL), -ESTALE);
	cr_assert_eq(xlen("samples"), 0);
	ro_claims_free(c, n);
	ro_queue_free(a);
}

Test(queue, renew_keeps_the_lease)
{
	struct ro_queue *q = open_q("w1");
	struct ro_claim *c;
	size_t n;
	bool ok[2] = {false, false};
	const struct ro_claim *pc[2];
	struct ro_sample s = sample(0);
	char ids[1][24];

	enqueue(q, "u1", 1);
	enqueue(q, "u2", 1);
	/* a 2 s lease renewed every 0.3 s outlives 3 s. A renewal is lost only if this process
	 * is off the CPU for the lease less 0.3 s: with a 1 s lease, a 1.5 s stop of the test
	 * process lost it (ok false) */
	cr_assert_eq(ro_queue_claim(q, 2, 2000, &c, &n), 2);
	pc[0] = &c[0];
	pc[1] = &c[1];
	for (int i = 0; i < 10; i++) {
		ro_test_msleep(300);
		cr_assert_eq(ro_queue_renew(q, pc, 2, 2000, ok), 0);
		cr_assert(ok[0] && ok[1]);
	}
	cr_assert_eq(ro_queue_publish(q, &c[1], &s, 1, true, ids, NULL), 0);
	ro_claims_free(c, n);
	ro_queue_free(q);
}

Test(queue, checkpoint_and_requeue_keep_progress_exactly)
{
	struct ro_queue *a = open_q("A"), *b = open_q("B");
	struct ro_claim *ca, *cb;
	size_t na, nb;
	int32_t t1[3] = {11, 12, 13}, t2[2] = {21, 22};
	float l1[3] = {-0.1f, -0.2f, -0.30000001f}, l2[2] = {-1e-7f, -7.5f};
	struct ro_progress p1 = {.idx = 1,
				 .len = 3,
				 .tokens = t1,
				 .logprobs = l1,
				 .sampler_pos = 3,
				 .policy_version = 2};
	struct ro_progress p2 = {.idx = 2,
				 .len = 2,
				 .tokens = t2,
				 .logprobs = l2,
				 .sampler_pos = 2,
				 .policy_version = 2};
	struct ro_sample s = sample(0);
	char ids[1][24];

	enqueue(a, "u0", 1);
	enqueue(a, "u1", 3);
	cr_assert_eq(ro_queue_claim(a, 1, 10000, &ca, &na), 1);
	cr_assert_str_eq(ca[0].id, "u0");
	ro_claims_free(ca, na);
	cr_assert_eq(ro_queue_claim(a, 1, 10000, &ca, &na), 1);
	cr_assert_str_eq(ca[0].id, "u1");
	cr_assert_eq(ro_queue_publish(a, ca, &s, 1, false, ids, NULL), 0);
	cr_assert_eq(ro_queue_checkpoint(a, ca, &p1, 1), 1);
	/* a checkpoint of a published sample is ignored */
	{
		struct ro_progress p0 = p1;

		p0.idx = 0;
		cr_assert_eq(ro_queue_checkpoint(a, ca, &p0, 1), 0);
	}
	enqueue(a, "u2", 1);
	cr_assert_eq(ro_queue_requeue(a, ca, &p2, 1), 0);
	/* the requeued unit is at the head, before u2 */
	cr_assert_eq(ro_queue_claim(b, 1, 10000, &cb, &nb), 1);
	cr_assert_str_eq(cb[0].id, "u1");
	cr_assert_eq(cb[0].attempt, 1, "a drain requeue does not charge an attempt");
	cr_assert_eq(cb[0].n_published, 1);
	cr_assert_eq(cb[0].published_idx[0], 0);
	cr_assert_str_eq(cb[0].published_ids[0], ids[0]);
	cr_assert_eq(cb[0].n_progress, 2);
	for (uint32_t i = 0; i < 2; i++) {
		const struct ro_progress *g = &cb[0].progress[i], *w = g->idx == 1 ? &p1 : &p2;

		cr_assert(g->idx == 1 || g->idx == 2);
		cr_assert_eq(g->len, w->len);
		cr_assert_eq(memcmp(g->tokens, w->tokens, w->len * sizeof(int32_t)), 0);
		cr_assert_eq(memcmp(g->logprobs, w->logprobs, w->len * sizeof(float)), 0);
		cr_assert_eq(g->sampler_pos, w->sampler_pos);
		cr_assert_eq(g->policy_version, 2);
	}
	/* the old holder's second requeue (a retry) is a no-op, not a second push */
	cr_assert_eq(ro_queue_requeue(a, ca, NULL, 0), -ESTALE);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s}:pending", Q), 1);
	ro_claims_free(ca, na);
	ro_claims_free(cb, nb);
	ro_queue_free(a);
	ro_queue_free(b);
}

Test(queue, requeue_retry_after_lost_reply_is_harmless)
{
	struct ro_queue *a = open_q("A");
	struct ro_claim *c;
	size_t n;

	enqueue(a, "u1", 1);
	cr_assert_eq(ro_queue_claim(a, 1, 10000, &c, &n), 1);
	cr_assert_eq(ro_queue_requeue(a, c, NULL, 0), 0);
	cr_assert_eq(ro_queue_requeue(a, c, NULL, 0), 0);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s}:pending", Q), 1);
	ro_claims_free(c, n);
	ro_queue_free(a);
}

Test(queue, release_goes_to_the_tail)
{
	struct ro_queue *q = open_q("w1");
	struct ro_claim *c;
	size_t n;

	enqueue(q, "u1", 1);
	enqueue(q, "u2", 1);
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	cr_assert_str_eq(c[0].id, "u1");
	cr_assert_eq(ro_queue_release(q, c), 0);
	ro_claims_free(c, n);
	cr_assert_eq(ro_queue_claim(q, 2, 10000, &c, &n), 2);
	cr_assert_str_eq(c[0].id, "u2");
	cr_assert_str_eq(c[1].id, "u1");
	cr_assert_eq(c[1].attempt, 1);
	ro_claims_free(c, n);
	ro_queue_free(q);
}

Test(queue, reap_requeues_then_dead_letters)
{
	struct ro_queue *q = ro_test_queue(ro_test_redis_url(), Q, "w1", 2);
	struct ro_claim *c;
	size_t n;
	uint32_t req = 9, dead = 9;
	struct ro_dead *d;

	enqueue(q, "u1", 1);
	cr_assert_eq(ro_queue_claim(q, 1, 50, &c, &n), 1);
	ro_claims_free(c, n);
	ro_test_msleep(120);
	cr_assert_eq(ro_queue_reap(q, &req, &dead), 0);
	cr_assert_eq(req, 1);
	cr_assert_eq(dead, 0);
	assert_field("u1", "state", "pending");
	assert_field("u1", "attempt", "2");
	cr_assert_eq(ro_queue_claim(q, 1, 50, &c, &n), 1);
	cr_assert_eq(c[0].attempt, 2);
	ro_claims_free(c, n);
	ro_test_msleep(120);
	cr_assert_eq(ro_queue_reap(q, &req, &dead), 0);
	cr_assert_eq(req, 0);
	cr_assert_eq(dead, 1);
	assert_field("u1", "state", "dead");
	cr_assert_eq(ro_queue_dead_list(q, 0, 10, &d, &n), 1);
	cr_assert_str_eq(d[0].id, "u1");
	cr_assert_eq(d[0].attempt, 2);
	cr_assert(strstr(d[0].reason, "lease expired on attempt 2 of 2 (last owner w1)"), "%s",
		  d[0].reason);
	cr_assert(strstr(d[0].history, "\"ev\":\"claim\""), "%s", d[0].history);
	cr_assert(strstr(d[0].history, "\"ev\":\"expired\""), "%s", d[0].history);
	ro_dead_free(d, n);
	/* nothing expired: reap does nothing */
	cr_assert_eq(ro_queue_reap(q, &req, &dead), 0);
	cr_assert_eq(req + dead, 0);
	ro_queue_free(q);
}

Test(queue, a_unit_that_failed_a_lease_is_claimed_alone)
{
	struct ro_queue *q = open_q("w1");
	struct ro_claim *c;
	size_t n;
	uint32_t req, dead;

	enqueue(q, "s", 1);
	cr_assert_eq(ro_queue_claim(q, 1, 50, &c, &n), 1);
	ro_claims_free(c, n);
	enqueue(q, "f1", 1);
	enqueue(q, "f2", 1);
	ro_test_msleep(120);
	cr_assert_eq(ro_queue_reap(q, &req, &dead), 0);
	cr_assert_eq(req, 1);
	cr_assert_eq(ro_queue_claim(q, 8, 10000, &c, &n), 1);
	cr_assert_str_eq(c[0].id, "s");
	cr_assert_eq(c[0].attempt, 2);
	ro_claims_free(c, n);
	cr_assert_eq(ro_queue_claim(q, 8, 10000, &c, &n), 2);
	ro_claims_free(c, n);
	/* behind fresh units, a suspect ends the batch and waits for the next claim */
	enqueue(q, "f3", 1);
	cr_assert_eq(ro_test_int(R, "RPUSH ro:{%s}:pending s", Q), 2);
	freeReplyObject(redisCommand(R, "HSET ro:{%s}:unit:s state pending", Q));
	cr_assert_eq(ro_queue_claim(q, 8, 10000, &c, &n), 1);
	cr_assert_str_eq(c[0].id, "f3");
	ro_claims_free(c, n);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s}:pending", Q), 1);
	ro_queue_free(q);
}

Test(queue, dead_letter_retry_and_purge)
{
	struct ro_queue *q = open_q("w1");
	struct ro_claim *c;
	size_t n;
	struct ro_dead *d;

	enqueue(q, "bad1", 1);
	enqueue(q, "bad2", 1);
	cr_assert_eq(ro_queue_claim(q, 2, 10000, &c, &n), 2);
	cr_assert_eq(ro_queue_dead_letter(q, &c[0], "prompt longer than the model context"), 0);
	cr_assert_eq(ro_queue_dead_letter(q, &c[1], "policy gone"), 0);
	ro_claims_free(c, n);
	cr_assert_eq(ro_queue_dead_list(q, 0, 10, &d, &n), 2);
	cr_assert_str_eq(d[0].reason, "prompt longer than the model context");
	ro_dead_free(d, n);
	cr_assert_eq(ro_queue_dead_retry(q, "nosuch"), -ENOENT);
	cr_assert_eq(ro_queue_dead_retry(q, "bad1"), 0);
	assert_field("bad1", "state", "pending");
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	cr_assert_str_eq(c[0].id, "bad1");
	cr_assert_eq(c[0].attempt, 1);
	ro_claims_free(c, n);
	cr_assert_eq(ro_queue_dead_purge(q), 1);
	cr_assert_eq(ro_test_int(R, "EXISTS ro:{%s}:unit:bad2", Q), 0);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s}:dead", Q), 0);
	ro_queue_free(q);
}

Test(queue, held_lists_this_workers_units)
{
	struct ro_queue *a = open_q("A"), *b = open_q("B");
	struct ro_claim *c, *h;
	size_t n, nh;

	for (int i = 0; i < 5; i++) {
		char id[8];

		(void)snprintf(id, sizeof(id), "u%d", i);
		enqueue(a, id, 1);
	}
	cr_assert_eq(ro_queue_claim(a, 3, 10000, &c, &n), 3);
	ro_claims_free(c, n);
	cr_assert_eq(ro_queue_claim(b, 3, 10000, &c, &n), 2);
	ro_claims_free(c, n);
	cr_assert_eq(ro_queue_held(a, &h, &nh), 3);
	for (size_t i = 0; i < nh; i++)
		assert_field(h[i].id, "owner", "A");
	ro_claims_free(h, nh);
	cr_assert_eq(ro_queue_held(b, &h, &nh), 2);
	ro_claims_free(h, nh);
	ro_queue_free(a);
	ro_queue_free(b);
}

Test(queue, idle_worker_wakes_on_enqueue)
{
	struct ro_queue *q = open_q("w1");
	bool woken = true;
	pid_t pid;
	int st;

	/* drain old markers, then a quiet wait times out */
	while (ro_queue_wait(q, 50, &woken) == 0 && woken)
		;
	cr_assert_eq(ro_queue_wait(q, 200, &woken), 0);
	cr_assert_not(woken);
	pid = fork();
	if (pid == 0) {
		struct ro_queue *p = open_q("producer");

		ro_test_msleep(200);
		enqueue(p, "late", 1);
		ro_queue_free(p);
		_exit(0);
	}
	cr_assert_eq(ro_queue_wait(q, 2000, &woken), 0);
	cr_assert(woken);
	cr_assert_eq(waitpid(pid, &st, 0), pid);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s}:pending", Q), 1);
	ro_queue_free(q);
}

Test(queue, backlog_reports_trainer_lag)
{
	struct ro_queue *q = open_q("w1");
	struct ro_claim *c;
	size_t n;
	struct ro_sample s[4] = {sample(0), sample(1), sample(2), sample(3)};
	char ids[4][24];
	int64_t len, lag;
	redisReply *rep;

	cr_assert_eq(ro_queue_backlog(q, NULL, &len, &lag), 0);
	cr_assert_eq(len, 0);
	cr_assert_eq(lag, 0);
	enqueue(q, "u1", 4);
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	cr_assert_eq(ro_queue_publish(q, c, s, 4, true, ids, NULL), 0);
	ro_claims_free(c, n);
	/* no consumer group: the whole stream counts as unread */
	cr_assert_eq(ro_queue_backlog(q, NULL, &len, &lag), 0);
	cr_assert_eq(len, 4);
	cr_assert_eq(lag, 4);
	freeReplyObject(redisCommand(R, "XGROUP CREATE ro:{%s}:samples trainer 0", Q));
	rep = redisCommand(R, "XREADGROUP GROUP trainer t1 COUNT 3 STREAMS ro:{%s}:samples >", Q);
	freeReplyObject(rep);
	cr_assert_eq(ro_queue_backlog(q, "trainer", &len, &lag), 0);
	cr_assert_eq(len, 4);
	cr_assert_eq(lag, 1);
	ro_queue_free(q);
}

Test(queue, heartbeat_and_stats)
{
	struct ro_queue *q = open_q("node-a:0");
	struct ro_queue_stats s;
	const char *kv[4] = {"state", "running", "in_flight", "12"};
	struct ro_claim *c;
	size_t n;

	enqueue(q, "u1", 1);
	enqueue(q, "u2", 1);
	enqueue(q, "u3", 1);
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	cr_assert_eq(ro_queue_dead_letter(q, c, "x"), 0);
	ro_claims_free(c, n);
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	ro_claims_free(c, n);
	cr_assert_eq(ro_queue_heartbeat(q, kv, 4), 0);
	cr_assert_eq(ro_queue_stats(q, &s), 0);
	cr_assert_eq(s.pending, 1);
	cr_assert_eq(s.leased, 1);
	cr_assert_eq(s.dead, 1);
	cr_assert_eq(s.done, 0);
	cr_assert_eq(s.n_workers, 1);
	cr_assert_str_eq(s.workers[0].id, "node-a:0");
	cr_assert(s.workers[0].age_ms >= 0 && s.workers[0].age_ms < 5000);
	cr_assert(strstr(s.workers[0].fields, "\"state\":\"running\""), "%s", s.workers[0].fields);
	cr_assert(strstr(s.workers[0].fields, "\"in_flight\":\"12\""), "%s", s.workers[0].fields);
	ro_queue_stats_clear(&s);
	ro_queue_free(q);
}

Test(queue, unix_socket_url)
{
	char url[200];
	struct ro_queue *q;
	int64_t len, lag;

	(void)snprintf(url, sizeof(url), "unix://%s", getenv("RO_TEST_REDIS_SOCK"));
	q = ro_test_queue(url, Q, "w1", 3);
	cr_assert_eq(ro_queue_backlog(q, NULL, &len, &lag), 0, "%s", ro_queue_errmsg(q));
	ro_queue_free(q);
}

Test(queue, bad_urls_are_refused)
{
	struct ro_queue *q = NULL;
	const char *bad[] = {"http://x", "redis://host:99999", "redis://host:1/x", "unix://"};

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct ro_queue_opts o = {.url = bad[i], .queue = "q"};

		cr_assert_eq(ro_queue_new(&o, &q), -EINVAL, "%s accepted", bad[i]);
	}
	{
		struct ro_queue_opts o = {.url = "redis://127.0.0.1:1/0", .queue = "bad name"};

		cr_assert_eq(ro_queue_new(&o, &q), -EINVAL);
	}
}

Test(queue, dead_redis_gives_an_error_not_a_hang)
{
	struct ro_queue_opts o = {.url = "redis://127.0.0.1:1/0", .queue = "q", .retry_ms = 300};
	struct ro_queue *q;
	struct ro_claim *c;
	size_t n;

	cr_assert_eq(ro_queue_new(&o, &q), 0);
	cr_assert_eq(ro_queue_claim(q, 1, 1000, &c, &n), -EIO);
	cr_assert(strstr(ro_queue_errmsg(q), "connect"), "%s", ro_queue_errmsg(q));
	ro_queue_free(q);
}
