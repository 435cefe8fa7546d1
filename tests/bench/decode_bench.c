/* decode_bench: decode tokens/s at batch 1, 8, 32, 128 and prefill tokens/s on a generated
 * Qwen3-MoE of ~0.9B total / ~0.2B active parameters (16 layers, hidden 1024, 64 experts
 * top-8, expert FFN 256, vocab 32768, bf16), each beside the roofline floor measured in the
 * same run: the larger of (bytes of weights and KV touched per step / the machine's measured
 * copy bandwidth) and (FLOPs per step / the machine's measured FMA throughput).
 *
 * Then decode under a chunked prefill: B running sequences decode while a long prompt is
 * prefilled in chunks of C tokens, one chunk per step in the same forward as the decode
 * tokens (as vLLM and SGLang schedule it), every chunk of the prompt in order, beside the
 * same decode alone (S steps, --chunk-steps) and beside the whole prompt prefilled in one
 * step (the stall chunking avoids). The prompt is 2000 tokens by default so that the whole
 * run stays within a minute on 2 cores; --long-prompt 8000 is the production-sized case
 * (its one-step prefill takes ~15 s there: attention over ~32e6 query-key pairs a head and
 * layer).
 *
 *   decode_bench [--model DIR | --fp8] [--steps N] [--threads N] [--batches 1,8,32,128]
 *                [--prompt P (prefill tokens, 512)]
 *                [--context C (each decode row's sequences' prompt, 32)]
 *                [--only decode|chunked|inflight] [--prefill-chunk C] [--long-prompt N]
 *                [--chunk-batches 8,32] [--chunk-steps S]
 *                [--inflight UNITSxN,PROMPT,MAX_NEW,STEPS (8x8,512,32768,32)]
 *                [--weights hugepages|map (hugepages: as rolloutd loads them)]
 *
 * In flight: the resident memory of UNITS x N samples decoding at once (each unit's
 * prompt prefilled once and forked N ways), beside a cache copied per sample. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/model.h"
#include "tests/bench/bench_model.h"

static double now(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- the machine ------------------------------------------------------------------------ */

struct bw_arg {
	char *src, *dst;
	size_t len;
	int reps;
};

static void *copy_thread(void *p)
{
	struct bw_arg *a = p;

	for (int i = 0; i < a->reps; i++)
		memcpy(a->dst, a->src, a->len);
	return NULL;
}

/* Bytes moved (read + written) per second by memcpy over all threads, best of 5. The
 * buffers stay for the next call (the machine is measured again beside every row). */
static double copy_bandwidth(uint32_t threads)
{
	static struct bw_arg a[64];
	static uint32_t have;
	const size_t per = 256u << 20;
	pthread_t th[64];
	double best = 0;

	for (; have < threads; have++) {
		a[have].src = malloc(per / threads);
		a[have].dst = malloc(per / threads);
		if (!a[have].src || !a[have].dst)
			return 0;
		a[have].len = per / threads;
		a[have].reps = 2;
		memset(a[have].src, 1, a[have].len);
		memset(a[have].dst, 2, a[have].len);
	}
	for (int rep = 0; rep < 5; rep++) {
		double t0 = now(), s;

		for (uint32_t t = 0; t < threads; t++)
			pthread_create(&th[t], NULL, copy_thread, &a[t]);
		for (uint32_t t = 0; t < threads; t++)
			pthread_join(th[t], NULL);
		s = 2.0 * 2 * per / (now() - t0);
		best = s > best ? s : best;
	}
	return best;
}

#if defined(__x86_64__)
/* Ten independent FMA chains in named registers: enough to cover the FMA latency on both
 * pipes, so this is the core's peak, not a dependency chain. */
__attribute__((target("avx2,fma"))) static void *fma_thread(void *p)
{
	long iters = *(long *)p;
	__m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
	__m256 a0 = _mm256_set1_ps(0), a1 = _mm256_set1_ps(1), a2 = _mm256_set1_ps(2),
	       a3 = _mm256_set1_ps(3), a4 = _mm256_set1_ps(4), a5 = _mm256_set1_ps(5),
	       a6 = _mm256_set1_ps(6), a7 = _mm256_set1_ps(7), a8 = _mm256_set1_ps(8),
	       a9 = _mm256_set1_ps(9);

	for (long k = 0; k < iters; k++) {
		a0 = _mm256_fmadd_ps(a0, x, y);
		a1 = _mm256_fmadd_ps(a1, x, y);
		a2 = _mm256_fmadd_ps(a2, x, y);
		a3 = _mm256_fmadd_ps(a3, x, y);
		a4 = _mm256_fmadd_ps(a4, x, y);
		a5 = _mm256_fmadd_ps(a5, x, y);
		a6 = _mm256_fmadd_ps(a6, x, y);
		a7 = _mm256_fmadd_ps(a7, x, y);
		a8 = _mm256_fmadd_ps(a8, x, y);
		a9 = _mm256_fmadd_ps(a9, x, y);
	}
	a0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
			   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
	a0 = _mm256_add_ps(a0, _mm256_add_ps(a8, a9));
	*(float *)p = a0[0]; /* keep the work */
	return NULL;
}

/* fma_thread with 16-wide registers: the kernels run AVX-512 where the CPU has it, and a
 * core that executes 512-bit FMAs at full width has twice the 256-bit peak; the floor must
 * be the peak of what the kernels could use, not of what they happen to use. */
__attribute__((target("avx512f,fma"))) static void *fma512_thread(void *p)
{
	long iters = *(long *)p;
	__m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
	__m512 a0 = _mm512_set1_ps(0), a1 = _mm512_set1_ps(1), a2 = _mm512_set1_ps(2),
	       a3 = _mm512_set1_ps(3), a4 = _mm512_set1_ps(4), a5 = _mm512_set1_ps(5),
	       a6 = _mm512_set1_ps(6), a7 = _mm512_set1_ps(7), a8 = _mm512_set1_ps(8),
	       a9 = _mm512_set1_ps(9);

	for (long k = 0; k < iters; k++) {
		a0 = _mm512_fmadd_ps(a0, x, y);
		a1 = _mm512_fmadd_ps(a1, x, y);
		a2 = _mm512_fmadd_ps(a2, x, y);
		a3 = _mm512_fmadd_ps(a3, x, y);
		a4 = _mm512_fmadd_ps(a4, x, y);
		a5 = _mm512_fmadd_ps(a5, x, y);
		a6 = _mm512_fmadd_ps(a6, x, y);
		a7 = _mm512_fmadd_ps(a7, x, y);
		a8 = _mm512_fmadd_ps(a8, x, y);
		a9 = _mm512_fmadd_ps(a9, x, y);
	}
	a0 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
			   _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
	a0 = _mm512_add_ps(a0, _mm512_add_ps(a8, a9));
	*(float *)p = a0[0]; /* keep the work */
	return NULL;
}
#endif

struct rd_arg {
	const char *p;
	size_t len;
	double sum;
};

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void *read_thread(void *p)
{
	struct rd_arg *a = p;
	__m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;

	for (size_t i = 0; i + 128 <= a->len; i += 128) {
		s0 = _mm256_add_ps(s0, _mm256_loadu_ps((const float *)(a->p + i)));
		s1 = _mm256_add_ps(s1, _mm256_loadu_ps((const float *)(a->p + i + 32)));
		s2 = _mm256_add_ps(s2, _mm256_loadu_ps((const float *)(a->p + i + 64)));
		s3 = _mm256_add_ps(s3, _mm256_loadu_ps((const float *)(a->p + i + 96)));
	}
	s0 = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
	a->sum = s0[0]; /* keep the work */
	return NULL;
}
#else
static void *read_thread(void *p)
{
	struct rd_arg *a = p;
	uint64_t s = 0;

	for (size_t i = 0; i + 8 <= a->len; i += 8) {
		uint64_t v;

		memcpy(&v, a->p + i, 8);
		s += v;
	}
	a->sum = (double)s;
	return NULL;
}
#endif

/* Bytes read per second by a plain read stream over all threads, each summing its part of
 * a 1 GiB buffer (past any L3 here: the weights a step streams are 1.8 GB), best of 4. The
 * buffer is asked for in 2 MiB pages, as rolloutd keeps its weights (in 4 KiB pages the
 * stream read 26-31 GB/s here; in 2 MiB pages 36-41), and stays for the next call. A step
 * only reads its weights, so this is the limit a step can reach, where memcpy's count is
 * the floor the goals were set against. */
static double read_bandwidth(uint32_t threads)
{
	static char *buf;
	const size_t len = (size_t)1 << 30;
	pthread_t th[64];
	struct rd_arg a[64];
	double best = 0;

	if (!buf) {
		void *p = NULL;

		if (posix_memalign(&p, (size_t)2 << 20, len))
			return 0;
		buf = p;
#if defined(__linux__)
		(void)madvise(buf, len, MADV_HUGEPAGE); /* a hint: 4 KiB pages if refused */
#endif
		memset(buf, 1, len);
	}
	for (int rep = 0; rep < 4; rep++) {
		double t0 = now(), s;

		for (uint32_t t = 0; t < threads; t++) {
			a[t] = (struct rd_arg){buf + len / threads * t, len / threads, 0};
			pthread_create(&th[t], NULL, read_thread, &a[t]);
		}
		for (uint32_t t = 0; t < threads; t++)
			pthread_join(th[t], NULL);
		s = (double)len / (now() - t0);
		best = s > best ? s : best;
	}
	return best;
}

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
struct tilecfg {
	uint8_t palette, start_row, reserved[14];
	uint16_t colsb[16];
	uint8_t rows[16];
};

/* TDPBF16PS into four independent C tiles (16 x 16 f32) from A and B tiles held in
 * registers (zeros: the unit's throughput does not depend on the values): the core's
 * AMX-BF16 peak, as fma_thread is its FMA peak. */
__attribute__((target("amx-tile,amx-bf16"))) static void *amx_thread(void *p)
{
	long iters = *(long *)p;
	static const uint16_t zeros[512] __attribute__((aligned(64))) = {0};
	struct tilecfg cfg;

	memset(&cfg, 0, sizeof(cfg));
	cfg.palette = 1;
	for (int i = 0; i < 8; i++) {
		cfg.rows[i] = 16;
		cfg.colsb[i] = 64;
	}
	/* GCC's _tile_loadconfig tells the compiler it reads 8 bytes: without the barrier
	 * the stores to the rest of cfg are dropped as dead (a #GP at ldtilecfg) */
	__asm__ volatile("" : : "r"(&cfg) : "memory");
	_tile_loadconfig(&cfg);
	_tile_zero(0);
	_tile_zero(1);
	_tile_zero(2);
	_tile_zero(3);
	_tile_loadd(4, zeros, 64);
	_tile_loadd(5, zeros, 64);
	_tile_loadd(6, zeros, 64);
	_tile_loadd(7, zeros, 64);
	for (long k = 0; k < iters; k++) {
		_tile_dpbf16ps(0, 4, 5);
		_tile_dpbf16ps(1, 4, 6);
		_tile_dpbf16ps(2, 7, 5);
		_tile_dpbf16ps(3, 7, 6);
	}
	_tile_release();
	return NULL;
}
#endif

/* FLOPs per second over all threads, best of 3: each thread runs fn for iters iterations
 * of flops_per_iter FLOPs. */
static double best_rate(uint32_t threads, void *(*fn)(void *), long iters, double flops_per_iter)
{
	pthread_t th[64];
	long arg[64];
	double best = 0;

	for (int rep = 0; rep < 3; rep++) {
		double t0 = now(), f;

		for (uint32_t t = 0; t < threads; t++) {
			arg[t] = iters;
			pthread_create(&th[t], NULL, fn, &arg[t]);
		}
		for (uint32_t t = 0; t < threads; t++)
			pthread_join(th[t], NULL);
		f = (double)threads * iters * flops_per_iter / (now() - t0);
		best = f > best ? f : best;
	}
	return best;
}

/* bf16 FLOPs per second (a multiply-add is two) of AMX over all threads, best of 3; 0 where
 * the CPU or the kernel does not give it. */
static double amx_throughput(uint32_t threads)
{
#if defined(__x86_64__) && defined(__linux__)
	__builtin_cpu_init();
	if (!__builtin_cpu_supports("amx-bf16") ||
	    syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */))
		return 0;
	return best_rate(threads, amx_thread, 2000000, 4.0 * 16 * 16 * 32 * 2);
#else
	(void)threads;
	return 0;
#endif
}

/* f32 FLOPs per second (an FMA is two) over all threads, best of 3, at the vector width
 * given (8 or 16 lanes). */
static double fma_throughput(uint32_t threads, int lanes)
{
#if defined(__x86_64__)
	return best_rate(threads, lanes == 16 ? fma512_thread : fma_thread, 20000000,
			 10.0 * lanes * 2);
#else
	(void)threads;
	(void)lanes;
	return 0;
#endif
}

/* The machine's rates, measured again beside every row: on the 2-vCPU VM these figures come
 * from, a read stream measured once a second moved 29-55 GB/s from one second to the next,
 * so a floor measured once at the start described the machine at the start only. */
struct machine {
	double bw, rd, fl; /* memcpy bytes/s, read-stream bytes/s, FMA FLOP/s (the wider) */
	double fl8, fl16;  /* FMA FLOP/s at 8 and at 16 lanes (0 without AVX-512) */
};

static void measure(uint32_t threads, struct machine *mc)
{
	mc->bw = copy_bandwidth(threads);
	mc->rd = read_bandwidth(threads);
	mc->fl8 = fma_throughput(threads, 8);
	mc->fl16 = 0;
#if defined(__x86_64__)
	__builtin_cpu_init();
	if (__builtin_cpu_supports("avx512f"))
		mc->fl16 = fma_throughput(threads, 16);
#endif
	mc->fl = mc->fl16 > mc->fl8 ? mc->fl16 : mc->fl8;
}

/* The floor beside a row: the machine at its best just before and just after it, rate by
 * rate (the stricter floor of the two). */
static struct machine around(const struct machine *before, const struct machine *after)
{
	return (struct machine){.bw = before->bw > after->bw ? before->bw : after->bw,
				.rd = before->rd > after->rd ? before->rd : after->rd,
				.fl = before->fl > after->fl ? before->fl : after->fl};
}

/* the two measures beside a row, printed under it */
static void print_machine(const struct machine *before, const struct machine *after)
{
	(void)printf("  %-20s memcpy %.1f, %.1f GB/s; read stream %.1f, %.1f; FMA %.0f, %.0f "
		     "GFLOP/s (before, after)\n",
		     "machine:", before->bw / 1e9, after->bw / 1e9, before->rd / 1e9,
		     after->rd / 1e9, before->fl / 1e9, after->fl / 1e9);
}

/* ---- the model's work --------------------------------------------------------------------- */

struct shape {
	double attn_bytes, router_bytes, expert_bytes, head_bytes, embed_row_bytes;
	double attn_params, router_params, expert_params, head_params;
	uint32_t layers, heads, kv_row, head_dim, top_k;
};

static void shape_of(const struct ro_model_config *c, struct shape *s)
{
	const double H = c->hidden, qd = (double)c->heads * c->head_dim,
		     kvd = (double)c->kv_heads * c->head_dim;

	s->attn_params = H * qd * 2 + H * kvd * 2;
	s->router_params = H * c->experts;
	s->expert_params = 3.0 * H * c->expert_ffn;
	s->head_params = H * c->vocab;
	/* the bytes the kernels stream per parameter: BF16 is read as stored, F16 is widened to
	 * F32 at load (kernels/loader.c), F32 is 4; the embedding is read as stored */
	const bool fp8 = !strcmp(c->dtype, "F8_E4M3");
	const double wb = !strcmp(c->dtype, "BF16") || fp8 ? 2 : 4,
		     eb = !strcmp(c->dtype, "F32") ? 4 : 2;
	/* FP8: a byte per parameter and an f32 scale per 128 x 128 block for the linear
	 * layers; the router and the LM head stay BF16 (as Qwen3-*-FP8 ships them) */
	const double qb = fp8 ? 1 + 4.0 / (128 * 128) : wb;

	s->attn_bytes = s->attn_params * qb;
	s->router_bytes = s->router_params * wb;
	s->expert_bytes = s->expert_params * qb;
	s->head_bytes = s->head_params * wb;
	s->embed_row_bytes = H * eb;
	s->layers = c->layers;
	s->heads = c->heads;
	s->kv_row = c->kv_heads * c->head_dim;
	s->head_dim = c->head_dim;
	s->top_k = c->top_k;
}

/* The step's work by phase, as ro_model_last_split() times them: attention (with its
 * projections, the norms, the embedding rows and the KV cache), router, experts, head. */
enum { PH_ATTN, PH_ROUTER, PH_EXPERTS, PH_HEAD, PH_N };
struct phases {
	double bytes[PH_N], flops[PH_N];
};

/* Bytes and FLOPs of one forward of `tokens` tokens over contexts summing to ctx_sum
 * positions, of which kv_read positions' K and V must come from memory, that ran `experts`
 * (layer, expert) pairs and produced `rows` logit rows. A decode step reads each
 * sequence's cache once (kv_read = ctx_sum); a prefill's queries share the prompt's K/V
 * tiles, so the floor reads them once (kv_read = tokens: until 2026-12-05 the prefill rows
 * counted ctx_sum, 4.3 of the 5.8 GB at 512 tokens and 275 GB at 4,096, a floor that
 * a tiled kernel beats). Each phase's share is added into *ph (a decode row sums its
 * steps', then averages them). */
static void work(const struct shape *s, double tokens, double ctx_sum, double kv_read,
		 double experts, double rows, double *bytes, double *flops, double *mm_flops,
		 struct phases *ph)
{
	/* scores and the weighted sum of V, per head */
	const double core = s->layers * 4.0 * ctx_sum * s->head_dim * s->heads;
	struct phases p = {
	    .bytes = {s->layers * s->attn_bytes + tokens * s->embed_row_bytes +
			  /* the KV cache read by attention, written for the new tokens */
			  s->layers * (kv_read + tokens) * s->kv_row * 4.0 * 2,
		      s->layers * s->router_bytes, experts * s->expert_bytes, s->head_bytes},
	    .flops = {2.0 * tokens * s->layers * s->attn_params + core,
		      2.0 * tokens * s->layers * s->router_params,
		      2.0 * tokens * s->layers * s->top_k * s->expert_params,
		      2.0 * rows * s->head_params}};

	*bytes = *flops = 0;
	for (int i = 0; i < PH_N; i++) {
		*bytes += p.bytes[i];
		*flops += p.flops[i];
		if (ph) {
			ph->bytes[i] += p.bytes[i];
			ph->flops[i] += p.flops[i];
		}
	}
	/* the linear layers' share (what AMX runs for a bf16 model) */
	*mm_flops = *flops - core;
}

/* One row of the floor table: time t for `tokens` tokens beside the floor, max(bytes /
 * bw, FLOPs / fl), and beside the machine's limit for the kernels that run: bytes at the
 * read stream's rate (rd), and where the linear layers run on AMX (amx: its rate for them,
 * else 0) their FLOPs at that rate. */
static void floor_row(const char *name, double tokens, double t, double bytes, double flops,
		      double mm, double bw, double fl, double rd, double amx)
{
	const double floor_s = bytes / bw > flops / fl ? bytes / bw : flops / fl;
	const double c_m = amx > 0 ? mm / amx + (flops - mm) / fl : flops / fl;
	const double m_rd = rd > 0 ? bytes / rd : bytes / bw;
	const double floor_m = m_rd > c_m ? m_rd : c_m;
	char xa[32];

	(void)snprintf(xa, sizeof(xa), "%.2f %s", t / floor_m, m_rd > c_m ? "memory" : "compute");
	(void)printf("%-22s %12.1f %12.2f %10.3f %10.2f %12.1f %9.2f  %-8s %s\n", name,
		     tokens / t, t * 1e3, bytes / 1e9, flops / 1e9, tokens / floor_s, t / floor_s,
		     bytes / bw > flops / fl ? "memory" : "compute", xa);
}

static void split_add(struct ro_model_split *a, const struct ro_model_split *b, double w)
{
	a->attention += b->attention * w;
	a->router += b->router * w;
	a->experts += b->experts * w;
	a->head += b->head * w;
	a->other += b->other * w;
}

/* The step's time by phase (ms and share of the step): names the next bottleneck. */
static void print_split(const struct ro_model_split *sp, double step)
{
	(void)printf("  %-20s attention %.2f ms (%.0f%%), router %.2f (%.0f%%), experts %.2f "
		     "(%.0f%%), head %.2f (%.0f%%), other %.2f\n",
		     "split:", sp->attention * 1e3, 100 * sp->attention / step, sp->router * 1e3,
		     100 * sp->router / step, sp->experts * 1e3, 100 * sp->experts / step,
		     sp->head * 1e3, 100 * sp->head / step, sp->other * 1e3);
}

/* Each phase beside its own floor, max(its bytes / bw, its FLOPs / fl), and the step beside
 * the sum of those: the phases run one after another (a layer's experts wait for its
 * attention, the next layer's attention for them), so where memory-bound and compute-bound
 * phases alternate the sum is the floor that an engine without overlap between them meets,
 * above the table's max over the whole step. */
static void print_phases(const struct ro_model_split *sp, const struct phases *ph, double step,
			 double bw, double fl)
{
	const double t[PH_N] = {sp->attention, sp->router, sp->experts, sp->head};
	const char *const name[PH_N] = {"attention", "router", "experts", "head"};
	double f[PH_N], sum = 0;
	char line[256];
	int n = 0;

	for (int i = 0; i < PH_N; i++) {
		const double b = ph->bytes[i] / bw, c = ph->flops[i] / fl;

		f[i] = b > c ? b : c;
		sum += f[i];
		n += snprintf(line + n, sizeof(line) - (size_t)n, "%s%s %.2fx (%s)",
			      i ? ", " : "", name[i], f[i] > 0 ? t[i] / f[i] : 0,
			      b > c ? "memory" : "compute");
	}
	(void)printf("  %-20s %s of its floor; the phases' floors summed %.2f ms: the step is "
		     "%.2fx that\n",
		     "by phase:", line, sum * 1e3, step / sum);
}

/* ---- decode under a chunked prefill ------------------------------------------------------ */

struct chunked {
	uint32_t batches[16], nb;
	uint32_t chunk;	 /* rows for chunk / 2, chunk, chunk * 2 */
	uint32_t prompt; /* the long prompt's tokens */
	uint32_t steps;	 /* decode steps measured per row */
};

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/* The q-quantile of v[n] (nearest rank); sorts v. */
static double quantile(double *v, uint32_t n, double q)
{
	uint32_t i = (uint32_t)ceil(q * n);

	qsort(v, n, sizeof(*v), cmp_double);
	return v[i ? i - 1 : 0];
}

struct decoders {
	uint32_t B, V, step;
	struct ro_seq **seq;
	struct ro_fwd_item *it; /* B decode items, then room for one prefill item */
	int32_t *tok;
	float *logits;
};

/* One step: every decoder's next token, with extra (a prefill chunk) in the same batch when
 * given; returns the forward's seconds, or a negative number on failure. */
static double decode_step(struct ro_model *m, struct decoders *d, const struct ro_fwd_item *extra)
{
	const struct ro_sampling sp = {.temperature = 1.0, .top_p = 1.0, .seed = 1};
	size_t n = 0;
	double t0;

	for (uint32_t i = 0; i < d->B; i++) {
		d->tok[i] = ro_sample(d->logits + (size_t)i * d->V, d->V, &sp, i, 0, d->step, NULL);
		d->it[n++] = (struct ro_fwd_item){d->seq[i], &d->tok[i], 1,
						  d->logits + (size_t)i * d->V, false};
		/* the prefill in the middle of the batch: its place does not matter to anyone's
		 * bits, and this way neither end is special */
		if (extra && i == d->B / 2)
			d->it[n++] = *extra;
	}
	d->step++;
	t0 = now();
	if (ro_model_forward(m, d->it, n))
		return -1;
	return now() - t0;
}

static void print_row(uint32_t B, const char *what, double p50, double p99, double a50, double a99,
		      double done_s)
{
	char done[32] = "";

	if (done_s > 0)
		(void)snprintf(done, sizeof(done), "%10.2f", done_s);
	(void)printf("%5u  %-24s %11.2f %11.2f %9.2f %9.2f  %10s\n", B, what, p50 * 1e3, p99 * 1e3,
		     p50 / a50, p99 / a99, done);
	fflush(stdout);
}

static int chunked_section(struct ro_model *m, const struct chunked *o)
{
	const uint32_t V = ro_model_config(m)->vocab, N = o->prompt, S = o->steps, plen = 32;
	const uint32_t sizes[3] = {o->chunk / 2 ? o->chunk / 2 : 1, o->chunk, o->chunk * 2};
	/* (b) runs every chunk of the prompt: up to n0 steps, the smallest chunks' */
	const uint32_t n0 = (N + sizes[0] - 1) / sizes[0], nt = n0 > S ? n0 : S;
	int32_t *p = malloc(N * sizeof(*p)), *dp = malloc(plen * sizeof(*dp));
	float *lp = malloc(V * sizeof(float));
	double *t = malloc(nt * sizeof(*t));
	int r = 0;

	for (uint32_t j = 0; j < N; j++)
		p[j] = (int32_t)(((uint64_t)j * 104729 + 31) % V);
	(void)printf("\ndecode under a chunked prefill: a %u-token prompt prefilled in the decode "
		     "batch, one chunk per step,\nevery chunk of the prompt in order; decode alone "
		     "over %u steps\n\n",
		     N, S);
	(void)printf("%5s  %-24s %11s %11s %9s %9s  %10s\n", "batch", "beside the decode", "p50 ms",
		     "p99 ms", "x p50", "x p99", "prompt s");
	for (uint32_t bi = 0; bi < o->nb && !r; bi++) {
		struct decoders d = {.B = o->batches[bi], .V = V};
		/* the decoders' cache: the decode-alone steps, two whole-prompt steps and every
		 * chunk step of the three sizes, with room to spare */
		const uint32_t dsteps = S + 2 + n0 + (N + sizes[1] - 1) / sizes[1] +
					(N + sizes[2] - 1) / sizes[2];
		struct ro_seq *ps = NULL;
		double a50, a99, full = -1;

		d.seq = calloc(d.B, sizeof(*d.seq));
		d.it = calloc(d.B + 1, sizeof(*d.it));
		d.tok = malloc(d.B * sizeof(*d.tok));
		d.logits = malloc((size_t)d.B * V * sizeof(float));
		for (uint32_t i = 0; i < d.B && !r; i++) {
			for (uint32_t j = 0; j < plen; j++)
				dp[j] = (int32_t)((i * 7919 + j * 104729) % V);
			r = ro_seq_new(m, plen + dsteps + 8, &d.seq[i]);
			if (!r)
				r = ro_model_forward(m,
						     &(struct ro_fwd_item){d.seq[i], dp, plen,
									   d.logits + (size_t)i * V,
									   false},
						     1);
		}
		if (!r)
			r = ro_seq_new(m, N, &ps);
		/* (a) decode alone, after one warm-up step */
		for (uint32_t s = 0; s <= S && !r; s++) {
			double dt = decode_step(m, &d, NULL);

			if (dt < 0)
				r = -1;
			else if (s)
				t[s - 1] = dt;
		}
		if (r)
			break;
		a50 = quantile(t, S, 0.5);
		a99 = quantile(t, S, 0.99);
		print_row(d.B, "nothing (decode alone)", a50, a99, a50, a99, 0);
		/* (c) the whole prompt in one step, the better of two: the first forward of that
		 * size also pays the first touch of its workspaces, which a daemon pays once */
		for (int k = 0; k < 2 && !r; k++) {
			double dt;

			ro_seq_truncate(ps, 0);
			dt = decode_step(m, &d, &(struct ro_fwd_item){ps, p, N, lp, false});
			if (dt < 0)
				r = -1;
			else if (full < 0 || dt < full)
				full = dt;
		}
		if (r)
			break;
		/* (b) the prompt in chunks of C, in order from its start, one chunk per step (as
		 * the engine schedules it): every step is sampled, and the prompt is in after
		 * their sum, since a chunk's cost grows with the positions before it */
		for (uint32_t c = 0; c < 3 && !r; c++) {
			const uint32_t C = sizes[c] < N ? sizes[c] : N, nc = (N + C - 1) / C;
			double sum = 0;
			char what[32];

			ro_seq_truncate(ps, 0);
			for (uint32_t k = 0; k < nc; k++) {
				const uint32_t off = k * C, len = N - off < C ? N - off : C;
				double dt = decode_step(m, &d,
							&(struct ro_fwd_item){ps, p + off, len, lp, false});

				if (dt < 0) {
					r = -1;
					break;
				}
				t[k] = dt;
				sum += dt;
			}
			if (r)
				break;
			(void)snprintf(what, sizeof(what), "chunks of %u", C);
			print_row(d.B, what, quantile(t, nc, 0.5), quantile(t, nc, 0.99), a50, a99, sum);
		}
		if (!r)
			print_row(d.B, "the whole prompt at once", full, full, a50, a99, full);
		ro_seq_free(ps);
		for (uint32_t i = 0; i < d.B; i++)
			ro_seq_free(d.seq[i]);
		free(d.seq);
		free(d.it);
		free(d.tok);
		free(d.logits);
	}
	if (!r)
		(void)printf("\nx p50, x p99: the step's time over decode alone's, over every step "
			     "that carried a chunk. prompt s:\nthe sum of those steps (the prompt "
			     "is in after them), while the batch decodes a token per step;\nthe whole "
			     "prompt: the better of two one-step runs.\n");
	free(p);
	free(dp);
	free(lp);
	free(t);
	return r;
}

/* ---- resident memory of in-flight samples ------------------------------------------------ */

/* kB of a /proc/self/status line ("VmRSS:", "VmHWM:") */
static double status_kb(const char *key)
{
	FILE *f = fopen("/proc/self/status", "r");
	char line[256];
	double v = 0;

	while (f && fgets(line, sizeof(line), f))
		if (!strncmp(line, key, strlen(key)))
			v = strtod(line + strlen(key), NULL);
	if (f)
		(void)fclose(f);
	return v;
}

/* What a rollout worker holds: `units` units of n samples each, a prompt of plen tokens
 * prefilled once per unit and forked n ways (as the engine does), then `steps` tokens
 * decoded for all of them in one batch a step. Beside it, in the same run, what a cache
 * copied per sample (the runtime before paged KV: each fork held its prompt's cache, grown
 * by doubling) holds for the same tokens. */
static int inflight_section(struct ro_model *m, uint32_t units, uint32_t n, uint32_t plen,
			    uint32_t max_new, uint32_t steps)
{
	const struct ro_model_config *c = ro_model_config(m);
	const uint32_t V = c->vocab, B = units * n;
	uint32_t max_len = plen + max_new + 1;
	const double per_pos = 2.0 * c->layers * c->kv_heads * c->head_dim * sizeof(float);
	struct ro_seq **seq = calloc(B, sizeof(*seq)), *base;
	struct ro_fwd_item *it = calloc(B, sizeof(*it));
	int32_t *prompt = malloc(plen * sizeof(int32_t)), *tok = malloc(B * sizeof(int32_t));
	float *logits = malloc((size_t)B * V * sizeof(float));
	double rss0, rss1, hwm, t0, t;
	struct ro_kv_stats st;
	uint64_t copied_bytes = 0;

	if (max_len > c->max_pos + 1)
		max_len = c->max_pos + 1;
	/* warm-up: the workspaces of a prompt's prefill and of a B-token decode step */
	for (uint32_t i = 0; i < B; i++) {
		tok[i] = (int32_t)(i % V);
		if (ro_seq_new(m, 2, &seq[i]))
			return -1;
		it[i] = (struct ro_fwd_item){seq[i], &tok[i], 1, logits + (size_t)i * V, false};
	}
	if (ro_model_forward(m, it, B))
		return -1;
	for (uint32_t i = 0; i < B; i++)
		seq[i] = ro_seq_free(seq[i]);
	for (uint32_t j = 0; j < plen; j++)
		prompt[j] = (int32_t)((j * 104729 + 3) % V);
	if (ro_seq_new(m, plen, &base) ||
	    ro_model_forward(m, &(struct ro_fwd_item){base, prompt, plen, logits, false}, 1))
		return -1;
	base = ro_seq_free(base);
	rss0 = status_kb("VmRSS:");
	t0 = now();
	for (uint32_t u = 0; u < units; u++) {
		for (uint32_t j = 0; j < plen; j++)
			prompt[j] = (int32_t)((u * 7919 + j * 104729 + 17) % V);
		if (ro_seq_new(m, max_len, &base) ||
		    ro_model_forward(m, &(struct ro_fwd_item){base, prompt, plen, logits, false},
				     1))
			return -1;
		for (uint32_t k = 0; k < n; k++)
			if (ro_seq_fork(base, &seq[u * n + k]))
				return -1;
		base = ro_seq_free(base);
	}
	for (uint32_t s = 0; s < steps; s++) {
		for (uint32_t i = 0; i < B; i++) {
			tok[i] = (int32_t)((i * 31 + s * 7 + 1) % V);
			it[i] =
			    (struct ro_fwd_item){seq[i], &tok[i], 1, logits + (size_t)i * V, false};
		}
		if (ro_model_forward(m, it, B))
			return -1;
	}
	t = now() - t0;
	rss1 = status_kb("VmRSS:");
	hwm = status_kb("VmHWM:");
	ro_model_kv_stats(m, &st);
	{
		/* per-sample copies: each sample's own prompt + tokens, the positions it
		 * wrote (the part of an unshared cache that is resident; the doubling's
		 * untouched slack is not counted) */
		const uint64_t len = plen + steps;

		copied_bytes = (uint64_t)B * len * (uint64_t)per_pos;
	}
	(void)printf("\nin flight: %u units x n=%u samples, %u-token prompts, max_new_tokens %u "
		     "(sequences of up to %u positions), %u tokens decoded each (%.1f s)\n",
		     units, n, plen, max_new, max_len, steps, t);
	(void)printf("  %-44s %10.1f MiB\n", "process RSS grown by (VmRSS after - before)",
		     (rss1 - rss0) / 1024);
	(void)printf("  %-44s %10.1f MiB  (%llu blocks of %u positions, %.2f MiB each; %llu "
		     "copied on write)\n",
		     "KV blocks held", st.bytes / 1048576.0, (unsigned long long)st.blocks,
		     st.block_positions, st.block_bytes / 1048576.0,
		     (unsigned long long)st.copied_on_write);
	(void)printf("  %-44s %10.1f kB  (%.1f kB is one position's K and V)\n",
		     "KV bytes per in-flight token",
		     st.bytes / 1024.0 / ((double)B * (plen + steps)), per_pos / 1024);
	(void)printf("  %-44s %10.1f MiB  -> paged holds %.2fx of it\n",
		     "baseline: a cache copied per sample", copied_bytes / 1048576.0,
		     (double)st.bytes / (double)copied_bytes);
	(void)printf("  %-44s %10.1f MiB\n", "process peak (VmHWM)", hwm / 1024);
	for (uint32_t i = 0; i < B; i++)
		ro_seq_free(seq[i]);
	free(seq);
	free(it);
	free(prompt);
	free(tok);
	free(logits);
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"model", required_argument, NULL, 'm'},
	    {"steps", required_argument, NULL, 's'},
	    {"threads", required_argument, NULL, 't'},
	    {"batches", required_argument, NULL, 'b'},
	    {"prompt", required_argument, NULL, 'p'},
	    {"only", required_argument, NULL, 'o'},
	    {"prefill-chunk", required_argument, NULL, 'c'},
	    {"long-prompt", required_argument, NULL, 'l'},
	    {"chunk-batches", required_argument, NULL, 'B'},
	    {"chunk-steps", required_argument, NULL, 'S'},
	    {"fp8", no_argument, NULL, 'F'},
	    {"inflight", required_argument, NULL, 'i'},
	    {"weights", required_argument, NULL, 'w'},
	    {"context", required_argument, NULL, 'x'},
	    {0},
	};
	const char *dir = "/tmp/rolloutd-decode-bench-model";
	bool own_model = false, fp8 = false;
	uint32_t steps = 8, threads = 0, batches[16] = {1, 8, 32, 128}, nb = 4, plen = 32;
	uint32_t prefill_len = 512;
	struct chunked ck = {.batches = {8, 32}, .nb = 2, .chunk = 256, .prompt = 2000, .steps = 4};
	bool run_decode = true, run_chunked = true, run_inflight = true;
	/* units, samples per unit, prompt, max_new_tokens, decoded tokens */
	uint32_t inf[5] = {8, 8, 512, 32768, 32};
	struct ro_model_opts mo = {.hugepages = true}; /* as rolloutd loads it */
	struct ro_model_pin pin;
	struct ro_model *m;
	const struct ro_model_config *c;
	struct shape sh;
	char err[512];
	double amx = 0, t_load;
	struct machine mc_prev, mc_now, mc;
	uint64_t total, active;
	int ch;

	while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (ch == 'm') {
			dir = optarg;
			own_model = true; /* loaded as it is, never written */
		} else if (ch == 's') {
			steps = (uint32_t)atoi(optarg);
		} else if (ch == 't') {
			threads = (uint32_t)atoi(optarg);
		} else if (ch == 'p') {
			prefill_len = (uint32_t)atoi(optarg);
		} else if (ch == 'x') {
			plen = (uint32_t)atoi(optarg);
		} else if (ch == 'b' || ch == 'B') {
			uint32_t *v = ch == 'b' ? batches : ck.batches,
				 *n = ch == 'b' ? &nb : &ck.nb;
			char *s = optarg;

			*n = 0;
			while (*s && *n < 16) {
				v[(*n)++] = (uint32_t)strtoul(s, &s, 10);
				if (*s == ',')
					s++;
			}
		} else if (ch == 'o') {
			run_decode = !strcmp(optarg, "decode");
			run_chunked = !strcmp(optarg, "chunked");
			run_inflight = !strcmp(optarg, "inflight");
			if (!run_decode && !run_chunked && !run_inflight)
				return 2;
		} else if (ch == 'i') {
			if (sscanf(optarg, "%ux%u,%u,%u,%u", &inf[0], &inf[1], &inf[2], &inf[3],
				   &inf[4]) != 5 ||
			    !inf[0] || !inf[1] || !inf[2] || !inf[4] || inf[0] * inf[1] > 4096)
				return 2;
		} else if (ch == 'c') {
			ck.chunk = (uint32_t)atoi(optarg);
		} else if (ch == 'l') {
			ck.prompt = (uint32_t)atoi(optarg);
		} else if (ch == 'S') {
			ck.steps = (uint32_t)atoi(optarg);
		} else if (ch == 'F') {
			fp8 = true;
		} else if (ch == 'w') {
			if (strcmp(optarg, "map") && strcmp(optarg, "hugepages"))
				return 2;
			mo.hugepages = !strcmp(optarg, "hugepages");
		} else {
			return 2;
		}
	}
	if (!steps || !nb || prefill_len < 2 || prefill_len > 8192 || !plen || plen > 32000 || !ck.nb || !ck.chunk ||
	    ck.prompt < 2 || !ck.steps)
		return 2;
	for (uint32_t i = 0; i < nb; i++)
		if (!batches[i])
			return 2;
	for (uint32_t i = 0; i < ck.nb; i++)
		if (!ck.batches[i])
			return 2;
	if (fp8 && !own_model)
		dir = "/tmp/rolloutd-decode-bench-model-fp8";
	if (!own_model &&
	    ro_bench_model_ensure_dtype("decode_bench", dir, 2026, fp8 ? "FP8" : "BF16"))
		return 1;
	mo.threads = threads;
	t_load = now();
	if (ro_model_load(dir, &mo, &m, err, sizeof(err))) {
		(void)fprintf(stderr, "decode_bench: %s\n", err);
		return 1;
	}
	t_load = now() - t_load;
	c = ro_model_config(m);
	shape_of(c, &sh);
	ro_model_sizes(m, &total, &active);
	threads = ro_model_threads(m);
	(void)printf("model: %s, %u layers, hidden %u, %u experts top-%u, expert FFN %u, vocab %u, "
		     "%s\n       %.2f GB of weights in all, %.3f GB touched per token; kernels %s, "
		     "%u threads\n",
		     dir, c->layers, c->hidden, c->experts, c->top_k, c->expert_ffn, c->vocab,
		     c->dtype, total / 1e9, active / 1e9, ro_model_kernels(m), threads);
	ro_model_pinned(m, &pin);
	if (pin.bytes)
		(void)printf("       weights: %.3f GB copied into huge pages, %.3f GB of them in 2 MiB "
			     "pages%s%s; loaded in %.2f s\n",
			     pin.bytes / 1e9, pin.huge_bytes / 1e9, pin.why[0] ? "; " : "", pin.why,
			     t_load);
	else
		(void)printf("       weights: read from the mapped files (huge pages: %s); loaded in "
			     "%.2f s\n",
			     pin.why[0] ? pin.why : "none to copy", t_load);
	if (run_decode) {
		(void)fprintf(stderr, "decode_bench: measuring the machine (%u threads) ...\n",
			      threads);
		measure(threads, &mc_prev);
		(void)printf("machine: memcpy %.1f GB/s (bytes read + written), FMA %.1f GFLOP/s "
			     "(f32, 8 lanes), %.1f (16 lanes); the floor uses the larger\n"
			     "machine: read stream %.1f GB/s (bytes read, 1 GiB)\n",
			     mc_prev.bw / 1e9, mc_prev.fl8 / 1e9, mc_prev.fl16 / 1e9,
			     mc_prev.rd / 1e9);
		/* a bf16 model's linear layers run on AMX where the kernels say so: each
		 * multiply-add is two bf16 products there (activations as hi + lo) */
		if (strstr(ro_model_kernels(m), "amx") && !strcmp(c->dtype, "BF16")) {
			amx = amx_throughput(threads) / 2;
			(void)printf("machine: AMX-BF16 %.1f GFLOP/s (bf16); the linear layers run "
				     "at half that (two products per multiply-add), %.1f f32-exact\n",
				     amx * 2 / 1e9, amx / 1e9);
		}
		(void)printf("\n%-22s %12s %12s %10s %10s %12s %9s  %-8s %s\n", "run", "tokens/s",
			     "ms/step", "GB/step", "GFLOP/step", "floor tok/s", "x floor", "bound",
			     "x machine limit");
		for (uint32_t bi = 0; bi < nb; bi++) {
			const uint32_t B = batches[bi], V = c->vocab;
			struct ro_seq **seq = calloc(B, sizeof(*seq));
			struct ro_fwd_item *it = calloc(B, sizeof(*it));
			int32_t *prompt = malloc(plen * sizeof(int32_t)),
				*tok = malloc(B * sizeof(int32_t));
			float *logits = malloc((size_t)B * V * sizeof(float));
			double t = 0, bytes = 0, flops = 0, mm = 0, b1, f1, m1;
			struct ro_model_split sp = {0}, s1;
			struct phases ph = {0};
			uint32_t ctx;

			for (uint32_t i = 0; i < B; i++) {
				for (uint32_t j = 0; j < plen; j++)
					prompt[j] = (int32_t)((i * 7919 + j * 104729) % V);
				ro_seq_new(m, plen + steps + 4, &seq[i]);
				it[i] = (struct ro_fwd_item){seq[i], prompt, plen,
							     logits + (size_t)i * V, false};
				if (ro_model_forward(m, &it[i], 1))
					return 1;
			}
			for (uint32_t s = 0; s < steps + 1; s++) {
				double t0;

				for (uint32_t i = 0; i < B; i++) {
					tok[i] = ro_sample(logits + (size_t)i * V, V,
							   &(struct ro_sampling){.temperature = 1.0,
										 .top_p = 1.0,
										 .seed = 1},
							   i, 0, s, NULL);
					it[i] = (struct ro_fwd_item){seq[i], &tok[i], 1,
								     logits + (size_t)i * V, false};
				}
				ctx = ro_seq_len(seq[0]);
				t0 = now();
				if (ro_model_forward(m, it, B))
					return 1;
				if (s == 0)
					continue; /* warm-up */
				t += now() - t0;
				ro_model_last_split(m, &s1);
				split_add(&sp, &s1, 1.0 / steps);
				work(&sh, B, (double)B * (ctx + 1), (double)B * (ctx + 1),
				     ro_model_last_experts(m), B, &b1, &f1, &m1, &ph);
				bytes += b1;
				flops += f1;
				mm += m1;
			}
			bytes /= steps;
			flops /= steps;
			mm /= steps;
			for (int i = 0; i < PH_N; i++) {
				ph.bytes[i] /= steps;
				ph.flops[i] /= steps;
			}
			t /= steps;
			{
				char name[32];

				(void)snprintf(name, sizeof(name), "decode, batch %u", B);
				measure(threads, &mc_now);
				mc = around(&mc_prev, &mc_now);
				floor_row(name, B, t, bytes, flops, mm, mc.bw, mc.fl, mc.rd, amx);
				print_split(&sp, t);
				print_phases(&sp, &ph, t, mc.bw, mc.fl);
				print_machine(&mc_prev, &mc_now);
				mc_prev = mc_now;
			}
			for (uint32_t i = 0; i < B; i++)
				ro_seq_free(seq[i]);
			free(seq);
			free(it);
			free(prompt);
			free(tok);
			free(logits);
			fflush(stdout);
		}
		{
			struct ro_seq *s;
			int32_t *p = malloc(prefill_len * sizeof(int32_t));
			float *logits = malloc(c->vocab * sizeof(float));
			double best = 1e30, bytes = 0, flops = 0, mm = 0;
			struct ro_model_split sp = {0};
			struct phases ph = {0};

			for (uint32_t j = 0; j < prefill_len; j++)
				p[j] = (int32_t)((j * 104729 + 17) % c->vocab);
			/* best of 3 (of 2 past 1024 tokens: one run is long enough to average, but
			 * the first of a process pays the first touch of the forward's workspaces,
			 * which a daemon pays once: ~0.5 s of a 4,096-token prefill's ~7 s) */
			for (int rep = 0; rep < (prefill_len > 1024 ? 2 : 3); rep++) {
				struct ro_fwd_item it;
				double t0;

				ro_seq_new(m, prefill_len, &s);
				it = (struct ro_fwd_item){s, p, prefill_len, logits, false};
				t0 = now();
				if (ro_model_forward(m, &it, 1))
					return 1;
				if (now() - t0 < best) {
					best = now() - t0;
					ro_model_last_split(m, &sp);
				}
				ro_seq_free(s);
			}
			/* context sum of a causal prefill: 1 + 2 + ... + n */
			work(&sh, prefill_len, (double)prefill_len * (prefill_len + 1) / 2,
			     prefill_len, ro_model_last_experts(m), 1, &bytes, &flops, &mm, &ph);
			char name[32];

			(void)snprintf(name, sizeof(name), "prefill, %u tokens", prefill_len);
			measure(threads, &mc_now);
			mc = around(&mc_prev, &mc_now);
			floor_row(name, prefill_len, best, bytes, flops, mm, mc.bw, mc.fl, mc.rd,
				  amx);
			print_split(&sp, best);
			print_phases(&sp, &ph, best, mc.bw, mc.fl);
			print_machine(&mc_prev, &mc_now);
			free(p);
			free(logits);
		}
		(void)printf(
		    "\nx floor = measured time / floor time (1.00 is the machine's limit; goal "
		    "<= 1.3 to batch 32, <= 1.5 above).\nfloor = max(bytes touched / memcpy "
		    "bandwidth, FLOPs / FMA "
		    "throughput); bytes count the weights of the\nexperts the step really ran "
		    "(all 64 per layer from batch ~32 on), attention, router, head, KV.\n"
		    "The machine is measured again just before and just after each row (the line "
		    "under it); its\nfloor takes the better of the two for each rate.\n"
		    "x machine limit: the same with bytes at the read stream's rate and, where "
		    "the linear layers run\non AMX, their FLOPs at its rate above: the limit for "
		    "the kernels that run (the goals were\nset against the floor).\n"
		    "by phase: each phase's time over its own floor (its bytes and FLOPs at the "
		    "row's rates), and\nthe step over those floors summed: the phases run in turn "
		    "(a layer's experts wait for its\nattention), so where memory-bound and "
		    "compute-bound phases alternate, the sum is above the\ntable's floor.\n");
	}
	if (run_inflight && inflight_section(m, inf[0], inf[1], inf[2], inf[3], inf[4])) {
		(void)fprintf(stderr, "decode_bench: a forward failed in the in-flight section\n");
		ro_model_free(m);
		return 1;
	}
	if (run_chunked && chunked_section(m, &ck)) {
		(void)fprintf(stderr, "decode_bench: a forward failed in the chunked section\n");
		ro_model_free(m);
		return 1;
	}
	ro_model_free(m);
	return 0;
}
