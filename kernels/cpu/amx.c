/* bf16 and FP8 weights through Intel AMX (TDPBF16PS), where the CPU and the kernel allow it.
 *
 * Two layouts, one per matrix for its lifetime. The loader's 16-row panels (where it copies
 * the weights: the default) run with the weights as B tiles, streamed straight from the
 * panels, and the tokens as A (below, "weights as B"). Row-major weights (`--weights map`,
 * or rows not a multiple of 16) stay as nn.Linear keeps them ([out][in]): sixteen output
 * rows by 32 inputs are one A tile, loaded in place with the row stride, and N tokens' hi
 * (or lo) pairs (N = 1, 2, 4, 8 or 16), transposed into VNNI order, one B tile; C (16 rows x
 * N tokens, f32) accumulates A.hi then A.lo for each 32-input chunk in k order.
 *
 * The activations are f32; each becomes two bf16, hi = bf16(x) and lo = bf16(x - hi)
 * (x - hi is exact), so x is carried to 2^-17 of itself (against 2^-24 for f32), and the
 * weights are exact: bf16 already, or FP8 (e4m3fn: 4 significant bits, 2^-9 to 448) turned
 * into bf16 by byte-table lookups, 64 weights in six operations. An FP8 matrix's products
 * sum a 128-input block at a time, and each block's sum is added into the output times its
 * weight_scale_inv (one FMA an element and block, in block order). Logits agree with the
 * float64 reference to ~1e-5 relative (the FMA paths: ~5e-7; the bound tests/test_model.c
 * holds every path to is 1e-4).
 *
 * Batch invariance: an element of C depends only on its own row of A and column of B, and
 * every (row, token) runs the same chunks in the same order whatever block, tile position,
 * thread or batch computes it; unused columns hold zeros and unused rows are not stored. A
 * matrix either always runs here or never, so a token's logits are the same bits in a batch
 * of 1 or of 256.
 *
 * Why: one core's TDPBF16PS does ~2.9 TFLOP/s here against ~180 GFLOP/s of 512-bit FMAs,
 * and the weights need no widening in registers, so the FMA-bound runs (large batches,
 * prefill) become bound by memory, and the memory-bound ones no longer queue loads behind
 * conversions. FP8 halves the bytes again; until 2026-12-07 it ran the AVX-512 FMAs on a
 * machine with AMX (row-major, not even in panels: 1.3-3x slower than bf16 on AMX). */
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

static void f8_tables(void);

static void amx_probe(void)
{
	__builtin_cpu_init();
	/* the kernel must also grant the tile data state to this process */
	amx_ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
		 __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f") &&
		 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
		 __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi") &&
		 syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
	if (amx_ok)
		f8_tables();
}

bool ro_amx_available(void)
{
	(void)pthread_once(&amx_once, amx_probe);
	return amx_ok;
}

bool ro_amx_fits(const struct ro_mat *W)
{
	if (W->panel || W->cols % 32 || W->rows < 16)
		return false;
	if (W->dtype == RO_BF16)
		return true;
	return W->dtype == RO_F8E4M3 && W->scale;
}

/* (VBMI for the FP8 bytes' table lookups: every CPU with AMX has it) */
#define AMX                                                                                      \
	__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16," \
			      "avx512vbmi,avx2,fma")))
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
	/* the panels' shapes (config_pan) are keyed 0x100 + M */
	/* GCC's _tile_loadconfig tells the compiler it reads 8 bytes: without the barrier
	 * the stores to the rest of cfg are dropped as dead (a #GP at ldtilecfg) */
	__asm__ volatile("" : : "r"(&cfg) : "memory");
	_tile_loadconfig(&cfg);
	tiles_n = N;
}

/* The panel kernel's tiles (weights as B): C 0-3, M tokens x 16 rows (f32); A 4-5, M tokens
 * x 32 inputs (bf16); B 6-7, 16 input pairs x 16 rows. */
static AMX void config_pan(uint32_t M)
{
	struct tilecfg cfg;

	if (tiles_n == 0x100 + M)
		return;
	memset(&cfg, 0, sizeof(cfg));
	cfg.palette = 1;
	for (int i = 0; i < 8; i++) {
		cfg.rows[i] = (uint8_t)(i < 6 ? M : 16);
		cfg.colsb[i] = 64;
	}
	__asm__ volatile("" : : "r"(&cfg) : "memory");
	_tile_loadconfig(&cfg);
	tiles_n = 0x100 + M;
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

/* The block's weights: row tile i's 16 rows of bf16 at a[i], sa bytes apart. An FP8
 * matrix's, converted exactly (f8_rows), come either so, the whole block at once (where
 * several calls of 32 tokens reuse it), or as f8[i], its rows in place (K8 bytes apart),
 * each block of 128 inputs converted into kbuf just before its tiles load it (one call:
 * the converted rows stay in L1). sc[(i * nkb + kb) * 16 + j] is the scale of row j of tile i for
 * input block kb, and acc, 16 x 16 floats per C tile, where the blocks' scaled sums add up. */
struct ablk {
	const uint16_t *a[2];
	size_t sa;
	const uint8_t *f8[2];
	size_t K8;
	uint16_t *kbuf;
	const float *sc;
	float *acc;
};

/* kbuf's row: one input block and a line, so that its sixteen rows fall in different
 * L1 sets */
#define KBUF_LD (RO_FP8_BLOCK + 32)

/* The C tiles of R row tiles (panels) x G groups zeroed: tile i + 2g */
INLINE AMX void c_zero(const int R, const int G)
{
	_tile_zero(0);
	if (R > 1)
		_tile_zero(1);
	if (G > 1) {
		_tile_zero(2);
		if (R > 1)
			_tile_zero(3);
	}
}

/* The C tiles stored into c (tile t at c + 256 t, rows stride bytes apart) */
INLINE AMX void c_store(float *c, const int R, const int G, size_t stride)
{
	_tile_stored(0, c, stride);
	if (R > 1)
		_tile_stored(1, c + 256, stride);
	if (G > 1) {
		_tile_stored(2, c + 512, stride);
		if (R > 1)
			_tile_stored(3, c + 768, stride);
	}
}

/* Chunk kc's share of the next block's lines (nx_lines of them), asked into L2 */
INLINE void ask_next(const char *nx, size_t kc, uint32_t nx_lines)
{
	if (nx)
		for (uint32_t i = 0; i < nx_lines; i++)
			_mm_prefetch(nx + (kc * nx_lines + i) * 64, _MM_HINT_T1);
}

/* The C tiles for chunks [k0, k1), zeroed first; a0 and a1 (sa bytes a row) hold the
 * weights' chunks from koff on */
INLINE AMX void chunks(const uint16_t *a0, const uint16_t *a1, size_t sa, size_t koff, size_t kcs,
		       size_t k0, size_t k1, const uint32_t *p, const int R, const int G,
		       uint32_t N, const char *nx, uint32_t nx_lines)
{
	c_zero(R, G);
	for (size_t kc = k0; kc < k1; kc++) {
		ask_next(nx, kc, nx_lines);
		_tile_loadd(4, a0 + (kc - koff) * 32, sa);
		if (R > 1)
			_tile_loadd(5, a1 + (kc - koff) * 32, sa);
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
}

/* The byte order that makes VPUNPCK[LH]BW's words come out in input order (the byte
 * tables themselves: ro_f8_bf16_hi and _lo) */
static uint8_t f8_perm[64], f8_pperm[64];

static void f8_tables(void)
{
	ro_f8_bf16_tables();
	/* UNPCKLBW takes bytes 16L..16L+7 of each 128-bit lane L, UNPCKHBW 16L+8..16L+15 */
	for (int L = 0; L < 4; L++)
		for (int j = 0; j < 8; j++) {
			f8_perm[16 * L + j] = (uint8_t)(8 * L + j);
			f8_perm[16 * L + 8 + j] = (uint8_t)(32 + 8 * L + j);
		}
	/* a panel's 64 bytes (16 rows x 4 inputs) as two B rows (16 rows x one pair): the
	 * first pair of row 4L + r from bytes 16L + 2r + j, the second from 16L + 8 + 2r + j */
	for (int L = 0; L < 4; L++)
		for (int r = 0; r < 4; r++)
			for (int j = 0; j < 2; j++) {
				f8_pperm[16 * L + 2 * r + j] = (uint8_t)(4 * (4 * L + r) + j);
				f8_pperm[16 * L + 8 + 2 * r + j] =
				    (uint8_t)(4 * (4 * L + r) + 2 + j);
			}
}

/* The byte tables in registers, and the byte order the caller wants (f8_perm for rows in
 * input order, f8_pperm for a panel's B rows) */
struct f8tab {
	__m512i hi0, hi1, lo0, lo1, perm, sign;
};

INLINE AMX struct f8tab f8_tab(const uint8_t *perm)
{
	return (struct f8tab){_mm512_loadu_si512(ro_f8_bf16_hi),
			      _mm512_loadu_si512(ro_f8_bf16_hi + 64),
			      _mm512_loadu_si512(ro_f8_bf16_lo),
			      _mm512_loadu_si512(ro_f8_bf16_lo + 64),
			      _mm512_loadu_si512(perm),	 _mm512_set1_epi8((char)0x80)};
}

/* 64 FP8 bytes as 64 bf16, in six operations (a byte permute, two table lookups, the sign,
 * two unpacks): the first 32 words into *w0, the others into *w1, in t's byte order */
INLINE AMX void f8_words(const struct f8tab *t, __m512i b, __m512i *w0, __m512i *w1)
{
	__m512i hi, lo;

	b = _mm512_permutexvar_epi8(t->perm, b);
	hi = _mm512_permutex2var_epi8(t->hi0, b, t->hi1);
	hi = _mm512_ternarylogic_epi32(hi, b, t->sign, 0xf8); /* hi | (b & 0x80) */
	lo = _mm512_permutex2var_epi8(t->lo0, b, t->lo1);
	*w0 = _mm512_unpacklo_epi8(lo, hi);
	*w1 = _mm512_unpackhi_epi8(lo, hi);
}

/* Inputs [0, w) (w a multiple of 32) of n FP8 rows (K8 bytes apart at src) as bf16 at dst,
 * lda elements a row */
INLINE AMX void f8_rows(const uint8_t *src, size_t K8, uint32_t n, size_t w, uint16_t *dst,
			size_t lda)
{
	const struct f8tab t = f8_tab(f8_perm);

	for (uint32_t r = 0; r < n; r++) {
		const uint8_t *s = src + (size_t)r * K8;
		uint16_t *d = dst + (size_t)r * lda;

		for (size_t k = 0; k < w; k += 64) {
			const bool half = w - k < 64;
			__m512i w0, w1;

			f8_words(&t,
				 half ? _mm512_maskz_loadu_epi8(0xffffffffull, s + k)
				      : _mm512_loadu_si512(s + k),
				 &w0, &w1);
			_mm512_storeu_si512(d + k, w0);
			if (!half)
				_mm512_storeu_si512(d + k + 32, w1);
		}
	}
}

/* C tile t (i + 2g) stored N floats a row (16 rows, contiguous), times each row's scale
 * s (16 floats) into acc: element (j, n) is float j N + n of both. The first block's onto
 * +0 (as the panels' are), so acc needs no zeroing. */
INLINE AMX void scale_add(const float *c, const float *s, float *acc, uint32_t N, bool first)
{
	const __m512 sv = _mm512_loadu_ps(s);
	const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
	const int sh = N == 1 ? 0 : N == 2 ? 1 : N == 4 ? 2 : N == 8 ? 3 : 4;

	for (uint32_t v = 0; v < N; v++) {
		const __m512i row =
		    _mm512_srli_epi32(_mm512_add_epi32(iota, _mm512_set1_epi32((int)(16 * v))), sh);

		_mm512_store_ps(
		    acc + 16 * v,
		    _mm512_fmadd_ps(_mm512_permutexvar_ps(row, sv), _mm512_load_ps(c + 16 * v),
				    first ? _mm512_setzero_ps() : _mm512_load_ps(acc + 16 * v)));
	}
}

/* R (1 or 2) tiles of 16 weight rows by G (1 or 2) groups of tokens (N wide, nt in all):
 * C tile i + 2g accumulates row tile i against group g, hi then lo, chunk by chunk in input
 * order (the order every block of every shape keeps). Each B load serves R row tiles and
 * each A load G groups. While it runs, the next block's rows (nx_lines cache lines a
 * chunk, contiguous at nx, if any) are asked into L2, spread over the chunks, so that its
 * loads do not wait on DRAM. (Into L2, not L1: sixteen rows 2 K bytes apart share two L1
 * sets.) FP8: C restarts at each block of 128 inputs and is added into acc times the
 * block's scale (one FMA per element and block, in block order), so that the f8 x bf16
 * products stay exact as they are in bf16. */
INLINE AMX void block(const struct ablk *A, size_t K, const uint32_t *p, const int R, const int G,
		      uint32_t N, uint32_t nt, float *const *y, const struct rows16 *rt, float *c,
		      const char *nx, uint32_t nx_lines)
{
	const size_t kcs = K / 32;

	if (!A->sc) {
		chunks(A->a[0], A->a[1], A->sa, 0, kcs, 0, kcs, p, R, G, N, nx, nx_lines);
		c_store(c, R, G, 64);
		for (int g = 0; g < G; g++)
			for (int i = 0; i < R; i++)
				unpack16(c + (i + 2 * g) * 256, y + g * 16,
					 nt - g * 16 < 16 ? nt - g * 16 : 16, rt[i].s, rt[i].lo,
					 rt[i].hi);
		return;
	}
	const size_t nkb = (K + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK, per = RO_FP8_BLOCK / 32;
	float *acc = A->acc;

	for (size_t kb = 0; kb < nkb; kb++) {
		const size_t k0 = kb * per, k1 = k0 + per < kcs ? k0 + per : kcs;

		if (A->f8[0]) {
			for (int i = 0; i < R; i++)
				f8_rows(A->f8[i] + k0 * 32, A->K8, 16, (k1 - k0) * 32,
					A->kbuf + i * 16 * KBUF_LD, KBUF_LD);
			chunks(A->kbuf, A->kbuf + 16 * KBUF_LD, KBUF_LD * 2, k0, kcs, k0, k1, p, R,
			       G, N, nx, nx_lines);
		} else {
			chunks(A->a[0], A->a[1], A->sa, 0, kcs, k0, k1, p, R, G, N, nx, nx_lines);
		}
		c_store(c, R, G, N * 4);
		for (int g = 0; g < G; g++)
			for (int i = 0; i < R; i++)
				scale_add(c + (i + 2 * g) * 256, A->sc + (i * nkb + kb) * 16,
					  acc + (i + 2 * g) * 256, N, kb == 0);
	}
	for (int g = 0; g < G; g++)
		for (int i = 0; i < R; i++) {
			const float *a = acc + (i + 2 * g) * 256;
			const uint32_t n = nt - g * 16 < 16 ? nt - g * 16 : 16;

			if (N == 16) {
				unpack16(a, y + g * 16, n, rt[i].s, rt[i].lo, rt[i].hi);
				continue;
			}
			for (uint32_t t = 0; t < n; t++)
				for (uint32_t j = rt[i].lo; j < rt[i].hi; j++)
					y[g * 16 + t][rt[i].s + j] = a[j * N + t];
		}
}

/* bytes a weight: 2 (bf16) or 1 (FP8) */
static size_t esize(const struct ro_mat *W)
{
	return W->dtype == RO_F8E4M3 ? 1 : 2;
}

static void prefetch_rows(const struct ro_mat *W, uint32_t r, uint32_t n)
{
	const char *a = (const char *)W->w + (size_t)r * W->cols * esize(W);

	for (size_t b = 0; b < (size_t)W->cols * esize(W) * n; b += 64)
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

/* An FP8 block's R row tiles: their scales, and their rows, converted whole into abuf
 * (whole) or left in place for block() to convert a block of inputs at a time */
static AMX void f8_block(const struct ro_mat *W, const struct rows16 *rt, uint32_t R, bool whole,
			 uint16_t *abuf, size_t lda, float *sc, struct ablk *A)
{
	const size_t K = W->cols, nkb = (K + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK;

	for (uint32_t i = 0; i < R; i++) {
		const uint8_t *src = (const uint8_t *)W->w + (size_t)rt[i].s * K;

		for (size_t kb = 0; kb < nkb; kb++)
			for (uint32_t j = 0; j < 16; j++)
				sc[(i * nkb + kb) * 16 + j] =
				    W->scale[((rt[i].s + j) / RO_FP8_BLOCK) * W->scale_cols + kb];
		if (whole) {
			f8_rows(src, K, 16, K, abuf + i * 16 * lda, lda);
			A->a[i] = abuf + i * 16 * lda;
		} else {
			A->f8[i] = src;
		}
	}
	A->sa = lda * 2;
	A->K8 = K;
	A->sc = sc;
}

/* y_m[t][r0..r1) = W_m x[t] for the nm (1 or 2) matrices W_m, which share K and dtype:
 * the tokens are packed once for all of them. */
static AMX int gemm_amx(const struct ro_mat *const *Ws, float *const *const *ys, int nm,
			const float *const *x, uint32_t T, uint32_t r0, uint32_t r1)
{
	const size_t K = Ws[0]->cols, es = esize(Ws[0]);
	const bool f8 = Ws[0]->dtype == RO_F8E4M3;
	/* FP8: a block's rows as bf16 (each row 64 bytes longer, so that sixteen of them do
	 * not fall in the same L1 sets), their scales, and the C tiles' sums */
	const size_t lda = K + 32, nkb = (K + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK;
	const size_t f8_bytes =
	    f8 ? (32 * lda + 32 * KBUF_LD) * 2 + 2 * nkb * 16 * sizeof(float) : 0;
	float c[1024] __attribute__((aligned(64)));
	float acc[1024] __attribute__((aligned(64)));
	uint32_t *p;
	uint16_t *abuf = NULL, *kbuf = NULL;
	float *sc = NULL;

	/* tokens per pass: all of them up to AMX_TOK (whole groups of 16); where that buffer
	 * cannot be had, 16 (the results are the same bits whatever the pass: a token's
	 * output depends on its own column alone), so that a matrix never leaves AMX for
	 * want of memory unless even K x 64 bytes are refused */
	uint32_t tok = T < AMX_TOK ? (T + 15) & ~15u : AMX_TOK;

	p = ro_thread_scratch((size_t)(tok / 16) * (K / 32) * 512 * sizeof(uint32_t) + f8_bytes);
	if (!p && tok > 16) {
		tok = 16;
		p = ro_thread_scratch((K / 32) * 512 * sizeof(uint32_t) + f8_bytes);
	}
	if (!p)
		return -1;
	if (f8) {
		abuf = (uint16_t *)(p + (size_t)(tok / 16) * (K / 32) * 512);
		kbuf = abuf + 32 * lda;
		sc = (float *)(kbuf + 32 * KBUF_LD);
	}
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
			float *const *y = ys[m] + t0;
			struct rows16 rt[2], nrt[2] = {{0, 0, 0}, {0, 0, 0}};
			uint32_t R = next_block(W, r0, r1, rt);

			for (uint32_t r = r0; r < r1;) {
				const uint32_t rn = r + 16 * R; /* the next block's first row */
				const char *nx = NULL;
				uint32_t nx_rows = 0, nR = 0;
				struct ablk A = {.acc = acc, .kbuf = kbuf};

				if (rn < r1) {
					nR = next_block(W, rn, r1, nrt);
					nx = (const char *)W->w + (size_t)nrt[0].s * K * es;
					nx_rows = 16 * nR;
				} else if (m + 1 < nm || t0 + tok < T) {
					const struct ro_mat *Wn = m + 1 < nm ? Ws[m + 1] : Ws[0];

					nx_rows = r1 - r0 < 32 ? r1 - r0 : 32;
					nx = (const char *)Wn->w + (size_t)r0 * K * es;
				}
				if (f8) {
					f8_block(W, rt, R, ng > 2, abuf, lda, sc, &A);
				} else {
					A.a[0] = (const uint16_t *)W->w + (size_t)rt[0].s * K;
					A.a[1] = (const uint16_t *)W->w + (size_t)rt[R - 1].s * K;
					A.sa = K * 2;
				}
				/* 32 tokens at a time; the next block is asked for in the first
				 * (a chunk of a row is 64 bytes of bf16, 32 of FP8) */
				for (uint32_t g = 0; g < ng; g += 2) {
					const uint32_t n = nt - g * 16 < 32 ? nt - g * 16 : 32;
					const uint32_t *pg = p + g * gsz;
					const char *pnx = g ? NULL : nx;
					const uint32_t nl = (uint32_t)(nx_rows * es / 2);

					if (R == 2 && n > 16)
						block(&A, K, pg, 2, 2, N, n, y + g * 16, rt, c, pnx,
						      nl);
					else if (R == 2)
						block(&A, K, pg, 2, 1, N, n, y + g * 16, rt, c, pnx,
						      nl);
					else if (n > 16)
						block(&A, K, pg, 1, 2, N, n, y + g * 16, rt, c, pnx,
						      nl);
					else
						block(&A, K, pg, 1, 1, N, n, y + g * 16, rt, c, pnx,
						      nl);
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

/* ---- weights as B: the loader's 16-row panels ----------------------------------------------
 *
 * A panel (ro_panel_pack: 16 rows, each 32-bit word the next 4 bytes of one row) is, in
 * bf16, a run of B tiles already: 16 input pairs x 16 rows, 1 KiB a chunk of 32 inputs,
 * one after the other. So a panelled matrix runs with the tokens as A (M of them a tile,
 * each row its 32 inputs' hi or lo halves, as they lie) and the weights as B, streamed
 * straight from the panels: one contiguous stream a panel, where the row-major tiles read
 * sixteen rows 2 KiB apart, and C comes out a token a row, stored without a transpose. An
 * FP8 panel's chunk (512 bytes) becomes its B tile in eight conversions of 64 bytes (the
 * table lookups above, the byte order f8_pperm). C[t][i] depends only on token t's inputs
 * and row i's weights, in chunk order, hi then lo, whatever M, group or panel pair computed
 * it; FP8 adds each 128-input block's C into acc times the block's scale (a panel's 16 rows
 * lie in one 128-row block: one scale a panel and block). */

/* tokens a pass and their tiles: 2 KiB per 16 tokens per chunk (hi and lo) */
#define PAN_TOK 256

/* Tokens x[0..nt) (nt <= M <= 16) as A tiles: chunk kc's hi at pa[kc * 1024] and lo at
 * pa[kc * 1024 + 512] (u16), token t in row t (64 bytes), rows nt..M zero */
INLINE AMX void pack_pan(const float *const *x, uint32_t nt, uint32_t M, size_t K, uint16_t *pa)
{
	for (size_t kc = 0; kc < K / 32; kc++) {
		uint16_t *ph = pa + kc * 1024, *pl = ph + 512;

		for (uint32_t t = 0; t < M; t++) {
			if (t >= nt) {
				_mm512_storeu_si512(ph + t * 32, _mm512_setzero_si512());
				_mm512_storeu_si512(pl + t * 32, _mm512_setzero_si512());
				continue;
			}
			const __m512 a = _mm512_loadu_ps(x[t] + kc * 32),
				     b = _mm512_loadu_ps(x[t] + kc * 32 + 16);
			const __m512i hb = (__m512i)_mm512_cvtne2ps_pbh(b, a);
			const __m512 ra = _mm512_sub_ps(a, bf_lo(hb)),
				     rb = _mm512_sub_ps(b, bf_hi(hb));

			_mm512_storeu_si512(ph + t * 32, hb);
			_mm512_storeu_si512(pl + t * 32, (__m512i)_mm512_cvtne2ps_pbh(rb, ra));
		}
	}
}

/* An FP8 panel's chunks [k0, k1) (512 bytes each at src) as B tiles at dst (1 KiB each) */
INLINE AMX void f8_pan(const uint8_t *src, size_t k0, size_t k1, uint16_t *dst)
{
	const struct f8tab t = f8_tab(f8_pperm);

	for (size_t q = k0 * 8; q < k1 * 8; q++) {
		__m512i w0, w1;

		f8_words(&t, _mm512_loadu_si512(src + q * 64), &w0, &w1);
		_mm512_store_si512(dst + (q - k0 * 8) * 64, w0);
		_mm512_store_si512(dst + (q - k0 * 8) * 64 + 32, w1);
	}
}

/* A panel pair's run over up to two groups of tokens. */
struct pan {
	const uint8_t *w[2];  /* the panels, in the matrix (NULL for FP8 converted per chunk) */
	const uint16_t *b[2]; /* or their B tiles converted whole (FP8, several groups) */
	const uint8_t *f8[2]; /* or an FP8 panel, converted a chunk at a time into bk */
	uint16_t *bk;	      /* 2 x 2 KiB: chunk kc's B tiles at bk + (kc & 1) * 1024 */
	const float *s[2];    /* FP8: panel j's scales, one per input block */
	float *acc;	      /* FP8: 4 x 256 floats, C tile t's sums at acc + 256 t */
};

/* C tiles for chunks [k0, k1), zeroed first: panel j (P of them) against group g (G) into
 * tile 2g + j; the next pair's nx_lines lines a chunk asked for (nx: NULL none) */
INLINE AMX void pan_chunks(const struct pan *S, size_t k0, size_t k1, const uint16_t *pa,
			   size_t kcs, const int P, const int G, const char *nx, uint32_t nx_lines)
{
	c_zero(P, G);
	for (size_t kc = k0; kc < k1; kc++) {
		ask_next(nx, kc, nx_lines);
		if (S->w[0]) {
			_tile_loadd(6, S->w[0] + kc * 1024, 64);
			if (P > 1)
				_tile_loadd(7, S->w[1] + kc * 1024, 64);
		} else if (S->b[0]) {
			_tile_loadd(6, S->b[0] + kc * 512, 64);
			if (P > 1)
				_tile_loadd(7, S->b[1] + kc * 512, 64);
		} else {
			uint16_t *bk = S->bk + (kc & 1) * 1024;

			f8_pan(S->f8[0], kc, kc + 1, bk);
			if (P > 1)
				f8_pan(S->f8[1], kc, kc + 1, bk + 512);
			_tile_loadd(6, bk, 64);
			if (P > 1)
				_tile_loadd(7, bk + 512, 64);
		}
		_tile_loadd(4, pa + kc * 1024, 64);
		_tile_loadd(5, pa + kc * 1024 + 512, 64);
		_tile_dpbf16ps(0, 4, 6);
		if (P > 1)
			_tile_dpbf16ps(1, 4, 7);
		_tile_dpbf16ps(0, 5, 6);
		if (P > 1)
			_tile_dpbf16ps(1, 5, 7);
		if (G > 1) {
			const uint16_t *pb = pa + (kcs + kc) * 1024;

			_tile_loadd(4, pb, 64);
			_tile_loadd(5, pb + 512, 64);
			_tile_dpbf16ps(2, 4, 6);
			if (P > 1)
				_tile_dpbf16ps(3, 4, 7);
			_tile_dpbf16ps(2, 5, 6);
			if (P > 1)
				_tile_dpbf16ps(3, 5, 7);
		}
	}
}

/* Panels p, p + 1 (P) x groups (G, nt tokens in all, M a tile) into y: rows [r0, r1) only */
INLINE AMX void pan_run(const struct pan *S, size_t K, bool f8, const uint16_t *pa, const int P,
			const int G, uint32_t M, uint32_t nt, float *const *y, uint32_t p,
			uint32_t r0, uint32_t r1, float *c, const char *nx, uint32_t nx_lines)
{
	const size_t kcs = K / 32;
	const float *out = c;

	if (!f8) {
		pan_chunks(S, 0, kcs, pa, kcs, P, G, nx, nx_lines);
		c_store(c, P, G, 64);
	} else {
		const size_t nkb = (K + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK, per = RO_FP8_BLOCK / 32;

		for (size_t kb = 0; kb < nkb; kb++) {
			const size_t k0 = kb * per, k1 = k0 + per < kcs ? k0 + per : kcs;

			pan_chunks(S, k0, k1, pa, kcs, P, G, nx, nx_lines);
			c_store(c, P, G, 64);
			for (int g = 0; g < G; g++)
				for (int j = 0; j < P; j++) {
					const __m512 sv = _mm512_set1_ps(S->s[j][kb]);
					float *a = S->acc + (2 * g + j) * 256;
					const float *ct = c + (2 * g + j) * 256;

					/* the first block's sum onto +0 (as every later one onto
					 * the sums so far): no zeroing pass */
					for (uint32_t t = 0; t < M; t++)
						_mm512_store_ps(
						    a + 16 * t,
						    _mm512_fmadd_ps(sv, _mm512_load_ps(ct + 16 * t),
								    kb ? _mm512_load_ps(a + 16 * t)
								       : _mm512_setzero_ps()));
				}
		}
		out = S->acc;
	}
	for (int g = 0; g < G; g++) {
		const uint32_t n = nt - g * 16 < 16 ? nt - g * 16 : 16;

		for (int j = 0; j < P; j++) {
			const uint32_t s0 = 16 * (p + j), lo = r0 > s0 ? r0 - s0 : 0,
				       hi = r1 < s0 + 16 ? r1 - s0 : 16;
			const __mmask16 keep =
			    (__mmask16)((0xffffu >> (16 - hi)) & (0xffffu << lo));

			for (uint32_t t = 0; t < n; t++)
				_mm512_mask_storeu_ps(
				    y[g * 16 + t] + s0, keep,
				    _mm512_load_ps(out + (2 * g + j) * 256 + 16 * t));
		}
	}
}

bool ro_amx_panel_fits(const struct ro_mat *W)
{
	return W->panel && W->cols % 32 == 0 &&
	       (W->dtype == RO_BF16 || (W->dtype == RO_F8E4M3 && W->scale));
}

/* ro_gemm_amx's work for nm (1 or 2) panelled matrices of one shape and dtype */
static AMX int gemm_amx_pan(const struct ro_mat *const *Ws, float *const *const *ys, int nm,
			    const float *const *x, uint32_t T, uint32_t r0, uint32_t r1)
{
	const size_t K = Ws[0]->cols, kcs = K / 32;
	const bool f8 = Ws[0]->dtype == RO_F8E4M3;
	const size_t ps = 16 * K * (f8 ? 1 : 2); /* a panel's bytes */
	/* FP8: a pair's B tiles converted whole (several groups), and two chunks' */
	const size_t f8_bytes = f8 ? (2 * kcs * 512 + 2 * 1024) * sizeof(uint16_t) : 0;
	float c[1024] __attribute__((aligned(64)));
	float acc[1024] __attribute__((aligned(64)));
	uint32_t tok = T < PAN_TOK ? (T + 15) & ~15u : PAN_TOK;
	uint16_t *pa, *bw = NULL, *bk = NULL;
	struct pan S;

	pa = ro_thread_scratch((size_t)(tok / 16) * kcs * 2048 + f8_bytes);
	if (!pa && tok > 16) {
		tok = 16;
		pa = ro_thread_scratch(kcs * 2048 + f8_bytes);
	}
	if (!pa)
		return -1;
	if (f8) {
		bw = pa + (size_t)(tok / 16) * kcs * 1024;
		bk = bw + 2 * kcs * 512;
	}
	memset(&S, 0, sizeof(S));
	S.acc = acc;
	S.bk = bk;
	{
		/* the first pair, before the loop asks for each next one */
		const char *a = (const char *)Ws[0]->w + (size_t)(r0 / 16) * ps;
		const uint32_t np = (r1 + 15) / 16 - r0 / 16;

		for (size_t b = 0; b < (np < 2 ? np : 2) * ps; b += 64)
			_mm_prefetch(a + b, _MM_HINT_T1);
	}
	for (uint32_t t0 = 0; t0 < T; t0 += tok) {
		const uint32_t nt = T - t0 < tok ? T - t0 : tok, ng = (nt + 15) / 16;
		const uint32_t M = nt <= 1 ? 1 : nt <= 2 ? 2 : nt <= 4 ? 4 : nt <= 8 ? 8 : 16;

		config_pan(M);
		for (uint32_t g = 0; g < ng; g++)
			pack_pan(x + t0 + g * 16, nt - g * 16 < 16 ? nt - g * 16 : 16, M, K,
				 pa + (size_t)g * kcs * 1024);
		for (int m = 0; m < nm; m++) {
			const struct ro_mat *W = Ws[m];
			float *const *y = ys[m] + t0;
			const uint32_t p0 = r0 / 16, p1 = (r1 + 15) / 16;

			for (uint32_t p = p0; p < p1; p += 2) {
				const int P = p1 - p >= 2 ? 2 : 1;
				const uint8_t *wp = (const uint8_t *)W->w + (size_t)p * ps;
				const char *nx = NULL;
				uint32_t nx_lines = 0;

				/* the next pair (of this matrix, the next one's, or the next
				 * pass's first), asked for over this pair's chunks */
				if (p + 2 < p1) {
					nx = (const char *)W->w + (size_t)(p + 2) * ps;
					nx_lines =
					    (uint32_t)((p1 - p - 2 >= 2 ? 2 : 1) * ps / 64 / kcs);
				} else if (m + 1 < nm || t0 + tok < T) {
					const struct ro_mat *Wn = m + 1 < nm ? Ws[m + 1] : Ws[0];

					nx = (const char *)Wn->w + (size_t)p0 * ps;
					nx_lines =
					    (uint32_t)((p1 - p0 >= 2 ? 2 : 1) * ps / 64 / kcs);
				}
				S.w[0] = S.w[1] = NULL;
				S.b[0] = S.b[1] = NULL;
				S.f8[0] = S.f8[1] = NULL;
				for (int j = 0; j < P; j++) {
					const uint8_t *pj = wp + j * ps;

					if (!f8) {
						S.w[j] = pj;
						continue;
					}
					S.s[j] = W->scale + (size_t)((p + j) * 16 / RO_FP8_BLOCK) *
								W->scale_cols;
					if (ng > 2) {
						/* several groups: the pair converted once */
						f8_pan(pj, 0, kcs, bw + j * kcs * 512);
						S.b[j] = bw + j * kcs * 512;
					} else {
						S.f8[j] = pj;
					}
				}
				for (uint32_t g = 0; g < ng; g += 2) {
					const uint32_t n = nt - g * 16 < 32 ? nt - g * 16 : 32;
					const uint16_t *pg = pa + (size_t)g * kcs * 1024;
					const char *pnx = g ? NULL : nx;

					if (P == 2 && n > 16)
						pan_run(&S, K, f8, pg, 2, 2, M, n, y + g * 16, p,
							r0, r1, c, pnx, nx_lines);
					else if (P == 2)
						pan_run(&S, K, f8, pg, 2, 1, M, n, y + g * 16, p,
							r0, r1, c, pnx, nx_lines);
					else if (n > 16)
						pan_run(&S, K, f8, pg, 1, 2, M, n, y + g * 16, p,
							r0, r1, c, pnx, nx_lines);
					else
						pan_run(&S, K, f8, pg, 1, 1, M, n, y + g * 16, p,
							r0, r1, c, pnx, nx_lines);
				}
			}
		}
	}
	return 0;
}

int ro_gemm_amx(const struct ro_mat *W, const float *const *x, uint32_t T, float *const *y,
		uint32_t r0, uint32_t r1)
{
	if (W->panel)
		return gemm_amx_pan(&W, &y, 1, x, T, r0, r1);
	return gemm_amx(&W, &y, 1, x, T, r0, r1);
}

int ro_gemm_amx2(const struct ro_mat *W1, const struct ro_mat *W2, const float *const *x,
		 uint32_t T, float *const *y1, float *const *y2, uint32_t r0, uint32_t r1)
{
	const struct ro_mat *Ws[2] = {W1, W2};
	float *const *ys[2] = {y1, y2};

	if (W1->panel)
		return gemm_amx_pan(Ws, ys, 2, x, T, r0, r1);
	return gemm_amx(Ws, ys, 2, x, T, r0, r1);
}

#else

bool ro_amx_available(void)
{
	return false;
}

bool ro_amx_panel_fits(const struct ro_mat *W)
{
	(void)W;
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
