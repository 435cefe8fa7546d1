/* bf16 weights through Intel AMX (TDPBF16PS), where the CPU and the kernel allow it.
 *
 * The weights stay as nn.Linear keeps them ([out][in], bf16): sixteen output rows by 32
 * inputs are one A tile, loaded in place with the row stride. The activations are f32; each
 * becomes two bf16, hi = bf16(x) and lo = bf16(x - hi) (x - hi is exact), so x is carried
 * to 2^-17 of itself (against 2^-24 for f32), and the weights, bf16 already, are exact.
 * Logits agree with the float64 reference to ~1e-5 relative (the FMA paths: ~5e-7; the
 * bound tests/test_model.c holds every path to is 1e-4). N tokens' hi (or lo) pairs (N = 1,
 * 2, 4, 8 or 16), transposed into VNNI order, are one B tile; C (16 rows x N tokens, f32)
 * accumulates A.hi then A.lo for each 32-input chunk in k order.
 *
 * Batch invariance: an element of C depends only on its own row of A and column of B, and
 * every (row, token) runs the same chunks in the same order whatever block, tile position,
 * thread or batch computes it; unused columns hold zeros and unused rows are not stored. A
 * matrix either always runs here (bf16, inputs a multiple of 32, at least 16 rows) or never,
 * so a token's logits are the same bits in a batch of 1 or of 256.
 *
 * Why: one core's TDPBF16PS does ~2.9 TFLOP/s here against ~180 GFLOP/s of 512-bit FMAs,
 * and the weights need no widening in registers, so the FMA-bound runs (large batches,
 * prefill) become bound by memory, and the memory-bound ones no longer queue loads behind
 * conversions. */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/internal.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static bool amx_ok;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void)
{
	__builtin_cpu_init();
	/* the kernel must also grant the tile data state to this process */
	amx_ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
		 __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f") &&
		 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
		 __builtin_cpu_supports("avx512dq") &&
		 syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

bool ro_amx_available(void)
{
	(void)pthread_once(&amx_once, amx_probe);
	return amx_ok;
}

bool ro_amx_fits(const struct ro_mat *W)
{
	return W->dtype == RO_BF16 && !W->panel && W->cols % 32 == 0 && W->rows >= 16;
}

#define AMX                                                                                      \
	__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16," \
			      "avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

/* tokens packed per pass (their hi and lo tiles for every chunk: 2 KiB per 16 tokens per 32
 * inputs, 1 MiB for 256 tokens of 1,024 inputs, in L2). A block of 32 weight rows runs over
 * all of them, 32 at a time (two row tiles x two groups: four C tiles), so its rows are
 * read from memory once per pass and from cache for the next 32 tokens. */
#define AMX_TOK 256

struct tilecfg {
	uint8_t palette, start_row;
	uint8_t reserved[14];
	uint16_t colsb[16];
	uint8_t rows[16];
};

/* The tiles for groups of N tokens: C (0 to 3: 16 rows x N tokens, f32), A (4 and 5: 16
 * rows x 32 bf16), B (6 and 7: 16 input pairs x N tokens). A C element depends only on its
 * own row of A and column of B, whatever N is. Loaded when N changes on this thread; the
 * kernel keeps it across switches. */
static __thread uint32_t tiles_n;

static AMX void config(uint32_t N)
{
	struct tilecfg cfg;

	if (tiles_n == N)
		return;
	memset(&cfg, 0, sizeof(cfg));
	cfg.palette = 1;
	for (int i = 0; i < 8; i++) {
		cfg.rows[i] = 16;
		cfg.colsb[i] = (uint16_t)(i == 4 || i == 5 ? 64 : N * 4);
	}
	/* GCC's _tile_loadconfig tells the compiler it reads 8 bytes: without the barrier
	 * the stores to the rest of cfg are dropped as dead (a #GP at ldtilecfg) */
	__asm__ volatile("" : : "r"(&cfg) : "memory");
	_tile_loadconfig(&cfg);
	tiles_n = N;
}


/* 16 x 16 dwords transposed in registers: r[i][j] -> r[j][i] */
INLINE AMX void tr16(__m512i r[16])
{
	__m512i b[16], c[16];

	for (int i = 0; i < 8; i++) {
		b[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
		b[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
	}
	/* c[4g + q], 128-bit lane L: rows 4g..4g+3, column 4L + q */
	for (int g = 0; g < 4; g++) {
		c[4 * g + 0] = _mm512_unpacklo_epi64(b[4 * g], b[4 * g + 2]);
		c[4 * g + 1] = _mm512_unpackhi_epi64(b[4 * g], b[4 * g + 2]);
		c[4 * g + 2] = _mm512_unpacklo_epi64(b[4 * g + 1], b[4 * g + 3]);
		c[4 * g + 3] = _mm512_unpackhi_epi64(b[4 * g + 1], b[4 * g + 3]);
	}
	for (int q = 0; q < 4; q++) {
		__m512i d0 = _mm512_shuffle_i32x4(c[q], c[4 + q], 0x88);
		__m512i d1 = _mm512_shuffle_i32x4(c[q], c[4 + q], 0xdd);
		__m512i e0 = _mm512_shuffle_i32x4(c[8 + q], c[12 + q], 0x88);
		__m512i e1 = _mm512_shuffle_i32x4(c[8 + q], c[12 + q], 0xdd);

		r[q] = _mm512_shuffle_i32x4(d0, e0, 0x88);
		r[4 + q] = _mm512_shuffle_i32x4(d1, e1, 0x88);
		r[8 + q] = _mm512_shuffle_i32x4(d0, e0, 0xdd);
		r[12 + q] = _mm512_shuffle_i32x4(d1, e1, 0xdd);
	}
}

/* bf16 (in the 16-bit halves of v, as cvtne2ps_pbh leaves them) widened back to f32: the
 * low 16 elements and the high 16 */
INLINE AMX __m512 bf_lo(__m512i v)
{
	return _mm512_castsi512_ps(
	    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
}

INLINE AMX __m512 bf_hi(__m512i v)
{
	return _mm512_castsi512_ps(
	    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}

/* Two tokens' pairs (v[0], v[1]: pair r in dword r) as 16 rows of 2 at p */
INLINE AMX void put2(uint32_t *p, const __m512i *v)
{
	/* lane L of b0: rows 4L, 4L + 1; of b1: rows 4L + 2, 4L + 3 */
	const __m512i b0 = _mm512_unpacklo_epi32(v[0], v[1]),
		      b1 = _mm512_unpackhi_epi32(v[0], v[1]);

	_mm512_storeu_si512(
	    p, _mm512_permutex2var_epi64(b0, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), b1));
	_mm512_storeu_si512(p + 16, _mm512_permutex2var_epi64(
					b0, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), b1));
}

/* Four tokens' pairs as 16 rows of 4 at p */
INLINE AMX void put4(uint32_t *p, const __m512i *v)
{
	const __m512i b0 = _mm512_unpacklo_epi32(v[0], v[1]),
		      b1 = _mm512_unpackhi_epi32(v[0], v[1]),
		      b2 = _mm512_unpacklo_epi32(v[2], v[3]),
		      b3 = _mm512_unpackhi_epi32(v[2], v[3]);
	/* lane L of c[q]: row 4L + q, the four tokens in order */
	const __m512i c[4] = {_mm512_unpacklo_epi64(b0, b2), _mm512_unpackhi_epi64(b0, b2),
			      _mm512_unpacklo_epi64(b1, b3), _mm512_unpackhi_epi64(b1, b3)};

	for (int q = 0; q < 4; q++) {
		_mm_storeu_si128((__m128i *)(p + q * 4), _mm512_castsi512_si128(c[q]));
		_mm_storeu_si128((__m128i *)(p + (4 + q) * 4), _mm512_extracti32x4_epi32(c[q], 1));
		_mm_storeu_si128((__m128i *)(p + (8 + q) * 4), _mm512_extracti32x4_epi32(c[q], 2));
		_mm_storeu_si128((__m128i *)(p + (12 + q) * 4), _mm512_extracti32x4_epi32(c[q], 3));
	}
}

/* Tokens x[0..nt) (nt <= N <= 16), K inputs, as B tiles of N columns: for chunk kc, hi at
 * p[kc * 32 N] and lo at p[kc * 32 N + 16 N], each 16 rows (input pairs 2r, 2r + 1 of the
 * chunk) of N tokens, N dwords apart (columns past nt hold zeros). */
INLINE AMX void pack(const float *const *x, uint32_t nt, uint32_t N, size_t K, uint32_t *p)
{
	const __mmask16 cols = (__mmask16)(0xffffu >> (16 - N));

	for (size_t kc = 0; kc < K / 32; kc++) {
		uint32_t *ph = p + kc * 32 * N, *pl = ph + 16 * N;
		__m512i h[16], l[16];

		for (uint32_t n = 0; n < 16; n++) {
			if (n < nt) {
				const __m512 a = _mm512_loadu_ps(x[n] + kc * 32),
					     b = _mm512_loadu_ps(x[n] + kc * 32 + 16);
				const __m512i hb = (__m512i)_mm512_cvtne2ps_pbh(b, a);
				const __m512 ra = _mm512_sub_ps(a, bf_lo(hb)),
					     rb = _mm512_sub_ps(b, bf_hi(hb));

				h[n] = hb;
				l[n] = (__m512i)_mm512_cvtne2ps_pbh(rb, ra);
			} else {
				h[n] = l[n] = _mm512_setzero_si512();
			}
		}
		if (N == 1) {
			_mm512_storeu_si512(ph, h[0]);
			_mm512_storeu_si512(pl, l[0]);
			continue;
		}
		if (N == 2) {
			put2(ph, h);
			put2(pl, l);
			continue;
		}
		if (N == 4) {
			put4(ph, h);
			put4(pl, l);
			continue;
		}
		tr16(h);
		tr16(l);
		for (uint32_t r = 0; r < 16; r++) {
			_mm512_mask_storeu_epi32(ph + r * N, cols, h[r]);
			_mm512_mask_storeu_epi32(pl + r * N, cols, l[r]);
		}
	}
}

/* C (16 rows x 16 tokens, as tile_stored left it in c) into y[n][s + i] for the rows
 * i in [lo, hi) and tokens n < nt */
INLINE AMX void unpack16(const float *c, float *const *y, uint32_t nt, uint32_t s, uint32_t lo,
			 uint32_t hi)
{
	__m512i v[16];
	const __mmask16 keep = (__mmask16)((0xffffu >> (16 - hi)) & (0xffffu << lo));

	for (int i = 0; i < 16; i++)
		v[i] = _mm512_load_si512(c + i * 16);
	tr16(v);
	for (uint32_t n = 0; n < nt; n++)
		_mm512_mask_storeu_ps(y[n] + s, keep, _mm512_castsi512_ps(v[n]));
}

/* Group G's B tile for chunk KC, hi (LO 0) or lo (LO 1), into tile TB */
#define BLOAD(TB, G, KC, LO) \
	_tile_loadd(TB, p + ((size_t)(G)*kcs + (KC)) * 32 * N + (LO)*16 * N, N * 4)

/* Both groups' hi (LO 0) or lo (LO 1) tiles of chunk kc against both row tiles */
#define HALF2(LO)                                \
	do {                                     \
		BLOAD(6, 0, kc, LO);             \
		BLOAD(7, 1, kc, LO);             \
		_tile_dpbf16ps(0, 4, 6);         \
		if (R > 1)                       \
			_tile_dpbf16ps(1, 5, 6); \
		_tile_dpbf16ps(2, 4, 7);         \
		if (R > 1)                       \
			_tile_dpbf16ps(3, 5, 7); \
	} while (0)

/* Where a block's rows go: rows [s, s + 16) of W, stored for s + lo to s + hi */
struct rows16 {
	uint32_t s, lo, hi;
};

/* R (1 or 2) tiles of 16 weight rows by G (1 or 2) groups of tokens (N wide, nt in all):
 * C tile i + 2g accumulates row tile i against group g, hi then lo, chunk by chunk in input
 * order (the order every block of every shape keeps). Each B load serves R row tiles and
 * each A load G groups. While it runs, the next block's rows (nx_rows of them, contiguous
 * at nx, if any) are asked into L2, spread over the chunks, so that its loads do not wait
 * on DRAM. (Into L2, not L1: sixteen rows 2 K bytes apart share two L1 sets.) */
INLINE AMX void block(const uint16_t *w, size_t K, const uint32_t *p, const int R, const int G,
		      uint32_t N, uint32_t nt, float *const *y, const struct rows16 *rt, float *c,
		      const char *nx, uint32_t nx_rows)
{
	const size_t stride = K * 2, kcs = K / 32;
	const uint16_t *a0 = w + (size_t)rt[0].s * K, *a1 = w + (size_t)rt[R - 1].s * K;

	_tile_zero(0);
	if (R > 1)
		_tile_zero(1);
	if (G > 1) {
		_tile_zero(2);
		if (R > 1)
			_tile_zero(3);
	}
	for (size_t kc = 0; kc < kcs; kc++) {
		if (nx)
			for (uint32_t i = 0; i < nx_rows; i++)
				_mm_prefetch(nx + (kc * nx_rows + i) * 64, _MM_HINT_T1);
		_tile_loadd(4, a0 + kc * 32, stride);
		if (R > 1)
			_tile_loadd(5, a1 + kc * 32, stride);
		if (G > 1) {
			HALF2(0);
			HALF2(1);
		} else {
			BLOAD(6, 0, kc, 0);
			BLOAD(7, 0, kc, 1);
			_tile_dpbf16ps(0, 4, 6);
			if (R > 1)
				_tile_dpbf16ps(1, 5, 6);
			_tile_dpbf16ps(0, 4, 7);
			if (R > 1)
				_tile_dpbf16ps(1, 5, 7);
		}
	}
	_tile_stored(0, c, 64);
	if (R > 1)
		_tile_stored(1, c + 256, 64);
	if (G > 1) {
		_tile_stored(2, c + 512, 64);
		if (R > 1)
			_tile_stored(3, c + 768, 64);
	}
	for (int g = 0; g < G; g++)
		for (int i = 0; i < R; i++)
			unpack16(c + (i + 2 * g) * 256, y + g * 16,
				 nt - g * 16 < 16 ? nt - g * 16 : 16, rt[i].s, rt[i].lo, rt[i].hi);
}

static void prefetch_rows(const struct ro_mat *W, uint32_t r, uint32_t n)
{
	const char *a = (const char *)W->w + (size_t)r * W->cols * 2;

	for (size_t b = 0; b < (size_t)W->cols * 2 * n; b += 64)
		_mm_prefetch(a + b, _MM_HINT_T1);
}

/* The next block of rows at or after r (< r1): 32 rows when as many remain, else 16 (the
 * last may start before r, never before row 0, and stores only [r, r1)) */
static uint32_t next_block(const struct ro_mat *W, uint32_t r, uint32_t r1, struct rows16 *rt)
{
	if (r1 - r >= 32) {
		rt[0] = (struct rows16){r, 0, 16};
		rt[1] = (struct rows16){r + 16, 0, 16};
		return 2;
	}
	rt[0].s = r + 16 <= W->rows ? r : W->rows - 16;
	rt[0].lo = r - rt[0].s;
	rt[0].hi = r1 - rt[0].s < 16 ? r1 - rt[0].s : 16;
	return 1;
}

/* y_m[t][r0..r1) = W_m x[t] for the nm (1 or 2) matrices W_m, which share K: the tokens are
 * packed once for all of them. */
static AMX int gemm_amx(const struct ro_mat *const *Ws, float *const *const *ys, int nm,
			const float *const *x, uint32_t T, uint32_t r0, uint32_t r1)
{
	const size_t K = Ws[0]->cols;
	float c[1024] __attribute__((aligned(64)));
	uint32_t *p;

	/* tokens per pass: all of them up to AMX_TOK (whole groups of 16); where that buffer
	 * cannot be had, 16 (the results are the same bits whatever the pass: a token's
	 * output depends on its own column alone), so that a matrix never leaves AMX for
	 * want of memory unless even K x 64 bytes are refused */
	uint32_t tok = T < AMX_TOK ? (T + 15) & ~15u : AMX_TOK;

	p = ro_thread_scratch((size_t)(tok / 16) * (K / 32) * 512 * sizeof(uint32_t));
	if (!p && tok > 16) {
		tok = 16;
		p = ro_thread_scratch((K / 32) * 512 * sizeof(uint32_t));
	}
	if (!p)
		return -1;
	/* the first block's rows, before the loop asks for each next one */
	prefetch_rows(Ws[0], r0, r1 - r0 < 32 ? r1 - r0 : 32);
	memset(c, 0, sizeof(c));
	for (uint32_t t0 = 0; t0 < T; t0 += tok) {
		const uint32_t nt = T - t0 < tok ? T - t0 : tok, ng = (nt + 15) / 16;
		/* tokens per group: 1, 2, 4, 8 or 16, the fewest that hold them (columns of
		 * zeros cost B bytes: one token's are 64 bytes a chunk, sixteen's 1 KiB) */
		const uint32_t N = nt <= 1 ? 1 : nt <= 2 ? 2 : nt <= 4 ? 4 : nt <= 8 ? 8 : 16;
		const size_t gsz = (K / 32) * 32 * N; /* a group's packed dwords */

		config(N);
		for (uint32_t g = 0; g < ng; g++)
			pack(x + t0 + g * 16, nt - g * 16 < 16 ? nt - g * 16 : 16, N, K,
			     p + g * gsz);
		for (int m = 0; m < nm; m++) {
			const struct ro_mat *W = Ws[m];
			const uint16_t *w = W->w;
			float *const *y = ys[m] + t0;
			struct rows16 rt[2], nrt[2] = {{0, 0, 0}, {0, 0, 0}};
			uint32_t R = next_block(W, r0, r1, rt);

			for (uint32_t r = r0; r < r1;) {
				const uint32_t rn = r + 16 * R; /* the next block's first row */
				const char *nx = NULL;
				uint32_t nx_rows = 0, nR = 0;

				if (rn < r1) {
					nR = next_block(W, rn, r1, nrt);
					nx = (const char *)(w + (size_t)nrt[0].s * K);
					nx_rows = 16 * nR;
				} else if (m + 1 < nm || t0 + tok < T) {
					const struct ro_mat *Wn = m + 1 < nm ? Ws[m + 1] : Ws[0];

					nx_rows = r1 - r0 < 32 ? r1 - r0 : 32;
					nx = (const char *)Wn->w + (size_t)r0 * K * 2;
				}
				/* 32 tokens at a time; the next block is asked for in the first */
				for (uint32_t g = 0; g < ng; g += 2) {
					const uint32_t n = nt - g * 16 < 32 ? nt - g * 16 : 32;
					const uint32_t *pg = p + g * gsz;
					const char *pnx = g ? NULL : nx;

					if (R == 2 && n > 16)
						block(w, K, pg, 2, 2, N, n, y + g * 16, rt, c, pnx,
						      nx_rows);
					else if (R == 2)
						block(w, K, pg, 2, 1, N, n, y + g * 16, rt, c, pnx,
						      nx_rows);
					else if (n > 16)
						block(w, K, pg, 1, 2, N, n, y + g * 16, rt, c, pnx,
						      nx_rows);
					else
						block(w, K, pg, 1, 1, N, n, y + g * 16, rt, c, pnx,
						      nx_rows);
				}
				r = rn;
				R = nR;
				rt[0] = nrt[0];
				rt[1] = nrt[1];
			}
		}
	}
	return 0;
}

int ro_gemm_amx(const struct ro_mat *W, const float *const *x, uint32_t T, float *const *y,
		uint32_t r0, uint32_t r1)
{
	return gemm_amx(&W, &y, 1, x, T, r0, r1);
}

int ro_gemm_amx2(const struct ro_mat *W1, const struct ro_mat *W2, const float *const *x,
		 uint32_t T, float *const *y1, float *const *y2, uint32_t r0, uint32_t r1)
{
	const struct ro_mat *Ws[2] = {W1, W2};
	float *const *ys[2] = {y1, y2};

	return gemm_amx(Ws, ys, 2, x, T, r0, r1);
}

#else

bool ro_amx_available(void)
{
	return false;
}

bool ro_amx_fits(const struct ro_mat *W)
{
	(void)W;
	return false;
}

int ro_gemm_amx(const struct ro_mat *W, const float *const *x, uint32_t T, float *const *y,
		uint32_t r0, uint32_t r1)
{
	(void)W, (void)x, (void)T, (void)y, (void)r0, (void)r1;
	return -1;
}

int ro_gemm_amx2(const struct ro_mat *W1, const struct ro_mat *W2, const float *const *x,
		 uint32_t T, float *const *y1, float *const *y2, uint32_t r0, uint32_t r1)
{
	(void)W1, (void)W2, (void)x, (void)T, (void)y1, (void)y2, (void)r0, (void)r1;
	return -1;
}
#endif
