/* Whole workers as separate processes against one redis-server: a worker killed with
 * SIGKILL mid-unit, eight workers racing for 2,000 units, and a poison unit that kills
 * every worker that takes it. Every sample of every unit ends up in the stream once. */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
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
	ro_test_name("w", Q, sizeof(Q));
}

static void teardown(void)
{
	redisFree(R);
}

TestSuite(workers, .init = setup, .fini = teardown, .timeout = 120);

/* Claims one unit, publishes samples 0 and 1 of its 4, checkpoints sample 2 with a
 * three-token prefix, and dies. */
static void crash_midway(const char *worker)
{
	struct ro_queue *q = ro_test_queue(ro_test_redis_url(), Q, worker, 3);
	struct ro_claim *c;
	size_t n;
	int32_t tok[3] = {100, 101, 102};
	float lp[3] = {-0.5f, -0.25f, -0.125f};
	struct ro_progress p = {
	    .idx = 2, .len = 3, .tokens = tok, .logprobs = lp, .sampler_pos = 3};
	struct ro_sample s[2] = {
	    {.idx = 0, .tokens = tok, .logprobs = lp, .len = 1, .finish = "stop"},
	    {.idx = 1, .tokens = tok, .logprobs = lp, .len = 2, .finish = "stop"},
	};
	char ids[2][24];

	if (ro_queue_claim(q, 1, 400, &c, &n) != 1 ||
	    ro_queue_publish(q, c, s, 2, false, ids, NULL) || ro_queue_checkpoint(q, c, &p, 1) != 1)
		_exit(3);
	(void)raise(SIGKILL);
	_exit(4);
}

Test(workers, sigkill_mid_unit_resumes_from_the_checkpoint)
{
	struct ro_queue *q = ro_test_queue(ro_test_redis_url(), Q, "B", 3);
	struct ro_claim *c;
	size_t n;
	uint32_t req = 0, dead = 0;
	pid_t pid[4];
	long done;

	ro_test_enqueue(q, "c", 0, 12, 4, false);
	for (int i = 0; i < 4; i++) {
		pid[i] = fork();
		if (pid[i] == 0) {
			char w[16];

			(void)snprintf(w, sizeof(w), "doomed%d", i);
			crash_midway(w);
		}
	}
	for (int i = 0; i < 4; i++) {
		int st;

		cr_assert_eq(waitpid(pid[i], &st, 0), pid[i]);
		cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "child %d: status %d", i, st);
	}
	cr_assert_eq(ro_test_int(R, "XLEN ro:{%s}:samples", Q), 8);
	ro_test_msleep(500);
	cr_assert_eq(ro_queue_reap(q, &req, &dead), 0);
	cr_assert_eq(req, 4);
	cr_assert_eq(dead, 0);
	/* the crashed units are at the head, with what was published and the checkpoint;
	 * having failed once, each is claimed alone */
	for (int k = 0; k < 4; k++) {
		cr_assert_eq(ro_queue_claim(q, 4, 10000, &c, &n), 1);
		cr_assert_eq(c[0].attempt, 2);
		cr_assert_eq(c[0].n_published, 2);
		cr_assert_eq(c[0].n_progress, 1);
		cr_assert_eq(c[0].progress[0].idx, 2);
		cr_assert_eq(c[0].progress[0].len, 3);
		cr_assert_eq(c[0].progress[0].tokens[2], 102);
		cr_assert_eq(c[0].progress[0].logprobs[2], -0.125f);
		cr_assert_eq(c[0].progress[0].sampler_pos, 3);
		/* hand it back untouched (to the tail: the next crashed unit is at the head) */
		cr_assert_eq(ro_queue_release(q, &c[0]), 0);
		ro_claims_free(c, n);
	}
	done = ro_test_worker_run(ro_test_redis_url(), Q, "B", 12, 60, 10000, false);
	cr_assert_eq(done, 12);
	/* samples 2 of the four crashed units resumed from the 3-token prefix */
	cr_assert_eq(ro_test_verify_exactly_once(R, Q, 12, 4), 4);
	ro_queue_free(q);
}

Test(workers, eight_workers_race_for_2000_units)
{
	const long units = 2000;
	const int W = 8;
	struct ro_queue *q = ro_test_queue(ro_test_redis_url(), Q, "producer", 3);
	pid_t pid[8];
	int fds[8][2];
	long total = 0;

	ro_test_enqueue(q, "r", 0, (int)units, 2, false);
	ro_queue_free(q);
	for (int i = 0; i < W; i++) {
		cr_assert_eq(pipe(fds[i]), 0);
		pid[i] = fork();
		if (pid[i] == 0) {
			char w[16];
			long done;

			(void)snprintf(w, sizeof(w), "racer%d", i);
			done =
			    ro_test_worker_run(ro_test_redis_url(), Q, w, units, 100, 30000, false);
			if (write(fds[i][1], &done, sizeof(done)) != sizeof(done))
				_exit(1);
			_exit(0);
		}
		(void)close(fds[i][1]);
	}
	for (int i = 0; i < W; i++) {
		long done = 0;
		int st;

		cr_assert_eq(read(fds[i][0], &done, sizeof(done)), (ssize_t)sizeof(done));
		(void)close(fds[i][0]);
		cr_assert_eq(waitpid(pid[i], &st, 0), pid[i]);
		cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
		total += done;
	}
	cr_assert_eq(total, units, "completions %ld, want %ld", total, units);
	cr_assert_eq(ro_test_int(R, "HGET ro:{%s}:stats done", Q), units);
	(void)ro_test_verify_exactly_once(R, Q, units, 2);
}

Test(workers, poison_unit_goes_dead_and_the_rest_flows)
{
	const long good = 20;
	struct ro_queue *q = ro_test_queue(ro_test_redis_url(), Q, "producer", 3);
	struct ro_dead *d;
	size_t nd;
	int deaths = 0, spawned = 0;

	ro_test_enqueue(q, "poison", 0, 1, 1, true);
	ro_test_enqueue(q, "good", 0, (int)good, 2, false);
	/* a supervisor that restarts its worker whenever it dies, a bounded number of times */
	while (spawned < 12) {
		pid_t pid = fork();
		int st;

		if (pid == 0) {
			char w[16];

			(void)snprintf(w, sizeof(w), "life%d", spawned);
			(void)ro_test_worker_run(ro_test_redis_url(), Q, w, good + 1, 30, 800,
						 true);
			_exit(0);
		}
		spawned++;
		cr_assert_eq(waitpid(pid, &st, 0), pid);
		if (WIFSIGNALED(st)) {
			deaths++;
			continue;
		}
		cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
		break;
	}
	cr_assert_eq(deaths, 3, "a worker died %d times, want the attempt limit 3", deaths);
	cr_assert_eq(ro_queue_dead_list(q, 0, 10, &d, &nd), 1, "%zu dead units, want 1", nd);
	cr_assert_str_eq(d[0].id, "poison-0");
	cr_assert_eq(d[0].attempt, 3);
	cr_assert(strstr(d[0].reason, "attempt 3 of 3"), "%s", d[0].reason);
	/* its history names each worker that took it */
	cr_assert(strstr(d[0].history, "life0") && strstr(d[0].history, "life1") &&
		      strstr(d[0].history, "life2"),
		  "%s", d[0].history);
	ro_dead_free(d, nd);
	cr_assert_eq(ro_test_int(R, "HGET ro:{%s}:stats done", Q), good);
	ro_queue_free(q);
}
