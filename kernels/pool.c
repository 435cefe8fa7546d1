/* A small fork-join thread pool for the forward pass: the caller and N-1 workers take
 * indexes of a parallel-for from one atomic counter. Workers spin briefly between jobs
 * (a decode step issues a few hundred back to back) and then sleep on a condition
 * variable, so an idle daemon costs no CPU.
 *
 * A job is done when its last index is done: the caller never waits for a worker that
 * has not joined it (one descheduled by another process on a busy node, or still asleep),
 * only for those inside it to leave. Joining is a compare-and-swap on one word, the job's
 * generation, an open bit and the count of workers inside: a worker enters only an open
 * job of the generation it read, and the caller, once every index is done, closes the job
 * and waits for the count to drop to zero before it writes the next job's function. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "kernels/internal.h"

#define SPIN_ROUNDS 20000

#define ST_OPEN (1ull << 31)
#define ST_INSIDE 0x7fffffffull
#define ST_GEN(s) ((s) >> 32)

struct ro_pool {
	uint32_t n; /* threads including the caller */
	pthread_t *th;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	_Atomic uint64_t state; /* generation << 32 | ST_OPEN | workers inside */
	_Atomic uint32_t next, done, sleepers;
	_Atomic bool stop;
	uint32_t total; /* these three: written only while no worker is inside */
	void (*fn)(void *arg, uint32_t i);
	void *arg;
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#endif
}

static void run_tasks(struct ro_pool *p)
{
	const uint32_t total = p->total;
	uint32_t i;

	while ((i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed)) < total) {
		p->fn(p->arg, i);
		atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
	}
}

/* Enter the open job *s says (a CAS that fails reloads *s: the same job with another
 * count, or a newer job); false once the state read is closed. */
static bool enter(struct ro_pool *p, uint64_t *s)
{
	while (*s & ST_OPEN)
		if (atomic_compare_exchange_weak_explicit(&p->state, s, *s + 1, memory_order_acquire,
							  memory_order_acquire))
			return true;
	return false;
}

static void *worker(void *arg)
{
	struct ro_pool *p = arg;
	/* the generation the pool was made with (0: state starts zeroed and no job opens
	 * before ro_pool_new returns), not the one this thread first reads: a worker that
	 * starts after the first job opened would take that job as already seen and sleep
	 * through it (test_pool's workers_take_part waited out its 60 s timeout on it, every
	 * run, on 2 vCPUs) */
	uint64_t seen = 0;

	for (;;) {
		uint64_t s;
		int spins = 0;

		while (ST_GEN(s = atomic_load_explicit(&p->state, memory_order_acquire)) == seen &&
		       !atomic_load_explicit(&p->stop, memory_order_relaxed) && spins++ < SPIN_ROUNDS)
			cpu_relax();
		if (ST_GEN(s) == seen && !atomic_load(&p->stop)) {
			(void)pthread_mutex_lock(&p->mu);
			atomic_fetch_add(&p->sleepers, 1); /* seq_cst: see ro_pool_for */
			while (ST_GEN(s = atomic_load(&p->state)) == seen && !atomic_load(&p->stop))
				(void)pthread_cond_wait(&p->cv, &p->mu);
			atomic_fetch_sub(&p->sleepers, 1);
			(void)pthread_mutex_unlock(&p->mu);
		}
		if (atomic_load(&p->stop))
			return NULL;
		/* the job it read, or a newer one if that closed meanwhile and the next opened */
		const bool in = enter(p, &s);

		seen = ST_GEN(s);
		if (!in)
			continue; /* it closed: wait for the next */
		run_tasks(p);
		atomic_fetch_sub_explicit(&p->state, 1, memory_order_release);
	}
}

int ro_pool_new(uint32_t threads, struct ro_pool **ret)
{
	struct ro_pool *p = calloc(1, sizeof(*p));

	if (!p)
		return -ENOMEM;
	if (threads < 1)
		threads = 1;
	p->n = 1; /* counts the threads started: ro_pool_free joins exactly those */
	(void)pthread_mutex_init(&p->mu, NULL);
	(void)pthread_cond_init(&p->cv, NULL);
	p->th = calloc(threads, sizeof(*p->th));
	if (!p->th) {
		ro_pool_free(p);
		return -ENOMEM;
	}
	for (uint32_t i = 1; i < threads; i++) {
		if (pthread_create(&p->th[i], NULL, worker, p))
			break;
		p->n = i + 1;
	}
	*ret = p;
	return 0;
}

struct ro_pool *ro_pool_free(struct ro_pool *p)
{
	if (!p)
		return NULL;
	atomic_store(&p->stop, true);
	(void)pthread_mutex_lock(&p->mu);
	(void)pthread_cond_broadcast(&p->cv);
	(void)pthread_mutex_unlock(&p->mu);
	for (uint32_t i = 1; i < p->n; i++)
		(void)pthread_join(p->th[i], NULL);
	free(p->th);
	(void)pthread_mutex_destroy(&p->mu);
	(void)pthread_cond_destroy(&p->cv);
	free(p);
	return NULL;
}

uint32_t ro_pool_size(const struct ro_pool *p)
{
	return p->n;
}

void ro_pool_for(struct ro_pool *p, uint32_t n, void (*fn)(void *arg, uint32_t i), void *arg)
{
	uint64_t s;

	if (n == 0)
		return;
	if (p->n == 1 || n == 1) {
		for (uint32_t i = 0; i < n; i++)
			fn(arg, i);
		return;
	}
	/* no worker is inside (the last job waited for them to leave): safe to write */
	p->fn = fn;
	p->arg = arg;
	p->total = n;
	atomic_store_explicit(&p->next, 0, memory_order_relaxed);
	atomic_store_explicit(&p->done, 0, memory_order_relaxed);
	s = atomic_load_explicit(&p->state, memory_order_relaxed);
	/* seq_cst, as the sleepers' count below and its increment in worker(): a worker
	 * either sees this generation before it sleeps, or is counted and woken */
	atomic_store(&p->state, ((ST_GEN(s) + 1) << 32) | ST_OPEN);
	if (atomic_load(&p->sleepers)) {
		(void)pthread_mutex_lock(&p->mu);
		(void)pthread_cond_broadcast(&p->cv);
		(void)pthread_mutex_unlock(&p->mu);
	}
	run_tasks(p);
	while (atomic_load_explicit(&p->done, memory_order_acquire) < n)
		cpu_relax();
	/* close it; then wait for the workers inside to leave (they find no index left) */
	(void)atomic_fetch_and_explicit(&p->state, ~ST_OPEN, memory_order_acq_rel);
	while (atomic_load_explicit(&p->state, memory_order_acquire) & ST_INSIDE)
		cpu_relax();
}

/* ---- per-thread scratch --------------------------------------------------------------------- */

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static bool scratch_key_ok;
static __thread void *scratch;
static __thread size_t scratch_len;

static void scratch_key_make(void)
{
	scratch_key_ok = pthread_key_create(&scratch_key, free) == 0;
}

void *ro_map_huge(size_t len, size_t before, int *madv_err)
{
	const size_t H = RO_HUGE_PAGE, all = before + len + H;
	char *raw = mmap(NULL, all, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	char *p;
	int e;

	if (raw == MAP_FAILED)
		return NULL;
	/* H more than asked: the start on a 2 MiB boundary, the ends given back */
	p = (char *)(((uintptr_t)raw + before + H - 1) & ~(uintptr_t)(H - 1));
	if (p - before > raw)
		(void)munmap(raw, (size_t)(p - before - raw));
	(void)munmap(p + len, (size_t)(raw + all - (p + len)));
	e = madvise(p, len, MADV_HUGEPAGE) ? errno : 0;
	if (madv_err)
		*madv_err = e;
	return p;
}

void *ro_malloc_huge(size_t bytes)
{
	const uintptr_t H = RO_HUGE_PAGE;
	char *p = malloc(bytes);

	if (p && bytes >= 2 * H) {
		const uintptr_t a = ((uintptr_t)p + H - 1) / H * H, b = ((uintptr_t)p + bytes) / H * H;

		if (b > a)
			(void)madvise((void *)a, b - a, MADV_HUGEPAGE); /* a hint */
	}
	return p;
}

void *ro_thread_scratch(size_t bytes)
{
	if (bytes > scratch_len) {
		void *p = NULL;

		if (posix_memalign(&p, 64, bytes))
			return NULL;
		free(scratch);
		scratch = p;
		scratch_len = bytes;
		(void)pthread_once(&scratch_once, scratch_key_make);
		if (scratch_key_ok) /* else the buffer outlives its thread: a leak, not a fault */
			(void)pthread_setspecific(scratch_key, scratch);
	}
	return scratch;
}
