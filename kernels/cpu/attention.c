/* Attention over the KV cache on the CPU: q/k/v biases, the q/k norms and RoPE of each new
 * token, its K and V stored in its sequence's cache, and each (token, head)'s query
 * against the cache in tiles with a running softmax. */
#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/model_internal.h"
#include "kernels/cpu/simd.h"

/* Keys per attention tile: one KV block. Tiles are the cache's blocks (positions
 * [64 b, 64 b + 64) clipped to the keys a query sees), so the tiles of a query (and with
 * them every rounding of its running softmax) follow from its own position alone, never
 * from the chunk or the batch it arrived in, and a tile's keys are contiguous. */
#define ATT_TILE RO_KV_BLOCK

/* The keys one query sees: positions [lo, hi) of a sequence's cache, one KV head of one
 * layer. */
struct kv_span {
	const struct ro_seq *s;
	uint32_t layer, kvh, lo, hi, row; /* row: V's row stride (head_dim) */
	size_t off; /* the KV head's first element in a row of K */
	const float *nk, *nv; /* the next task's first K^T and V tile, when known */
};

static inline uint32_t tile_end(const struct kv_span *kv, uint32_t p)
{
	const uint32_t e = (p / RO_KV_BLOCK + 1) * RO_KV_BLOCK;

	return e < kv->hi ? e : kv->hi;
}

/* The KV head's K^T in the block of position p: element d of position p' (same block) at
 * [d * ATT_TILE + p' % ATT_TILE]. */
static inline const float *kv_kt(const struct kv_span *kv, uint32_t p)
{
	return ro_kv_kt(kv->s, kv->layer, p) + kv->off * ATT_TILE;
}

static inline const float *kv_v(const struct kv_span *kv, uint32_t p)
{
	return ro_kv_v(kv->s, kv->layer, kv->kvh, p);
}

/* q . K[j] for the key in column j of a K^T tile: eight accumulators over the elements
 * (element k into acc[k % 8]), a fixed tree, then the tail in order. */
static float dot_kt(const float *q, const float *kt, uint32_t j, uint32_t n)
{
	float acc[8] = {0}, s;
	uint32_t n8 = n & ~7u;

	for (uint32_t k = 0; k < n8; k += 8)
		for (int l = 0; l < 8; l++)
			acc[l] = acc[l] + q[k + l] * kt[(size_t)(k + l) * ATT_TILE + j];
	s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
	for (uint32_t k = n8; k < n; k++)
		s = s + q[k] * kt[(size_t)k * ATT_TILE + j];
	return s;
}

/* Token t's keys at this layer for KV head kvh: every position up to its own, or with a
 * sliding_window W, positions p - W + 1 .. p (Hugging Face's mask). */
static struct kv_span span_of(const struct fwd *f, uint32_t t, uint32_t kvh)
{
	const struct ro_model_config *c = &f->m->c;
	struct kv_span kv = {.s = f->seq[t],
			     .layer = f->layer,
			     .hi = f->pos[t] + 1,
			     .kvh = kvh,
			     .row = c->head_dim,
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
		const uint32_t w = tile_end(kv, p0) - p0, j0 = p0 % ATT_TILE;
		const float *K = kv_kt(kv, p0), *V = kv_v(kv, p0);
		float tmx = mx;

		for (uint32_t j = 0; j < w; j++) {
			sc[j] = dot_kt(q, K, j0 + j, hd) * scale;
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

/* attend_portable with 8-wide vectors, bitwise the same: a multiply then an add for every
 * lane where the portable code has a * b + c (no FMA, -ffp-contract=off). Scores eight keys
 * at a time, one per lane, each lane running dot_kt's eight accumulators and tree; the
 * output eight elements at a time. */
static AVX2 void attend_avx2(const float *q, const struct kv_span *kv, uint32_t hd, float scale,
			     float *out, bool pf)
{
	const uint32_t h8 = hd & ~7u, row = kv->row;
	float sc[ATT_TILE + 8], mx = -INFINITY, sum = 0;

	for (uint32_t d = 0; d < hd; d++)
		out[d] = 0;
	for (uint32_t p0 = kv->lo, pn; p0 < kv->hi; p0 = pn) {
		const uint32_t w = (pn = tile_end(kv, p0)) - p0, j0 = p0 % ATT_TILE;
		const float *K = kv_kt(kv, p0), *V = kv_v(kv, p0);
		/* a decode's next tile (from pn) asked for while this one computes, as
		 * attend_rows512 does: K^T's rows spread over the score loop, V's rows over the
		 * output loop. RO_KERNELS=avx2 here, batch 8 over 1,024 positions, alternating in
		 * one process: attention 49.6 -> 43.4 ms a step (46.7 -> 39.2 in another window) */
		const float *Kn = pf && pn < kv->hi ? kv_kt(kv, pn) : NULL,
			    *Vn = Kn ? kv_v(kv, pn) : NULL;
		const uint32_t kstep = (hd + ATT_TILE / 8 - 1) / (ATT_TILE / 8);
		float tmx = mx;

		for (uint32_t j = 0; j < w; j += 8) {
			/* columns past the tile (inside the block, or the V rows after it) are
			 * read and dropped */
			const float *kc = K + j0 + j;
			__m256 a[8], s;

			if (Kn) /* rows [kstep j / 8, kstep (j / 8 + 1)) of the next K^T */
				for (uint32_t d = kstep * (j / 8); d < kstep * (j / 8 + 1) && d < hd; d++)
					for (uint32_t c = 0; c < ATT_TILE; c += 16)
						_mm_prefetch((const char *)(Kn + (size_t)d * ATT_TILE + c),
							     _MM_HINT_T0);

			for (int l = 0; l < 8; l++)
				a[l] = _mm256_setzero_ps();
			for (uint32_t k = 0; k < h8; k += 8)
				for (int l = 0; l < 8; l++)
					a[l] = _mm256_add_ps(
					    a[l], _mm256_mul_ps(_mm256_set1_ps(q[k + l]),
								_mm256_loadu_ps(kc + (size_t)(k + l) *
											 ATT_TILE)));
			s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[4]),
							_mm256_add_ps(a[2], a[6])),
					  _mm256_add_ps(_mm256_add_ps(a[1], a[5]),
							_mm256_add_ps(a[3], a[7])));
			for (uint32_t k = h8; k < hd; k++)
				s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_set1_ps(q[k]),
								   _mm256_loadu_ps(kc + (size_t)k *
											ATT_TILE)));
			_mm256_storeu_ps(sc + j, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
		}
		for (uint32_t j = 0; j < w; j++)
			if (sc[j] > tmx)
				tmx = sc[j];
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

			if (Vn) /* rows [8 d / h8 ... ) of the next V: the tile over the loop */
				for (uint32_t r = d * ATT_TILE / h8; r < (d + 8) * ATT_TILE / h8; r++)
					for (uint32_t c = 0; c < hd; c += 16)
						_mm_prefetch((const char *)(Vn + (size_t)r * row + c),
							     _MM_HINT_T0);

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

static inline AVX512 float hsum16(__m512 v)
{
	__m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
				 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
	__m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
	__m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));

	return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* One query row of a task: its query, its output, the keys it sees [lo, hi), its running
 * max and sum, and the scores of the current tile by the tile's block column. */
struct arow {
	const float *q;
	float *out;
	uint32_t lo, hi;
	float mx, sum;
};

/* Scores of R (<= 4) rows against the key columns [16 c0, 16 (c0 + C)) of a K^T tile
 * (C <= 4): for each (row, key) q[0] k[0], then an FMA per element in order, times scale.
 * R x C independent 16-lane chains share each K^T load; the arithmetic of a (row, key) is
 * the same whichever rows and columns it was computed beside. */
static inline __attribute__((always_inline)) AVX512 void
qk_block(const float *const *q, uint32_t R, const float *kt, uint32_t c0, uint32_t C,
	 uint32_t hd, float scale, float (*sc)[ATT_TILE], const float *pf)
{
	__m512 acc[4][4];

	for (uint32_t r = 0; r < 4; r++)
		for (uint32_t c = 0; c < 4; c++)
			acc[r][c] = _mm512_setzero_ps();
	for (uint32_t d = 0; d < hd; d++) {
		const float *kr = kt + (size_t)d * ATT_TILE + 16 * c0;
		__m512 k[4];

		if (pf) /* the next tile's K^T row d: its four lines */
			for (uint32_t c = 0; c < ATT_TILE / 16; c++)
				_mm_prefetch((const char *)(pf + (size_t)d * ATT_TILE + 16 * c),
					     _MM_HINT_T0);

#pragma GCC unroll 4
		for (uint32_t c = 0; c < 4; c++)
			k[c] = c < C ? _mm512_loadu_ps(kr + 16 * c) : _mm512_setzero_ps();
#pragma GCC unroll 4
		for (uint32_t r = 0; r < 4; r++) {
			if (r >= R)
				break;
			const __m512 qd = _mm512_set1_ps(q[r][d]);

#pragma GCC unroll 4
			for (uint32_t c = 0; c < 4; c++)
				if (c < C)
					acc[r][c] = _mm512_fmadd_ps(qd, k[c], acc[r][c]);
		}
	}
	for (uint32_t r = 0; r < R; r++)
		for (uint32_t c = 0; c < C; c++)
			_mm512_store_ps(&sc[r][16 * (c0 + c)],
					_mm512_mul_ps(acc[r][c], _mm512_set1_ps(scale)));
}

/* qk_block with R and C constants, so that its accumulators live in registers */
static AVX512 void qk_rows(const float *const *q, uint32_t R, const float *kt, uint32_t c0,
			   uint32_t C, uint32_t hd, float scale, float (*sc)[ATT_TILE],
			   const float *pf)
{
#define QK(r, c) qk_block(q, r, kt, c0, c, hd, scale, sc, pf)
	switch (R * 8 + C) {
	case 4 * 8 + 4: QK(4, 4); break;
	case 4 * 8 + 3: QK(4, 3); break;
	case 4 * 8 + 2: QK(4, 2); break;
	case 4 * 8 + 1: QK(4, 1); break;
	case 3 * 8 + 4: QK(3, 4); break;
	case 2 * 8 + 4: QK(2, 4); break;
	case 1 * 8 + 4: QK(1, 4); break;
	default:
		qk_block(q, R, kt, c0, C, hd, scale, sc, pf);
	}
#undef QK
}

/* out[r] += p[r][j] V[j] for j in [a, b), R (<= 8) rows, output elements [d0, d0 + 16 D)
 * (D <= 2): each element takes its terms in key order, as attend_portable. */
static inline __attribute__((always_inline)) AVX512 void
pv_block(float *const *out, const float *const *p, uint32_t R, const float *V, uint32_t row,
	 uint32_t a, uint32_t b, uint32_t d0, uint32_t D, const float *pf)
{
	__m512 acc[8][2];

	for (uint32_t r = 0; r < R; r++)
		for (uint32_t e = 0; e < D; e++)
			acc[r][e] = _mm512_loadu_ps(out[r] + d0 + 16 * e);
	for (uint32_t j = a; j < b; j++) {
		const float *vr = V + (size_t)j * row + d0;
		__m512 v[2];

		if (pf) /* the next tile's V row j, this call's part of it */
			for (uint32_t e = 0; e < 2; e++)
				_mm_prefetch((const char *)(pf + (size_t)j * row + d0 + 16 * e),
					     _MM_HINT_T0);

#pragma GCC unroll 2
		for (uint32_t e = 0; e < 2; e++)
			v[e] = e < D ? _mm512_loadu_ps(vr + 16 * e) : _mm512_setzero_ps();
#pragma GCC unroll 8
		for (uint32_t r = 0; r < 8; r++) {
			if (r >= R)
				break;
			const __m512 pj = _mm512_set1_ps(p[r][j]);

#pragma GCC unroll 2
			for (uint32_t e = 0; e < 2; e++)
				if (e < D)
					acc[r][e] = _mm512_fmadd_ps(pj, v[e], acc[r][e]);
		}
	}
	for (uint32_t r = 0; r < R; r++)
		for (uint32_t e = 0; e < D; e++)
			_mm512_storeu_ps(out[r] + d0 + 16 * e, acc[r][e]);
}

static AVX512 void pv_rows(float *const *out, const float *const *p, uint32_t R, const float *V,
			   uint32_t row, uint32_t a, uint32_t b, uint32_t hd, const float *pf)
{
	for (uint32_t d0 = 0; d0 < hd; d0 += 32) {
		const uint32_t D = hd - d0 >= 32 ? 2 : 1;

		switch (R * 4 + D) {
		case 8 * 4 + 2: pv_block(out, p, 8, V, row, a, b, d0, 2, pf); break;
		case 4 * 4 + 2: pv_block(out, p, 4, V, row, a, b, d0, 2, pf); break;
		case 2 * 4 + 2: pv_block(out, p, 2, V, row, a, b, d0, 2, pf); break;
		case 1 * 4 + 2: pv_block(out, p, 1, V, row, a, b, d0, 2, pf); break;
		default: pv_block(out, p, R, V, row, a, b, d0, D, pf);
		}
	}
}

/* The rows of a task (a run of consecutive tokens of one sequence, the heads of one KV
 * group each) against their keys, AVX-512 (head_dim a multiple of 16). Each row goes
 * through the same tiles as attend_portable (block-aligned, counted from its own first
 * key), with its own running max and rescaling; the rows share each tile's K^T and V
 * while they are in cache. Scores by FMA chains over the elements, a 16-lane exp and a
 * fixed tree for each tile's sum: every row's arithmetic is its own and the same whatever
 * rows it ran beside, so a token's output does not depend on its batch or chunk. */
static AVX512 void attend_rows512(struct arow *rw, uint32_t nr, const struct kv_span *kv,
				  uint32_t hd, float scale)
{
	float sc[RO_ATT_ROWS][ATT_TILE] __attribute__((aligned(64)));
	uint32_t lo = UINT32_MAX, hi = 0;
	const uint32_t row = kv->row;

	for (uint32_t r = 0; r < nr; r++) {
		rw[r].mx = -INFINITY;
		rw[r].sum = 0;
		memset(rw[r].out, 0, hd * sizeof(float));
		lo = rw[r].lo < lo ? rw[r].lo : lo;
		hi = rw[r].hi > hi ? rw[r].hi : hi;
	}
	for (uint32_t p0 = lo; p0 < hi;) {
		const uint32_t blk = p0 - p0 % ATT_TILE, e = blk + ATT_TILE < hi ? blk + ATT_TILE : hi;
		const float *K = kv_kt(kv, p0), *V = kv_v(kv, blk);
		/* the next tile's K^T and V, asked for while this one computes (spread over its
		 * score and output loops, four lines a row; T0: 5-6% less attention than into
		 * L2 at 1,024 positions, a prefill the same either way): a decode reads each tile
		 * once from memory, 32 KB in another KV block (2 MiB apart), where the hardware's
		 * streams stop. Decode at batch 32 over 1,024 positions: attention 53.3 -> 39.9
		 * ms a step (alternating in one process; two tiles ahead or three, the same); at
		 * batch 8, 15.5 -> 11.7; batch 1 over 4,096, 9.5 -> 7.4; a 2,048-token prefill
		 * unchanged. The last tile asks for the next task's first (kv->nk), when known */
		const float *Kn = e < hi ? kv_kt(kv, e) : kv->nk, *Vn = e < hi ? kv_v(kv, e) : kv->nv;

		/* scores: rows in fours over the columns some row of the four needs */
		for (uint32_t r0 = 0; r0 < nr; r0 += 4) {
			const uint32_t R = nr - r0 < 4 ? nr - r0 : 4;
			uint32_t a = ATT_TILE, b = 0;
			const float *q[4];

			for (uint32_t r = 0; r < R; r++) {
				const struct arow *x = &rw[r0 + r];
				const uint32_t ra = x->lo > p0 ? x->lo : p0, rb = x->hi < e ? x->hi : e;

				q[r] = x->q;
				if (ra < rb) {
					a = ra - blk < a ? ra - blk : a;
					b = rb - blk > b ? rb - blk : b;
				}
			}
			if (a < b)
				for (uint32_t c0 = a / 16; c0 <= (b - 1) / 16; c0 += 4) {
					const uint32_t cl = (b - 1) / 16 + 1 - c0;

					qk_rows(q, R, K, c0, cl < 4 ? cl : 4, hd, scale, sc + r0,
						r0 || c0 ? NULL : Kn);
				}
		}
		/* each row's running softmax over its own keys of the tile */
		for (uint32_t r = 0; r < nr; r++) {
			struct arow *x = &rw[r];
			const uint32_t ra = x->lo > p0 ? x->lo : p0, rb = x->hi < e ? x->hi : e;
			float tmx = x->mx, *s;
			uint32_t w;
			__m512 ts = _mm512_setzero_ps();

			if (rb <= ra)
				continue; /* none of its keys here (a window that starts later) */
			w = rb - ra;
			s = &sc[r][ra - blk];
			{
				/* the tile's max in 16 lanes (the same value in any order; as a
				 * scalar chain it cost as much as the tile's scores) */
				__m512 mv = _mm512_set1_ps(tmx);

				for (uint32_t j = 0; j < w; j += 16) {
					const __mmask16 k =
					    w - j >= 16 ? 0xffff : (__mmask16)((1u << (w - j)) - 1);

					mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, k, s + j));
				}
				tmx = _mm512_reduce_max_ps(mv);
			}
			if (tmx > x->mx) {
				const float f = expf(x->mx - tmx);

				x->sum = x->sum * f;
				for (uint32_t d = 0; d < hd; d += 16)
					_mm512_storeu_ps(x->out + d,
							 _mm512_mul_ps(_mm512_loadu_ps(x->out + d),
								       _mm512_set1_ps(f)));
				x->mx = tmx;
			}
			/* the tile's weights, 16 at a time from the row's first key (lanes past w
			 * are 0), summed lane-wise in order, then one tree */
			for (uint32_t j = 0; j < w; j += 16) {
				const __mmask16 k =
				    w - j >= 16 ? 0xffff : (__mmask16)((1u << (w - j)) - 1);
				__m512 ex = exp512(
				    _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), _mm512_set1_ps(x->mx)));

				ex = _mm512_maskz_mov_ps(k, ex);
				_mm512_mask_storeu_ps(s + j, k, ex);
				ts = _mm512_add_ps(ts, ex);
			}
			x->sum = x->sum + hsum16(ts);
		}
		/* outputs: rows that see the same keys of the tile (a token's, and its
		 * neighbours' where the tile is below all of their diagonals) in eights: 16
		 * accumulators, where a token's four rows left 8 FMA chains for the FMAs'
		 * latency x 2 (attention core of a 2,048-token prefill 557 -> 527-537 ms) */
		{
			float *out[8];
			const float *pp[8], *vpf = Vn;
			uint32_t R = 0, pa = 0, pb = 0;

			for (uint32_t r = 0; r < nr; r++) {
				const struct arow *x = &rw[r];
				const uint32_t ra = x->lo > p0 ? x->lo : p0,
					       rb = x->hi < e ? x->hi : e;

				if (R && (R == 8 || ra != pa || rb != pb)) {
					pv_rows(out, pp, R, V, row, pa - blk, pb - blk, hd, vpf);
					vpf = NULL;
					R = 0;
				}
				if (ra >= rb)
					continue;
				pa = ra;
				pb = rb;
				out[R] = x->out;
				pp[R++] = sc[r];
			}
			if (R)
				pv_rows(out, pp, R, V, row, pa - blk, pb - blk, hd, vpf);
		}
		p0 = e;
	}
	/* (a division is exact-rounded in a lane as in a scalar: the same bits; as scalars
	 * the 16 rows' 1,024 divisions were a tenth of this function's time at batch 128) */
	for (uint32_t r = 0; r < nr; r++) {
		const __m512 sum = _mm512_set1_ps(rw[r].sum);

		for (uint32_t d = 0; d < hd; d += 16)
			_mm512_storeu_ps(rw[r].out + d,
					 _mm512_div_ps(_mm512_loadu_ps(rw[r].out + d), sum));
	}
}

static void attend_task(struct fwd *f, uint32_t run, uint32_t kvh, bool chain);

/* ro_attend_one for a run of tokens and a KV group: task i is (token run, KV head). */
void ro_attend_group(void *arg, uint32_t i)
{
	struct fwd *f = arg;
	const uint32_t kvh = f->m->c.kv_heads;

	attend_task(f, i / kvh, i % kvh, false);
}

/* A prefill's attention tasks by KV head, then token runs from the last (the longest)
 * first: tasks that follow each other read the same K/V tiles (a thread's next task finds
 * them in its L2), and the long ones come before the short ones that even out the threads'
 * ends. Attention of a 2,048-token prefill 877-896 -> 649-652 ms. */
void ro_attend_head_major(void *arg, uint32_t i)
{
	struct fwd *f = arg;

	attend_task(f, f->n_tb - 1 - i % f->n_tb, i / f->n_tb, false);
}

static void attend_task(struct fwd *f, uint32_t run, uint32_t kvh, bool chain)
{
	const struct ro_model_config *c = &f->m->c;
	const uint32_t hd = c->head_dim;
	const uint32_t G = c->heads / c->kv_heads, t0 = f->tb[run], t1 = f->tb[run + 1];
	const float scale = (float)(1.0 / sqrt((double)hd));
	struct arow rw[RO_ATT_ROWS];
	struct kv_span kv = span_of(f, t0, kvh);

	/* a run's KV heads follow each other on one thread: the last tile of one asks for
	 * the next one's first (a decode's whole context when it is a tile or less): batch
	 * 32 over 32 positions, attention 12.3 -> 11.7 ms a step, 128: 49.4 -> 48.1 */
	if (chain && kvh + 1 < c->kv_heads) {
		const struct kv_span nx = span_of(f, t0, kvh + 1);

		kv.nk = kv_kt(&nx, nx.lo);
		kv.nv = kv_v(&nx, nx.lo - nx.lo % ATT_TILE);
	}

	/* G > RO_ATT_ROWS: a token's heads in parts */
	for (uint32_t g0 = 0; g0 < G; g0 += RO_ATT_ROWS) {
		const uint32_t gn = G - g0 < RO_ATT_ROWS ? G - g0 : RO_ATT_ROWS;
		uint32_t nr = 0;

		for (uint32_t t = t0; t < t1; t++) {
			const struct kv_span ks = span_of(f, t, kvh);

			for (uint32_t g = 0; g < gn; g++, nr++) {
				const size_t hh = (size_t)kvh * G + g0 + g;

				rw[nr].q = f->q + (size_t)t * c->heads * hd + hh * hd;
				rw[nr].out = f->att + (size_t)t * c->heads * hd + hh * hd;
				rw[nr].lo = ks.lo;
				rw[nr].hi = ks.hi;
			}
		}
		attend_rows512(rw, nr, &kv, hd, scale);
	}
}

/* Run i's K and V stored, then its KV groups attended, in one task: while the store's
 * lines (a column of K^T, one line per KV element) are in cache, and without a barrier
 * between the two. In one process, alternating per forward, store + attention took 24.4 ->
 * 19.8 ms a step at batch 128, 6.4 -> 5.1 at 32, 2.0 -> 1.4 at 8. Asking for the next run's
 * lines first (K^T's columns, V's rows: ~1,400 lines here) measured no better, so is not
 * done. */
void ro_rope_attend_run(void *arg, uint32_t i)
{
	struct fwd *f = arg;
	const uint32_t kvh = f->m->c.kv_heads;

	for (uint32_t t = f->tb[i]; t < f->tb[i + 1]; t++)
		ro_qk_rope_store(f, t);
	for (uint32_t g = 0; g < kvh; g++)
		attend_task(f, i, g, true);
}
#endif

void ro_qk_rope_store_run(void *arg, uint32_t i)
{
	const struct fwd *f = arg;

	for (uint32_t t = f->sb[i]; t < f->sb[i + 1]; t++)
		ro_qk_rope_store(arg, t);
}

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
		/* a decode token (its sequence's only one here) reads each tile once, from
		 * memory; a prefill's rows find the tiles in cache, where asking costs 6% */
		const bool one = (t == 0 || f->seq[t - 1] != f->seq[t]) &&
				 (t + 1 == f->T || f->seq[t + 1] != f->seq[t]);

		attend_avx2(q, &kv, hd, scale, out, one);
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
	float *kt = ro_kv_kt(s, f->layer, f->pos[t]) + f->pos[t] % RO_KV_BLOCK;

	/* K goes into the cache transposed: a float in each of `row` lines, lines a decode
	 * step last wrote one position ago and that left the caches since (the cache of 256
	 * sequences is ~270 MB). Stored cold, each store waits for its line in turn (94% of
	 * this function's time at batch 256); asked for first, they arrive together while the
	 * norms and RoPE run. */
	for (uint32_t i = 0; i < row; i++)
		__builtin_prefetch(kt + (size_t)i * RO_KV_BLOCK, 1, 3);

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
	for (uint32_t i = 0; i < row; i++)
		kt[(size_t)i * RO_KV_BLOCK] = k[i];
	for (uint32_t hh = 0; hh < c->kv_heads; hh++)
		memcpy(ro_kv_v(s, f->layer, hh, f->pos[t]), v + (size_t)hh * hd, hd * sizeof(float));
}
