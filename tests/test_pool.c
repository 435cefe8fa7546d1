/* The forward pass's fork-join pool (kernels/pool.c): every index of every parallel-for
 * runs exactly once, with that job's function and argument, however jobs follow each other
 * (back to back, after the workers fell asleep, of one index, of many), and a job is done
 * when its indexes are, not when every worker has looked in. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/internal.h"

struct job {
	uint32_t id;	       /* which job: a stale worker would bring another one's */
	_Atomic uint32_t *hits; /* per index */
	_Atomic uint32_t wrong;
	_Atomic uint64_t sum;
};

static void count(void *arg, uint32_t i)
{
	struct job *j = arg;

	atomic_fetch_add(&j->hits[i], 1);
	atomic_fetch_add(&j->sum, (uint64_t)j->id * 1000003u + i);
}

static void check_job(struct ro_pool *p, uint32_t id, uint32_t n, _Atomic uint32_t *hits)
{
	struct job j = {.id = id, .hits = hits};
	uint64_t want = 0;

	for (uint32_t i = 0; i < n; i++) {
		atomic_store(&hits[i], 0);
		want += (uint64_t)id * 1000003u + i;
	}
	ro_pool_for(p, n, count, &j);
	/* the pool returned: every index ran once, and nothing of this job runs any more */
	for (uint32_t i = 0; i < n; i++)
		cr_assert_eq(atomic_load(&hits[i]), 1, "job %u (n %u): index %u ran %u times", id,
			     n, i, atomic_load(&hits[i]));
	cr_assert_eq(atomic_load(&j.sum), want, "job %u: an index ran with another job's state",
		     id);
}

Test(pool, every_index_runs_once_in_back_to_back_jobs)
{
	static const uint32_t threads[] = {2, 3, 5};
	_Atomic uint32_t *hits = calloc(4096, sizeof(*hits));

	cr_assert_not_null(hits);
	for (size_t t = 0; t < sizeof(threads) / sizeof(threads[0]); t++) {
		struct ro_pool *p = NULL;

		cr_assert_eq(ro_pool_new(threads[t], &p), 0);
		cr_assert_eq(ro_pool_size(p), threads[t]);
		/* sizes from 0 to 4096, many of them smaller than the thread count */
		for (uint32_t id = 1; id <= 20000; id++)
			check_job(p, id, (id * 2654435761u >> 7) % (id % 7 ? 9 : 4097), hits);
		ro_pool_free(p);
	}
	free(hits);
}

/* Workers asleep (past their spin) are woken by the next job, and a job that lands while
 * they fall asleep is not lost: each job is checked as it comes back. */
Test(pool, jobs_after_the_workers_sleep)
{
	_Atomic uint32_t *hits = calloc(256, sizeof(*hits));
	struct ro_pool *p = NULL;

	cr_assert_not_null(hits);
	cr_assert_eq(ro_pool_new(3, &p), 0);
	for (uint32_t id = 1; id <= 60; id++) {
		/* from no pause to a pause well past the spin (20,000 pauses: ~1 ms or less) */
		struct timespec ts = {0, (long)(id % 6) * 700000L};

		(void)nanosleep(&ts, NULL);
		check_job(p, id, 256, hits);
	}
	ro_pool_free(p);
	free(hits);
}

/* A task that waits until every index of its job has been taken: with the caller as one
 * thread, the job cannot finish unless the others take part, so the pool really is
 * parallel; and the job ends once they have (the caller waits for no more than that). */
struct gate {
	_Atomic uint32_t taken;
	_Atomic bool gave_up;
	uint32_t n;
};

static void wait_all(void *arg, uint32_t i)
{
	struct gate *g = arg;
	time_t t0 = time(NULL);

	(void)i;
	atomic_fetch_add(&g->taken, 1);
	while (atomic_load(&g->taken) < g->n)
		if (time(NULL) - t0 > 60) {
			atomic_store(&g->gave_up, true); /* the assertion below reports it */
			return;
		}
}

Test(pool, workers_take_part)
{
	struct ro_pool *p = NULL;

	cr_assert_eq(ro_pool_new(3, &p), 0);
	for (int rep = 0; rep < 50; rep++) {
		struct gate g = {.n = 3};

		ro_pool_for(p, 3, wait_all, &g);
		cr_assert_eq(atomic_load(&g.taken), 3);
		/* the caller takes what is left once its task gives up: that is not taking
		 * part (a worker that started late slept through the pool's first job) */
		cr_assert(!atomic_load(&g.gave_up), "rep %d: a worker did not take part", rep);
	}
	ro_pool_free(p);
}

Test(pool, one_thread_runs_inline)
{
	_Atomic uint32_t *hits = calloc(64, sizeof(*hits));
	struct ro_pool *p = NULL;

	cr_assert_eq(ro_pool_new(1, &p), 0);
	cr_assert_eq(ro_pool_size(p), 1);
	for (uint32_t id = 1; id <= 100; id++)
		check_job(p, id, id % 64, hits);
	ro_pool_free(p);
	free(hits);
}
