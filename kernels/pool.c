/* A small fork-join thread pool for the forward pass: the caller and N-1 workers take
 * indexes of a parallel-for from one atomic counter. Workers spin briefly between jobs
 * (a decode step issues a few hundred back to back) and then sleep on a condition
 * variable, so an idle daemon costs no CPU. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "kernels/internal.h"

#define SPIN_ROUNDS 20000

struct ro_pool {
	uint32_t n; /* threads including the caller */
	pthread_t *th;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	_Atomic uint64_t gen;
	_Atomic uint32_t next, done, active;
	_Atomic bool stop;
	uint32_t total;
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
	uint32_t i;

	while ((i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed)) < p->total) {
		p->fn(p->arg, i);
		atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
	}
}

static void *worker(void *arg)
{
	struct ro_pool *p = arg;
	uint64_t seen = 0;

	for (;;) {
		uint64_t g;
		int spins = 0;

		while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen &&
		       !atomic_load(&p->stop) && spins++ < SPIN_ROUNDS)
			cpu_relax();
		if (g == seen && !atomic_load(&p->stop)) {
			(void)pthread_mutex_lock(&p->mu);
			while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop))
				(void)pthread_cond_wait(&p->cv, &p->mu);
			(void)pthread_mutex_unlock(&p->mu);
		}
		if (atomic_load(&p->stop))
			return NULL;
		seen = g;
		run_tasks(p);
		atomic_fetch_sub_explicit(&p->active, 1, memory_order_release);
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
	if (n == 0)
		return;
	if (p->n == 1 || n == 1) {
		for (uint32_t i = 0; i < n; i++)
			fn(arg, i);
		return;
	}
	p->fn = fn;
	p->arg = arg;
	p->total = n;
	atomic_store_explicit(&p->next, 0, memory_order_relaxed);
	atomic_store_explicit(&p->done, 0, memory_order_relaxed);
	/* every worker joins each job and leaves it before the next is set up, so none can
	 * take an index of a job with the previous job's function */
	atomic_store_explicit(&p->active, p->n - 1, memory_order_relaxed);
	(void)pthread_mutex_lock(&p->mu);
	atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
	(void)pthread_cond_broadcast(&p->cv);
	(void)pthread_mutex_unlock(&p->mu);
	run_tasks(p);
	while (atomic_load_explicit(&p->done, memory_order_acquire) < n ||
	       atomic_load_explicit(&p->active, memory_order_acquire) > 0)
		cpu_relax();
}
