/* The model: a batched forward pass runs every token of a batch through embedding,
 * attention with a KV cache, the expert layer and the LM head. Every per-token step (norms,
 * RoPE, attention over the cache, routing, the experts, the combine in expert order) is
 * computed the same way whatever shares the batch: that is what makes a sample independent
 * of its batch and of how its prompt was chunked. Sequences (their caches) live here; the
 * loader, attention and the expert layer have files of their own. */
#include "config.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

#include "kernels/model_internal.h"
#include "kernels/cpu/simd.h"

bool ro_kernels_cuda_built(void)
{
#ifdef HAVE_CUDA
	return true;
#else
	return false;
#endif
}

/* ---- sequences ------------------------------------------------------------------------- */

size_t ro_kv_row(const struct ro_model *m)
{
	return (size_t)m->c.kv_heads * m->c.head_dim;
}

int ro_seq_new(struct ro_model *m, uint32_t max_len, struct ro_seq **ret)
{
	struct ro_seq *s = calloc(1, sizeof(*s));

	if (!s)
		return -ENOMEM;
	/* positions 0 .. max_pos - 1, and one slot past them for the step that stops */
	if ((uint64_t)max_len > (uint64_t)m->c.max_pos + 1) {
		free(s);
		return -E2BIG;
	}
	s->m = m;
	s->max = max_len ? max_len : m->c.max_pos;
	*ret = s;
	return 0;
}

/* ---- KV blocks ---- */

/* A block is one allocation: a 64-byte head that holds its reference count, then its data
 * (every layer's K^T and V for RO_KV_BLOCK positions). A block of 1 MiB or more is mapped
 * on its own with its data 2 MiB-aligned (the head at the end of the 4 KiB page before it),
 * and asked for transparent huge pages: a decode step reads a sequence's K^T and V of a
 * layer across ~28 pages of 4 KiB, one TLB miss each (a nested walk in a VM); in 2 MiB
 * pages it is one. */
#define BLK_HEAD 64
#define BLK_PAGE ((size_t)4096)

static size_t blk_bytes(const struct ro_model *m)
{
	return (size_t)m->c.layers * 2 * RO_KV_BLOCK * ro_kv_row(m) * sizeof(float);
}

/* what a block takes beyond its data: its head, or the page that holds it */
static size_t blk_over(const struct ro_model *m)
{
	return blk_bytes(m) >= RO_HUGE_PAGE / 2 ? BLK_PAGE : BLK_HEAD;
}

static uint32_t *blk_ref(float *b)
{
	return (uint32_t *)(void *)((char *)b - BLK_HEAD);
}

/* the mapping of a block's data (whole pages), 0 for a block from malloc */
static size_t blk_map_bytes(const struct ro_model *m)
{
	return blk_over(m) == BLK_PAGE ? (blk_bytes(m) + BLK_PAGE - 1) / BLK_PAGE * BLK_PAGE : 0;
}

static float *blk_new(struct ro_model *m)
{
	const size_t map = blk_map_bytes(m);
	char *p;

	if (map) {
		/* the head in the page below the data (a hint: 4 KiB pages without THP) */
		p = ro_map_huge(map, BLK_PAGE, NULL);
		if (!p)
			return NULL;
	} else {
		char *q = aligned_alloc(BLK_HEAD, BLK_HEAD + blk_bytes(m));

		if (!q)
			return NULL;
		p = q + BLK_HEAD;
	}
	*blk_ref((float *)(void *)p) = 1;
	__atomic_add_fetch(&m->kv_blocks, 1, __ATOMIC_RELAXED);
	return (float *)(void *)p;
}

static void blk_put(struct ro_model *m, float *b)
{
	if (b && __atomic_sub_fetch(blk_ref(b), 1, __ATOMIC_ACQ_REL) == 0) {
		const size_t map = blk_map_bytes(m);

		if (map)
			(void)munmap((char *)b - BLK_PAGE, BLK_PAGE + map);
		else
			free((char *)b - BLK_HEAD);
		__atomic_sub_fetch(&m->kv_blocks, 1, __ATOMIC_RELAXED);
	}
}

/* Drop blocks from index nb on. */
static void blk_drop_from(struct ro_seq *s, uint32_t nb)
{
	while (s->n_blk > nb)
		blk_put(s->m, s->blk[--s->n_blk]);
}

struct ro_seq *ro_seq_free(struct ro_seq *s)
{
	if (!s)
		return NULL;
	blk_drop_from(s, 0);
	free(s->blk);
	free(s);
	return NULL;
}

/* Before positions [len, need) are stored: the table covers them, and every block they land
 * in is this sequence's own. A shared block is copied (its positions below len: the rest is
 * not this sequence's yet), or replaced by a fresh one when none of it is below len. */
int ro_seq_reserve(struct ro_seq *s, uint32_t need)
{
	struct ro_model *m = s->m;
	const size_t row = ro_kv_row(m);
	const uint32_t nb = (uint32_t)(((uint64_t)need + RO_KV_BLOCK - 1) / RO_KV_BLOCK);

	if (need > s->max)
		return -ENOSPC;
	if (need <= s->len)
		return 0;
	if (nb > s->cap_blk) {
		uint32_t cap = s->cap_blk ? s->cap_blk : 4;
		float **t;

		while (cap < nb)
			cap *= 2;
		t = realloc(s->blk, cap * sizeof(*t));
		if (!t)
			return -ENOMEM;
		s->blk = t;
		s->cap_blk = cap;
	}
	for (uint32_t b = s->len / RO_KV_BLOCK; b < s->n_blk && b < nb; b++) {
		const uint32_t keep = s->len > b * RO_KV_BLOCK ? s->len - b * RO_KV_BLOCK : 0;
		float *o = s->blk[b], *n;

		if (__atomic_load_n(blk_ref(o), __ATOMIC_ACQUIRE) == 1)
			continue;
		n = blk_new(m);
		if (!n)
			return -ENOMEM;
		/* K is stored transposed (a column per position): its whole part; V the first
		 * `keep` rows of each KV head */
		for (uint32_t l = 0; l < m->c.layers * 2 && keep; l++) {
			const size_t at = (size_t)l * RO_KV_BLOCK * row;

			if (l % 2 == 0 || keep >= RO_KV_BLOCK) {
				memcpy(n + at, o + at, RO_KV_BLOCK * row * sizeof(float));
				continue;
			}
			for (uint32_t h = 0; h < m->c.kv_heads; h++) {
				const size_t hat = at + (size_t)h * RO_KV_BLOCK * m->c.head_dim;

				memcpy(n + hat, o + hat, keep * m->c.head_dim * sizeof(float));
			}
		}
		if (keep)
			__atomic_add_fetch(&m->kv_cow, 1, __ATOMIC_RELAXED);
		s->blk[b] = n;
		blk_put(m, o);
	}
	while (s->n_blk < nb) {
		float *n = blk_new(m);

		if (!n)
			return -ENOMEM;
		s->blk[s->n_blk++] = n;
	}
	return 0;
}

/* The fork shares src's blocks: nothing is copied until one of them writes. */
int ro_seq_fork(const struct ro_seq *src, struct ro_seq **ret)
{
	struct ro_seq *s;
	int r = ro_seq_new(src->m, src->max, &s);

	if (r)
		return r;
	if (src->n_blk) {
		s->blk = malloc(src->n_blk * sizeof(*s->blk));
		if (!s->blk) {
			ro_seq_free(s);
			return -ENOMEM;
		}
		s->cap_blk = src->n_blk;
		for (uint32_t b = 0; b < src->n_blk; b++) {
			__atomic_add_fetch(blk_ref(src->blk[b]), 1, __ATOMIC_RELAXED);
			s->blk[b] = src->blk[b];
		}
		s->n_blk = src->n_blk;
	}
	s->len = src->len;
	*ret = s;
	return 0;
}

uint32_t ro_seq_len(const struct ro_seq *s)
{
	return s->len;
}

uint32_t ro_seq_max(const struct ro_seq *s)
{
	return s->max;
}

void ro_seq_truncate(struct ro_seq *s, uint32_t len)
{
	if (len < s->len) {
		s->len = len;
		blk_drop_from(s, (uint32_t)(((uint64_t)len + RO_KV_BLOCK - 1) / RO_KV_BLOCK));
	}
}

uint64_t ro_seq_kv_bytes(const struct ro_seq *s, uint64_t *ret_shared)
{
	uint64_t shared = 0;

	for (uint32_t b = 0; b < s->n_blk; b++)
		if (__atomic_load_n(blk_ref(s->blk[b]), __ATOMIC_RELAXED) > 1)
			shared++;
	if (ret_shared)
		*ret_shared = shared * blk_bytes(s->m);
	return (uint64_t)s->n_blk * blk_bytes(s->m);
}

void ro_model_kv_stats(const struct ro_model *m, struct ro_kv_stats *ret)
{
	ret->block_positions = RO_KV_BLOCK;
	ret->block_bytes = blk_bytes(m);
	ret->blocks = __atomic_load_n(&m->kv_blocks, __ATOMIC_RELAXED);
	ret->bytes = ret->blocks * ret->block_bytes;
	ret->copied_on_write = __atomic_load_n(&m->kv_cow, __ATOMIC_RELAXED);
}

/* ---- per-token pieces -------------------------------------------------------------------- */

#if defined(__x86_64__)
/* The eight lanes of ro_rmsnorm in one zmm of doubles: a float's square is exact in
 * double, so the FMA rounds once, as the scalar add does: the same bits. */
static AVX512 void sumsq8(const float *x, uint32_t n8, double acc[8])
{
	__m512d a = _mm512_setzero_pd();

	for (uint32_t i = 0; i < n8; i += 8) {
		const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));

		a = _mm512_fmadd_pd(v, v, a);
	}
	_mm512_storeu_pd(acc, a);
}

/* out = w * (x * scale), 16 lanes: the same two roundings an element as the scalar loop */
static AVX512 void scale_mul16(const float *x, const float *w, float scale, uint32_t n16,
			       float *out)
{
	const __m512 s = _mm512_set1_ps(scale);

	for (uint32_t i = 0; i < n16; i += 16)
		_mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(w + i),
							_mm512_mul_ps(_mm512_loadu_ps(x + i), s)));
}

/* ro_rope in 16 lanes (h % 16 == 0): each element's two products and their sum or
 * difference, rounded as the scalar loop rounds them */
static AVX512 void rope16(float *v, const float *cs, const float *sn, uint32_t h)
{
	for (uint32_t i = 0; i < h; i += 16) {
		const __m512 a = _mm512_loadu_ps(v + i), b = _mm512_loadu_ps(v + i + h),
			     c = _mm512_loadu_ps(cs + i), s = _mm512_loadu_ps(sn + i);

		_mm512_storeu_ps(v + i, _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)));
		_mm512_storeu_ps(v + i + h,
				 _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s)));
	}
}
#endif

void ro_rmsnorm(const float *x, const float *w, uint32_t n, double eps, float *out)
{
	/* the squares summed in double in eight lanes (lane j takes i = 8k + j, in order),
	 * then a fixed tree, then the tail: one order on every machine, and lanes that go
	 * in vectors (one double add chain was 4 cycles an element) */
	double acc[8] = {0}, ss;
	const uint32_t n8 = n & ~7u;
	float scale;

#if defined(__x86_64__)
	if (ro_kernels_avx512())
		sumsq8(x, n8, acc);
	else
#endif
		for (uint32_t i = 0; i < n8; i += 8)
			for (uint32_t j = 0; j < 8; j++)
				acc[j] = acc[j] + (double)x[i + j] * x[i + j];
	ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
	for (uint32_t i = n8; i < n; i++)
		ss += (double)x[i] * x[i];
	scale = (float)(1.0 / sqrt(ss / n + eps));
	uint32_t i = 0;

#if defined(__x86_64__)
	if (ro_kernels_avx512()) {
		i = n & ~15u;
		scale_mul16(x, w, scale, i, out);
	}
#endif
	for (; i < n; i++)
		out[i] = w[i] * (x[i] * scale);
}

void ro_rope(float *v, const float *cs, const float *sn, uint32_t hd)
{
	const uint32_t h = hd / 2;

#if defined(__x86_64__)
	if (h % 16 == 0 && ro_kernels_avx512()) {
		rope16(v, cs, sn, h);
		return;
	}
#endif
	for (uint32_t i = 0; i < h; i++) {
		float a = v[i], b = v[i + h];

		v[i] = a * cs[i] - b * sn[i];
		v[i + h] = b * cs[i] + a * sn[i];
	}
}



/* Per token t: x[t] += res[t] (+ bias) when res is given, then out[t] = rmsnorm(x[t]) */
struct norm_task {
	float *x;
	const float *res, *bias, *w;
	uint32_t n;
	double eps;
	float *out;
};

#if defined(__x86_64__)
static AVX512 void add16(float *x, const float *r, size_t n16)
{
	for (size_t d = 0; d < n16; d += 16)
		_mm512_storeu_ps(x + d, _mm512_add_ps(_mm512_loadu_ps(x + d), _mm512_loadu_ps(r + d)));
}
#endif

/* x += r for n floats, in 16 lanes where AVX-512 runs (the scalar loop compiles to
 * scalars): the same additions */
static void add_to(float *x, const float *r, size_t n)
{
	size_t d = 0;

#if defined(__x86_64__)
	if (ro_kernels_avx512()) {
		d = n & ~(size_t)15;
		add16(x, r, d);
	}
#endif
	for (; d < n; d++)
		x[d] = x[d] + r[d];
}

static void norm_one(void *arg, uint32_t t)
{
	const struct norm_task *k = arg;
	float *x = k->x + (size_t)t * k->n;

	if (k->res) {
		const float *r = k->res + (size_t)t * k->n;

		if (k->bias)
			for (uint32_t d = 0; d < k->n; d++)
				x[d] = x[d] + (r[d] + k->bias[d]);
		else
			add_to(x, r, k->n);
	}
	ro_rmsnorm(x, k->w, k->n, k->eps, k->out + (size_t)t * k->n);
}

struct route_task {
	const struct ro_model_config *c;
	const float *logits;
	int32_t *ids;
	float *w;
};

static void route_one(void *arg, uint32_t t)
{
	const struct route_task *k = arg;

	ro_route(k->c, k->logits + (size_t)t * k->c->experts, k->ids + (size_t)t * k->c->top_k,
		 k->w + (size_t)t * k->c->top_k);
}

/* fn(arg, t) for the T tokens: on the pool from 8 tokens up (below, a job costs more than
 * it saves) */
static void per_token(struct ro_model *m, uint32_t T, void (*fn)(void *, uint32_t), void *arg)
{
	if (T >= 8) {
		ro_pool_for(m->pool, T, fn, arg);
		return;
	}
	for (uint32_t t = 0; t < T; t++)
		fn(arg, t);
}

/* Seconds since *t, and *t moved to now: the forward's phase timer (a few dozen calls per
 * forward; CLOCK_MONOTONIC is a vDSO read). */
static double lap(struct timespec *t)
{
	struct timespec n;
	double d;

	(void)clock_gettime(CLOCK_MONOTONIC, &n);
	d = (double)(n.tv_sec - t->tv_sec) + (n.tv_nsec - t->tv_nsec) / 1e9;
	*t = n;
	return d;
}

#if defined(__x86_64__)
/* combine_one's sums in 16 lanes, 64 outputs at a time: each lane the same multiply and add
 * (no FMA) in the same order, so the same bits as the loop below. The loop as compiled for
 * the baseline ISA is scalar (a load, multiply, add and store an element): 8 experts x
 * 1,024 outputs took ~2.5 us a token and layer, 5 ms a step at batch 256. */
static AVX512 void combine512(const struct fwd *f, uint32_t t, uint32_t H, uint32_t K)
{
	float *xr = f->x + (size_t)t * H;

	for (uint32_t d0 = 0; d0 + 64 <= H; d0 += 64) {
		__m512 acc[4];

		for (int i = 0; i < 4; i++)
			acc[i] = _mm512_setzero_ps();
		for (uint32_t j = 0; j < K; j++) {
			const __m512 w = _mm512_set1_ps(f->rw[(size_t)t * K + j]);
			const float *o = f->moe_out + ((size_t)t * K + j) * H + d0;

			for (int i = 0; i < 4; i++)
				acc[i] = _mm512_add_ps(acc[i],
						       _mm512_mul_ps(w, _mm512_loadu_ps(o + 16 * i)));
		}
		for (int i = 0; i < 4; i++)
			_mm512_storeu_ps(xr + d0 + 16 * i,
					 _mm512_add_ps(_mm512_loadu_ps(xr + d0 + 16 * i), acc[i]));
	}
}
#endif

/* Token t's expert outputs, weighted and summed in expert order, added to its residual. */
static void combine_one(void *arg, uint32_t t)
{
	const struct fwd *f = arg;
	const uint32_t H = f->m->c.hidden, K = f->m->c.top_k;
	float *xr = f->x + (size_t)t * H;

#if defined(__x86_64__)
	if (f->combine512) {
		combine512(f, t, H, K);
		return;
	}
#endif

	/* 64 outputs at a time, experts outer: each element's sum is the same additions in
	 * the same order as one loop over j, and the inner loops run in vectors */
	for (uint32_t d0 = 0; d0 < H; d0 += 64) {
		const uint32_t n = H - d0 < 64 ? H - d0 : 64;
		float acc[64] = {0};

		for (uint32_t j = 0; j < K; j++) {
			const float w = f->rw[(size_t)t * K + j],
				    *o = f->moe_out + ((size_t)t * K + j) * H + d0;

			for (uint32_t d = 0; d < n; d++)
				acc[d] = acc[d] + w * o[d];
		}
		for (uint32_t d = 0; d < n; d++)
			xr[d0 + d] = xr[d0 + d] + acc[d];
	}
}

/* ---- the batch ------------------------------------------------------------------------- */


int ro_jobs_add(struct jobs *J, const struct ro_mat *W, const float *x, uint32_t T,
		    float *y, uint32_t ldy, uint32_t chunk)
{
	for (uint32_t r0 = 0; r0 < W->rows; r0 += chunk) {
		if (J->n == J->cap) {
			uint32_t cap = J->cap ? J->cap * 2 : 256;
			struct gemm_job *nj = realloc(J->j, cap * sizeof(*nj));

			if (!nj)
				return -ENOMEM;
			J->j = nj;
			J->cap = cap;
		}
		J->j[J->n++] = (struct gemm_job){W, x, T, y, ldy, r0,
						 r0 + chunk < W->rows ? r0 + chunk : W->rows, NULL};
	}
	return 0;
}

static void run_job(void *arg, uint32_t i)
{
	const struct gemm_job *j = &((const struct jobs *)arg)->j[i];

	if (j->yp) {
		const float *xp[RO_JOB_PTRS];

		for (uint32_t t = 0; t < j->T; t++)
			xp[t] = j->x + (size_t)t * j->W->cols;
		ro_gemm_ptrs(j->W, xp, j->T, j->yp, j->r0, j->r1);
		return;
	}
	ro_gemm_rows(j->W, j->x, j->T, j->y, j->ldy, j->r0, j->r1);
}

/* Rows per task: enough tasks to balance the threads, each big enough to amortize. */
uint32_t ro_chunk_for(const struct ro_model *m, uint32_t rows, uint32_t T, uint32_t mats)
{
	uint32_t th = ro_pool_size(m->pool), want = th * 4 / (mats ? mats : 1);
	const bool amx = ro_kernels_amx();
	uint32_t c;

	/* AMX packs a call's tokens for its tiles (a few microseconds per 16 tokens of 1,024
	 * inputs) once per call: past 16 tokens, a chunk per thread, not four */
	if (amx && T > 16)
		want = th;
	if (want < 1)
		want = 1;
	c = (rows + want - 1) / want;
	/* whole blocks: AMX runs 32 rows a block (a chunk of 36 would run a 16-row tile for
	 * its last 4), the AVX-512 panels 16; and at least 2 panels, so that each weight load
	 * feeds two panels' FMAs (a 64-expert router was 4 one-panel tasks: router phase 3.08
	 * -> 2.71-2.81 ms a step at batch 128) */
	c = amx ? (c + 31) & ~31u : (c + 15) & ~15u;
	if (c < 32)
		c = 32;
	return c;
}

int ro_run_jobs(struct ro_model *m, struct jobs *J)
{
	ro_pool_for(m->pool, J->n, run_job, J);
	J->n = 0;
	return 0;
}

static float *ws_get(struct ro_model *m, size_t floats)
{
	if (floats > m->ws_len) {
		/* free, then allocate: the contents are scratch, and realloc would hold the
		 * old and the new block at once */
		free(m->ws);
		m->ws_len = 0;
		m->ws = ro_malloc_huge(floats * sizeof(float));
		if (!m->ws)
			return NULL;
		m->ws_len = floats;
	}
	return m->ws;
}

void ro_model_set_exchange(struct ro_model *m, const struct ro_moe_exchange *x)
{
	m->have_xch = x != NULL;
	if (x)
		m->xch = *x;
}

/* Logit rows the LM head computes per pass: the forward's logits scratch is at most this
 * many rows whatever the batch (the head's weights are read once per pass; a decode batch
 * up to this size is one pass). */
#define HEAD_ROWS RO_JOB_PTRS

/* Floats of the forward's workspace per token: x, h, q, att, k, v, the RoPE cos and sin,
 * the experts' outputs (top_k rows), the dense MLP's gate, up and down (when a layer is
 * dense), the router's logits. Shared by the forward and ro_model_forward_bytes so the two cannot
 * drift. */
static size_t ws_per_token(const struct ro_model_config *c)
{
	const size_t H = c->hidden, hd = c->head_dim, qd = (size_t)c->heads * hd,
		     kvd = (size_t)c->kv_heads * hd;
	const size_t dense = c->dense_layers ? (size_t)c->dense_ffn * 2 + H : 0;

	return H * 2 + qd * 2 + kvd * 2 + hd + (size_t)c->top_k * H + dense + c->experts;
}

/* Logit rows an item gets: one per token with all_logits, else one for its last token. */
static uint32_t item_rows(const struct ro_fwd_item *it)
{
	return it->all_logits ? it->n : (it->n ? 1 : 0);
}

static size_t ws_floats(const struct ro_model_config *c, size_t T, size_t n_out)
{
	return T * ws_per_token(c) + (n_out < HEAD_ROWS ? n_out : HEAD_ROWS) * c->vocab;
}

int ro_model_forward(struct ro_model *m, struct ro_fwd_item *items, size_t count)
{
	const struct ro_model_config *c = &m->c;
	const uint32_t H = c->hidden, hd = c->head_dim, qd = c->heads * hd,
		       kvd = c->kv_heads * hd, K = c->top_k;
	uint32_t T = 0, n_out = 0;
	struct fwd f = {.m = m};
	struct jobs J = {0};
	int32_t *ids = NULL;
	float *rw = NULL;
	uint32_t *out_tok = NULL;
	struct timespec tm;
	float *p;
	int r = 0;

	for (size_t i = 0; i < count; i++) {
		if (!items[i].seq || (!items[i].tokens && items[i].n))
			return -EINVAL;
		if ((uint64_t)items[i].seq->len + items[i].n > items[i].seq->max)
			return -ENOSPC;
		/* (token, head) and (token, expert) pairs are counted in 32 bits (the pool's
		 * indexes, the experts' row offsets) */
		if (((uint64_t)T + items[i].n) * (c->heads > K ? c->heads : K) > UINT32_MAX)
			return -E2BIG;
		for (uint32_t j = 0; j < items[i].n; j++)
			if (items[i].tokens[j] < 0 || (uint32_t)items[i].tokens[j] >= c->vocab)
				return -EINVAL;
		for (size_t k = 0; k < i; k++)
			if (items[k].seq == items[i].seq)
				return -EINVAL; /* one entry per sequence and batch */
		T += items[i].n;
		n_out += item_rows(&items[i]);
	}
	if (!T)
		return m->have_xch ? ro_forward_idle(m) : 0;
	m->experts_run = 0;
	m->split = (struct ro_model_split){0};
	(void)clock_gettime(CLOCK_MONOTONIC, &tm);
	for (size_t i = 0; i < count; i++) {
		r = ro_seq_reserve(items[i].seq, items[i].seq->len + items[i].n);
		if (r)
			return r;
	}
	/* O(tokens x hidden): attention keeps its scores in a tile on each thread's stack */
	p = ws_get(m, ws_floats(c, T, n_out));
	f.seq = malloc(T * sizeof(*f.seq));
	f.pos = malloc(T * sizeof(*f.pos));
	ids = malloc((size_t)T * K * sizeof(*ids));
	rw = malloc((size_t)T * K * sizeof(*rw));
	out_tok = malloc((size_t)n_out * sizeof(*out_tok));
	if (!p || !f.seq || !f.pos || !ids || !rw || (n_out && !out_tok)) {
		r = -ENOMEM;
		goto out;
	}
	f.T = T;
	f.avx2 = ro_kernels_avx2();
	f.avx512 = ro_kernels_avx512() && hd % 16 == 0;
	f.combine512 = ro_kernels_avx512() && H % 64 == 0;
	f.x = p;
	f.h = f.x + (size_t)T * H;
	f.q = f.h + (size_t)T * H;
	f.att = f.q + (size_t)T * qd;
	f.k = f.att + (size_t)T * qd;
	f.v = f.k + (size_t)T * kvd;
	f.cs = f.v + (size_t)T * kvd;
	f.sn = f.cs + (size_t)T * hd / 2;
	{
		const size_t dense = c->dense_layers ? (size_t)c->dense_ffn * 2 + H : 0;
		float *moe_out = f.sn + (size_t)T * hd / 2;
		float *scratch = moe_out + (size_t)T * K * H;
		float *router = scratch + (size_t)T * dense;
		float *logits = router + (size_t)T * c->experts;
		uint32_t t = 0, o = 0;

		for (size_t i = 0; i < count; i++) {
			for (uint32_t j = 0; j < items[i].n; j++, t++) {
				struct ro_seq *s = items[i].seq;
				const size_t e = (size_t)items[i].tokens[j] * H;

				f.seq[t] = s;
				f.pos[t] = s->len + j;
				for (uint32_t d = 0; d < H; d++)
					f.x[(size_t)t * H + d] = ro_elem(m->embed, e + d);
				/* HF computes inv_freq and the angles in float32 */
				for (uint32_t d = 0; d < hd / 2; d++) {
					float inv = (float)(1.0 / pow(c->rope_theta, (double)(2 * d) / hd));
					float ang = (float)f.pos[t] * inv;

					f.cs[(size_t)t * hd / 2 + d] = cosf(ang);
					f.sn[(size_t)t * hd / 2 + d] = sinf(ang);
				}
				if (items[i].all_logits || j + 1 == items[i].n)
					out_tok[o++] = t;
			}
		}
		/* Runs of consecutive positions of one sequence, two ways. The K/V stores' (sb):
		 * within one line of K^T (16 positions), so that no two threads write one line (a
		 * store task a token, with a prefill's neighbours on the other thread, bounced
		 * each of the token's 256 K^T lines between the cores: 45 of a 512-token
		 * prefill's 250 ms of attention, against ~2 for the norms and RoPE). Attention's
		 * (tb, AVX-512): as many tokens as make RO_ATT_ROWS query rows of a KV group (one
		 * when a group has more), fewer (down to 16 rows) where the batch would
		 * otherwise give a thread less than 4 tasks. */
		f.tb = malloc(((size_t)T + 1) * 2 * sizeof(*f.tb));
		if (!f.tb) {
			r = -ENOMEM;
			goto out;
		}
		f.sb = f.tb + T + 1;
		{
			const uint32_t G = c->heads / c->kv_heads,
				       least = G < 16 ? 16 / G : 1,
				       want = 4 * ro_pool_size(m->pool);
			uint32_t per = G < RO_ATT_ROWS ? RO_ATT_ROWS / G : 1;

			while (per / 2 >= least && (uint64_t)T * c->kv_heads < (uint64_t)want * per)
				per /= 2;

			for (t = 0; t < T; t++) {
				const bool cut = !t || f.seq[t] != f.seq[t - 1] ||
						 f.pos[t] != f.pos[t - 1] + 1;

				if (cut || f.pos[t] % 16 == 0)
					f.sb[f.n_sb++] = t;
				if (f.avx512 && (cut || t - f.tb[f.n_tb - 1] == per))
					f.tb[f.n_tb++] = t;
			}
			f.sb[f.n_sb] = T;
			f.tb[f.n_tb] = T;
		}
		if (f.avx512) {
			/* a decode step (no sequence in two runs, so no run reads K/V that another
			 * task stores): each task stores a run's K and V and attends it at once; a
			 * batch of fewer runs keeps the KV heads apart (a task each) so that every
			 * thread has work */
			f.runs_whole = f.n_tb >= 2 * ro_pool_size(m->pool);
			for (uint32_t b = 1; b < f.n_tb && f.runs_whole; b++)
				if (f.seq[f.tb[b]] == f.seq[f.tb[b] - 1])
					f.runs_whole = false;
		}
		m->split.other += lap(&tm);
		for (uint32_t l = 0; l < c->layers; l++) {
			const struct layer *L = &m->L[l];

			f.layer = l;
			per_token(m, T, norm_one,
				  &(struct norm_task){f.x, NULL, NULL, L->in_norm, H, c->rms_eps, f.h});
			if ((r = ro_jobs_add(&J, &L->q, f.h, T, f.q, qd, ro_chunk_for(m, qd, T, 3))) ||
			    (r = ro_jobs_add(&J, &L->k, f.h, T, f.k, kvd, ro_chunk_for(m, kvd, T, 3))) ||
			    (r = ro_jobs_add(&J, &L->v, f.h, T, f.v, kvd, ro_chunk_for(m, kvd, T, 3))))
				goto out;
			ro_run_jobs(m, &J);
#if defined(__x86_64__)
			if (f.runs_whole)
				ro_pool_for(m->pool, f.n_tb, ro_rope_attend_run, &f);
			else
#endif
			{
				ro_pool_for(m->pool, f.n_sb, ro_qk_rope_store_run, &f);
#if defined(__x86_64__)
				if (f.avx512)
					ro_pool_for(m->pool, f.n_tb * c->kv_heads,
						    ro_attend_head_major, &f);
				else
#endif
					ro_pool_for(m->pool, T * c->heads, ro_attend_one, &f);
			}
			/* o_proj into h, then the residual */
			if ((r = ro_jobs_add(&J, &L->o, f.att, T, f.h, H, ro_chunk_for(m, H, T, 1))))
				goto out;
			ro_run_jobs(m, &J);
			per_token(m, T, norm_one,
				  &(struct norm_task){f.x, f.h, L->bo, L->post_norm, H, c->rms_eps, f.h});
			m->split.attention += lap(&tm);
			if (L->dense) {
				float *g = scratch, *u = g + (size_t)T * L->ffn,
				      *y = u + (size_t)T * L->ffn;

				if ((r = ro_jobs_add(&J, &L->gate[0], f.h, T, g, L->ffn,
						  ro_chunk_for(m, L->ffn, T, 2))) ||
				    (r = ro_jobs_add(&J, &L->up[0], f.h, T, u, L->ffn,
						  ro_chunk_for(m, L->ffn, T, 2))))
					goto out;
				ro_run_jobs(m, &J);
				ro_swiglu(g, u, (size_t)T * L->ffn);
				if ((r = ro_jobs_add(&J, &L->down[0], g, T, y, H, ro_chunk_for(m, H, T, 1))))
					goto out;
				ro_run_jobs(m, &J);
				add_to(f.x, y, (size_t)T * H);
				m->split.experts += lap(&tm);
				continue;
			}
			if ((r = ro_jobs_add(&J, &L->router, f.h, T, router, c->experts,
					  ro_chunk_for(m, c->experts, T, 1))))
				goto out;
			ro_run_jobs(m, &J);
			per_token(m, T, route_one, &(struct route_task){c, router, ids, rw});
			m->split.router += lap(&tm);
			if (m->have_xch)
				r = m->xch.exchange(m->xch.ctx, l, f.h, ids, rw, T, K, H, moe_out);
			else
				r = ro_local_experts(m, l, f.h, ids, T, moe_out);
			if (r)
				goto out;
			if (m->have_xch && m->xch.summed) {
				/* the transport summed the weighted outputs: only the residual */
				add_to(f.x, moe_out, (size_t)T * H);
				m->split.experts += lap(&tm);
				continue;
			}
			/* combine: the weighted outputs summed in expert order, then the residual */
			f.rw = rw;
			f.moe_out = moe_out;
			ro_pool_for(m->pool, T, combine_one, &f);
			m->split.experts += lap(&tm);
		}
		/* final norm and the LM head, only for the rows whose logits are wanted */
		for (o = 0; o < n_out; o++)
			ro_rmsnorm(f.x + (size_t)out_tok[o] * H, m->final_norm, H, c->rms_eps,
				f.h + (size_t)o * H);
		{
			/* the head in passes of HEAD_ROWS rows: a row's logits are the same bits
			 * whatever the pass holds (ro_gemm_rows), and the scratch stays bounded
			 * however many rows all_logits asks for */
			size_t it = 0;
			uint32_t it_row = 0;

			for (uint32_t o0 = 0; o0 < n_out && !r; o0 += HEAD_ROWS) {
				const uint32_t rows =
				    n_out - o0 > HEAD_ROWS ? HEAD_ROWS : n_out - o0;

				float *yp[HEAD_ROWS];

				/* each row straight into its item's logits (a row no item wants
				 * into the scratch), not copied there after the pass: with a
				 * 32,768-token vocabulary 16 MB a step at batch 128, on one thread
				 * while the other waited (in-process, alternating steps: 0-2.5 ms
				 * less a step at 128 and 256, within the noise) */
				for (o = 0; o < rows; o++, it_row++) {
					/* items own consecutive rows: find this one's */
					while (it_row == item_rows(&items[it])) {
						it++;
						it_row = 0;
					}
					yp[o] = items[it].logits
						    ? items[it].logits + (size_t)it_row * c->vocab
						    : logits + (size_t)o * c->vocab;
				}
				r = ro_jobs_add(&J, &m->head, f.h + (size_t)o0 * H, rows, logits,
					     c->vocab, ro_chunk_for(m, c->vocab, rows, 1));
				if (r)
					break;
				for (uint32_t k = 0; k < J.n; k++)
					J.j[k].yp = yp;
				ro_run_jobs(m, &J);
			}
		}
		m->split.head += lap(&tm);
		for (size_t i = 0; i < count && !r; i++)
			items[i].seq->len += items[i].n;
	}
out:
	free(J.j);
	free(f.seq);
	free(f.pos);
	free(f.tb);
	free(ids);
	free(rw);
	free(out_tok);
	return r;
}

/* ---- memory estimates ------------------------------------------------------------------- */

/* A table of nb blocks: its room doubles from 4 */
static uint64_t table_bytes(uint64_t nb)
{
	return (nb < 4 ? 4 : 2 * nb) * sizeof(float *);
}

/* A sequence grows a block at a time (no copy of what it holds): at max_len it holds
 * ceil(max_len / RO_KV_BLOCK) blocks and its table. */
uint64_t ro_model_seq_bytes(const struct ro_model *m, uint32_t max_len)
{
	const uint64_t max = max_len ? max_len : m->c.max_pos;
	const uint64_t nb = (max + RO_KV_BLOCK - 1) / RO_KV_BLOCK;

	return sizeof(struct ro_seq) + nb * (blk_over(m) + blk_bytes(m)) + table_bytes(nb);
}

/* A prompt of prompt_len positions prefilled once, then forked n ways, each growing to
 * max_len: the prompt's blocks (held by all) plus each fork's own: the blocks past the
 * prompt's full ones (the partly filled last one is copied by each fork that writes). */
uint64_t ro_model_forks_bytes(const struct ro_model *m, uint32_t prompt_len, uint32_t max_len,
			      uint32_t n)
{
	const uint64_t max = max_len ? max_len : m->c.max_pos, b = blk_over(m) + blk_bytes(m);
	const uint64_t nb = (max + RO_KV_BLOCK - 1) / RO_KV_BLOCK;
	const uint64_t pb = ((uint64_t)prompt_len + RO_KV_BLOCK - 1) / RO_KV_BLOCK,
		       full = prompt_len / RO_KV_BLOCK;
	const uint64_t own = nb > full ? nb - full : 0,
		       per = sizeof(struct ro_seq) + table_bytes(nb);

	/* saturating: callers compare against what the machine has */
	if (own && n > (UINT64_MAX / 2) / (own * b + per))
		return UINT64_MAX;
	return pb * b + per + (uint64_t)n * (own * b + per);
}

/* A job array of a phase that adds n jobs: its capacity and, while realloc moves it, the
 * old half of that. */
static uint64_t jobs_bytes(uint64_t n)
{
	uint64_t cap = n * 2 > 256 ? n * 2 : 256;

	return cap * 3 / 2 * sizeof(struct gemm_job);
}

/* Rows per job are at least 16 (chunk_for): a bound on a matrix's jobs. */
static uint64_t njobs(uint64_t rows)
{
	return rows / 16 + 1;
}

/* Everything ro_model_forward allocates, as if all of it were live at once: the workspace,
 * the experts' scratch and their index arrays, the job lists. A bound, not a guess: tests
 * check it against what malloc is asked for. */
uint64_t ro_model_forward_bytes(const struct ro_model *m, uint32_t tokens)
{
	const struct ro_model_config *c = &m->c;
	const uint64_t T = tokens, TK = T * c->top_k, H = c->hidden, E = c->experts;
	const uint64_t qd = (uint64_t)c->heads * c->head_dim, kvd = ro_kv_row(m);
	uint64_t b, fj;
	bool moe = false;

	if (!tokens)
		return 0;
	for (uint32_t l = 0; l < c->layers; l++)
		moe = moe || !m->L[l].dense;
	b = ws_floats(c, T, T) * sizeof(float);
	/* f.seq, f.pos, ids, rw, out_tok, f.tb and f.sb */
	b += T * (sizeof(struct ro_seq *) + sizeof(uint32_t) * 2) + TK * (sizeof(int32_t) * 2) +
	     (T + 1) * 2 * sizeof(uint32_t);
	fj = njobs(qd) + njobs(kvd) * 2;
	fj = fj > njobs(H) ? fj : njobs(H);
	fj = fj > njobs(c->dense_ffn) * 2 ? fj : njobs(c->dense_ffn) * 2;
	fj = fj > njobs(E) ? fj : njobs(E);
	fj = fj > njobs(c->vocab) ? fj : njobs(c->vocab);
	b += jobs_bytes(fj);
	if (moe) {
		/* local_experts' row pointers; ro_model_experts' gate/up scratch, counts,
		 * offsets, active experts, their sort keys and its four row-pointer arrays */
		b += TK * sizeof(float *);
		b += TK * (uint64_t)c->expert_ffn * 2 * sizeof(float);
		b += (E + 1) * sizeof(uint32_t) * 2 + E * sizeof(uint32_t) + E * sizeof(uint64_t) +
		     TK * 4 * sizeof(void *);
	}
	return b;
}
