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

/* Keys per attention tile: one KV block. Tiles are the cache's blocks (positions
 * [64 b, 64 b + 64) clipped to the keys a query sees), so the tiles of a query (and with
 * them every rounding of its running softmax) follow from its own position alone, never
 * from the chunk or the batch it arrived in, and a tile's keys are contiguous. */
#define ATT_TILE RO_KV_BLOCK

/* The keys one query sees: positions [lo, hi) of a sequence's cache, one KV head of one
 * layer. */
struct kv_span {
	const struct ro_seq *s;
	uint32_t layer, lo, hi, row;
	size_t off; /* the KV head's first element in a row */
};

static inline uint32_t tile_end(const struct kv_span *kv, uint32_t p)
{
	const uint32_t e = (p / RO_KV_BLOCK + 1) * RO_KV_BLOCK;

	return e < kv->hi ? e : kv->hi;
}

static inline const float *kv_k(const struct kv_span *kv, uint32_t p)
{
	return ro_kv_at(kv->s, kv->layer, 0, p) + kv->off;
}

static inline const float *kv_v(const struct kv_span *kv, uint32_t p)
{
	return ro_kv_at(kv->s, kv->layer, 1, p) + kv->off;
}

/* Token t's keys at this layer for KV head kvh: every position up to its own, or with a
 * sliding_window W, positions p - W + 1 .. p (Hugging Face's mask). */
static struct kv_span span_of(const struct fwd *f, uint32_t t, uint32_t kvh)
{
	const struct ro_model_config *c = &f->m->c;
	struct kv_span kv = {.s = f->seq[t],
			     .layer = f->layer,
			     .hi = f->pos[t] + 1,
			     .row = c->kv_heads * c->head_dim,
			     .off = (size_t)kvh * c->head_dim};

	if (c->sliding_window && kv.hi > c->sliding_window)
		kv.lo = kv.hi - c->sliding_window;
	return kv;
}

/* One query row against keys [0, n) of its sequence, flash-attention style: keys in tiles
 * of ATT_TILE positions, a running max and sum, and the output accumulated in out (rescaled
 * whenever a tile raises the max), then divided by the sum once. The only scratch is one
 * tile of scores on the stack, whatever the context. Every float is computed the same way
 * for a given position, whether the query's neighbours in its chunk came in this call or an
 * earlier one: this is what keeps a chunked prefill bitwise a full one.
 *
 * Each output element takes its tile's terms in key order; the loops run over elements
 * first or keys first as suits the vector width, which changes no rounding. */
static void attend_portable(const float *q, const struct kv_span *kv, uint32_t hd, float scale,
			    float *out)
{
	float sc[ATT_TILE], mx = -INFINITY, sum = 0;
	const uint32_t row = kv->row;

	for (uint32_t d = 0; d < hd; d++)
		out[d] = 0;
	for (uint32_t p0 = kv->lo; p0 < kv->hi; p0 = tile_end(kv, p0)) {
		const uint32_t w = tile_end(kv, p0) - p0;
		const float *K = kv_k(kv, p0), *V = kv_v(kv, p0);
		float tmx = mx;

		for (uint32_t j = 0; j < w; j++) {
			sc[j] = dotf(q, K + (size_t)j * row, hd) * scale;
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
			const float *vr = V + (size_t)j * row;

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
static AVX2 void attend_avx2(const float *q, const struct kv_span *kv, uint32_t hd, float scale,
			     float *out)
{
	const uint32_t h8 = hd & ~7u, row = kv->row;
	float sc[ATT_TILE], mx = -INFINITY, sum = 0;

	for (uint32_t d = 0; d < hd; d++)
		out[d] = 0;
	for (uint32_t p0 = kv->lo; p0 < kv->hi; p0 = tile_end(kv, p0)) {
		const uint32_t w = tile_end(kv, p0) - p0;
		const float *K = kv_k(kv, p0), *V = kv_v(kv, p0);
		float tmx = mx;

		for (uint32_t j = 0; j < w; j++) {
			const float *kr = K + (size_t)j * row;
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
			const float *vr = V + d;
			__m256 o = _mm256_loadu_ps(out + d);

			for (uint32_t j = 0; j < w; j++, vr += row)
				o = _mm256_add_ps(
				    o, _mm256_mul_ps(_mm256_set1_ps(sc[j]), _mm256_loadu_ps(vr)));
			_mm256_storeu_ps(out + d, o);
		}
		for (uint32_t d = h8; d < hd; d++)
			for (uint32_t j = 0; j < w; j++)
				out[d] = out[d] + sc[j] * V[(size_t)j * row + d];
	}
	for (uint32_t d = 0; d < hd; d++)
		out[d] = out[d] / sum;
}
#endif

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx2,fma")))

/* exp(x) for x <= 0 (scores minus their running max), 16 lanes: n = round(x / ln 2),
 * r = x - n ln 2 in two steps, e^r by its degree-6 Taylor polynomial (|r| <= 0.35: error
 * under 2e-7 relative), times 2^n by scalef (which goes to 0 below the f32 range). About
 * an ulp from expf; the same bits for the same x wherever it is computed. */
static inline AVX512 __m512 exp512(__m512 x)
{
	const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
					      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
	__m512 p;

	r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
	p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 720), r, _mm512_set1_ps(1.0f / 120));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
	return _mm512_scalef_ps(p, n);
}

static inline AVX512 float hsum16(__m512 v)
{
	__m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
				 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));

	return hsum8(a);
}

#define GQ 8 /* query heads of a KV group handled together */

/* The G (<= GQ) query heads of one KV group against keys [0, n), AVX-512 (head_dim a
 * multiple of 16): the same tiles of ATT_TILE keys as attend_portable, counted from the
 * same start, the same running max and rescaling, but FMAs, a 16-lane exp and a fixed
 * tree for each tile's sum. The heads go through each K/V tile together, so it is read
 * once from memory for all of them; every query's arithmetic is its own and the same
 * whatever the batch or chunk (its tiles follow from its position alone). */
static AVX512 void attend_group512(const float *q, size_t qstride, const struct kv_span *kv,
				   uint32_t hd, float scale, float *out, size_t ostride, uint32_t G)
{
	float sc[GQ][ATT_TILE] __attribute__((aligned(64)));
	float mx[GQ], sum[GQ];
	const uint32_t row = kv->row;

	for (uint32_t g = 0; g < G; g++) {
		mx[g] = -INFINITY;
		sum[g] = 0;
		for (uint32_t d = 0; d < hd; d++)
			out[g * ostride + d] = 0;
	}
	for (uint32_t p0 = kv->lo; p0 < kv->hi; p0 = tile_end(kv, p0)) {
		const uint32_t w = tile_end(kv, p0) - p0;
		const float *K = kv_k(kv, p0), *V = kv_v(kv, p0);

		for (uint32_t j = 0; j < w; j++) {
			const float *kr = K + (size_t)j * row;

			for (uint32_t g = 0; g < G; g++) {
				const float *qg = q + g * qstride;
				__m512 acc =
				    _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(kr));

				for (uint32_t d = 16; d < hd; d += 16)
					acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d),
							      _mm512_loadu_ps(kr + d), acc);
				sc[g][j] = hsum16(acc) * scale;
			}
		}
		for (uint32_t g = 0; g < G; g++) {
			float tmx = mx[g];
			__m512 ts = _mm512_setzero_ps();

			for (uint32_t j = 0; j < w; j++)
				if (sc[g][j] > tmx)
					tmx = sc[g][j];
			if (tmx > mx[g]) {
				const float a = expf(mx[g] - tmx);
				float *o = out + g * ostride;

				sum[g] = sum[g] * a;
				for (uint32_t d = 0; d < hd; d += 16)
					_mm512_storeu_ps(o + d,
							 _mm512_mul_ps(_mm512_loadu_ps(o + d),
								       _mm512_set1_ps(a)));
				mx[g] = tmx;
			}
			/* the tile's weights, 16 at a time (lanes past w are 0), summed lane-wise
			 * in order, then one tree */
			for (uint32_t j = 0; j < w; j += 16) {
				const __mmask16 k =
				    w - j >= 16 ? 0xffff : (__mmask16)((1u << (w - j)) - 1);
				__m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, &sc[g][j]),
								_mm512_set1_ps(mx[g])));

				e = _mm512_maskz_mov_ps(k, e);
				_mm512_store_ps(&sc[g][j], e);
				ts = _mm512_add_ps(ts, e);
			}
			sum[g] = sum[g] + hsum16(ts);
		}
		for (uint32_t g = 0; g < G; g++) {
			float *o = out + g * ostride;

			for (uint32_t d = 0; d < hd; d += 16) {
				const float *vr = V + d;
				__m512 acc = _mm512_loadu_ps(o + d);

				for (uint32_t j = 0; j < w; j++, vr += row)
					acc = _mm512_fmadd_ps(_mm512_set1_ps(sc[g][j]),
							      _mm512_loadu_ps(vr), acc);
				_mm512_storeu_ps(o + d, acc);
			}
		}
	}
	for (uint32_t g = 0; g < G; g++)
		for (uint32_t d = 0; d < hd; d++)
			out[g * ostride + d] = out[g * ostride + d] / sum[g];
}

/* ro_attend_one for a whole KV group: task i is (token, KV head). */
void ro_attend_group(void *arg, uint32_t i)
{
	struct fwd *f = arg;
	const struct ro_model_config *c = &f->m->c;
	const uint32_t hd = c->head_dim, t = i / c->kv_heads, kvh = i % c->kv_heads;
	const uint32_t G = c->heads / c->kv_heads;
	const struct kv_span kv = span_of(f, t, kvh);
	const float scale = (float)(1.0 / sqrt((double)hd));

	for (uint32_t g0 = 0; g0 < G; g0 += GQ) {
		const uint32_t hh = kvh * G + g0;

		attend_group512(f->q + (size_t)t * c->heads * hd + (size_t)hh * hd, hd, &kv, hd,
				scale, f->att + (size_t)t * c->heads * hd + (size_t)hh * hd, hd,
				G - g0 < GQ ? G - g0 : GQ);
	}
}
#endif

void ro_attend_one(void *arg, uint32_t i)
{
	struct fwd *f = arg;
	const struct ro_model_config *c = &f->m->c;
	const uint32_t hd = c->head_dim, t = i / c->heads, hh = i % c->heads;
	const struct kv_span kv = span_of(f, t, hh / (c->heads / c->kv_heads));
	const float *q = f->q + (size_t)t * c->heads * hd + (size_t)hh * hd;
	float *out = f->att + (size_t)t * c->heads * hd + (size_t)hh * hd;
	const float scale = (float)(1.0 / sqrt((double)hd));

#if defined(__x86_64__)
	if (f->avx2) {
		attend_avx2(q, &kv, hd, scale, out);
		return;
	}
#endif
	attend_portable(q, &kv, hd, scale, out);
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
	/* (the forward made the block this position lands in the sequence's own) */
	memcpy(ro_kv_at(s, f->layer, 0, f->pos[t]), k, row * sizeof(float));
	memcpy(ro_kv_at(s, f->layer, 1, f->pos[t]), v, row * sizeof(float));
}
