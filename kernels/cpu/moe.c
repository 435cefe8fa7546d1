/* The expert layer on the CPU: routing (softmax, top-k, renormalized), each expert's rows
 * gathered and run through gate/up, SwiGLU and down for all of them at once, scattered
 * back; the entry points a transport uses for the pairs other ranks send. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/model_internal.h"

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
 * renormalized when configured, then sorted by expert index for the combine. */
void ro_route(const struct ro_model_config *c, const float *logits, int32_t *ids, float *w)
{
	const uint32_t E = c->experts, K = c->top_k;
	float mx = -INFINITY;
	double sum = 0, ksum = 0;

	for (uint32_t e = 0; e < E; e++)
		if (logits[e] > mx)
			mx = logits[e];
	for (uint32_t e = 0; e < E; e++)
		sum += exp((double)logits[e] - mx);
	for (uint32_t j = 0; j < K; j++) {
		int32_t best = -1;

		for (uint32_t e = 0; e < E; e++) {
			bool taken = false;

			for (uint32_t i = 0; i < j && !taken; i++)
				taken = ids[i] == (int32_t)e;
			if (!taken && (best < 0 || logits[e] > logits[best]))
				best = (int32_t)e;
		}
		ids[j] = best;
		w[j] = (float)(exp((double)logits[best] - mx) / sum);
		ksum += w[j];
	}
	if (c->norm_topk)
		for (uint32_t j = 0; j < K; j++)
			w[j] = (float)(w[j] / ksum);
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

/* Run n (row, expert) pairs of layer l: y[i] = expert[experts[i]](x[i]). Each
 * expert's rows are gathered, gate/up run for all experts at once, then down, then the
 * results scattered back. A row's result does not depend on what else is in the batch, so
 * the expert-parallel path (pairs received from other ranks) equals the local one. Uses
 * its own scratch: a transport calls it from inside ro_model_forward. */
int ro_model_experts(struct ro_model *m, uint32_t l, const float *const *x,
		     const int32_t *experts, size_t n, float *y)
{
	const struct ro_model_config *c = &m->c;
	const struct layer *L;
	const uint32_t E = c->experts, H = c->hidden;
	uint32_t F, *cnt, *off, *slot;
	float *xe, *g, *u, *ye;
	struct jobs J = {0};
	int r = 0;

	if (l >= c->layers || m->L[l].dense)
		return -EINVAL;
	if (n > UINT32_MAX) /* rows are counted in 32 bits */
		return -E2BIG;
	for (size_t i = 0; i < n; i++)
		if (experts[i] < 0 || (uint32_t)experts[i] >= E)
			return -EINVAL;
	if (!n)
		return 0;
	L = &m->L[l];
	F = L->ffn;
	if (n * (H * 2 + F * 2) > m->ews_len) {
		free(m->ews); /* scratch: nothing to keep, and no old and new block at once */
		m->ews_len = 0;
		m->ews = malloc(n * (H * 2 + F * 2) * sizeof(float));
		if (!m->ews)
			return -ENOMEM;
		m->ews_len = n * (H * 2 + F * 2);
	}
	xe = m->ews;
	g = xe + n * H;
	u = g + n * F;
	ye = u + n * F;
	cnt = calloc(E + 1, sizeof(*cnt));
	off = calloc(E + 1, sizeof(*off));
	slot = malloc(n * sizeof(*slot)); /* gathered row -> pair */
	if (!cnt || !off || !slot) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < n; i++)
		cnt[experts[i]]++;
	for (uint32_t e = 0; e < E; e++)
		off[e + 1] = off[e] + cnt[e];
	memset(cnt, 0, (E + 1) * sizeof(*cnt));
	for (size_t i = 0; i < n; i++) {
		uint32_t e = (uint32_t)experts[i], row = off[e] + cnt[e]++;

		slot[row] = (uint32_t)i;
		memcpy(xe + (size_t)row * H, x[i], H * sizeof(float));
	}
	for (uint32_t e = 0; e < E && !r; e++) {
		uint32_t k = off[e + 1] - off[e];

		if (!k)
			continue;
		m->experts_run++;
		r = ro_jobs_add(&J, &L->gate[e], xe + (size_t)off[e] * H, k, g + (size_t)off[e] * F, F,
			     ro_chunk_for(m, F, k, 2 * c->top_k));
		if (!r)
			r = ro_jobs_add(&J, &L->up[e], xe + (size_t)off[e] * H, k,
				     u + (size_t)off[e] * F, F, ro_chunk_for(m, F, k, 2 * c->top_k));
	}
	if (r)
		goto out;
	ro_run_jobs(m, &J);
	ro_swiglu(g, u, n * F);
	for (uint32_t e = 0; e < E && !r; e++) {
		uint32_t k = off[e + 1] - off[e];

		if (k)
			r = ro_jobs_add(&J, &L->down[e], g + (size_t)off[e] * F, k,
				     ye + (size_t)off[e] * H, H, ro_chunk_for(m, H, k, c->top_k));
	}
	if (r)
		goto out;
	ro_run_jobs(m, &J);
	for (size_t row = 0; row < n; row++)
		memcpy(y + (size_t)slot[row] * H, ye + row * H, H * sizeof(float));
out:
	free(J.j);
	free(cnt);
	free(off);
	free(slot);
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
