/* rolloutd end to end: real rolloutd processes against the binary's redis-server and the
 * mock IMDS. Two agents share a queue; a spot notice, SIGTERM, `rolloutctl drain`, a
 * rebalance (per policy) and an ASG lifecycle change each drain an agent with nothing lost
 * or duplicated; resumed samples are bitwise those of an uninterrupted run; SIGKILL loses
 * at most one checkpoint interval per sequence; backpressure; the notify protocol over a
 * real NOTIFY_SOCKET; bad config and bad units. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
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
#include "tests/agent_fixture.h"
#include "tests/agent_model.h"
#include "tests/mock_fixture.h"
#include "tests/redis_hooks.h"
#include "tests/testutil.h"

static char dir[64];
static char model[128];


static void setup(void)
{
	struct ro_make_model_opts o;
	char err[256];

	(void)snprintf(dir, sizeof(dir), "/tmp/ro-agent-XXXXXX");
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

TestSuite(agent, .init = setup, .fini = teardown, .timeout = 120);

/* The Redis the agents use: the binary's shared one, or a test's private one (a test that
 * stops or kills its server must not touch the one other tests share). */
static const char *agent_redis;

static const char *redis_url(void)
{
	return agent_redis ? agent_redis : ro_test_redis_url();
}

/* Start rolloutd as worker `name` on queue q; extra flags after. */
static void start(struct ro_test_agent *ag, const char *name, const char *q,
		  const char *const *extra, const char *const *env)
{
	ro_test_agent_start(ag, dir, model, redis_url(), name, q, extra, env);
}

static void enqueue(const char *q, const char *prefix, int count, unsigned n, unsigned max_new,
		    unsigned long_every, unsigned long_max)
{
	struct ro_queue *qq = ro_test_queue(redis_url(), q, "enq", 3);

	for (int i = 0; i < count; i++) {
		char js[512], why[256];
		struct ro_unit u = {0};
		int st;
		unsigned mx = long_every && i % long_every == 0 ? long_max : max_new;

		(void)snprintf(js, sizeof(js),
			       "{\"id\":\"%s-%d\",\"prompt\":[%d,%d,%d],\"n\":%u,"
			       "\"max_new_tokens\":%u,\"sampling\":{\"temperature\":1.0,\"seed\":%d}}",
			       prefix, i, i % 1000, (i * 7) % 1000, 5, n, mx, i);
		cr_assert_eq(ro_unit_parse(js, strlen(js), &(struct ro_unit_bounds){1000, 64, 100000,
										    1 << 20},
					   &u, why, sizeof(why)),
			     0, "%s", why);
		cr_assert_eq(ro_queue_enqueue(qq, &u, 1, &st), 0);
		ro_unit_clear(&u);
	}
	ro_queue_free(qq);
}

static long done_count(redisContext *c, const char *q)
{
	return ro_test_int(c, "HGET ro:{%s}:stats done", q);
}

static bool wait_done(redisContext *c, const char *q, long want, long ms)
{
	for (long t = 0; t < ms; t += 50) {
		if (done_count(c, q) >= want)
			return true;
		ro_test_msleep(50);
	}
	return false;
}

/* unit|idx -> "tokens logprobs" of every sample in q's stream */
struct smp {
	char key[64], val[65536];
	char worker[32];
	long resumed;
	long long ms;
};

static size_t read_samples(redisContext *c, const char *q, struct smp **ret)
{
	redisReply *rep = redisCommand(c, "XRANGE ro:{%s}:samples - +", q);
	struct smp *v;

	cr_assert(rep && rep->type == REDIS_REPLY_ARRAY);
	v = calloc(rep->elements + 1, sizeof(*v));
	for (size_t i = 0; i < rep->elements; i++) {
		redisReply *f = rep->element[i]->element[1];
		const char *unit = "", *idx = "", *tok = "", *lp = "";

		v[i].ms = strtoll(rep->element[i]->element[0]->str, NULL, 10);
		for (size_t j = 0; j + 1 < f->elements; j += 2) {
			const char *k = f->element[j]->str, *x = f->element[j + 1]->str;

			if (!strcmp(k, "unit"))
				unit = x;
			else if (!strcmp(k, "idx"))
				idx = x;
			else if (!strcmp(k, "tokens"))
				tok = x;
			else if (!strcmp(k, "logprobs"))
				lp = x;
			else if (!strcmp(k, "worker"))
				(void)snprintf(v[i].worker, sizeof(v[i].worker), "%s", x);
			else if (!strcmp(k, "resumed_from"))
				v[i].resumed = strtol(x, NULL, 10);
		}
		(void)snprintf(v[i].key, sizeof(v[i].key), "%s|%s", unit, idx);
		(void)snprintf(v[i].val, sizeof(v[i].val), "%s %s", tok, lp);
	}
	*ret = v;
	{
		size_t n = rep->elements;

		freeReplyObject(rep);
		return n;
	}
}

/* Every sample of q equals the one of ref with the same unit and index, bit for bit. */
static long same_samples(redisContext *c, const char *q, const char *ref, size_t want)
{
	struct smp *a, *b;
	size_t na = read_samples(c, q, &a), nb = read_samples(c, ref, &b);
	long resumed = 0;

	cr_assert_eq(na, want);
	cr_assert_eq(nb, want);
	for (size_t i = 0; i < na; i++) {
		bool found = false;

		for (size_t j = 0; j < nb && !found; j++)
			if (!strcmp(a[i].key, b[j].key)) {
				found = true;
				cr_expect_str_eq(a[i].val, b[j].val, "sample %s differs from the "
								     "uninterrupted run", a[i].key);
			}
		cr_expect(found, "sample %s missing from the reference", a[i].key);
		resumed += a[i].resumed > 0;
	}
	free(a);
	free(b);
	return resumed;
}

static void reference_run(redisContext *c, const char *ref, int units, unsigned n,
			  unsigned max_new, unsigned long_every, unsigned long_max)
{
	struct ro_test_agent r;

	enqueue(ref, "u", units, n, max_new, long_every, long_max);
	start(&r, "ref", ref, (const char *const[]){"--imds", "false", NULL}, NULL);
	cr_assert(wait_done(c, ref, units, 60000), "reference run did not finish");
	ro_test_agent_term(&r);
	cr_assert_eq(ro_test_agent_wait_exit(&r, 10000), 0);
}

Test(agent, two_agents_every_sample_once)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64];
	struct ro_test_agent a, b;

	ro_test_name("e2e", q, sizeof(q));
	enqueue(q, "u", 30, 4, 24, 0, 0);
	start(&a, "a", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	start(&b, "b", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	cr_assert(wait_done(c, q, 30, 60000), "not all units completed");
	ro_test_agent_term(&a);
	ro_test_agent_term(&b);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 10000), 0);
	cr_expect_eq(ro_test_agent_wait_exit(&b, 10000), 0);
	ro_test_verify_exactly_once(c, q, 30, 4);
	cr_expect_gt(ro_test_int(c, "XLEN ro:{%s}:groups", q), 0);
	redisFree(c);
}

/* A Spot notice whose drain deadline (notice time minus the margin) has already passed when
 * it is seen: every unit in flight is checkpointed and requeued at once, the agent exits
 * before the notice time, and another worker resumes the units from their prefixes,
 * bitwise what an uninterrupted run gives. The deadline is in the past on purpose: with one
 * in the future, whether a long unit "can finish" depends on this machine's speed. */
Test(agent, spot_notice_drains_before_the_deadline)
{
	static const char *const on[] = {"--imds-poll-ms", "200", "--drain-margin-ms", "9000",
					 "--checkpoint-tokens", "16", "--lease-ms", "5000", NULL};
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	struct ro_test_mock mk = {0};
	char q[64], ref[64], ep[96], fire[128];
	const char *av[16];
	struct ro_test_agent a, b;
	/* long units: far more tokens than can run between the test's look and the notice */
	unsigned long_max = ro_test_scaled(1500) < 400 ? 400 : ro_test_scaled(1500);
	int64_t notice, exited;
	size_t n = 0;
	long resumed;
	struct smp *s;
	size_t ns;
	bool seen = false;

	ro_test_name("spot", q, sizeof(q));
	ro_test_name("spotref", ref, sizeof(ref));
	/* 8 units of 2 samples: short ones (done before the notice), long ones (in flight) */
	reference_run(c, ref, 8, 2, 60, 2, long_max);
	cr_assert_eq(ro_test_mock_start(&mk, 0, NULL), 0);
	(void)snprintf(ep, sizeof(ep), "%s", mk.url);
	for (size_t i = 0; on[i]; i++)
		av[n++] = on[i];
	av[n++] = "--imds-endpoint";
	av[n++] = ep;
	av[n] = NULL;
	enqueue(q, "u", 8, 2, 60, 2, long_max);
	start(&a, "a", q, av, NULL);
	/* wait until it is into the long units: the short ones published, a long one
	 * checkpointed and still leased (events, not times: a busy box may take a while) */
	for (int i = 0; i < 2400 && !seen; i++) {
		redisReply *r = redisCommand(c, "HGET ro:{%s}:unit:u-0 state", q);

		seen = ro_test_int(c, "XLEN ro:{%s}:samples", q) >= 8 &&
		       ro_test_int(c, "HEXISTS ro:{%s}:unit:u-0 p:0", q) == 1 && r &&
		       r->type == REDIS_REPLY_STRING && !strcmp(r->str, "leased");
		freeReplyObject(r);
		if (!seen)
			ro_test_msleep(50);
	}
	cr_assert(seen, "the short units published and u-0 checkpointed while leased");
	/* the notice time (whole seconds in IMDS) 8-9 s ahead; deadline = it - 9 s: passed */
	notice = (ro_test_wall_ms() / 1000 + 9) * 1000;
	(void)snprintf(fire, sizeof(fire), "spot?in=0&time=%lld", (long long)(notice / 1000));
	free(ro_test_mock_ctl(&mk, fire));
	cr_assert_eq(ro_test_agent_wait_exit(&a, 30000), 0, "the notified agent exits 0");
	exited = ro_test_wall_ms();
	cr_expect_lt(exited, notice, "exited %lld ms before the notice time", (long long)(notice - exited));
	cr_expect(ro_test_agent_log_has(&a, "requeued u-0"), "the long unit in flight was requeued");
	cr_expect_gt(ro_test_int(c, "LLEN ro:{%s}:pending", q), 0, "requeued units wait at the head");
	start(&b, "b", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	cr_assert(wait_done(c, q, 8, 120000), "the other agent completes the requeued units");
	ro_test_agent_term(&b);
	cr_expect_eq(ro_test_agent_wait_exit(&b, 30000), 0);
	ro_test_verify_exactly_once(c, q, 8, 2);
	resumed = same_samples(c, q, ref, 16);
	cr_expect_gt(resumed, 0, "some samples resumed from a checkpointed prefix");
	/* nothing written by the drained agent after it left */
	ns = read_samples(c, q, &s);
	for (size_t i = 0; i < ns; i++)
		if (!strcmp(s[i].worker, "a"))
			cr_expect_leq(s[i].ms, exited);
	free(s);
	ro_test_mock_stop(&mk);
	redisFree(c);
}

Test(agent, sigkill_loses_at_most_one_checkpoint_interval)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64], ref[64];
	struct ro_test_agent a, b;
	double worst = 0;
	int rc;

	ro_test_name("kill", q, sizeof(q));
	ro_test_name("killref", ref, sizeof(ref));
	reference_run(c, ref, 4, 2, ro_test_scaled(1000), 0, 0);
	enqueue(q, "u", 4, 2, ro_test_scaled(1000), 0, 0);
	start(&a, "a", q,
	      (const char *const[]){"--imds", "false", "--checkpoint-tokens", "8", "--lease-ms",
				    "2000", NULL},
	      NULL);
	/* sample the live bound while waiting, then kill mid-run: as soon as a leased unit has
	 * a checkpoint (an event: a slow sanitized start may take seconds to get there, and a
	 * fast kernel finishes a unit in well under a second; until 2026-12-06 the kill also
	 * waited for 20 polls, 1 s, and with AMX the units were done by then) */
	for (int i = 0, mid = 0; i < 12000 && !mid; i++) {
		const char *st = ro_test_agent_status(&a, "status\n");
		double u = ro_test_json_field(st, "uncheckpointed_max");

		if (u > worst)
			worst = u;
		for (int k = 0; k < 4 && !mid; k++) {
			redisReply *r = redisCommand(c, "HMGET ro:{%s}:unit:u-%d state ckpt", q, k);

			mid = r && r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
			      r->element[0]->type == REDIS_REPLY_STRING &&
			      !strcmp(r->element[0]->str, "leased") &&
			      r->element[1]->type == REDIS_REPLY_STRING;
			freeReplyObject(r);
		}
		if (!mid)
			ro_test_msleep(5);
	}
	cr_expect_leq(worst, 8, "a sequence never runs more than checkpoint-tokens ahead of its "
				"checkpoint (saw %.0f)",
		      worst);
	kill(a.pid, SIGKILL);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 5000), 128 + SIGKILL);
	start(&b, "b", q, (const char *const[]){"--imds", "false", "--lease-ms", "2000", NULL}, NULL);
	cr_assert(wait_done(c, q, 4, 60000), "the other agent finishes after lease expiry");
	ro_test_agent_term(&b);
	rc = ro_test_agent_wait_exit(&b, 10000);
	if (rc)
		ro_test_agent_dump_log(&b);
	cr_expect_eq(rc, 0, "the second agent exits 0 (%d)", rc);
	ro_test_verify_exactly_once(c, q, 4, 2);
	cr_expect_gt(same_samples(c, q, ref, 8), 0, "resumed from checkpoints, bitwise the same");
	redisFree(c);
}

static void drain_by(const char *how)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	struct ro_test_mock mk = {0};
	char q[64], ep[96];
	struct ro_test_agent a, b;
	const char *extra[16] = {"--sigterm-grace-s", "1", "--drain-margin-ms", "0",
				 "--notice-s", "1", NULL};
	size_t n = 6;
	int rc;

	ro_test_name(how, q, sizeof(q));
	enqueue(q, "u", 6, 2, ro_test_scaled(2000), 0, 0);
	if (strcmp(how, "sigterm") && strcmp(how, "ctl")) {
		cr_assert_eq(ro_test_mock_start(&mk, 0, NULL), 0);
		(void)snprintf(ep, sizeof(ep), "%s", mk.url);
		extra[n++] = "--imds-endpoint";
		extra[n++] = ep;
		extra[n++] = "--imds-poll-ms";
		extra[n++] = "100";
		extra[n++] = "--imds-slow-poll-ms";
		extra[n++] = "100";
		extra[n++] = "--rebalance";
		extra[n++] = "drain";
	} else {
		extra[n++] = "--imds";
		extra[n++] = "false";
	}
	extra[n] = NULL;
	start(&a, "a", q, extra, NULL);
	for (int i = 0; i < 100 && ro_test_agent_field(&a, "in_flight") < 1; i++)
		ro_test_msleep(50);
	if (!strcmp(how, "sigterm")) {
		ro_test_agent_term(&a);
	} else if (!strcmp(how, "ctl")) {
		char cmd[512];

		(void)snprintf(cmd, sizeof(cmd), "%s drain --deadline 1 --wait --socket %s >/dev/null",
			       ro_test_bin("RO_ROLLOUTCTL", "rolloutctl"), a.sock);
		cr_expect_eq(system(cmd), 0, "rolloutctl drain --wait returns once drained");
	} else if (!strcmp(how, "rebalance")) {
		free(ro_test_mock_ctl(&mk, "rebalance?in=0"));
	} else {
		free(ro_test_mock_ctl(&mk, "lifecycle?state=Terminated"));
	}
	rc = ro_test_agent_wait_exit(&a, 15000);
	if (rc)
		ro_test_agent_dump_log(&a);
	cr_expect_eq(rc, 0, "%s: the agent drains and exits 0", how);
	start(&b, "b", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	/* bounded generously: on a busy 2-core box the other tests share the CPU */
	cr_assert(wait_done(c, q, 6, 200000), "%s: the requeued units complete elsewhere", how);
	ro_test_agent_term(&b);
	rc = ro_test_agent_wait_exit(&b, 10000);
	if (rc)
		ro_test_agent_dump_log(&b);
	cr_expect_eq(rc, 0, "%s: the second agent exits 0 (%d)", how, rc);
	ro_test_verify_exactly_once(c, q, 6, 2);
	if (mk.pid)
		ro_test_mock_stop(&mk);
	redisFree(c);
}

/* Crashes stay crashes: Debian's libfabric loads libinfinipath, whose constructor catches
 * SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT (and SIGTERM) with handlers that print a line
 * and exit 1; rolloutd puts the crash signals back to their default action (a core, and
 * the signal in systemd's record), and SIGTERM is its own. (Under the sanitizers their
 * runtime catches SIGSEGV itself.) */
Test(agent, crash_signals_keep_their_default, .timeout = 120)
{
	struct ro_test_agent a;
	char q[64], path[64], line[256];
	unsigned long long cgt = 0;
	FILE *f;
	int rc;

	ro_test_name("sigs", q, sizeof(q));
	start(&a, "a", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	for (int i = 0; i < 600 && ro_test_agent_field(&a, "in_flight") < 0; i++)
		ro_test_msleep(50);
	cr_assert_geq(ro_test_agent_field(&a, "in_flight"), 0, "the agent answers status");
	(void)snprintf(path, sizeof(path), "/proc/%d/status", (int)a.pid);
	f = fopen(path, "r");
	cr_assert_not_null(f);
	while (fgets(line, sizeof(line), f))
		(void)sscanf(line, "SigCgt: %llx", &cgt);
	fclose(f);
	cr_expect(cgt & (1ULL << (SIGTERM - 1)), "SIGTERM caught");
	if (!getenv("RO_SANITIZED"))
		for (int s = 0; s < 5; s++) {
			const int sig = (int[]){SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}[s];

			cr_expect(!(cgt & (1ULL << (sig - 1))), "signal %d caught (SigCgt %llx)", sig,
				  cgt);
		}
	ro_test_agent_term(&a);
	rc = ro_test_agent_wait_exit(&a, 30000);
	if (rc)
		ro_test_agent_dump_log(&a);
	cr_expect_eq(rc, 0);
}

Test(agent, drain_on_sigterm, .timeout = 300)
{
	drain_by("sigterm");
}

Test(agent, drain_on_rolloutctl_drain, .timeout = 300)
{
	drain_by("ctl");
}

Test(agent, drain_on_rebalance_when_configured, .timeout = 300)
{
	drain_by("rebalance");
}

Test(agent, drain_on_asg_lifecycle, .timeout = 300)
{
	drain_by("lifecycle");
}

/* A requeue writes every token the engine drew: the step running when the drain ends a
 * unit commits before its progress is written (before, that step's token of each sequence
 * landed after the write and the resuming worker drew it again: drain_bench threw away 64
 * of ~33,000 every run). A drain with deadline 0 requeues every unit at once, whatever the
 * machine's speed, and the 3 s margin leaves the wait its time. Tokens generated (the
 * metrics file, written at exit) = the tokens in the requeued units' checkpoints. */
Test(agent, requeue_keeps_every_drawn_token, .timeout = 120)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	struct ro_test_agent a;
	char q[64], cmd[512], line[512];
	long gen = -1, kept = 0;
	FILE *f;
	int rc;

	ro_test_name("keep", q, sizeof(q));
	enqueue(q, "u", 4, 2, 5000, 0, 0);
	start(&a, "a", q, (const char *const[]){"--imds", "false", "--drain-margin-ms", "3000", NULL},
	      NULL);
	for (int i = 0; i < 400 && ro_test_agent_field(&a, "in_flight") < 8; i++)
		ro_test_msleep(50);
	cr_assert_eq(ro_test_agent_field(&a, "in_flight"), 8, "all 4 units decoding");
	/* tokens drawn (the units are 5,000 tokens long), then the drain */
	for (int i = 0; i < 400 && ro_test_agent_field(&a, "kv_positions") < 8 * 40; i++)
		ro_test_msleep(50);
	(void)snprintf(cmd, sizeof(cmd), "%s drain --deadline 0 --wait --socket %s >/dev/null",
		       ro_test_bin("RO_ROLLOUTCTL", "rolloutctl"), a.sock);
	cr_expect_eq(system(cmd), 0);
	rc = ro_test_agent_wait_exit(&a, 30000);
	if (rc)
		ro_test_agent_dump_log(&a);
	cr_assert_eq(rc, 0);
	cr_expect_eq(ro_test_int(c, "LLEN ro:{%s}:pending", q), 4, "the 4 units requeued");
	f = fopen(a.metrics, "r");
	cr_assert_not_null(f, "%s", a.metrics);
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, "rolloutd_tokens_generated_total", 31))
			gen = strtol(strrchr(line, ' ') + 1, NULL, 10);
	fclose(f);
	for (int i = 0; i < 4; i++) {
		redisReply *r = redisCommand(c, "HGETALL ro:{%s}:unit:u-%d", q, i);

		for (size_t j = 0; r && j + 1 < r->elements; j += 2)
			if (!strncmp(r->element[j]->str, "p:", 2))
				kept += ro_test_json_array_len(r->element[j + 1]->str, "tokens");
		if (r)
			freeReplyObject(r);
	}
	cr_expect_eq(ro_test_int(c, "XLEN ro:{%s}:samples", q), 0, "nothing finished");
	cr_expect_gt(gen, 0, "tokens were drawn");
	cr_expect_eq(kept, gen, "checkpointed %ld of the %ld tokens drawn", kept, gen);
	redisFree(c);
}

Test(agent, rebalance_stop_claiming_and_ignore)
{
	struct ro_test_mock mk = {0};
	char q[64], ep[96];
	struct ro_test_agent a, b;

	ro_test_name("rebal", q, sizeof(q));
	cr_assert_eq(ro_test_mock_start(&mk, 0, NULL), 0);
	(void)snprintf(ep, sizeof(ep), "%s", mk.url);
	start(&a, "a", q,
	      (const char *const[]){"--imds-endpoint", ep, "--imds-poll-ms", "100",
				    "--imds-slow-poll-ms", "100", "--rebalance", "stop-claiming", NULL},
	      NULL);
	start(&b, "b", q,
	      (const char *const[]){"--imds-endpoint", ep, "--imds-poll-ms", "100",
				    "--imds-slow-poll-ms", "100", "--rebalance", "ignore", NULL},
	      NULL);
	/* events, not times: both agents up and past their first metadata read before the
	 * notice (a start under load can take seconds), then both have seen the notice */
	for (int i = 0; i < 1200 && !(ro_test_agent_log_has(&a, "imds: .*first read") &&
				      ro_test_agent_log_has(&b, "imds: .*first read"));
	     i++)
		ro_test_msleep(25);
	free(ro_test_mock_ctl(&mk, "rebalance?in=0"));
	for (int i = 0; i < 1200 && !(ro_test_agent_log_has(&a, "\"event\":\"rebalance\"") &&
				      ro_test_agent_log_has(&b, "\"event\":\"rebalance\""));
	     i++)
		ro_test_msleep(25);
	cr_expect(strstr(ro_test_agent_status(&a, "status\n"), "\"stop_claiming\":true"), "%s",
		  ro_test_agent_status(&a, "status\n"));
	cr_expect(strstr(ro_test_agent_status(&a, "status\n"), "\"state\":\"running\""));
	cr_expect(strstr(ro_test_agent_status(&b, "status\n"), "\"stop_claiming\":false"));
	cr_expect(strstr(ro_test_agent_status(&b, "status\n"), "\"state\":\"running\""));
	ro_test_agent_term(&a);
	ro_test_agent_term(&b);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 10000), 0);
	cr_expect_eq(ro_test_agent_wait_exit(&b, 10000), 0);
	ro_test_mock_stop(&mk);
}

/* Waits (bounded in count) until the agent's status number key equals want, or reaches
 * it with at_least. */
static bool bp_wait(const struct ro_test_agent *a, const char *key, double want, bool at_least)
{
	for (int i = 0; i < 4000; i++) {
		double v = ro_test_agent_field(a, key);

		if (at_least ? v >= want : v == want)
			return true;
		ro_test_msleep(25);
	}
	return false;
}

/* Backpressure, asserted on events rather than on how fast the machine is: the trainer's
 * stream holds more unread entries than high-water before the agent starts, so at most the
 * units claimed before its first lag reading run; once it reports backpressure and has
 * nothing in flight, two more lag readings (seen as the reported lag following entries the
 * test adds) pass, and each is followed by a claim opportunity the agent must not take. */
Test(agent, backpressure_stops_and_resumes_claims)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64];
	struct ro_test_agent a;
	double claimed, lag;
	long done_then;

	ro_test_name("bp", q, sizeof(q));
	ro_test_int(c, "XGROUP CREATE ro:{%s}:samples trainer $ MKSTREAM", q);
	for (int i = 0; i < 11; i++)
		freeReplyObject(redisCommand(c, "XADD ro:{%s}:samples * unit old idx %d", q, i));
	enqueue(q, "u", 40, 2, ro_test_scaled(60), 0, 0);
	start(&a, "a", q,
	      (const char *const[]){"--imds", "false", "--high-water", "10", "--claim-batch", "1",
				    "--max-inflight", "4", NULL},
	      NULL);
	/* whatever was claimed before the first lag reading finishes, and nothing follows it */
	cr_assert(bp_wait(&a, "backpressure", 1, false), "%s", ro_test_agent_status(&a, "status\n"));
	cr_assert(bp_wait(&a, "in_flight", 0, false), "%s", ro_test_agent_status(&a, "status\n"));
	cr_assert(bp_wait(&a, "units", 0, false), "%s", ro_test_agent_status(&a, "status\n"));
	claimed = ro_test_agent_field(&a, "claimed");
	done_then = done_count(c, q);
	cr_expect_lt(done_then, 40, "backpressure from the first lag reading");
	for (int k = 0; k < 2; k++) {
		lag = ro_test_agent_field(&a, "lag");
		freeReplyObject(redisCommand(c, "XADD ro:{%s}:samples * unit old idx x%d", q, k));
		cr_assert(bp_wait(&a, "lag", lag + 1, true), "lag reading %d: %s", k,
			  ro_test_agent_status(&a, "status\n"));
	}
	cr_expect(strstr(ro_test_agent_status(&a, "status\n"), "\"backpressure\":true"));
	cr_expect_eq(ro_test_agent_field(&a, "claimed"), claimed, "no claims while the trainer is behind: %s",
		     ro_test_agent_status(&a, "status\n"));
	cr_expect_eq(done_count(c, q), done_then, "no claims while the trainer is behind");
	/* the trainer reads and acknowledges everything: claims resume */
	for (int round = 0; round < 4000 && done_count(c, q) < 40; round++) {
		redisReply *r = redisCommand(c, "XREADGROUP GROUP trainer t1 COUNT 1000 STREAMS "
						"ro:{%s}:samples >",
					     q);

		if (r && r->type == REDIS_REPLY_ARRAY)
			for (size_t i = 0; i < r->element[0]->element[1]->elements; i++)
				freeReplyObject(redisCommand(
				    c, "XACK ro:{%s}:samples trainer %s", q,
				    r->element[0]->element[1]->element[i]->element[0]->str));
		if (r)
			freeReplyObject(r);
		ro_test_msleep(25);
	}
	cr_expect_eq(done_count(c, q), 40, "all units done once the trainer caught up");
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 10000), 0);
	redisFree(c);
}

Test(agent, notify_protocol_in_order)
{
	char path[160], buf[4096], all[16384] = "", q[64];
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
	struct ro_test_agent a;
	const char *ready, *status_, *wd, *stopping;

	ro_test_name("notify", q, sizeof(q));
	(void)snprintf(path, sizeof(path), "%s/notify.sock", dir);
	strcpy(sa.sun_path, path);
	cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	start(&a, "a", q, (const char *const[]){"--imds", "false", NULL},
	      (const char *const[]){"NOTIFY_SOCKET", path, "WATCHDOG_USEC", "200000", NULL});
	/* read as systemd does, all along: a full datagram queue would block the sender */
	/* SIGTERM once the watchdog has been fed (an event: a slow start takes what it takes) */
	for (int t = 0, st = 0, exited = 0, termed = 0; t < 3000 && !exited; t++) {
		ssize_t n;

		while ((n = recv(fd, buf, sizeof(buf) - 1, MSG_DONTWAIT)) > 0) {
			buf[n] = '\0';
			strncat(all, buf, sizeof(all) - strlen(all) - 2);
			strcat(all, "\n");
		}
		if (!termed && strstr(all, "WATCHDOG=1")) {
			ro_test_agent_term(&a);
			termed = 1;
		}
		if (termed && waitpid(a.pid, &st, WNOHANG) == a.pid) {
			exited = 1;
			cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0);
			a.pid = 0;
		}
		ro_test_msleep(20);
	}
	cr_assert_eq(a.pid, 0, "exited after SIGTERM");
	for (ssize_t n; (n = recv(fd, buf, sizeof(buf) - 1, MSG_DONTWAIT)) > 0;) {
		buf[n] = '\0';
		strncat(all, buf, sizeof(all) - strlen(all) - 2);
		strcat(all, "\n");
	}
	close(fd);
	ready = strstr(all, "READY=1");
	status_ = strstr(all, "STATUS=");
	wd = strstr(all, "WATCHDOG=1");
	stopping = strstr(all, "STOPPING=1");
	cr_assert(ready && status_ && wd && stopping, "got: %s", all);
	cr_expect_lt(ready, wd, "READY before WATCHDOG");
	cr_expect_lt(wd, stopping, "WATCHDOG before STOPPING");
	cr_expect(strstr(all, "EXTEND_TIMEOUT_USEC="), "EXTEND_TIMEOUT_USEC while draining");
	cr_expect(strstr(all, "STATUS=drained"), "the last STATUS says drained");
}

static int run_cmd(const char *cmd, char *out, size_t len)
{
	FILE *f = popen(cmd, "r");
	size_t n;
	int st;

	cr_assert_not_null(f);
	n = fread(out, 1, len - 1, f);
	out[n] = '\0';
	st = pclose(f);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(agent, bad_config_is_an_error_naming_it)
{
	char cmd[1024], out[8192], conf[160];
	const char *d = ro_test_bin("RO_ROLLOUTD", "rolloutd");
	FILE *f;

	(void)snprintf(cmd, sizeof(cmd), "%s --model %s --no-such-thing 1 2>&1", d, model);
	cr_expect_eq(run_cmd(cmd, out, sizeof(out)), 2);
	cr_expect(strstr(out, "no-such-thing"), "%s", out);
	(void)snprintf(cmd, sizeof(cmd), "%s --model %s --lease-ms soon 2>&1", d, model);
	cr_expect_eq(run_cmd(cmd, out, sizeof(out)), 2);
	cr_expect(strstr(out, "lease-ms"), "%s", out);
	(void)snprintf(cmd, sizeof(cmd), "ROLLOUTD_REBALANCE=sometimes %s --model %s 2>&1", d, model);
	cr_expect_eq(run_cmd(cmd, out, sizeof(out)), 2);
	cr_expect(strstr(out, "rebalance") && strstr(out, "environment"), "%s", out);
	(void)snprintf(cmd, sizeof(cmd), "%s 2>&1", d);
	cr_expect_eq(run_cmd(cmd, out, sizeof(out)), 2);
	cr_expect(strstr(out, "model is not set"), "%s", out);
	/* file < env < flag, and the file's unknown key named with its line */
	(void)snprintf(conf, sizeof(conf), "%s/r.conf", dir);
	f = fopen(conf, "w");
	fprintf(f, "# test\nqueue = fromfile\nlease-ms = 4000\nclaim_batch = 3\nmodel = %s\n", model);
	fclose(f);
	(void)snprintf(cmd, sizeof(cmd),
		       "ROLLOUTD_LEASE_MS=5000 ROLLOUTD_CLAIM_BATCH=2 %s --config %s --claim-batch 7 "
		       "--print-config",
		       d, conf);
	cr_expect_eq(run_cmd(cmd, out, sizeof(out)), 0);
	cr_expect(strstr(out, "queue = fromfile\n"), "%s", out);
	cr_expect(strstr(out, "lease-ms = 5000\n"), "%s", out);
	cr_expect(strstr(out, "claim-batch = 7\n"), "%s", out);
	f = fopen(conf, "a");
	fprintf(f, "colour = blue\n");
	fclose(f);
	(void)snprintf(cmd, sizeof(cmd), "%s --config %s 2>&1", d, conf);
	cr_expect_eq(run_cmd(cmd, out, sizeof(out)), 2);
	cr_expect(strstr(out, "r.conf:6") && strstr(out, "colour"), "%s", out);
	/* a bad model is a clear error at start, not a crash */
	(void)snprintf(cmd, sizeof(cmd), "%s --model %s/nope --imds false 2>&1", d, dir);
	cr_expect_eq(run_cmd(cmd, out, sizeof(out)), 1);
	cr_expect(strstr(out, "config.json"), "%s", out);
}

Test(agent, bad_units_dead_lettered_with_reasons_policy_respected)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	struct ro_queue *qq;
	char q[64];
	struct ro_test_agent a;
	static const char *const bad[] = {
	    "{\"id\":\"vocab\",\"prompt\":[1,5000],\"n\":1,\"max_new_tokens\":4}",
	    "{\"id\":\"toolong\",\"prompt\":[1,2],\"n\":1,\"max_new_tokens\":900}",
	    "{\"id\":\"newer\",\"prompt\":[1,2],\"n\":1,\"max_new_tokens\":4,"
	    "\"min_policy_version\":5}",
	    "{\"id\":\"fine\",\"prompt\":[1,2],\"n\":2,\"max_new_tokens\":4}",
	};
	redisReply *r;

	ro_test_name("bad", q, sizeof(q));
	qq = ro_test_queue(ro_test_redis_url(), q, "enq", 3);
	for (size_t i = 0; i < 4; i++) {
		struct ro_unit u = {0};
		char why[256];
		int st;

		cr_assert_eq(ro_unit_parse(bad[i], strlen(bad[i]),
					   &(struct ro_unit_bounds){100, 64, 100000, 1 << 20}, &u, why,
					   sizeof(why)),
			     0, "%s", why);
		cr_assert_eq(ro_queue_enqueue(qq, &u, 1, &st), 0);
		ro_unit_clear(&u);
	}
	start(&a, "a", q, (const char *const[]){"--imds", "false", "--max-new-tokens", "100", NULL},
	      NULL);
	cr_assert(wait_done(c, q, 1, 20000));
	for (int i = 0; i < 100 && ro_test_int(c, "LLEN ro:{%s}:dead", q) < 2; i++)
		ro_test_msleep(50);
	cr_expect_eq(ro_test_int(c, "LLEN ro:{%s}:dead", q), 2);
	r = redisCommand(c, "HGET ro:{%s}:unit:vocab reason", q);
	cr_expect(r && r->str && strstr(r->str, "vocab"), "%s", r && r->str ? r->str : "(none)");
	freeReplyObject(r);
	r = redisCommand(c, "HGET ro:{%s}:unit:toolong reason", q);
	cr_expect(r && r->str && strstr(r->str, "max_new_tokens"), "%s",
		  r && r->str ? r->str : "(none)");
	freeReplyObject(r);
	/* the unit needing a newer policy is released, not run */
	cr_expect_eq(ro_test_int(c, "LLEN ro:{%s}:pending", q), 1);
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 10000), 0);
	start(&a, "a2", q, (const char *const[]){"--imds", "false", "--policy-version", "5", NULL},
	      NULL);
	cr_expect(wait_done(c, q, 2, 20000), "a worker with new enough weights runs it");
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 10000), 0);
	ro_queue_free(qq);
	redisFree(c);
}

/* A unit whose prompt and max_new_tokens together run past the model's context
 * (max_position_embeddings) is dead-lettered with that reason, not half-run. */
Test(agent, unit_past_the_models_context_dead_lettered)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	struct ro_queue *qq;
	char q[64], small[256], cmd[1024];
	struct ro_test_agent a;
	static const char *const units[] = {
	    "{\"id\":\"past\",\"prompt\":[1,2],\"n\":1,\"max_new_tokens\":63}",
	    "{\"id\":\"fits\",\"prompt\":[1,2],\"n\":2,\"max_new_tokens\":8}",
	};
	redisReply *r;

	(void)snprintf(small, sizeof(small), "%s/ctx64", dir);
	(void)snprintf(cmd, sizeof(cmd),
		       "cp -r %s %s && sed -i 's/\"max_position_embeddings\": [0-9]*/"
		       "\"max_position_embeddings\": 64/' %s/config.json",
		       model, small, small);
	cr_assert_eq(system(cmd), 0, "%s", cmd);
	ro_test_name("ctx", q, sizeof(q));
	qq = ro_test_queue(ro_test_redis_url(), q, "enq", 3);
	for (size_t i = 0; i < 2; i++) {
		struct ro_unit u = {0};
		char why[256];
		int st;

		cr_assert_eq(ro_unit_parse(units[i], strlen(units[i]),
					   &(struct ro_unit_bounds){100, 64, 100000, 1 << 20}, &u, why,
					   sizeof(why)),
			     0, "%s", why);
		cr_assert_eq(ro_queue_enqueue(qq, &u, 1, &st), 0);
		ro_unit_clear(&u);
	}
	ro_test_agent_start(&a, dir, small, redis_url(), "a", q,
			    (const char *const[]){"--imds", "false", NULL}, NULL);
	cr_assert(wait_done(c, q, 1, 20000));
	for (int i = 0; i < 100 && ro_test_int(c, "LLEN ro:{%s}:dead", q) < 1; i++)
		ro_test_msleep(50);
	cr_expect_eq(ro_test_int(c, "LLEN ro:{%s}:dead", q), 1);
	r = redisCommand(c, "HGET ro:{%s}:unit:past reason", q);
	cr_expect(r && r->str && strstr(r->str, "max_position_embeddings (64)"), "%s",
		  r && r->str ? r->str : "(none)");
	freeReplyObject(r);
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 10000), 0);
	ro_queue_free(qq);
	redisFree(c);
}

/* ---- expert-parallel groups (--ep-local-ranks) ------------------------------------------ */

static const char *const fi_env[] = {"FI_TCP_IFACE", "lo", "FI_SOCKETS_IFACE", "lo", NULL};

/* The pids of pid's children (the group's ranks, in fork order as Linux lists them). */
static int children(pid_t pid, pid_t *out, int max)
{
	char path[64], buf[256];
	FILE *f;
	int n = 0;

	(void)snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)pid, (int)pid);
	f = fopen(path, "r");
	if (!f)
		return 0;
	if (fgets(buf, sizeof(buf), f))
		for (char *p = strtok(buf, " \n"); p && n < max; p = strtok(NULL, " \n"))
			out[n++] = (pid_t)atoi(p);
	(void)fclose(f);
	return n;
}

/* Until a rank of the group has claimed a unit (at most 10 s), and half a second more. */
static void wait_working(const struct ro_test_agent *g)
{
	for (int i = 0; i < 200 && !ro_test_agent_log_has(g, "claimed u-"); i++)
		ro_test_msleep(50);
	ro_test_msleep(500);
}

/* EP = 2 (tcp on lo) and EP = 4 (shm) groups generate the units; every sample bitwise the
 * single-rank run's, and every rank did some of the work. */
Test(agent, ep_groups_equal_single_rank, .timeout = 240)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char ref[64];
	const int units = 12;
	const unsigned n = 2, max_new = ro_test_scaled(40);

	ro_test_name("epref", ref, sizeof(ref));
	reference_run(c, ref, units, n, max_new, 0, 0);
	for (int w = 2; w <= 4; w += 2) {
		char q[64], ranks[8];
		struct ro_test_agent g;
		struct smp *s;
		size_t ns;
		bool rank_seen[4] = {0};

		ro_test_name(w == 2 ? "ep2" : "ep4", q, sizeof(q));
		(void)snprintf(ranks, sizeof(ranks), "%d", w);
		enqueue(q, "u", units, n, max_new, 0, 0);
		start(&g, w == 2 ? "ep2" : "ep4", q,
		      (const char *const[]){"--imds", "false", "--ep-local-ranks", ranks,
					    "--fabric-provider", w == 2 ? "tcp" : "shm",
					    "--max-inflight", "4", "--claim-batch", "1", NULL},
		      fi_env);
		if (!wait_done(c, q, units, 120000)) {
			ro_test_agent_dump_log(&g);
			cr_assert_fail("EP=%d: not all units completed", w);
		}
		{
			const char *st = ro_test_agent_status(&g, "status\n");

			cr_expect(strstr(st, "\"ep\":{\"group\":") && ro_test_json_field(st, "exchanges") > 0,
				  "EP=%d: status --local shows the group and its exchanges: %s", w,
				  st);
		}
		ro_test_agent_term(&g);
		cr_expect_eq(ro_test_agent_wait_exit(&g, 20000), 0, "EP=%d: the group drains and exits 0", w);
		ro_test_verify_exactly_once(c, q, units, n);
		(void)same_samples(c, q, ref, (size_t)units * n);
		ns = read_samples(c, q, &s);
		for (size_t i = 0; i < ns; i++) {
			const char *r = strstr(s[i].worker, "-r");

			if (r && atoi(r + 2) < w)
				rank_seen[atoi(r + 2)] = true;
		}
		for (int r = 0; r < w; r++)
			cr_expect(rank_seen[r], "EP=%d: rank %d published nothing", w, r);
		free(s);
	}
	redisFree(c);
}

/* The lossy options end to end: summed combine, bf16 both ways: every sample once. */
Test(agent, ep_group_sum_combine_bf16, .timeout = 180)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64];
	struct ro_test_agent g;

	ro_test_name("epsum", q, sizeof(q));
	enqueue(q, "u", 6, 2, ro_test_scaled(30), 0, 0);
	start(&g, "eps", q,
	      (const char *const[]){"--imds", "false", "--ep-local-ranks", "2", "--fabric-provider",
				    "shm", "--ep-combine", "sum", "--ep-dtype", "bf16",
				    "--ep-combine-dtype", "bf16", "--max-inflight", "4", NULL},
	      fi_env);
	if (!wait_done(c, q, 6, 90000)) {
		ro_test_agent_dump_log(&g);
		cr_assert_fail("not all units completed");
	}
	{
		/* rank 1's metrics are a *.prom file too, for node_exporter's textfile collector */
		char m1[300];
		size_t n = strlen(g.metrics) - strlen(".prom");
		struct stat st;
		bool seen = false;

		(void)snprintf(m1, sizeof(m1), "%.*s-rank1.prom", (int)n, g.metrics);
		for (int i = 0; i < 2000 && !(seen = stat(m1, &st) == 0); i++)
			ro_test_msleep(25);
		cr_expect(seen, "%s", m1);
	}
	ro_test_agent_term(&g);
	cr_expect_eq(ro_test_agent_wait_exit(&g, 20000), 0);
	ro_test_verify_exactly_once(c, q, 6, 2);
	redisFree(c);
}

/* `rolloutctl drain` on rank 1 drains the whole group to its deadline; nothing is lost. */
Test(agent, ep_group_drains_together, .timeout = 240)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64], cmd[512];
	struct ro_test_agent g, b;
	int rc;

	ro_test_name("epdrain", q, sizeof(q));
	enqueue(q, "u", 9, 2, ro_test_scaled(1500), 0, 0);
	start(&g, "epd", q,
	      (const char *const[]){"--imds", "false", "--ep-local-ranks", "3",
				    "--fabric-provider", "shm", "--max-inflight", "4",
				    "--claim-batch", "1", "--drain-margin-ms", "0", NULL},
	      fi_env);
	wait_working(&g);
	(void)snprintf(cmd, sizeof(cmd), "%s drain --deadline 2 --socket %s.rank1 >/dev/null",
		       ro_test_bin("RO_ROLLOUTCTL", "rolloutctl"), g.sock);
	cr_assert_eq(system(cmd), 0, "rolloutctl drain to rank 1");
	rc = ro_test_agent_wait_exit(&g, 30000);
	if (rc)
		ro_test_agent_dump_log(&g);
	cr_expect_eq(rc, 0, "every rank drains and the group exits 0");
	cr_expect(ro_test_agent_log_has(&g, "group drain from rank 1"), "ranks 0 and 2 drained with rank 1");
	start(&b, "b", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	cr_assert(wait_done(c, q, 9, 120000), "the requeued units complete elsewhere");
	ro_test_agent_term(&b);
	cr_expect_eq(ro_test_agent_wait_exit(&b, 10000), 0);
	ro_test_verify_exactly_once(c, q, 9, 2);
	redisFree(c);
}

/* A rank killed with SIGKILL: the others name it within the timeout, requeue what they
 * hold and exit non-zero; everything completes elsewhere, once. */
Test(agent, ep_rank_killed_fails_fast, .timeout = 240)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64];
	struct ro_test_agent g, b;
	pid_t kids[8];
	int nk = 0, rc;
	int64_t t0;

	ro_test_name("epkill", q, sizeof(q));
	enqueue(q, "u", 9, 2, ro_test_scaled(1500), 0, 0);
	start(&g, "epk", q,
	      (const char *const[]){"--imds", "false", "--ep-local-ranks", "3",
				    "--fabric-provider", "tcp", "--max-inflight", "4",
				    "--claim-batch", "1", "--ep-timeout-ms", "2000", "--lease-ms",
				    "3000", "--checkpoint-tokens", "8", NULL},
	      fi_env);
	wait_working(&g);
	for (int i = 0; i < 50 && (nk = children(g.pid, kids, 8)) < 3; i++)
		ro_test_msleep(50);
	cr_assert_eq(nk, 3, "three ranks running");
	t0 = ro_test_wall_ms();
	kill(kids[2], SIGKILL);
	rc = ro_test_agent_wait_exit(&g, 20000);
	cr_expect(rc != 0 && rc != -1, "the group exits non-zero for its supervisor (got %d)", rc);
	cr_expect_lt(ro_test_wall_ms() - t0, 15000, "the others noticed within the timeout");
	cr_expect(ro_test_agent_log_has(&g, "expert-parallel group failed: .*rank"),
		  "the error names the late rank");
	cr_expect(ro_test_agent_log_has(&g, "requeued u-"), "the surviving ranks requeued what they held");
	if (!ro_test_agent_log_has(&g, "expert-parallel group failed"))
		ro_test_agent_dump_log(&g);
	start(&b, "b", q, (const char *const[]){"--imds", "false", "--lease-ms", "3000", NULL},
	      NULL);
	cr_assert(wait_done(c, q, 9, 120000), "everything completes elsewhere");
	ro_test_agent_term(&b);
	cr_expect_eq(ro_test_agent_wait_exit(&b, 10000), 0);
	ro_test_verify_exactly_once(c, q, 9, 2);
	redisFree(c);
}

/* ---- the control plane never blocks ------------------------------------------------------ */

/* Enqueue one unit given as JSON (bounds as large as the daemon's). */
static void enqueue_json(const char *q, const char *js)
{
	struct ro_queue *qq = ro_test_queue(redis_url(), q, "enq", 3);
	struct ro_unit u = {0};
	char why[256];
	int st;

	cr_assert_eq(ro_unit_parse(js, strlen(js),
				   &(struct ro_unit_bounds){1 << 24, 64, 1 << 24, 1 << 30}, &u, why,
				   sizeof(why)),
		     0, "%s", why);
	cr_assert_eq(ro_queue_enqueue(qq, &u, 1, &st), 0);
	ro_unit_clear(&u);
	ro_queue_free(qq);
}

/* {"id":id,"prompt":[len tokens],"n":n,"max_new_tokens":max_new}, malloc'd */
static char *unit_json(const char *id, unsigned len, unsigned n, unsigned max_new, unsigned seed)
{
	size_t cap = (size_t)len * 6 + 256, off;
	char *js = malloc(cap);

	off = (size_t)snprintf(js, cap, "{\"id\":\"%s\",\"prompt\":[", id);
	for (unsigned i = 0; i < len; i++)
		off += (size_t)snprintf(js + off, cap - off, "%s%u", i ? "," : "",
					(i * 37 + seed) % 1000 + 1);
	(void)snprintf(js + off, cap - off,
		       "],\"n\":%u,\"max_new_tokens\":%u,\"sampling\":{\"temperature\":1.0,"
		       "\"seed\":%u}}",
		       n, max_new, seed);
	return js;
}

static long dead_count(redisContext *c, const char *q)
{
	return ro_test_int(c, "LLEN ro:{%s}:dead", q);
}

static bool wait_dead(redisContext *c, const char *q, long want, long ms)
{
	for (long t = 0; t < ms; t += 50) {
		if (dead_count(c, q) >= want)
			return true;
		ro_test_msleep(50);
	}
	return false;
}

static char *hget(redisContext *c, const char *q, const char *id, const char *field)
{
	redisReply *rep = redisCommand(c, "HGET ro:{%s}:unit:%s %s", q, id, field);
	char *s = rep && rep->type == REDIS_REPLY_STRING ? strdup(rep->str) : strdup("");

	freeReplyObject(rep);
	return s;
}

/* Four 3000-token prompts claimed at once under 2 s leases: before, every claimed unit was
 * prefilled before the first renewal and all were lost; now the leases are renewed while
 * the engine prefills in chunks. */
Test(agent, long_prefills_keep_their_leases, .timeout = 240)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	const unsigned len = ro_test_scaled(3000);
	char q[64];
	struct ro_test_agent a;

	ro_test_name("prefill", q, sizeof(q));
	for (int i = 0; i < 4; i++) {
		char id[16], *js;

		(void)snprintf(id, sizeof(id), "u-%d", i);
		js = unit_json(id, len, 2, 8, (unsigned)i);
		enqueue_json(q, js);
		free(js);
	}
	start(&a, "a", q,
	      (const char *const[]){"--imds", "false", "--lease-ms", "2000", "--claim-batch", "4",
				    "--prefill-chunk", "256", NULL},
	      NULL);
	if (!wait_done(c, q, 4, 180000))
		ro_test_agent_dump_log(&a);
	cr_assert_eq(done_count(c, q), 4, "every unit completes");
	cr_expect_eq(dead_count(c, q), 0, "none dead-lettered");
	cr_expect_eq(ro_test_agent_field(&a, "lease_losses"), 0, "%s", ro_test_agent_status(&a, "status\n"));
	(void)ro_test_verify_exactly_once(c, q, 4, 2);
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	redisFree(c);
}

/* Paged KV in the daemon: a unit's n samples hold its prompt's cache once. Status reports
 * the KV bytes held and the positions they cover; while the samples decode, what is held
 * is at most the prompt once, each sample's own tokens and one block of slack each (a
 * copy per sample would hold the prompt n times), and nothing once the unit is done. */
Test(agent, samples_share_their_prompt_cache, .timeout = 240)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	const unsigned P = 640, N = 4;
	struct ro_make_model_opts o;
	double pos_bytes, bytes = 0, positions = 0;
	char q[64], *js;
	struct ro_test_agent a;

	ro_test_agent_model(&o);
	pos_bytes = 2.0 * o.layers * o.kv_heads * o.head_dim * sizeof(float);
	ro_test_name("kvshare", q, sizeof(q));
	js = unit_json("u-0", P, N, ro_test_scaled(2000), 7);
	enqueue_json(q, js);
	free(js);
	start(&a, "a", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	for (int i = 0; i < 800 && ro_test_agent_field(&a, "in_flight") < N; i++)
		ro_test_msleep(25);
	for (int i = 0; i < 400 && positions <= (double)P * N; i++) {
		/* (one status: the two figures are one step's snapshot) */
		const char *st = ro_test_agent_status(&a, "status\n");

		bytes = ro_test_json_field(st, "kv_bytes");
		positions = ro_test_json_field(st, "kv_positions");
		cr_assert(bytes >= 0 && positions >= 0, "status has kv_bytes and kv_positions: %s",
			  st);
		if (positions <= (double)P * N)
			ro_test_msleep(25);
	}
	cr_assert_gt(positions, (double)P * N, "the samples decode (%.0f positions)", positions);
	cr_expect_gt(bytes, 0);
	cr_expect_leq(bytes / pos_bytes, P + (positions - (double)P * N) + N * 64.0,
		      "%.0f positions' worth of KV held for %.0f positions of %u samples of a "
		      "%u-token prompt: the prompt is not shared",
		      bytes / pos_bytes, positions, N, P);
	if (!wait_done(c, q, 1, 180000))
		ro_test_agent_dump_log(&a);
	cr_assert_eq(done_count(c, q), 1);
	for (int i = 0; i < 400 && ro_test_agent_field(&a, "kv_bytes") > 0; i++)
		ro_test_msleep(25);
	cr_expect_eq(ro_test_agent_field(&a, "kv_bytes"), 0,
		     "a finished unit's blocks are freed: %s",
		     ro_test_agent_status(&a, "status\n"));
	(void)ro_test_verify_exactly_once(c, q, 1, N);
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	redisFree(c);
}

/* SIGTERM with a 4 s grace and a 2 s margin while Redis is stopped (or refusing
 * connections): the agent exits within the 6 s, its units are reaped with their
 * checkpoints, and every unit still completes exactly once. */
static void drain_without_redis(bool kill_it)
{
	struct ro_test_redis r;
	redisContext *c;
	char q[64];
	struct ro_test_agent a, b;
	int64_t t0, took;

	cr_assert_eq(ro_test_redis_start(&r, true), 0); /* AOF: a killed server comes back whole */
	agent_redis = r.url;
	c = ro_test_redis_connect(r.url);
	ro_test_name("noredis", q, sizeof(q));
	enqueue(q, "u", 6, 2, ro_test_scaled(400), 0, 0);
	start(&a, "a", q,
	      (const char *const[]){"--imds", "false", "--sigterm-grace-s", "4",
				    "--drain-margin-ms", "2000", "--lease-ms", "10000",
				    "--checkpoint-tokens", "8", NULL},
	      NULL);
	for (int i = 0; i < 400 && ro_test_agent_field(&a, "in_flight") < 1; i++)
		ro_test_msleep(25);
	cr_assert_geq(ro_test_agent_field(&a, "in_flight"), 1, "working");
	if (kill_it)
		ro_test_redis_kill(&r);
	else
		(void)kill(r.pid, SIGSTOP);
	t0 = ro_test_mono_ms();
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	took = ro_test_mono_ms() - t0;
	/* the promise is 6 s; the second more is for the process's own exit on a busy box */
	cr_expect_leq(took, 7000, "exited %lld ms after SIGTERM (due within 6000)",
		      (long long)took);
	if (!ro_test_agent_log_has(&a, "hard deadline passed")) {
		ro_test_agent_dump_log(&a);
		cr_expect_fail("says what it left behind");
	}
	if (kill_it)
		cr_assert_eq(ro_test_redis_restart(&r), 0);
	else
		(void)kill(r.pid, SIGCONT);
	redisFree(c);
	c = ro_test_redis_connect(r.url);
	start(&b, "b", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	if (!wait_done(c, q, 6, 120000))
		ro_test_agent_dump_log(&b);
	cr_assert_eq(done_count(c, q), 6);
	(void)ro_test_verify_exactly_once(c, q, 6, 2);
	ro_test_agent_term(&b);
	cr_expect_eq(ro_test_agent_wait_exit(&b, 30000), 0);
	redisFree(c);
	ro_test_redis_stop(&r);
	agent_redis = NULL;
}

Test(agent, drain_on_time_with_redis_stopped, .timeout = 240)
{
	drain_without_redis(false);
}

Test(agent, drain_on_time_with_redis_refusing, .timeout = 240)
{
	drain_without_redis(true);
}

/* A claim the agent gave up on while Redis stood still (SIGSTOP) runs when it goes on,
 * leasing a unit to an agent that never heard the answer. The agent's next claim carries
 * the same request id and gets the unit back, and runs it under that lease: done with no
 * expiry after the agent's claim. (It used to claim past it; the
 * orphaned lease expired and charged the unit an attempt.) To have a unit for that claim
 * to take and none for the agent to take first, another worker holds it under a lease
 * that runs out while Redis is stopped (a claim reaps expired leases first). A server of
 * its own, since it is stopped. */
Test(agent, unanswered_claim_is_taken_up, .timeout = 240)
{
	struct ro_test_redis r;
	redisContext *c;
	char q[64], pfx[96];
	struct ro_test_agent a;
	redisReply *rep;
	bool idle = false;
	const char *body = "{\"id\":\"g-0\",\"prompt\":[5,6,7],\"n\":2,\"max_new_tokens\":24,"
			   "\"sampling\":{\"temperature\":1.0,\"seed\":3}}";
	const char *h;

	cr_assert_eq(ro_test_redis_start(&r, false), 0);
	agent_redis = r.url;
	c = ro_test_redis_connect(r.url);
	ro_test_name("ghost", q, sizeof(q));
	start(&a, "ghostw", q,
	      (const char *const[]){"--imds", "false", "--redis-timeout-ms", "200", "--lease-ms",
				    "6000", "--max-attempts", "5", NULL},
	      NULL);
	/* idle: blocked on the wake-up marker */
	for (int i = 0; i < 800 && !idle; i++) {
		rep = redisCommand(c, "CLIENT LIST");
		idle = rep && rep->type == REDIS_REPLY_STRING && strstr(rep->str, "flags=b ");
		freeReplyObject(rep);
		if (!idle)
			ro_test_msleep(25);
	}
	cr_assert(idle, "the agent never waited for work");
	/* in one write, so that the agent's claim (woken by the enqueue) comes after: the
	 * unit, and worker x's claim of it under a 1.5 s lease */
	(void)snprintf(pfx, sizeof(pfx), "ro:{%s}:", q);
	(void)redisAppendCommand(c, "FCALL ro_enqueue 1 %s g-0 %s 2 %s", pfx, body, "");
	(void)redisAppendCommand(c, "FCALL ro_claim 1 %s x 1 1500 0123456789abcdef 5 60000", pfx);
	for (int i = 0; i < 2; i++) {
		cr_assert_eq(redisGetReply(c, (void **)&rep), REDIS_OK);
		cr_assert(rep->type != REDIS_REPLY_ERROR, "%s", rep->str);
		freeReplyObject(rep);
	}
	cr_assert_eq(kill(r.pid, SIGSTOP), 0);
	/* the agent's next look for work (its wait times out on the stopped server) is a
	 * claim that times out in turn */
	for (int i = 0; i < 1200 && !ro_test_agent_log_has(&a, "claim: "); i++)
		ro_test_msleep(25);
	ro_test_msleep(1600); /* x's lease is over by the server's clock too */
	cr_assert_eq(kill(r.pid, SIGCONT), 0);
	if (!ro_test_agent_log_has(&a, "claim: ")) {
		ro_test_agent_dump_log(&a);
		cr_assert_fail("no claim timed out while Redis was stopped");
	}
	if (!wait_done(c, q, 1, 120000))
		ro_test_agent_dump_log(&a);
	cr_assert_eq(done_count(c, q), 1);
	rep = redisCommand(c, "HGET ro:{%s}:unit:g-0 hist", q);
	cr_assert(rep && rep->type == REDIS_REPLY_STRING);
	/* x's lease expired; after the agent's claim, nothing did */
	h = strstr(rep->str, "\"w\":\"ghostw\"");
	cr_assert(h, "the agent never claimed it: %s", rep->str);
	if (strstr(h, "\"expired\""))
		ro_test_agent_dump_log(&a);
	cr_expect(!strstr(h, "\"expired\""), "a lease of the agent's expired: %s", rep->str);
	cr_expect_eq(ro_test_int(c, "HGET ro:{%s}:unit:g-0 attempt", q), 2, "%s", rep->str);
	freeReplyObject(rep);
	(void)ro_test_verify_exactly_once(c, q, 1, 2);
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	redisFree(c);
	ro_test_redis_stop(&r);
	agent_redis = NULL;
}

/* A control connection; with nonblock, one the daemon must take at once (a unix socket
 * refuses a non-blocking connect while its backlog is full). */
static int connect_to(const char *path, bool nonblock)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | (nonblock ? SOCK_NONBLOCK : 0), 0);

	strcpy(sa.sun_path, path);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
		close(fd);
		return -1;
	}
	return fd;
}

/* 64 idle connections held on the control socket: the agent still publishes and answers;
 * a command in two writes works; only exact command words count. */
Test(agent, control_socket_flood_and_exact_commands, .timeout = 180)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64], buf[2048];
	struct ro_test_agent a;
	int idle[64], fd;
	double before;
	ssize_t n;

	ro_test_name("flood", q, sizeof(q));
	enqueue(q, "u", 40, 4, ro_test_scaled(64), 0, 0);
	start(&a, "a", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	for (int i = 0; i < 400 && ro_test_agent_field(&a, "in_flight") < 1; i++)
		ro_test_msleep(25);
	for (int i = 0; i < 64; i++) {
		idle[i] = connect_to(a.sock, true);
		cr_assert_geq(idle[i], 0, "connection %d taken at once", i);
	}
	before = ro_test_agent_field(&a, "published");
	cr_assert_geq(before, 0, "answers beside 64 idle clients");
	for (int i = 0; i < 600 && ro_test_agent_field(&a, "published") < before + 10; i++)
		ro_test_msleep(25);
	cr_expect_geq(ro_test_agent_field(&a, "published"), before + 10,
		      "still publishing beside 64 idle clients");
	for (int i = 0; i < 64; i++) { /* none of them was dropped meanwhile */
		char x;

		cr_expect_eq(recv(idle[i], &x, 1, MSG_DONTWAIT), -1, "connection %d closed", i);
	}
	/* one command in two writes */
	fd = connect_to(a.sock, false);
	cr_assert_eq(send(fd, "sta", 3, MSG_NOSIGNAL), 3);
	ro_test_msleep(50);
	cr_assert_eq(send(fd, "tus\n", 4, MSG_NOSIGNAL), 4, "the first half was taken");
	n = read(fd, buf, sizeof(buf) - 1);
	cr_assert_gt(n, 0);
	buf[n] = '\0';
	cr_expect(strstr(buf, "\"state\":\"running\""), "%s", buf);
	close(fd);
	/* a line that merely begins with "drain" is not a drain */
	cr_expect(strstr(ro_test_agent_status(&a, "drainage please\n"), "unknown command"));
	cr_expect(strstr(ro_test_agent_status(&a, "drain now\n"), "error"));
	cr_expect(strstr(ro_test_agent_status(&a, "status\n"), "\"state\":\"running\""), "not draining");
	for (int i = 0; i < 64; i++)
		close(idle[i]);
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	redisFree(c);
}

/* SIGKILL, then the same worker id again: what the old process held is resumed at once
 * (no attempt charged, no wait for the 2-minute leases). */
Test(agent, restart_with_same_worker_id_resumes_held_units, .timeout = 240)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64];
	struct ro_test_agent a;

	ro_test_name("held", q, sizeof(q));
	enqueue(q, "u", 4, 2, ro_test_scaled(300), 0, 0);
	start(&a, "w", q,
	      (const char *const[]){"--imds", "false", "--lease-ms", "120000", "--claim-batch",
				    "4", "--checkpoint-tokens", "8", NULL},
	      NULL);
	for (int i = 0; i < 800 && ro_test_int(c, "ZCARD ro:{%s}:leases", q) < 4; i++)
		ro_test_msleep(25);
	cr_assert_eq(ro_test_int(c, "ZCARD ro:{%s}:leases", q), 4, "holds all four");
	kill(a.pid, SIGKILL);
	(void)ro_test_agent_wait_exit(&a, 10000);
	start(&a, "w", q, (const char *const[]){"--imds", "false", "--lease-ms", "120000", NULL},
	      NULL);
	if (!wait_done(c, q, 4, 90000))
		ro_test_agent_dump_log(&a);
	cr_assert_eq(done_count(c, q), 4, "done well before the old leases expire");
	cr_expect(ro_test_agent_log_has(&a, "still holds 4 units"), "resumed what it held");
	for (int i = 0; i < 4; i++) {
		char id[16], *att;

		(void)snprintf(id, sizeof(id), "u-%d", i);
		att = hget(c, q, id, "attempt");
		cr_expect_str_eq(att, "1", "unit %s charged an attempt", id);
		free(att);
	}
	(void)ro_test_verify_exactly_once(c, q, 4, 2);
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	redisFree(c);
}

/* Checkpoints holding tokens outside the vocabulary (or negative): before, each claim
 * failed and released the unit, ~20,000 times a minute; now the sample starts over and
 * comes out bitwise as an uninterrupted run's. */
Test(agent, bad_checkpoints_restart_their_samples, .timeout = 180)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64], ref[64];
	int32_t big[2] = {5, 99999}, neg[1] = {-3};
	float lp2[2] = {-0.5f, -0.25f}, lp1[1] = {-1.0f};
	struct ro_progress p0 = {.idx = 0, .len = 2, .tokens = big, .logprobs = lp2, .sampler_pos = 2},
			   p1 = {.idx = 1, .len = 1, .tokens = neg, .logprobs = lp1, .sampler_pos = 1};
	char *e0 = ro_progress_encode(&p0), *e1 = ro_progress_encode(&p1);
	struct ro_test_agent a;

	ro_test_name("badckpt", q, sizeof(q));
	ro_test_name("badref", ref, sizeof(ref));
	reference_run(c, ref, 1, 2, ro_test_scaled(24), 0, 0);
	enqueue(q, "u", 1, 2, ro_test_scaled(24), 0, 0);
	freeReplyObject(redisCommand(c, "HSET ro:{%s}:unit:u-0 p:0 %s p:1 %s ckpt 1", q, e0, e1));
	free(e0);
	free(e1);
	start(&a, "a", q, (const char *const[]){"--imds", "false", NULL}, NULL);
	if (!wait_done(c, q, 1, 60000))
		ro_test_agent_dump_log(&a);
	cr_assert_eq(done_count(c, q), 1);
	cr_expect_eq(same_samples(c, q, ref, 2), 0, "started over, not resumed");
	cr_expect(ro_test_agent_log_has(&a, "checkpoint discarded"));
	cr_expect_eq(ro_test_agent_field(&a, "claimed"), 1, "claimed once, no loop");
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	redisFree(c);
}

/* A unit no worker can hold in memory: before, released without charge and claimed again
 * forever; now each claim charges an attempt and the last dead-letters it with the reason. */
Test(agent, unit_too_big_for_memory_is_dead_lettered, .timeout = 120)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64], *js, *why;
	struct ro_test_agent a;

	char big[256], cmd[1024];

	/* a model whose context holds the unit (max_position_embeddings 2^24): only memory
	 * stops it */
	(void)snprintf(big, sizeof(big), "%s/ctxbig", dir);
	(void)snprintf(cmd, sizeof(cmd),
		       "rm -rf %s && cp -r %s %s && sed -i 's/\"max_position_embeddings\": [0-9]*/"
		       "\"max_position_embeddings\": 16777216/' %s/config.json",
		       big, model, big, big);
	cr_assert_eq(system(cmd), 0, "%s", cmd);
	ro_test_name("toobig", q, sizeof(q));
	js = unit_json("big", 16000, 64, (1 << 24) - 16000, 1);
	enqueue_json(q, js);
	free(js);
	ro_test_agent_start(&a, dir, big, redis_url(), "a", q,
			    (const char *const[]){"--imds", "false", "--max-attempts", "2",
						  "--max-prompt", "16000", "--max-new-tokens",
						  "16777216", NULL},
			    NULL);
	if (!wait_dead(c, q, 1, 60000))
		ro_test_agent_dump_log(&a);
	cr_assert_eq(dead_count(c, q), 1);
	why = hget(c, q, "big", "reason");
	cr_expect(strstr(why, "MiB available") && strstr(why, "attempt 2 of 2"), "%s", why);
	free(why);
	cr_expect_eq(ro_test_agent_field(&a, "claimed"), 2, "two attempts, no loop");
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	redisFree(c);
}

/* A unit record that disagrees with its body (n differs; a stray sample field that makes
 * the completion INCOMPLETE): before, retried forever or taken for success; now the first
 * dead-lettered at once, the second charged an attempt per run (a server that lost its last
 * writes gives the same INCOMPLETE, and the next claim repairs that) and dead-lettered with
 * the reason at the last. */
Test(agent, inconsistent_unit_records_are_dead_lettered, .timeout = 120)
{
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	char q[64], *why;
	struct ro_test_agent a;

	ro_test_name("badrec", q, sizeof(q));
	enqueue(q, "u", 2, 2, ro_test_scaled(16), 0, 0);
	freeReplyObject(redisCommand(c, "HSET ro:{%s}:unit:u-0 n 3", q));
	freeReplyObject(redisCommand(c, "HSET ro:{%s}:unit:u-1 s:0 0-1", q));
	start(&a, "a", q, (const char *const[]){"--imds", "false", "--max-attempts", "2", NULL},
	      NULL);
	if (!wait_dead(c, q, 2, 60000))
		ro_test_agent_dump_log(&a);
	cr_assert_eq(dead_count(c, q), 2);
	why = hget(c, q, "u-0", "reason");
	cr_expect(strstr(why, "says n=3"), "%s", why);
	free(why);
	why = hget(c, q, "u-1", "reason");
	cr_expect(strstr(why, "INCOMPLETE") && strstr(why, "attempt 2 of 2"), "%s", why);
	free(why);
	cr_expect_eq(done_count(c, q), 0, "nothing taken for a success");
	cr_expect_eq(ro_test_agent_field(&a, "claimed"), 3, "u-0 once, u-1 per attempt");
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	redisFree(c);
}
