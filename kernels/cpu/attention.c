/* Attention over the KV cache on the CPU: q/k/v biases, the q/k norms and RoPE of each new
 * token, its K and V stored in its sequence's cache, and each (token, head)'s query
 * against the cache in tiles with a running softmax. */
#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/model_internal.h"

static float dotf(const float *a, const float *b, uint32_t n)
{
	float acc[8] = {0}, s;
	uint32_t n8 = n & ~7u;

	for (uint32_t k = 0; k < n8; k += 8)
		for (int l = 0; l < 8; l++)
			acc[l] = acc[l] + a[k + l] * b[k + l];
	s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
	for (uint32_t k = n8; k < n; k++)
		s = s + a[k] * b[k];
	return s;
}

/* Keys per attention tile. Tiles are counted from position 0 of the sequence, so the tiles
 * of a query (and with them every rounding of its running softmax) follow from its own
 * position alone, never from the chunk or the batch it arrived in. */
#define ATT_TILE 64

/* One query row against keys [0, n) of its sequence, flash-attention style: keys in tiles
 * of ATT_TILE positions, a running max and sum, and the output accumulated in out (rescaled
 * whenever a tile raises the max), then divided by the sum once. The only scratch is one
 * tile of scores on the stack, whatever the context. Every float is computed the same way
 * for a given position, whether the query's neighbours in its chunk came in this call or an
 * earlier one: this is what keeps a chunked prefill bitwise a full one.
 *
 * Each output element takes its tile's terms in key order; the loops run over elements
 * first or keys first as suits the vector width, which changes no rounding. */
static void attend_portable(const float *q, const float *K, const float *V, uint32_t row,
			    uint32_t n, uint32_t hd, float scale, float *out)
{
	float sc[ATT_TILE], mx = -INFINITY, sum = 0;

	for (uint32_t d = 0; d < hd; d++)
		out[d] = 0;
	for (uint32_t p0 = 0; p0 < n; p0 += ATT_TILE) {
		const uint32_t w = n - p0 < ATT_TILE ? n - p0 : ATT_TILE;
		float tmx = mx;

		for (uint32_t j = 0; j < w; j++) {
			sc[j] = dotf(q, K + (size_t)(p0 + j) * row, hd) * scale;
			if (sc[j] > tmx)
				tmx = sc[j];
		}
		if (tmx > mx) {
			/* the max grew: rescale what is summed so far (zeros in the first tile) */
			const float a = expf(mx - tmx);

			sum = sum * a;
			for (uint32_t d = 0; d < hd; d++)
				out[d] = out[d] * a;
			mx = tmx;
		}
		for (uint32_t j = 0; j < w; j++) {
			sc[j] = expf(sc[j] - mx);
			sum = sum + sc[j];
		}
		for (uint32_t j = 0; j < w; j++) {
			const float *vr = V + (size_t)(p0 + j) * row;

			for (uint32_t d = 0; d < hd; d++)
				out[d] = out[d] + sc[j] * vr[d];
		}
	}
	for (uint32_t d = 0; d < hd; d++)
		out[d] = out[d] / sum;
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2")))

/* dotf's tree: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) */
static inline AVX2 float hsum8(__m256 v)
{
	__m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	__m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));

	return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* attend_portable with 8-wide vectors, bitwise the same: a multiply then an add for every
 * lane where the portable code has a * b + c (no FMA, -ffp-contract=off), the dot product's
 * eight accumulators as one register, the output eight elements at a time. */
static AVX2 void attend_avx2(const float *q, const float *K, const float *V, uint32_t row,
			     uint32_t n, uint32_t hd, float scale, float *out)
{
	const uint32_t h8 = hd & ~7u;
	float sc[ATT_TILE], mx = -INFINITY, sum = 0;

	for (uint32_t d = 0; d < hd; d++)
		out[d] = 0;
	for (uint32_t p0 = 0; p0 < n; p0 += ATT_TILE) {
		const uint32_t w = n - p0 < ATT_TILE ? n - p0 : ATT_TILE;
		float tmx = mx;

		for (uint32_t j = 0; j < w; j++) {
			const float *kr = K + (size_t)(p0 + j) * row;
			__m256 acc = _mm256_setzero_ps();
			float s;

			for (uint32_t k = 0; k < h8; k += 8)
				acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + k),
								       _mm256_loadu_ps(kr + k)));
			s = hsum8(acc);
			for (uint32_t k = h8; k < hd; k++)
				s = s + q[k] * kr[k];
			sc[j] = s * scale;
			if (sc[j] > tmx)
				tmx = sc[j];
		}
		if (tmx > mx) {
			const float a = expf(mx - tmx);

			sum = sum * a;
			for (uint32_t d = 0; d < hd; d++)
				out[d] = out[d] * a;
			mx = tmx;
		}
		for (uint32_t j = 0; j < w; j++) {
			sc[j] = expf(sc[j] - mx);
			sum = sum + sc[j];
		}
		for (uint32_t d = 0; d < h8; d += 8) {
			const float *vr = V + (size_t)p0 * row + d;
			__m256 o = _mm256_loadu_ps(out + d);

			for (uint32_t j = 0; j < w; j++, vr += row)
				o = _mm256_add_ps(
				    o, _mm256_mul_ps(_mm256_set1_ps(sc[j]), _mm256_loadu_ps(vr)));
			_mm256_storeu_ps(out + d, o);
		}
		for (uint32_t d = h8; d < hd; d++)
			for (uint32_t j = 0; j < w; j++)
				out[d] = out[d] + sc[j] * V[(size_t)(p0 + j) * row + d];
	}
	for (uint32_t d = 0; d < hd; d++)
		out[d] = out[d] / sum;
}
#endif

void ro_attend_one(void *arg, uint32_t i)
{
	struct fwd *f = arg;
	const struct ro_model_config *c = &f->m->c;
	const uint32_t hd = c->head_dim, t = i / c->heads, hh = i % c->heads;
	const uint32_t kvh = hh / (c->heads / c->kv_heads), row = c->kv_heads * hd;
	const struct ro_seq *s = f->seq[t];
	const float *q = f->q + (size_t)t * c->heads * hd + (size_t)hh * hd;
	const float *K = s->k + (size_t)f->layer * s->cap * row + (size_t)kvh * hd;
	const float *V = s->v + (size_t)f->layer * s->cap * row + (size_t)kvh * hd;
	float *out = f->att + (size_t)t * c->heads * hd + (size_t)hh * hd;
	const float scale = (float)(1.0 / sqrt((double)hd));
	uint32_t n = f->pos[t] + 1, p0 = 0;

	/* sliding_window W: position p sees p - W + 1 .. p (Hugging Face's mask) */
	if (c->sliding_window && n > c->sliding_window)
		p0 = n - c->sliding_window;
	K += (size_t)p0 * row;
	V += (size_t)p0 * row;
	n -= p0;
#if defined(__x86_64__)
	if (f->avx2) {
		attend_avx2(q, K, V, row, n, hd, scale, out);
		return;
	}
#endif
	attend_portable(q, K, V, row, n, hd, scale, out);
}

void ro_qk_rope_store(void *arg, uint32_t t)
{
	struct fwd *f = arg;
	const struct ro_model_config *c = &f->m->c;
	const struct layer *L = &f->m->L[f->layer];
	const uint32_t hd = c->head_dim, row = c->kv_heads * hd;
	struct ro_seq *s = f->seq[t];
	float *q = f->q + (size_t)t * c->heads * hd, *k = f->k + (size_t)t * row,
	      *v = f->v + (size_t)t * row;
	const float *cs = f->cs + (size_t)t * hd / 2, *sn = f->sn + (size_t)t * hd / 2;

	if (L->bq) { /* nn.Linear's bias, before the norms and RoPE */
		for (uint32_t i = 0; i < c->heads * hd; i++)
			q[i] = q[i] + L->bq[i];
		for (uint32_t i = 0; i < row; i++) {
			k[i] = k[i] + L->bk[i];
			v[i] = v[i] + L->bv[i];
		}
	}

	for (uint32_t hh = 0; hh < c->heads; hh++) {
		if (L->q_norm)
			ro_rmsnorm(q + hh * hd, L->q_norm, hd, c->rms_eps, q + hh * hd);
		ro_rope(q + hh * hd, cs, sn, hd);
	}
	for (uint32_t hh = 0; hh < c->kv_heads; hh++) {
		if (L->k_norm)
			ro_rmsnorm(k + hh * hd, L->k_norm, hd, c->rms_eps, k + hh * hd);
		ro_rope(k + hh * hd, cs, sn, hd);
	}
	memcpy(s->k + (size_t)f->layer * s->cap * row + (size_t)f->pos[t] * row, k,
	       row * sizeof(float));
	memcpy(s->v + (size_t)f->layer * s->cap * row + (size_t)f->pos[t] * row, v,
	       row * sizeof(float));
}
