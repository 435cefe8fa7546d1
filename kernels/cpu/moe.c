/* The expert layer on the CPU: routing (softmax, top-k, renormalized), each expert's rows
 * gathered and run through gate/up, SwiGLU and down for all of them at once, scattered
 * back; the entry points a transport uses for the pairs other ranks send. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/model_internal.h"
#include "kernels/cpu/simd.h"

/* g = silu(g) * u, elementwise: the experts' and dense MLP's activation. With the AVX-512
 * kernels 16 lanes at a time through exp512, the tail masked (so an element's bits do not
 * depend on where in a call it falls: batch invariance), else expf. */
#if defined(__x86_64__)
static AVX512 void swiglu512(float *g, const float *u, size_t n)
{
	const __m512 one = _mm512_set1_ps(1.0f);

	for (size_t i = 0; i < n; i += 16) {
		const __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
		const __m512 gv = _mm512_maskz_loadu_ps(k, g + i), uv = _mm512_maskz_loadu_ps(k, u + i);
		const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));

		_mm512_mask_storeu_ps(g + i, k,
				      _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv));
	}
}
#endif

void ro_swiglu(float *g, const float *u, size_t n)
{
#if defined(__x86_64__)
	if (ro_kernels_avx512()) {
		swiglu512(g, u, n);
		return;
	}
#endif
	for (size_t i = 0; i < n; i++)
		g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

int ro_model_expert(struct ro_model *m, uint32_t layer, uint32_t e, const float *x, uint32_t n,
		    float *y)
{
	const struct layer *L;
	float *g, *u;
	struct jobs J = {0};
	int r = 0;

	if (layer >= m->c.layers || m->L[layer].dense || e >= m->c.experts)
		return -EINVAL;
	if (!n)
		return 0;
	L = &m->L[layer];
	g = malloc((size_t)n * L->ffn * sizeof(float) * 2);
	if (!g)
		return -ENOMEM;
	u = g + (size_t)n * L->ffn;
	r = ro_jobs_add(&J, &L->gate[e], x, n, g, L->ffn, ro_chunk_for(m, L->ffn, n, 2));
	if (!r)
		r = ro_jobs_add(&J, &L->up[e], x, n, u, L->ffn, ro_chunk_for(m, L->ffn, n, 2));
	if (!r) {
		ro_run_jobs(m, &J);
		ro_swiglu(g, u, (size_t)n * L->ffn);
		r = ro_jobs_add(&J, &L->down[e], g, n, y, m->c.hidden,
			     ro_chunk_for(m, m->c.hidden, n, 1));
	}
	if (!r)
		ro_run_jobs(m, &J);
	free(J.j);
	free(g);
	return r;
}

/* Route each token: softmax over the router's logits, top-k (ties to the lower index),
 * renormalized when configured, then sorted by expert index for the combine. Renormalized,
 * the softmax's sum over all experts cancels, w_j = e^(l_j - max) / (the top-k's sum): 16
 * exp() calls a token at top-8 of 64, not 64. */
void ro_route(const struct ro_model_config *c, const float *logits, int32_t *ids, float *w)
{
	const uint32_t E = c->experts, K = c->top_k;
	float mx = -INFINITY;
	double sum = 0, ksum = 0;

	for (uint32_t e = 0; e < E; e++)
		if (logits[e] > mx)
			mx = logits[e];
	if (!c->norm_topk)
		for (uint32_t e = 0; e < E; e++)
			sum += exp((double)logits[e] - mx);
	/* the experts taken so far, a bit each (the loader bounds E); a scan of ids[0..j) for
	 * every expert was 1.7 us a token at top-8 of 64, this 1.0 (the same picks) */
	uint64_t taken[(RO_MAX_EXPERTS + 63) / 64] = {0};

	for (uint32_t j = 0; j < K; j++) {
		int32_t best = -1;

		for (uint32_t e = 0; e < E; e++)
			if (!(taken[e / 64] >> (e % 64) & 1) &&
			    (best < 0 || logits[e] > logits[best]))
				best = (int32_t)e;
		taken[best / 64] |= 1ull << (best % 64);
		ids[j] = best;
		if (c->norm_topk)
			ksum += exp((double)logits[best] - mx);
		else
			w[j] = (float)(exp((double)logits[best] - mx) / sum);
	}
	if (c->norm_topk) /* (each exp again: 16 calls where a buffer would need top_k's bound) */
		for (uint32_t j = 0; j < K; j++)
			w[j] = (float)(exp((double)logits[ids[j]] - mx) / ksum);
	for (uint32_t j = 1; j < K; j++) /* insertion sort by expert id */
		for (uint32_t i = j; i > 0 && ids[i - 1] > ids[i]; i--) {
			int32_t ti = ids[i];
			float tw = w[i];

			ids[i] = ids[i - 1];
			w[i] = w[i - 1];
			ids[i - 1] = ti;
			w[i - 1] = tw;
		}
}

/* Rows of W per task: gate and up in panels of PANEL_GU rows (of each), down in panels of
 * PANEL_D output rows; on AMX a task takes an expert's whole gate and up, or its whole
 * down (fewer, larger panels when few experts are active), so that its tokens are packed
 * for the tiles once (ro_gemm_ptrs2) rather than per panel. An expert's weights are
 * streamed once per step for all of its rows, and threads take different (expert, panel)
 * pairs, so they read different weights. */
#define PANEL_GU 128
#define PANEL_D 128

struct moe_task {
	const struct layer *L;
	uint32_t F, H;
	const uint32_t *off; /* expert e's rows are [off[e], off[e + 1]) of the grouped order */
	const uint32_t *act; /* the experts with rows: in index order, or most rows first */
	uint32_t n_gu, n_d;  /* panels per expert */
	uint32_t p_gu, p_d;  /* rows per panel */
	const float **xp;    /* grouped row -> its input */
	float **gp, **up;    /* grouped row -> its gate and up rows (scratch) */
	float **yp;	     /* grouped row -> its output */
};

/* Gate and up rows [r0, r1) of expert e for all of its rows, then SwiGLU on them: the
 * activation is elementwise, so the rows need nothing from any other task. */
static void gate_up_rows(const struct moe_task *k, uint32_t e, uint32_t r0, uint32_t r1)
{
	const uint32_t a = k->off[e], n = k->off[e + 1] - a;

	ro_gemm_ptrs2(&k->L->gate[e], &k->L->up[e], k->xp + a, n, k->gp + a, k->up + a, r0, r1);
	for (uint32_t j = 0; j < n; j++)
		ro_swiglu(k->gp[a + j] + r0, k->up[a + j] + r0, r1 - r0);
}

/* Down's output rows [r0, r1) of expert e, from all of the activation. */
static void down_rows(const struct moe_task *k, uint32_t e, uint32_t r0, uint32_t r1)
{
	const uint32_t a = k->off[e], n = k->off[e + 1] - a;

	ro_gemm_ptrs(&k->L->down[e], (const float *const *)k->gp + a, n, k->yp + a, r0, r1);
}

static void gate_up_task(void *arg, uint32_t i)
{
	const struct moe_task *k = arg;
	const uint32_t p = i % k->n_gu, r0 = p * k->p_gu;

	gate_up_rows(k, k->act[i / k->n_gu], r0, r0 + k->p_gu < k->F ? r0 + k->p_gu : k->F);
}

static void down_task(void *arg, uint32_t i)
{
	const struct moe_task *k = arg;
	const uint32_t p = i % k->n_d, r0 = p * k->p_d;

	down_rows(k, k->act[i / k->n_d], r0, r0 + k->p_d < k->H ? r0 + k->p_d : k->H);
}

/* One whole expert: gate, up, SwiGLU and down for all of its rows, so no thread waits for
 * another between the two halves (each row's output is its own). */
static void expert_task(void *arg, uint32_t i)
{
	const struct moe_task *k = arg;

	ro_gemm_then(&k->L->down[k->act[i]]);
	gate_up_rows(k, k->act[i], 0, k->F);
	ro_gemm_then(NULL);
	down_rows(k, k->act[i], 0, k->H);
}

static int by_rows_desc(const void *a, const void *b)
{
	const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* act[0..n_act) reordered by rows, most first, ties by index (one sort key per expert:
 * the complement of its rows above its index). Without memory for the keys the order
 * stays: it changes which thread runs what, never a result. */
static void sort_by_rows(uint32_t *act, uint32_t n_act, const uint32_t *off)
{
	uint64_t *key = malloc(n_act * sizeof(*key));

	if (!key)
		return;
	for (uint32_t i = 0; i < n_act; i++)
		key[i] = (uint64_t)(UINT32_MAX - (off[act[i] + 1] - off[act[i]])) << 32 | act[i];
	qsort(key, n_act, sizeof(*key), by_rows_desc);
	for (uint32_t i = 0; i < n_act; i++)
		act[i] = (uint32_t)key[i];
	free(key);
}

/* Run n (row, expert) pairs of layer l: y[i] = expert[experts[i]](x[i]), as a grouped GEMM.
 * The pairs are grouped by expert (pointers only: rows are read and written in place), then
 * run as whole-expert tasks where enough experts share the rows evenly, else gate/up/SwiGLU
 * as (expert, panel) tasks, then down the same way. A row's result does
 * not depend on what else is in the batch (ro_gemm_ptrs sums every output element in one
 * order whatever rows share its block), so the expert-parallel path (pairs received from
 * other ranks) equals the local one. Uses its own scratch: a transport calls it from inside
 * ro_model_forward. */
int ro_model_experts(struct ro_model *m, uint32_t l, const float *const *x,
		     const int32_t *experts, size_t n, float *y)
{
	const struct ro_model_config *c = &m->c;
	const uint32_t E = c->experts, H = c->hidden;
	struct moe_task k = {0};
	const uint32_t P = ro_pool_size(m->pool);
	uint32_t F, *cnt = NULL, *off = NULL, *act = NULL, n_act = 0, max_rows = 0;
	void **ptrs = NULL;
	int r = 0;

	if (l >= c->layers || m->L[l].dense)
		return -EINVAL;
	if (n > UINT32_MAX / 4) /* rows and (expert, panel) tasks are counted in 32 bits */
		return -E2BIG;
	for (size_t i = 0; i < n; i++)
		if (experts[i] < 0 || (uint32_t)experts[i] >= E)
			return -EINVAL;
	if (!n)
		return 0;
	k.L = &m->L[l];
	F = k.F = k.L->ffn;
	k.H = H;
	if (n * F * 2 > m->ews_len) {
		free(m->ews); /* scratch: nothing to keep, and no old and new block at once */
		m->ews_len = 0;
		m->ews = ro_malloc_huge(n * F * 2 * sizeof(float));
		if (!m->ews)
			return -ENOMEM;
		m->ews_len = n * F * 2;
	}
	cnt = calloc(E + 1, sizeof(*cnt));
	off = calloc(E + 1, sizeof(*off));
	act = malloc(E * sizeof(*act));
	ptrs = malloc(n * 4 * sizeof(*ptrs));
	if (!cnt || !off || !act || !ptrs) {
		r = -ENOMEM;
		goto out;
	}
	k.xp = (const float **)ptrs;
	k.gp = (float **)ptrs + n;
	k.up = (float **)ptrs + n * 2;
	k.yp = (float **)ptrs + n * 3;
	for (size_t i = 0; i < n; i++)
		cnt[experts[i]]++;
	for (uint32_t e = 0; e < E; e++) {
		off[e + 1] = off[e] + cnt[e];
		if (cnt[e])
			act[n_act++] = e;
		if (cnt[e] > max_rows)
			max_rows = cnt[e];
	}
	memset(cnt, 0, (E + 1) * sizeof(*cnt));
	for (size_t i = 0; i < n; i++) {
		uint32_t e = (uint32_t)experts[i], row = off[e] + cnt[e]++;

		k.xp[row] = x[i];
		k.yp[row] = y + i * H;
		k.gp[row] = m->ews + (size_t)row * F;
		k.up[row] = m->ews + (n + row) * F;
	}
	m->experts_run += n_act;
	k.off = off;
	k.act = act;
	if (n_act >= 4 * P && (size_t)max_rows * 2 * P <= n) {
		/* enough experts to share out whole, none more than half a thread's share:
		 * one pass, no barrier between gate/up and down, and each task streams its
		 * expert's 16-row panels 8 at a time at one token (2 threads, 8 experts at
		 * batch 1: 17% faster than the split; 9-19% at 8 and 32 tokens). The largest
		 * go first, so that the last tasks taken are short. */
		sort_by_rows(act, n_act, off);
		ro_pool_for(m->pool, n_act, expert_task, &k);
		goto out;
	}
	k.p_gu = PANEL_GU;
	k.p_d = PANEL_D;
	if (ro_kernels_amx() &&
	    (ro_amx_fits(&k.L->gate[act[0]]) || ro_amx_panel_fits(&k.L->gate[act[0]]))) {
		/* whole experts, unless too few are active to give every thread two tasks
		 * (batch 1 of a top-2 model on many threads): then panels of whole blocks */
		const uint32_t want = 2 * P, per = (want + n_act - 1) / n_act;

		k.p_gu = per > 1 ? (((F + per - 1) / per + 31) & ~31u) : F;
		k.p_d = per > 1 ? (((H + per - 1) / per + 31) & ~31u) : H;
	}
	k.n_gu = (F + k.p_gu - 1) / k.p_gu;
	k.n_d = (H + k.p_d - 1) / k.p_d;
	ro_pool_for(m->pool, n_act * k.n_gu, gate_up_task, &k);
	ro_pool_for(m->pool, n_act * k.n_d, down_task, &k);
out:
	free(cnt);
	free(off);
	free(act);
	free(ptrs);
	return r;
}

/* Every selected expert's output for every token, computed here. */
int ro_local_experts(struct ro_model *m, uint32_t l, const float *x, const int32_t *ids,
			 uint32_t T, float *out)
{
	const size_t TK = (size_t)T * m->c.top_k;
	const float **rows = malloc(TK * sizeof(*rows));
	int r;

	if (!rows)
		return -ENOMEM;
	for (size_t i = 0; i < TK; i++)
		rows[i] = x + (i / m->c.top_k) * m->c.hidden;
	r = ro_model_experts(m, l, rows, ids, TK, out);
	free(rows);
	return r;
}

/* A rank with no tokens still takes part in every MoE layer's exchange, in layer order. */
int ro_forward_idle(struct ro_model *m)
{
	int r = 0;

	for (uint32_t l = 0; l < m->c.layers && !r; l++)
		if (!m->L[l].dense)
			r = m->xch.exchange(m->xch.ctx, l, NULL, NULL, NULL, 0, m->c.top_k,
					    m->c.hidden, NULL);
	return r;
}
