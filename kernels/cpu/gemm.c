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
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "kernels/internal.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

static int use_avx2 = -1;

bool ro_cpu_has_avx2(void)
{
#if HAVE_X86
	__builtin_cpu_init();
	return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
	return false;
#endif
}

void ro_kernels_force_scalar(bool scalar)
{
	use_avx2 = scalar ? 0 : ro_cpu_has_avx2();
}

bool ro_kernels_avx2(void)
{
	if (use_avx2 < 0)
		use_avx2 = ro_cpu_has_avx2();
	return use_avx2;
}

const char *ro_kernels_name(void)
{
	if (use_avx2 < 0)
		use_avx2 = ro_cpu_has_avx2();
	return use_avx2 ? "avx2+fma" : "scalar";
}

/* ---- portable path --------------------------------------------------------------------- */

static inline float w_at(const void *w, enum ro_dtype dt, size_t i)
{
	return dt == RO_BF16 ? ro_bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
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
	const size_t base = (size_t)r * K;
	float acc[8] = {0};
	float s;

	for (size_t k = 0; k < K8; k += 8)
		for (int l = 0; l < 8; l++)
			acc[l] = acc[l] + w_at(W->w, W->dtype, base + k + l) * x[k + l];
	s = hsum8(acc);
	for (size_t k = K8; k < K; k++)
		s = s + w_at(W->w, W->dtype, base + k) * x[k];
	*out = s;
}

static void gemm_scalar(const struct ro_mat *W, const float *x, uint32_t T, float *y,
			uint32_t ldy, uint32_t r0, uint32_t r1)
{
	for (uint32_t r = r0; r < r1; r++)
		for (uint32_t t = 0; t < T; t++)
			dot_scalar(W, r, x + (size_t)t * W->cols, &y[(size_t)t * ldy + r]);
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
INLINE AVX2 void block(const struct ro_mat *W, uint32_t r, const float *x, uint32_t t,
		       float *y, uint32_t ldy, const int R, const int TT)
{
	const size_t K = W->cols, K8 = K & ~(size_t)7;
	const enum ro_dtype dt = W->dtype;
	const float *xr[4];
	const uint16_t *wb[4];
	const float *wf[4];
	__m256 acc[4][4];

#pragma GCC unroll 4
	for (int i = 0; i < R; i++) {
		wb[i] = (const uint16_t *)W->w + (size_t)(r + i) * K;
		wf[i] = (const float *)W->w + (size_t)(r + i) * K;
#pragma GCC unroll 4
		for (int j = 0; j < TT; j++)
			acc[i][j] = _mm256_setzero_ps();
	}
#pragma GCC unroll 4
	for (int j = 0; j < TT; j++)
		xr[j] = x + (size_t)(t + j) * K;
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
				s = s + w_at(W->w, dt, (size_t)(r + i) * K + k) * xr[j][k];
			y[(size_t)(t + j) * ldy + r + i] = s;
		}
	}
}

static AVX2 void gemm_avx2(const struct ro_mat *W, const float *x, uint32_t T, float *y,
			   uint32_t ldy, uint32_t r0, uint32_t r1)
{
	/* rows in blocks that stay in L2 while every token passes over them */
	const uint32_t RB = 32;

	for (uint32_t rb = r0; rb < r1; rb += RB) {
		uint32_t re = rb + RB < r1 ? rb + RB : r1;
		uint32_t t = 0;

		for (; t + 4 <= T; t += 4) {
			uint32_t r = rb;

			for (; r + 2 <= re; r += 2)
				block(W, r, x, t, y, ldy, 2, 4);
			for (; r < re; r++)
				block(W, r, x, t, y, ldy, 1, 4);
		}
		for (; t < T; t++) {
			uint32_t r = rb;

			for (; r + 4 <= re; r += 4)
				block(W, r, x, t, y, ldy, 4, 1);
			for (; r < re; r++)
				block(W, r, x, t, y, ldy, 1, 1);
		}
	}
}
#endif

void ro_gemm_rows(const struct ro_mat *W, const float *x, uint32_t T, float *y, uint32_t ldy,
		  uint32_t r0, uint32_t r1)
{
	if (use_avx2 < 0)
		use_avx2 = ro_cpu_has_avx2();
#if HAVE_X86
	if (use_avx2) {
		gemm_avx2(W, x, T, y, ldy, r0, r1);
		return;
	}
#endif
	gemm_scalar(W, x, T, y, ldy, r0, r1);
}
