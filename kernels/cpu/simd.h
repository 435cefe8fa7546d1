/* AVX-512 helpers shared by the CPU kernels (x86-64 only; each function carries its own
 * target attribute, the files are built for the baseline ISA). */
#ifndef RO_KERNELS_CPU_SIMD_H
#define RO_KERNELS_CPU_SIMD_H

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx2,fma")))

/* exp(x), 16 lanes (attention's scores minus their running max, SwiGLU's -g): n = round(x / ln 2),
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

#endif
#endif
