/* The matrix kernels of the CPU forward pass: y = W x for bf16 or f32 weights stored as
 * nn.Linear keeps them ([out][in]), f32 activations, f32 accumulation. AVX2+FMA when the
 * CPU has it (detected once at run time), a portable path otherwise.
 *
 * Batch invariance rests here. Each (row, token) dot product has its own 8-lane
 * accumulator, fed in k order, reduced by one fixed tree, then the tail in k order. The
 * blocked variants (4 rows x 1 token for decode, 2 rows x 4 tokens for batches) only share
 * the loads of W and x between accumulators: a token's result is bitwise the same whichever
 * variant, block or thread computed it. The build uses -ffp-contract=off so the compiler
 * cannot fuse the scalar tail differently in different places. */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/internal.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* 0 portable, 1 AVX2+FMA, 2 AVX-512 (F, BW, DQ, VL), 3 that and AMX-BF16 for the bf16
 * matrices it fits (amx.c); -1 until first asked */
static int kern = -1;
/* AVX512-VBMI for FP8's conversion to bf16 (RO_KERNELS=avx512-novbmi: not) */
static bool f8_vbmi;

uint8_t ro_f8_bf16_hi[128], ro_f8_bf16_lo[128];
static pthread_once_t f8_once = PTHREAD_ONCE_INIT;

static void f8_bf16_fill(void)
{
	for (uint32_t m = 0; m < 128; m++) {
		const float f = ro_f8e4m3_to_f32((uint8_t)m);
		uint32_t u;

		memcpy(&u, &f, sizeof(u));
		ro_f8_bf16_hi[m] = (uint8_t)(u >> 24);
		ro_f8_bf16_lo[m] = (uint8_t)(u >> 16);
	}
}

void ro_f8_bf16_tables(void)
{
	(void)pthread_once(&f8_once, f8_bf16_fill);
}

bool ro_cpu_has_avx2(void)
{
#if HAVE_X86
	__builtin_cpu_init();
	return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
	return false;
#endif
}

static bool cpu_has_avx512(void)
{
#if HAVE_X86
	__builtin_cpu_init();
	return ro_cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
	       __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
	       __builtin_cpu_supports("avx512vl");
#else
	return false;
#endif
}

/* The best the CPU has, capped by RO_KERNELS ("avx512", "avx2" or "scalar"; "avx512-novbmi":
 * AVX-512 without its VBMI byte tables; anything else: no cap), read at each model load: to
 * run, and test, the slower paths on a machine with the faster ones. */
static int kern_best(void)
{
	const char *cap = getenv("RO_KERNELS");
	const bool novbmi = cap && !strcmp(cap, "avx512-novbmi");
	const bool capped = cap && (!strcmp(cap, "avx512") || !strcmp(cap, "avx2") ||
				    !strcmp(cap, "scalar") || novbmi);
	/* (AMX is asked of the kernel only when it may run) */
	int best = cpu_has_avx512() ? (!capped && ro_amx_available() ? 3 : 2)
		   : ro_cpu_has_avx2() ? 1
				       : 0;

#if HAVE_X86
	f8_vbmi = !novbmi && best >= 2 && __builtin_cpu_supports("avx512vbmi");
	if (f8_vbmi)
		ro_f8_bf16_tables();
#endif
	if (cap && !strcmp(cap, "avx2") && best > 1)
		best = 1;
	else if (cap && !strcmp(cap, "scalar"))
		best = 0;
	return best;
}

static int kern_get(void)
{
	if (kern < 0)
		kern = kern_best();
	return kern;
}

void ro_kernels_force_scalar(bool scalar)
{
	kern = scalar ? 0 : kern_best();
}

bool ro_kernels_avx2(void)
{
	return kern_get() >= 1;
}

bool ro_kernels_avx512(void)
{
	return kern_get() >= 2;
}

bool ro_kernels_amx(void)
{
	return kern_get() == 3;
}

const char *ro_kernels_name(void)
{
	static const char *const names[] = {"scalar", "avx2+fma", "avx512+fma",
					    "amx-bf16+avx512+fma"};

	return names[kern_get()];
}

/* ---- portable path --------------------------------------------------------------------- */

/* W[r][k] as f32: bf16 widened; F8E4M3 decoded and times its block's scale (one f32
 * rounding, as tests/ref/ref_moe.py dequantizes) */
/* where W[r][k] is in W->w: in panels, 16 rows of `per` inputs a 32-bit word
 * (ro_panel_pack) */
static inline size_t w_index(const struct ro_mat *W, size_t r, size_t k)
{
	const size_t per = W->dtype == RO_F8E4M3 ? 4 : 2;

	return W->panel ? (r / 16) * 16 * W->cols + (k / per) * 16 * per + (r % 16) * per + k % per
			: r * W->cols + k;
}

/* FP8: the weight_scale_inv of W[r][k]'s block */
static inline float w_scale(const struct ro_mat *W, size_t r, size_t k)
{
	return W->scale[(r / RO_FP8_BLOCK) * W->scale_cols + k / RO_FP8_BLOCK];
}

static inline float w_at(const struct ro_mat *W, size_t r, size_t k)
{
	const size_t i = w_index(W, r, k);

	if (W->dtype == RO_F8E4M3)
		return ro_f8e4m3_to_f32(((const uint8_t *)W->w)[i]) * w_scale(W, r, k);
	return W->dtype == RO_BF16 ? ro_bf16_to_f32(((const uint16_t *)W->w)[i])
				   : ((const float *)W->w)[i];
}

static float hsum8(const float a[8])
{
	/* the tree of the AVX2 path: (lo + hi), then pairs, then the last two */
	float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
	float c0 = b0 + b2, c1 = b1 + b3;

	return c0 + c1;
}

static void dot_scalar(const struct ro_mat *W, uint32_t r, const float *x, float *out)
{
	const size_t K = W->cols, K8 = K & ~(size_t)7;
	float acc[8] = {0};
	float s;

	for (size_t k = 0; k < K8; k += 8)
		for (int l = 0; l < 8; l++)
			acc[l] = acc[l] + w_at(W, r, k + l) * x[k + l];
	s = hsum8(acc);
	for (size_t k = K8; k < K; k++)
		s = s + w_at(W, r, k) * x[k];
	*out = s;
}

static void gemm_scalar(const struct ro_mat *W, const float *const *x, uint32_t T, float *const *y,
			uint32_t r0, uint32_t r1)
{
	for (uint32_t r = r0; r < r1; r++)
		for (uint32_t t = 0; t < T; t++)
			dot_scalar(W, r, x[t], &y[t][r]);
}

/* the matrix this thread runs next (ro_gemm_then): the AVX-512 panels ask for its first
 * group while they run the current one's last */
static __thread const struct ro_mat *pf_after;

void ro_gemm_then(const struct ro_mat *W)
{
	pf_after = W;
}

/* ---- AVX2 + FMA ------------------------------------------------------------------------ */

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))
#define PF_AHEAD 4096

INLINE AVX2 float hsum256(__m256 v)
{
	__m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
	__m128 b = _mm_add_ps(lo, hi);			   /* b0..b3 = a0+a4 .. a3+a7 */
	__m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));	   /* c0 = b0+b2, c1 = b1+b3 */
	__m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1)); /* c0 + c1 */

	return _mm_cvtss_f32(d);
}

/* R rows x TT tokens; R, TT are constants at every call, and the pragmas unroll their
 * loops completely so the accumulators live in registers (without them GCC keeps acc[][]
 * in memory and the kernel runs at a third of its speed). */
INLINE AVX2 void block(const struct ro_mat *W, uint32_t r, const float *const *x, uint32_t t,
		       float *const *y, const int R, const int TT)
{
	const size_t K = W->cols, K8 = K & ~(size_t)7;
	const enum ro_dtype dt = W->dtype;
	const float *xr[4];
	const uint16_t *wb[4];
	const float *wf[4];
	const uint8_t *w8[4];
	const float *srow[4];
	__m256 acc[4][4];

#pragma GCC unroll 4
	for (int i = 0; i < R; i++) {
		wb[i] = (const uint16_t *)W->w + (size_t)(r + i) * K;
		wf[i] = (const float *)W->w + (size_t)(r + i) * K;
		w8[i] = (const uint8_t *)W->w + (size_t)(r + i) * K;
		srow[i] =
		    dt == RO_F8E4M3 ? W->scale + ((r + i) / RO_FP8_BLOCK) * W->scale_cols : NULL;
#pragma GCC unroll 4
		for (int j = 0; j < TT; j++)
			acc[i][j] = _mm256_setzero_ps();
	}
#pragma GCC unroll 4
	for (int j = 0; j < TT; j++)
		xr[j] = x[t + j];
	if (dt == RO_BF16) {
		for (size_t k = 0; k < K8; k += 8) {
			__m256 wv[4];

			/* weights stream from DRAM once per step: ask for them early, a line
			 * per 32 elements, PF_AHEAD bytes ahead (past the row's end is harmless:
			 * prefetches do not fault) */
			if (!(k & 31)) {
#pragma GCC unroll 4
				for (int i = 0; i < R; i++)
					_mm_prefetch((const char *)(wb[i] + k) + PF_AHEAD, _MM_HINT_T0);
			}

#pragma GCC unroll 4
			for (int i = 0; i < R; i++)
				wv[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
				    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wb[i] + k))),
				    16));
#pragma GCC unroll 4
			for (int j = 0; j < TT; j++) {
				__m256 xv = _mm256_loadu_ps(xr[j] + k);

#pragma GCC unroll 4
				for (int i = 0; i < R; i++)
					acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
			}
		}
	} else if (dt == RO_F8E4M3) {
		__m256 sc[4] = {0};

		for (size_t k = 0; k < K8; k += 8) {
			__m256 wv[4];

			if (!(k & 63)) {
#pragma GCC unroll 4
				for (int i = 0; i < R; i++)
					_mm_prefetch((const char *)(w8[i] + k) + PF_AHEAD,
						     _MM_HINT_T0);
			}
			if (!(k % RO_FP8_BLOCK)) {
#pragma GCC unroll 4
				for (int i = 0; i < R; i++)
					sc[i] = _mm256_set1_ps(srow[i][k / RO_FP8_BLOCK]);
			}
#pragma GCC unroll 4
			for (int i = 0; i < R; i++) {
				/* e4m3fn as in the AVX-512 path: the byte at the top, exponent and
				 * mantissa moved to bits 30..20 and scaled by 2^120, the sign put
				 * back; then the block's scale (one rounding, as w_at) */
				const __m256i b =
				    _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
							  (const __m128i *)(w8[i] + k))),
						      24);
				const __m256 mag = _mm256_mul_ps(
				    _mm256_castsi256_ps(_mm256_and_si256(
					_mm256_srli_epi32(b, 4), _mm256_set1_epi32(0x07f00000))),
				    _mm256_set1_ps(0x1p120f));
				const __m256 v =
				    _mm256_or_ps(mag, _mm256_castsi256_ps(_mm256_and_si256(
							  b, _mm256_set1_epi32((int)0x80000000u))));

				wv[i] = _mm256_mul_ps(v, sc[i]);
			}
#pragma GCC unroll 4
			for (int j = 0; j < TT; j++) {
				__m256 xv = _mm256_loadu_ps(xr[j] + k);

#pragma GCC unroll 4
				for (int i = 0; i < R; i++)
					acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
			}
		}
	} else {
		for (size_t k = 0; k < K8; k += 8) {
			__m256 wv[4];

#pragma GCC unroll 4
			for (int i = 0; i < R; i++)
				wv[i] = _mm256_loadu_ps(wf[i] + k);
#pragma GCC unroll 4
			for (int j = 0; j < TT; j++) {
				__m256 xv = _mm256_loadu_ps(xr[j] + k);

#pragma GCC unroll 4
				for (int i = 0; i < R; i++)
					acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
			}
		}
	}
#pragma GCC unroll 4
	for (int i = 0; i < R; i++) {
#pragma GCC unroll 4
		for (int j = 0; j < TT; j++) {
			float s = hsum256(acc[i][j]);

			for (size_t k = K8; k < K; k++)
				s = s + w_at(W, r + i, k) * xr[j][k];
			y[t + j][r + i] = s;
		}
	}
}

static AVX2 void gemm_avx2(const struct ro_mat *W, const float *const *x, uint32_t T,
			   float *const *y, uint32_t r0, uint32_t r1)
{
	/* rows in blocks that stay in L2 while every token passes over them */
	const uint32_t RB = 32;

	for (uint32_t rb = r0; rb < r1; rb += RB) {
		uint32_t re = rb + RB < r1 ? rb + RB : r1;
		uint32_t t = 0;

		for (; t + 4 <= T; t += 4) {
			uint32_t r = rb;

			for (; r + 2 <= re; r += 2)
				block(W, r, x, t, y, 2, 4);
			for (; r < re; r++)
				block(W, r, x, t, y, 1, 4);
		}
		for (; t < T; t++) {
			uint32_t r = rb;

			for (; r + 4 <= re; r += 4)
				block(W, r, x, t, y, 4, 1);
			for (; r < re; r++)
				block(W, r, x, t, y, 1, 1);
		}
	}
}

/* ---- AVX-512 ----------------------------------------------------------------------------
 *
 * The order every (row, token) dot product is summed in, whatever block, thread or batch
 * computes it: sixteen lane accumulators, lane l taking k = 16j + l for j = 0, 1, ... in
 * order (one FMA each), reduced by one fixed tree (lanes l + l+8, then l + l+4, then l + l+2,
 * then the last two), then the tail k >= K16 in k order (a multiply and an add). Blocks of
 * R rows x TT tokens share the loads of W and x between R x TT such accumulators and change
 * nothing else, so a token's logits are the same bits in a batch of 1 or of 256. */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
#define AVX512VBMI \
	__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx2,fma")))

INLINE AVX512 float hsum512(__m512 v)
{
	__m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
				 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
	__m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
	__m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));

	return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* Sixteen weights as f32: bf16 widened in the register (a zero-extend and a shift). */
INLINE AVX512 __m512 w16(const void *w, enum ro_dtype dt, size_t i)
{
	if (dt == RO_BF16)
		return _mm512_castsi512_ps(
		    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
					  (const __m256i *)((const uint16_t *)w + i))),
				      16));
	if (dt == RO_F8E4M3) {
		/* e4m3fn: the byte at the top (sign at bit 31), exponent and mantissa moved to an
		 * f32's bits 30..20 and scaled by 2^120 (exact, subnormals included), the sign
		 * put back; ro_f8e4m3_to_f32 with sixteen lanes */
		const __m512i t = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(
							(const __m128i *)((const uint8_t *)w + i))),
						    24);
		const __m512 mag =
		    _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(
				      _mm512_srli_epi32(t, 4), _mm512_set1_epi32(0x07f00000))),
				  _mm512_set1_ps(0x1p120f));

		/* mag | (t & sign bit) */
		return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
		    _mm512_castps_si512(mag), t, _mm512_set1_epi32((int)0x80000000u), 0xf8));
	}
	return _mm512_loadu_ps((const float *)w + i);
}

/* R rows x TT tokens (constants at every call; the pragmas unroll the loops so the R x TT
 * accumulators live in zmm registers: R x TT + R <= 31). */
INLINE AVX512 void block512(const struct ro_mat *W, uint32_t r, const float *const *x, uint32_t t,
			    float *const *y, const int R, const int TT, const enum ro_dtype dt)
{
	const size_t K = W->cols, K16 = K & ~(size_t)15;
	const size_t wsz = dt == RO_BF16 ? 2 : dt == RO_F8E4M3 ? 1 : 4;
	const char *wr[8];
	const float *xr[6], *srow[8];
	__m512 acc[8][6], sc[8];

#pragma GCC unroll 8
	for (int i = 0; i < R; i++) {
		wr[i] = (const char *)W->w + (size_t)(r + i) * K * wsz;
		srow[i] =
		    dt == RO_F8E4M3 ? W->scale + ((r + i) / RO_FP8_BLOCK) * W->scale_cols : NULL;
		sc[i] = _mm512_setzero_ps();
#pragma GCC unroll 6
		for (int j = 0; j < TT; j++)
			acc[i][j] = _mm512_setzero_ps();
	}
#pragma GCC unroll 6
	for (int j = 0; j < TT; j++)
		xr[j] = x[t + j];
	for (size_t k = 0; k < K16; k += 16) {
		__m512 wv[8];

		/* the weights stream from DRAM once per step: a line per row every 64 bytes,
		 * R rows + 1 KiB ahead, i.e. in the next block's rows (W is contiguous), so the
		 * misses of the next block overlap this one's FMAs. A fixed distance (the old
		 * 4 KiB) lands inside this very block once R rows span more than it: measured
		 * on 256 experts of 256 x 1024 bf16 (past L3), 1 thread, 4 tokens each: 16 GB/s
		 * with 4 KiB, 31-36 with this; 1 token: 27 -> 33-36 GB/s. (Prefetches past the
		 * end do not fault.) */
		if (!((k * wsz) & 63)) {
#pragma GCC unroll 8
			for (int i = 0; i < R; i++)
				_mm_prefetch(wr[i] + ((size_t)R * K + k) * wsz + 1024, _MM_HINT_T0);
		}
		if (dt == RO_F8E4M3 && !(k % RO_FP8_BLOCK)) {
#pragma GCC unroll 8
			for (int i = 0; i < R; i++)
				sc[i] = _mm512_set1_ps(srow[i][k / RO_FP8_BLOCK]);
		}
#pragma GCC unroll 8
		for (int i = 0; i < R; i++) {
			wv[i] = w16(wr[i], dt, k);
			if (dt == RO_F8E4M3) /* the block's scale: one rounding, as w_at */
				wv[i] = _mm512_mul_ps(wv[i], sc[i]);
		}
#pragma GCC unroll 6
		for (int j = 0; j < TT; j++) {
			__m512 xv = _mm512_loadu_ps(xr[j] + k);

#pragma GCC unroll 8
			for (int i = 0; i < R; i++)
				acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
		}
	}
#pragma GCC unroll 8
	for (int i = 0; i < R; i++) {
#pragma GCC unroll 6
		for (int j = 0; j < TT; j++) {
			float s = hsum512(acc[i][j]);

			for (size_t k = K16; k < K; k++)
				s = s + w_at(W, r + i, k) * xr[j][k];
			y[t + j][r + i] = s;
		}
	}
}

/* Rows [rb, re) for tokens [t, t + TT): R at a time, then 2, then 1. */
INLINE AVX512 void rows512(const struct ro_mat *W, uint32_t rb, uint32_t re, const float *const *x,
			   uint32_t t, float *const *y, const int R, const int TT,
			   const enum ro_dtype dt)
{
	uint32_t r = rb;

	for (; r + R <= re; r += R)
		block512(W, r, x, t, y, R, TT, dt);
	for (; r + 2 <= re; r += 2)
		block512(W, r, x, t, y, 2, TT, dt);
	for (; r < re; r++)
		block512(W, r, x, t, y, 1, TT, dt);
}

INLINE AVX512 void gemm512(const struct ro_mat *W, const float *const *x, uint32_t T,
			   float *const *y, uint32_t r0, uint32_t r1, const enum ro_dtype dt)
{
	/* rows in blocks that stay in L2 while every token passes over them */
	const uint32_t RB = 48;

	for (uint32_t rb = r0; rb < r1; rb += RB) {
		const uint32_t re = rb + RB < r1 ? rb + RB : r1;
		uint32_t t = 0;

		/* 4 x 6 for the bulk: 24 accumulators, each W load feeds 6 FMAs */
		for (; t + 6 <= T; t += 6)
			rows512(W, rb, re, x, t, y, 4, 6, dt);
		switch (T - t) {
		case 5:
			rows512(W, rb, re, x, t, y, 4, 5, dt);
			break;
		case 4:
			rows512(W, rb, re, x, t, y, 6, 4, dt);
			break;
		case 3:
			rows512(W, rb, re, x, t, y, 6, 3, dt);
			break;
		case 2:
			rows512(W, rb, re, x, t, y, 8, 2, dt);
			break;
		case 1:
			/* decode: eight rows in flight keep enough misses outstanding */
			rows512(W, rb, re, x, t, y, 8, 1, dt);
			break;
		}
	}
}

static AVX512 void gemm_avx512(const struct ro_mat *W, const float *const *x, uint32_t T,
			       float *const *y, uint32_t r0, uint32_t r1)
{
	if (W->dtype == RO_BF16)
		gemm512(W, x, T, y, r0, r1, RO_BF16);
	else if (W->dtype == RO_F8E4M3)
		gemm512(W, x, T, y, r0, r1, RO_F8E4M3);
	else
		gemm512(W, x, T, y, r0, r1, RO_F32);
}

/* ---- AVX-512 on panels (ro_panel_pack) ----------------------------------------------------
 *
 * Sixteen rows are one zmm of f32 accumulators, one lane per row, and the inputs come
 * broadcast, so an output element is one chain of FMAs in k order, acc = w[k] x[k] + acc
 * from k = 0, whatever block, thread or batch computes it: no reduction tree, and a
 * 64-byte load (16 rows x 2 inputs) is widened by one shift (even k) and one mask (odd k).
 * Blocks of R panels x TT tokens share the weight loads between tokens; the inputs come as
 * FMA broadcast operands. Measured in cache on a Zen 5 core (256 x 1,024 and 1,024 x 256,
 * 12+ tokens): 97% of its FMA peak, where the row-major kernel above does 66-80% (its
 * horizontal sums cost as much as a 256-input dot product's FMAs).
 *
 * Every BF16 matrix with even cols runs here when the AVX-512 kernels are in use: in
 * panels as the loader copied it, or row-major (mapped in place, a rank's experts it does
 * not own) packed into panels a group at a time first, so the bits do not depend on where
 * the weights live. */

/* The panels of the group that comes next (pf_bytes of them), asked into L2 while the
 * current group runs its second pass over the tokens (or its only one, under 12 tokens):
 * the next group's first pass then finds them there instead of waiting on DRAM. The
 * expert layer alone (16 layers, in-process A/B, best of 6-8): 128 tokens 81.9 -> 79.7
 * ms, 256 153.1 -> 148.0, 32 36.0-37.3 -> 35.3-36.7, 512 unchanged; FP8 (its second pass
 * of 8 tokens, or its only one) 8 tokens 16.2 -> 16.0, 32 29.3 -> 28.1, 128 90.9 -> 88.9,
 * 256 unchanged. */
static __thread const uint8_t *pf_next;
static __thread size_t pf_bytes;
static __thread unsigned pf_shift; /* 1 while bf16 panels converted from FP8 run: their
				      offsets are twice the FP8 ones the next group has */

/* byte o of the next group's panels asked for into L2, if it has that many */
static inline void pf_ask(const uint8_t *pf, size_t o)
{
	o >>= pf_shift;
	if (pf && o < pf_bytes)
		_mm_prefetch((const char *)pf + o, _MM_HINT_T1);
}

/* a panel's bytes: 16 rows of cols inputs, a byte each for FP8, else two (BF16) */
static inline size_t panel_bytes_of(uint32_t cols, enum ro_dtype dt)
{
	return (size_t)16 * cols * (dt == RO_F8E4M3 ? 1 : 2);
}

static size_t panel_bytes(const struct ro_mat *W)
{
	return panel_bytes_of(W->cols, W->dtype);
}

#define PANEL_G 12 /* panels per group: 192 rows, 384 KiB of 1,024 inputs, stay in L2 */
#define PF_AHEAD512 8192 /* bytes prefetched ahead, over all of a block's panels */

/* FP8 on the AVX-512 panels. Every element is the chain acc = fmaf(w, x', acc) in k order,
 * w the e4m3fn value exactly (4 significant bits, 2^-9 to 448: an f32 and a bf16 exactly)
 * and x' = x * scale (one rounding): the block's weight_scale_inv moved from the weights to
 * the inputs (f8_scale_x, per 128-row block; until 2026-12-08 each weight was multiplied by
 * it). Two routes give those bits:
 * - under ro_f8_via_bf16 tokens (20), the FP8 panels widened in registers on every pass
 *   over the tokens (f8x16: a shift, an arithmetic shift, a mask and a multiply by 2^120,
 *   15 operations for 64 weights);
 * - from that many, each 128-row block converted once per call into bf16 panels in
 *   per-thread scratch (f8_to_bf16_*) and run by the bf16 kernel, whose widening costs 4
 *   operations for 64 weights a pass.
 * Alternating in one process on a Sapphire Rapids core without AMX (one 256 x 1,024 or
 * 1,024 x 256 matrix in L2), the converted route ran 12 tokens 1.15-1.18x as fast, 24
 * 1.16-1.22x, 64 1.23-1.26x, 128 1.31-1.35x, and 8 tokens 0.88x; over the expert layer
 * (16 layers x 64 experts, 2 threads, weights from memory, random routing) it lost 2-8% at
 * ~16 tokens an expert (the conversion's pass over memory does not overlap the FMAs) and
 * gained 10% at ~32 and 21% at ~48: hence 20. The two routes are the same products in the
 * same order (test_gemm checks both against the chain bitwise), so which one a batch takes
 * changes no token's bits. With AVX512-VBMI (Ice Lake, Zen 4 and later) the conversion
 * looks the bytes up in two 128-entry tables (ro_f8_bf16_hi and _lo, shared with amx.c):
 * 7 operations for 64 weights against 19. Widening every pass through
 * the same tables instead of the shifts ran at 79 GFLOP/s against 114 (its two-source byte
 * permutes, VPERMT2B, cost here about twice a shift), so the per-pass route keeps the
 * shifts; they leave an FP8 subnormal as an f32 subnormal, whose multiply costs a microcode
 * assist (~100x the instruction here), rare in checkpoints (~1e-4 of the weights). */
uint32_t ro_f8_via_bf16 = 20;

/* Sixteen FP8 weights (e4m3fn, each byte at the top of its lane: bits
 * 31..24; bits below are ignored) as f32, exactly: an arithmetic shift by 4 and a mask leave
 * sign | exponent | mantissa at an f32's bits 31, 26..20 (the value times 2^-120, an f32
 * subnormal for an FP8 one), and a multiply by s120 = 2^120 (exact) makes it the value. */
INLINE AVX512 __m512 f8x16(__m512i t, __m512 s120)
{
	return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(
				 _mm512_srai_epi32(t, 4), _mm512_set1_epi32((int)0x87f00000u))),
			     s120);
}

/* n FP8 panels of K inputs at src (a word: 4 inputs of a row) into bf16 panels at dst (a
 * word: 2 inputs of a row), exactly. A 64-byte load is 16 rows x 4 inputs, two 64-byte
 * stores 16 rows x inputs (0, 1) and (2, 3). */
static AVX512 void f8_to_bf16_plain(const uint8_t *src, uint8_t *dst, size_t bytes)
{
	const __m512 s120 = _mm512_set1_ps(0x1p120f);

	for (size_t o = 0; o < bytes; o += 64) {
		const __m512i d = _mm512_loadu_si512(src + o);
		__m512i f[4];

		for (int b = 0; b < 4; b++)
			f[b] = _mm512_castps_si512(
			    f8x16(b == 3 ? d : _mm512_slli_epi32(d, 8 * (3 - b)), s120));
		/* (f[0] >> 16) | (f[1] & 0xffff0000), in one ternary logic */
		_mm512_storeu_si512(dst + 2 * o,
				    _mm512_ternarylogic_epi32(_mm512_srli_epi32(f[0], 16), f[1],
							      _mm512_set1_epi32((int)0xffff0000u),
							      0xf8));
		_mm512_storeu_si512(dst + 2 * o + 64,
				    _mm512_ternarylogic_epi32(_mm512_srli_epi32(f[2], 16), f[3],
							      _mm512_set1_epi32((int)0xffff0000u),
							      0xf8));
	}
}

static AVX512VBMI void f8_to_bf16_vbmi(const uint8_t *src, uint8_t *dst, size_t bytes)
{
	const __m512i th0 = _mm512_loadu_si512(ro_f8_bf16_hi),
		      th1 = _mm512_loadu_si512(ro_f8_bf16_hi + 64),
		      tl0 = _mm512_loadu_si512(ro_f8_bf16_lo),
		      tl1 = _mm512_loadu_si512(ro_f8_bf16_lo + 64), sgn = _mm512_set1_epi8((char)0x80);

	for (size_t o = 0; o < bytes; o += 64) {
		const __m512i d = _mm512_loadu_si512(src + o);
		/* byte 4r + b: the high (with the sign) and low bytes of row r's input b */
		const __m512i h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(th0, d, th1), d,
							    sgn, 0xf8),
			      l = _mm512_permutex2var_epi8(tl0, d, tl1);
		/* per 128-bit lane (rows 4j..4j+3): dwords (row, inputs 0-1), (row, 2-3) for
		 * rows 4j, 4j+1 (lo) and 4j+2, 4j+3 (hi) */
		const __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi8(l, h)),
			     hi = _mm512_castsi512_ps(_mm512_unpackhi_epi8(l, h));

		_mm512_storeu_ps((float *)(dst + 2 * o), _mm512_shuffle_ps(lo, hi, 0x88));
		_mm512_storeu_ps((float *)(dst + 2 * o + 64), _mm512_shuffle_ps(lo, hi, 0xdd));
	}
}

/* Tokens [t, t + m)'s inputs times the scales of the 128-row block of row a (one rounding
 * each), into buf (K floats a token), pointed to by xs[t + j]. */
static AVX512 void f8_scale_x(const struct ro_mat *W, uint32_t a, const float *const *x,
			      uint32_t t, uint32_t m, float *buf, const float **xs)
{
	const uint32_t K = W->cols;
	const float *s = W->scale + (size_t)(a / RO_FP8_BLOCK) * W->scale_cols;

	for (uint32_t j = 0; j < m; j++) {
		float *o = buf + (size_t)j * K;

		for (uint32_t k = 0; k < K; k += 16) {
			const __mmask16 mk =
			    K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);

			_mm512_mask_storeu_ps(o + k, mk,
					      _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, x[t + j] + k),
							    _mm512_set1_ps(s[k / RO_FP8_BLOCK])));
		}
		xs[t + j] = o;
	}
}

/* R panels (the first at wp, its first row a) x TT tokens (from t), all K inputs; rows
 * outside [r0, r1) are computed and not stored. */
INLINE AVX512 void pblock(const struct ro_mat *W, const uint8_t *wp, uint32_t a,
			  const float *const *x, uint32_t t, float *const *y, uint32_t r0,
			  uint32_t r1, const int R, const int TT, const enum ro_dtype dt,
			  const uint8_t *pf, size_t pfo)
{
	const uint32_t K = W->cols;
	const size_t ps = panel_bytes_of(K, dt);
	const __m512i *wr[8];
	const float *xr[16];
	__m512 acc[8][16];
	const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);

#pragma GCC unroll 8
	for (int i = 0; i < R; i++) {
		wr[i] = (const __m512i *)(wp + (size_t)i * ps);
#pragma GCC unroll 16
		for (int j = 0; j < TT; j++)
			acc[i][j] = _mm512_setzero_ps();
	}
#pragma GCC unroll 16
	for (int j = 0; j < TT; j++)
		xr[j] = x[t + j];
	if (dt == RO_F8E4M3) {
		/* (AVX-512 without VBMI: Skylake-SP, Cascade Lake) four inputs a word, byte b
		 * moved to the top by a shift (none for b = 3), widened by f8x16; x is x' */
		const __m512 s120 = _mm512_set1_ps(0x1p120f);

		for (uint32_t k = 0; k < K; k += 4) {
			__m512i d[8];

#pragma GCC unroll 8
			for (int i = 0; i < R; i++) {
				d[i] = _mm512_loadu_si512(wr[i] + k / 4);
				_mm_prefetch((const char *)(wr[i] + k / 4) + 1024, _MM_HINT_T0);
				pf_ask(pf, pfo + (size_t)i * ps + k / 4 * 64);
			}
#pragma GCC unroll 4
			for (int bb = 0; bb < 4; bb++) {
				__m512 wv[8];

#pragma GCC unroll 8
				for (int i = 0; i < R; i++)
					wv[i] = f8x16(bb == 3 ? d[i]
							      : _mm512_slli_epi32(d[i], 8 * (3 - bb)),
						      s120);
#pragma GCC unroll 16
				for (int j = 0; j < TT; j++) {
					const __m512 xb = _mm512_set1_ps(xr[j][k + bb]);

#pragma GCC unroll 8
					for (int i = 0; i < R; i++)
						acc[i][j] = _mm512_fmadd_ps(wv[i], xb, acc[i][j]);
				}
			}
		}
	} else {
		for (uint32_t k = 0; k < K; k += 2) {
			__m512 we[8], wo[8];

#pragma GCC unroll 8
			for (int i = 0; i < R; i++) {
				const __m512i d = _mm512_loadu_si512(wr[i] + k / 2);

				/* each panel is one stream: a line per step, 8 KiB ahead over
				 * the R streams (1 KiB each for 8; 2 KiB for the 4 of 3-5 tokens:
				 * 5% faster at 32 tokens on a 64-expert layer; 16 KiB loses 5%) */
				_mm_prefetch((const char *)(wr[i] + k / 2) + PF_AHEAD512 / R,
					     _MM_HINT_T0);
				pf_ask(pf, pfo + (size_t)i * ps + k / 2 * 64);
				we[i] = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
				wo[i] = _mm512_castsi512_ps(_mm512_and_si512(d, hi));
			}
#pragma GCC unroll 16
			for (int j = 0; j < TT; j++) {
				const __m512 xb = _mm512_set1_ps(xr[j][k]);

#pragma GCC unroll 8
				for (int i = 0; i < R; i++)
					acc[i][j] = _mm512_fmadd_ps(we[i], xb, acc[i][j]);
			}
#pragma GCC unroll 16
			for (int j = 0; j < TT; j++) {
				const __m512 xb = _mm512_set1_ps(xr[j][k + 1]);

#pragma GCC unroll 8
				for (int i = 0; i < R; i++)
					acc[i][j] = _mm512_fmadd_ps(wo[i], xb, acc[i][j]);
			}
		}
	}
#pragma GCC unroll 8
	for (int i = 0; i < R; i++) {
		const uint32_t b = a + (uint32_t)i * 16, lo = r0 > b ? r0 - b : 0,
			       end = r1 < b + 16 ? r1 - b : 16;
		const __mmask16 mk = (__mmask16)((0xffffu >> (16 - end + lo)) << lo);

#pragma GCC unroll 16
		for (int j = 0; j < TT; j++)
			_mm512_mask_storeu_ps(y[t + j] + b, mk, acc[i][j]);
	}
}

/* n panels at wp (the first's first row a) for tokens [t, t + TT): R at a time, then
 * fewer. */
INLINE AVX512 void panels512(const struct ro_mat *W, const uint8_t *wp, uint32_t a, uint32_t n,
			     const float *const *x, uint32_t t, float *const *y, uint32_t r0,
			     uint32_t r1, const int R, const int TT, const enum ro_dtype dt)
{
	const size_t ps = panel_bytes_of(W->cols, dt);
	const uint8_t *nx = pf_next;
	uint32_t p = 0;

	for (; p + R <= n; p += R)
		pblock(W, wp + p * ps, a + p * 16, x, t, y, r0, r1, R, TT, dt, nx, p * ps);
	for (; p + 2 <= n; p += 2)
		pblock(W, wp + p * ps, a + p * 16, x, t, y, r0, r1, 2, TT, dt, nx, p * ps);
	for (; p < n; p++)
		pblock(W, wp + p * ps, a + p * 16, x, t, y, r0, r1, 1, TT, dt, nx, p * ps);
}

/* An FP8 tail of 1-7 tokens, each shape a function of its own: inlined beside every other
 * shape into gemm_panel512, the same code ran 12-35% slower (its register allocation and
 * layout shared one giant function; one core, one 256 x 1,024 matrix, in L2 and streamed:
 * 4 tokens 18.5 -> 14.5 us and 19.2 -> 17.0, 6 tokens 27.9 -> 18.5 and 26.3 -> 22.8). */
/* (f8_tail_8 is the bulk: 2 panels x 8 tokens) */
#define F8_TAIL(R, TT)                                                                          \
	static AVX512 __attribute__((noinline)) void f8_tail_##TT(                              \
	    const struct ro_mat *W, const uint8_t *wp, uint32_t a, uint32_t n,                  \
	    const float *const *x, uint32_t t, float *const *y, uint32_t r0, uint32_t r1)       \
	{                                                                                       \
		panels512(W, wp, a, n, x, t, y, r0, r1, R, TT, RO_F8E4M3);                      \
	}
/* R panels a block for TT tokens: the fastest of 2-8 in that measure; at one token 8
 * streams (all 16 layers' experts for one token, top-8: 3.18 -> 2.80 ms against 4) */
F8_TAIL(8, 1)
F8_TAIL(4, 2)
F8_TAIL(4, 3)
F8_TAIL(4, 4)
F8_TAIL(4, 5)
F8_TAIL(3, 6)
F8_TAIL(3, 7)
F8_TAIL(2, 8)
#undef F8_TAIL

/* Tokens [0, T) over n panels: the block shapes. BF16: 2 x 12 for the bulk (24
 * accumulators, each load feeds 24 FMAs), past 12 tokens in passes of near-equal size. FP8
 * decodes 4 operations per 16 weights and keeps its block scales and constants in
 * registers: 2 x 8 (in L2 on a Zen 5 core: 171-180 GFLOP/s, 78-83% of the FMA peak; 1 x 16,
 * 2 x 10 and 2 x 12 spill and run at 63-159). */
/* FP8: n panels of one 128-row block (its first row a) for tokens [0, T), 8 at a time, each
 * pass's inputs scaled first (f8_scale_x into xsb, pointed to from xsp[0, T)) */
static AVX512 void tokens_f8(const struct ro_mat *W, const uint8_t *wp, uint32_t a, uint32_t n,
			     const float *const *x, uint32_t T, float *const *y, uint32_t r0,
			     uint32_t r1, float *xsb, const float **xsp)
{
	typedef void tail_fn(const struct ro_mat *, const uint8_t *, uint32_t, uint32_t,
			     const float *const *, uint32_t, float *const *, uint32_t, uint32_t);
	static tail_fn *const fn[9] = {NULL,	  f8_tail_1, f8_tail_2, f8_tail_3, f8_tail_4,
				       f8_tail_5, f8_tail_6, f8_tail_7, f8_tail_8};
	const float *const *xs = xsp;
	const uint8_t *nx = pf_next;

	/* the next group asked for in the second pass of 8 tokens, or the only one */
	for (uint32_t t = 0; t < T; t += 8) {
		const uint32_t m = T - t < 8 ? T - t : 8;

		f8_scale_x(W, a, x, t, m, xsb, xsp);
		pf_next = t == 8 || T <= 8 ? nx : NULL;
		fn[m](W, wp, a, n, xs, t, y, r0, r1);
	}
}

/* BF16: n panels (the first's first row a) for tokens [0, T). For FP8 converted to bf16
 * (xsb not NULL), each pass first scales its tokens' inputs from xs_src by Ws's scales into
 * xsb, pointed to from x = xsp. */
INLINE AVX512 void tokens512(const struct ro_mat *W, const uint8_t *wp, uint32_t a, uint32_t n,
			     const float *const *x, uint32_t T, float *const *y, uint32_t r0,
			     uint32_t r1, const struct ro_mat *Ws, const float *const *xs_src,
			     float *xsb, const float **xsp)
{
	const enum ro_dtype dt = RO_BF16;
	uint32_t t = 0;

#define PASS512(R, TT)                                                                           \
	do {                                                                                     \
		if (xsb)                                                                         \
			f8_scale_x(Ws, a, xs_src, t, TT, xsb, xsp);                              \
		panels512(W, wp, a, n, x, t, y, r0, r1, R, TT, dt);                              \
	} while (0)

	if (T >= 12) {
		/* ceil(T / 12) passes of near-equal size, 6 to 12 tokens each (16 = 8 + 8, not
		 * 12 + a pass of 4 whose weight loads feed 4 FMAs each): the expert layer at
		 * batch 128 (~16 rows an expert) 79.9 -> 74.7 ms, 322 -> 345 GFLOP/s */
		const uint32_t passes = (T + 11) / 12;

		const uint8_t *nx = pf_next;

		for (uint32_t p = 0; p < passes; p++) {
			const uint32_t m = (T - t) / (passes - p);

			pf_next = p == 1 ? nx : NULL; /* the second pass asks for them */

			switch (m) {
			case 12:
				PASS512(2, 12);
				break;
			case 11:
				PASS512(2, 11);
				break;
			case 10:
				PASS512(2, 10);
				break;
			case 9:
				PASS512(3, 9);
				break;
			case 8:
				PASS512(3, 8);
				break;
			case 7:
				PASS512(3, 7);
				break;
			default: /* 6: T = 13's first pass */
				PASS512(3, 6);
				break;
			}
			t += m;
		}
		return;
	}
	if (T - t >= 8) {
		PASS512(3, 8);
		t += 8;
	}
	switch (T - t) {
	case 7:
		PASS512(3, 7);
		break;
	case 6:
		PASS512(3, 6);
		break;
	case 5:
		PASS512(4, 5);
		break;
	case 4:
		PASS512(4, 4);
		break;
	case 3:
		PASS512(4, 3);
		break;
	case 2:
		PASS512(6, 2);
		break;
	case 1:
		/* decode: 8 streams, 8 independent chains (the FMA's latency x 2) */
		PASS512(8, 1);
		break;
	}
#undef PASS512
}

/* Row-major panel p of W (es-byte elements) into dst in panels (rows past the matrix as
 * zeros): 16 rows x 16 words (64 bytes) transposed in registers at a time, the tail by the
 * word (rows are a whole number of words). */
static AVX512 void pack_panel(const struct ro_mat *W, uint32_t p, size_t es, uint8_t *dst)
{
	const size_t RB = W->cols * es;
	const uint32_t a = p * 16, n = W->rows - a < 16 ? W->rows - a : 16;
	const uint8_t *src = (const uint8_t *)W->w + a * RB;
	size_t b = 0;

	for (; b + 64 <= RB; b += 64) {
		__m512i r[16], t[16], u[16];
		__m512i *o = (__m512i *)(dst + b * 16);

		for (int i = 0; i < 16; i++)
			r[i] = (uint32_t)i < n ? _mm512_loadu_si512(src + i * RB + b)
					       : _mm512_setzero_si512();
		for (int i = 0; i < 16; i += 2) {
			t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
			t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
		}
		for (int i = 0; i < 16; i += 4) { /* per 128-bit lane L: u[i + m] = word 4L + m of
						     rows i..i+3 */
			u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
			u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
			u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
			u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
		}
		for (int m = 0; m < 4; m++) {
			const __m512i v = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88),
				      w = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd),
				      v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88),
				      w2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);

			_mm512_storeu_si512(o + m, _mm512_shuffle_i32x4(v, v2, 0x88));
			_mm512_storeu_si512(o + 4 + m, _mm512_shuffle_i32x4(w, w2, 0x88));
			_mm512_storeu_si512(o + 8 + m, _mm512_shuffle_i32x4(v, v2, 0xdd));
			_mm512_storeu_si512(o + 12 + m, _mm512_shuffle_i32x4(w, w2, 0xdd));
		}
	}
	for (; b < RB; b += 4)
		for (uint32_t i = 0; i < 16; i++) {
			if (i < n)
				memcpy(dst + b * 16 + i * 4, src + i * RB + b, 4);
			else
				memset(dst + b * 16 + i * 4, 0, 4);
		}
}

/* Without the memory for the kernel's scratch: the same FMA chains an element at a time
 * (fmaf rounds once, as a lane of the vector FMA; FP8 on the inputs times the block's
 * scale, as f8_scale_x). */
static AVX512 void gemm_panel_elem(const struct ro_mat *W, const float *const *x, uint32_t T,
				   float *const *y, uint32_t r0, uint32_t r1)
{
	const bool f8 = W->dtype == RO_F8E4M3;

	for (uint32_t r = r0; r < r1; r++)
		for (uint32_t t = 0; t < T; t++) {
			float acc = 0;

			for (uint32_t k = 0; k < W->cols; k++)
				acc = f8 ? fmaf(ro_f8e4m3_to_f32(
						    ((const uint8_t *)W->w)[w_index(W, r, k)]),
						x[t][k] * w_scale(W, r, k), acc)
					 : fmaf(w_at(W, r, k), x[t][k], acc);
			y[t][r] = acc;
		}
}

static AVX512 void gemm_panel512(const struct ro_mat *W, const float *const *x, uint32_t T,
				 float *const *y, uint32_t r0, uint32_t r1)
{
	const bool f8 = W->dtype == RO_F8E4M3, via = f8 && T >= ro_f8_via_bf16;
	const size_t ps = panel_bytes(W), K = W->cols;
	const uint32_t p0 = r0 / 16, p1 = (r1 + 15) / 16;
	/* bf16: groups of 12 panels (one token: 16, for its 8 streams); FP8: of one 128-row
	 * block (8 panels) at most, all on the same scaled inputs */
	uint32_t G = f8 ? RO_FP8_BLOCK / 16 : T == 1 ? 16 : PANEL_G;
	/* scratch: per panel of a group, its row-major packing and (via) its bf16; per call,
	 * FP8's scaled inputs (12 tokens) and their pointers */
	const size_t pp = (W->panel ? 0 : ps) + (via ? panel_bytes_of(W->cols, RO_BF16) : 0),
		     fixed = f8 ? (size_t)12 * K * sizeof(float) + (size_t)T * sizeof(float *) : 0;
	size_t pack, cvt;
	uint8_t *buf = NULL;
	float *xsb = NULL;
	const float **xsp = NULL;
	struct ro_mat Wb;

	if (!W->panel && p1 - p0 < G)
		G = p1 - p0;
	if (pp || fixed) {
		buf = ro_thread_scratch(G * pp + fixed);
		if (!buf && pp) /* one panel at a time */
			buf = ro_thread_scratch((G = 1) * pp + fixed);
		if (!buf) {
			gemm_panel_elem(W, x, T, y, r0, r1);
			return;
		}
	}
	pack = W->panel ? 0 : G * ps;
	cvt = via ? G * panel_bytes_of(W->cols, RO_BF16) : 0;
	if (f8) {
		xsb = (float *)(buf + pack + cvt);
		xsp = (const float **)(xsb + (size_t)12 * K);
	}
	Wb = *W;
	Wb.dtype = RO_BF16;
	Wb.scale = NULL;
	Wb.panel = true;
	pf_shift = via;
	for (uint32_t pb = p0; pb < p1;) {
		/* (FP8: never past the end of the 128-row block) */
		const uint32_t blk = (pb / 8 + 1) * 8, g = f8 && blk < pb + G ? blk : pb + G,
			       n = (g < p1 ? g : p1) - pb;
		const uint8_t *wp = (const uint8_t *)W->w + pb * ps;

		if (pack) {
			for (uint32_t i = 0; i < n; i++)
				pack_panel(W, pb + i, f8 ? 1 : 2, buf + i * ps);
			wp = buf;
		}
		/* the next group's panels (the next matrix's first, after the last) asked for
		 * during this group's second pass over the tokens (tokens512 picks the pass;
		 * pf_next is NULL outside this call) */
		if (!pack && pb + n < p1) {
			const uint32_t nn = p1 - (pb + n) < G ? p1 - (pb + n) : G;

			pf_next = (const uint8_t *)W->w + (pb + n) * ps;
			pf_bytes = nn * ps;
		} else if (!pack && pf_after && pf_after->panel) {
			const uint32_t ap = (pf_after->rows + 15) / 16;

			pf_next = pf_after->w;
			pf_bytes = (ap < G ? ap : G) * panel_bytes(pf_after);
		}
		if (via) {
			uint8_t *bp = buf + pack;

			if (f8_vbmi)
				f8_to_bf16_vbmi(wp, bp, n * ps);
			else
				f8_to_bf16_plain(wp, bp, n * ps);
			tokens512(&Wb, bp, pb * 16, n, xsp, T, y, r0, r1, W, x, xsb, xsp);
		} else if (f8) {
			tokens_f8(W, wp, pb * 16, n, x, T, y, r0, r1, xsb, xsp);
		} else {
			tokens512(W, wp, pb * 16, n, x, T, y, r0, r1, NULL, NULL, NULL, NULL);
		}
		pf_next = NULL;
		pb += n;
	}
	pf_shift = 0;
}
#endif

/* The panel kernel runs W: it is in panels, or BF16 (FP8) with cols a multiple of 2 (4)
 * under AVX-512, and with AMX where AMX does not fit it (one choice per matrix, the same
 * whether the weights are in panels or row-major: batch invariance, and the same bits
 * however the weights were loaded). */
static bool panel_cols_fit(const struct ro_mat *W)
{
	return (W->dtype == RO_BF16 && W->cols % 2 == 0) ||
	       (W->dtype == RO_F8E4M3 && W->cols % 4 == 0);
}

#if HAVE_X86
/* (x86 only: elsewhere every matrix, in panels or not, runs the portable kernel) */
static bool panel_runs(const struct ro_mat *W)
{
	/* with AMX, a row-major matrix it does not fit runs the panel kernel too: its bits
	 * are then those of its panelled copy, however the weights were loaded */
	return W->panel ||
	       (kern_get() >= 2 && panel_cols_fit(W) && !(kern_get() == 3 && ro_amx_fits(W)));
}
#endif

bool ro_panel_wanted(const struct ro_mat *W)
{
	/* (with AMX too: it runs the panels of inputs a multiple of 32 as B tiles, amx.c) */
	return kern_get() >= 2 && !W->panel && W->rows && W->rows % 16 == 0 && W->cols &&
	       panel_cols_fit(W);
}

void ro_panel_pack(const void *src, uint32_t rows, uint32_t cols, size_t es, void *dst)
{
	const size_t RB = cols * es;

#if HAVE_X86
	/* panels are wanted only where AVX-512 runs: the kernels' own transposer */
	if (cpu_has_avx512()) {
		const struct ro_mat W = {.w = src, .rows = rows, .cols = cols};

		for (uint32_t p = 0; p < rows / 16; p++)
			pack_panel(&W, p, es, (uint8_t *)dst + p * 16 * RB);
		return;
	}
#endif
	for (uint32_t p = 0; p < rows / 16; p++)
		for (size_t b = 0; b < RB; b += 4)
			for (uint32_t i = 0; i < 16; i++)
				memcpy((uint8_t *)dst + p * 16 * RB + b * 16 + i * 4,
				       (const uint8_t *)src + (p * 16 + i) * RB + b, 4);
}

uint64_t ro_panel_index(uint64_t i, uint32_t cols, size_t es)
{
	const uint64_t per = 4 / es, ps = 16ull * cols, p = i / ps, in = i % ps;
	const uint64_t q = in / (16 * per), rem = in % (16 * per);

	return (p * 16 + rem / per) * cols + q * per + rem % per;
}

void ro_gemm_ptrs(const struct ro_mat *W, const float *const *x, uint32_t T, float *const *y,
		  uint32_t r0, uint32_t r1)
{
#if HAVE_X86
	if (panel_runs(W)) {
		/* (AVX-512 or AMX at load, or forced to the portable path since: w_at reads
		 * panels). A panel AMX fits always runs there (batch invariance); only a failed
		 * allocation of its packing buffer falls back. */
		if (kern_get() == 3 && ro_amx_panel_fits(W) && !ro_gemm_amx(W, x, T, y, r0, r1))
			return;
		if (kern_get() >= 2)
			gemm_panel512(W, x, T, y, r0, r1);
		else
			gemm_scalar(W, x, T, y, r0, r1);
		return;
	}
	switch (kern_get()) {
	case 3:
		/* a matrix AMX fits always runs there (batch invariance); only a failed
		 * allocation of the packing buffer falls back */
		if (ro_amx_fits(W) && !ro_gemm_amx(W, x, T, y, r0, r1))
			return;
		/* fall through */
	case 2:
		gemm_avx512(W, x, T, y, r0, r1);
		return;
	case 1:
		gemm_avx2(W, x, T, y, r0, r1);
		return;
	}
#endif
	gemm_scalar(W, x, T, y, r0, r1);
}

void ro_gemm_ptrs2(const struct ro_mat *W1, const struct ro_mat *W2, const float *const *x,
		   uint32_t T, float *const *y1, float *const *y2, uint32_t r0, uint32_t r1)
{
	if (kern_get() == 3 &&
	    ((ro_amx_fits(W1) && ro_amx_fits(W2)) ||
	     (ro_amx_panel_fits(W1) && ro_amx_panel_fits(W2))) &&
	    W1->cols == W2->cols && W1->rows == W2->rows && W1->dtype == W2->dtype &&
	    !ro_gemm_amx2(W1, W2, x, T, y1, y2, r0, r1))
		return;
	const struct ro_mat *after = pf_after;

	pf_after = W2;
	ro_gemm_ptrs(W1, x, T, y1, r0, r1);
	pf_after = after;
	ro_gemm_ptrs(W2, x, T, y2, r0, r1);
}

/* Strided rows as pointers, GEMM_TOK tokens at a time (the pointers on the stack): a token
 * block's W rows are read once per GEMM_TOK tokens, which is every token at decode. */
#define GEMM_TOK 256

void ro_gemm_rows(const struct ro_mat *W, const float *x, uint32_t T, float *y, uint32_t ldy,
		  uint32_t r0, uint32_t r1)
{
	const float *xp[GEMM_TOK];
	float *yp[GEMM_TOK];

	for (uint32_t t0 = 0; t0 < T; t0 += GEMM_TOK) {
		const uint32_t n = T - t0 < GEMM_TOK ? T - t0 : GEMM_TOK;

		for (uint32_t t = 0; t < n; t++) {
			xp[t] = x + (size_t)(t0 + t) * W->cols;
			yp[t] = y + (size_t)(t0 + t) * ldy;
		}
		ro_gemm_ptrs(W, xp, n, yp, r0, r1);
	}
}
