/* The matrix kernels (kernels/cpu/gemm.c, amx.c) on their own: every kernel the CPU has
 * (portable, AVX2, AVX-512, AMX-BF16), bf16 and FP8, against a float64 dot product, over shapes with
 * tails (rows not a multiple of 16, inputs not of 32, row ranges that start and end
 * anywhere) and token counts that take every tile width (1 to 70); and each token's output
 * bitwise the same whatever else is in the batch, where in the batch it is, and which row
 * range computed it: batch invariance rests on this. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/internal.h"
#include "kernels/model_internal.h"

static uint32_t rnd_state = 12345;

static uint32_t rnd(void)
{
	rnd_state = rnd_state * 1664525u + 1013904223u;
	return rnd_state >> 8;
}

/* a float in [-1, 1) */
static float frnd(void)
{
	return (float)rnd() / (float)(1u << 23) - 1.0f;
}

static uint16_t to_bf16(float f)
{
	uint32_t u;

	memcpy(&u, &f, 4);
	return (uint16_t)(u >> 16);
}

static float bf16_f(uint16_t b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;

	memcpy(&f, &u, 4);
	return f;
}

struct mat {
	struct ro_mat W;
	uint16_t *w;
	uint8_t *w8; /* FP8 instead (e4m3fn, every code but NaN, subnormals too) */
	float *scale;
	void *wp; /* W's copy in panels, once mat_panel made it */
	float **x, **y;
	uint32_t T;
};

/* a bf16 (fp8 false) or FP8 matrix, each 128 x 128 block of the latter with a scale of
 * its own, and T tokens' inputs */
static void mat_new_dt(struct mat *m, uint32_t rows, uint32_t cols, uint32_t T, bool fp8)
{
	m->w = NULL;
	m->w8 = NULL;
	m->scale = NULL;
	m->wp = NULL;
	if (fp8) {
		const uint32_t sr = (rows + 127) / 128, sc = (cols + 127) / 128;

		m->w8 = malloc((size_t)rows * cols);
		for (size_t i = 0; i < (size_t)rows * cols; i++) {
			m->w8[i] = (uint8_t)(rnd() & 0xff);
			if ((m->w8[i] & 0x7f) == 0x7f)
				m->w8[i] ^= 1;
		}
		m->scale = malloc((size_t)sr * sc * sizeof(float));
		for (uint32_t i = 0; i < sr * sc; i++)
			m->scale[i] = 1e-3f * (float)(1 + rnd() % 1000);
		m->W = (struct ro_mat){.w = m->w8,
				       .dtype = RO_F8E4M3,
				       .rows = rows,
				       .cols = cols,
				       .scale = m->scale,
				       .scale_cols = sc};
	} else {
		m->w = malloc((size_t)rows * cols * 2);
		for (size_t i = 0; i < (size_t)rows * cols; i++)
			m->w[i] = to_bf16(frnd());
		m->W = (struct ro_mat){.w = m->w, .dtype = RO_BF16, .rows = rows, .cols = cols};
	}
	m->T = T;
	m->x = malloc(T * sizeof(*m->x));
	m->y = malloc(T * sizeof(*m->y));
	for (uint32_t t = 0; t < T; t++) {
		m->x[t] = malloc(cols * sizeof(float));
		m->y[t] = malloc(rows * sizeof(float));
		for (uint32_t k = 0; k < cols; k++)
			m->x[t][k] = frnd() * (t % 3 == 1 ? 1e3f : 1.0f);
		for (uint32_t r = 0; r < rows; r++)
			m->y[t][r] = NAN;
	}
}

static void mat_new(struct mat *m, uint32_t rows, uint32_t cols, uint32_t T)
{
	mat_new_dt(m, rows, cols, T, false);
}

/* W[r][k] exactly: bf16, or FP8 times its block's scale (4 + 24 significant bits: exact in
 * a double) */
static double mat_w(const struct mat *m, uint32_t r, uint32_t k)
{
	const size_t i = (size_t)r * m->W.cols + k;

	if (m->w8)
		return (double)ro_f8e4m3_to_f32(m->w8[i]) *
		       m->scale[(r / 128) * m->W.scale_cols + k / 128];
	return bf16_f(m->w[i]);
}

static void mat_free(struct mat *m)
{
	for (uint32_t t = 0; t < m->T; t++) {
		free(m->x[t]);
		free(m->y[t]);
	}
	free(m->x);
	free(m->y);
	free(m->w);
	free(m->w8);
	free(m->scale);
	free(m->wp);
}

/* W in the loader's panels from here on (as the loader copies it where the AVX-512 or AMX
 * kernels run): false where its shape has none (rows not a multiple of 16) */
static bool mat_panel(struct mat *m)
{
	const size_t es = m->w8 ? 1 : 2;

	if (m->W.rows % 16 || m->W.cols % (m->w8 ? 4 : 2))
		return false;
	m->wp = malloc((size_t)m->W.rows * m->W.cols * es);
	ro_panel_pack(m->w8 ? (const void *)m->w8 : (const void *)m->w, m->W.rows, m->W.cols, es,
		      m->wp);
	m->W.w = m->wp;
	m->W.panel = true;
	return true;
}

/* y against float64, relative to the sum of |products| (the scale f32 rounding works at) */
static void check_exact(const struct mat *m, uint32_t r0, uint32_t r1, const char *what)
{
	for (uint32_t t = 0; t < m->T; t++)
		for (uint32_t r = r0; r < r1; r++) {
			double s = 0, mag = 0;

			for (uint32_t k = 0; k < m->W.cols; k++) {
				double p = mat_w(m, r, k) * m->x[t][k];

				s += p;
				mag += fabs(p);
			}
			cr_assert(
			    fabs(m->y[t][r] - s) <= 2e-5 * mag + 1e-30,
			    "%s %s %s %ux%u T=%u: token %u row %u: %.9g, float64 %.9g (scale %g)",
			    ro_kernels_name(), m->w8 ? "fp8" : "bf16", what, m->W.rows, m->W.cols, m->T, t, r, m->y[t][r],
			    s, mag);
		}
}

static const char *const caps[] = {"scalar", "avx2", "avx512", "none"};

/* RO_KERNELS=cap, then the kernels re-read it; false when that is not what runs */
static bool use(const char *cap)
{
	static const char *const want[] = {"scalar", "avx2+fma", "avx512+fma",
					   "amx-bf16+avx512+fma"};

	cr_assert_eq(setenv("RO_KERNELS", cap, 1), 0);
	ro_kernels_force_scalar(false);
	for (size_t i = 0; i < 4; i++)
		if (!strcmp(cap, caps[i]))
			return !strcmp(ro_kernels_name(), want[i]);
	if (!strcmp(cap, "avx512-novbmi")) /* AVX-512 without the VBMI byte tables */
		return !strcmp(ro_kernels_name(), want[2]);
	return false;
}

/* rows [r0, r1) of m into y (all NaN first): right, and nothing outside written */
static void run_range(struct mat *m, uint32_t r0, uint32_t r1)
{
	const uint32_t R = m->W.rows;

	for (uint32_t t = 0; t < m->T; t++)
		for (uint32_t r = 0; r < R; r++)
			m->y[t][r] = NAN;
	ro_gemm_ptrs(&m->W, (const float *const *)m->x, m->T, m->y, r0, r1);
	check_exact(m, r0, r1, "rows");
	for (uint32_t t = 0; t < m->T; t++) {
		for (uint32_t r = 0; r < r0; r++)
			cr_assert(isnan(m->y[t][r]), "%s %ux%u T=%u [%u, %u): row %u written",
				  ro_kernels_name(), R, m->W.cols, m->T, r0, r1, r);
		for (uint32_t r = r1; r < R; r++)
			cr_assert(isnan(m->y[t][r]), "%s %ux%u T=%u [%u, %u): row %u written",
				  ro_kernels_name(), R, m->W.cols, m->T, r0, r1, r);
	}
}

Test(gemm, every_kernel_matches_float64)
{
	/* (FP8: 160 and 288 end in part of a 128-input block, 96 and 160 in half a pair of
	 * chunks; 257 rows, a partial 16-row tile astride a 128-row block) */
	static const uint32_t shapes[][2] = {{16, 32},	 {40, 64},   {7, 96},	 {64, 1024},
					     {257, 256}, {33, 40},   {100, 288}, {144, 160},
					     {272, 96}};
	/* every tile width, and past one AMX pass (256 tokens) */
	static const uint32_t Ts[] = {1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 33, 70, 257, 300};
	int ran = 0;

	for (size_t c = 0; c < 4; c++) {
		if (!use(caps[c]))
			continue;
		ran++;
		for (size_t s = 0; s < 2 * sizeof(shapes) / sizeof(shapes[0]); s++)
			for (size_t i = 0; i < sizeof(Ts) / sizeof(Ts[0]); i++) {
				struct mat m;
				const size_t sh = s % (sizeof(shapes) / sizeof(shapes[0]));
				const uint32_t R = shapes[sh][0];

				if (Ts[i] > 100 && shapes[sh][1] > 256)
					continue; /* (the float64 check's time) */
				/* bf16, then FP8 */
				mat_new_dt(&m, R, shapes[sh][1], Ts[i], s != sh);
				/* most rows; then ranges of fewer than 16 at the end and inside,
				 * whose tiles must start before them and store none of those */
				for (int pan = 0; pan < 2; pan++) {
					/* row-major, then in panels where the shape has them */
					if (pan && !mat_panel(&m))
						break;
					run_range(&m, R > 20 ? 3 : 0, R > 20 ? R - 2 : R);
					run_range(&m, R > 5 ? R - 5 : 0, R);
					run_range(&m, R / 2, R / 2 + 1);
					if (R >= 34)
						run_range(&m, 17, 34);
				}
				mat_free(&m);
			}
	}
	cr_assert_geq(ran, 1);
	cr_assert_eq(unsetenv("RO_KERNELS"), 0);
	ro_kernels_force_scalar(false);
}

/* One token's output, bitwise: alone; at every position of batches of every size; from
 * row ranges cut anywhere; and through ro_gemm_ptrs2 (gate and up on shared inputs). */
Test(gemm, a_token_is_bitwise_the_same_in_any_batch)
{
	static const uint32_t shapes[][2] = {{64, 1024}, {48, 64}, {21, 32}, {256, 96}, {272, 384}};
	int ran = 0;

	for (size_t c = 0; c < 4; c++) {
		if (!use(caps[c]))
			continue;
		ran++;
		for (size_t s = 0; s < 4 * sizeof(shapes) / sizeof(shapes[0]); s++) {
			const size_t ns = sizeof(shapes) / sizeof(shapes[0]), sh = s % ns;
			const uint32_t R = shapes[sh][0], K = shapes[sh][1], T = 70;
			/* bf16, FP8; then both in panels */
			const bool fp8 = (s / ns) & 1, pan = s / ns >= 2;
			struct mat m, u;
			float *alone = malloc(R * sizeof(float));
			float *one = malloc(R * sizeof(float));
			float **y2 = malloc(T * sizeof(*y2));

			mat_new_dt(&m, R, K, T, fp8);
			mat_new_dt(&u, R, K, 1, fp8);
			if (pan && (!mat_panel(&m) || !mat_panel(&u))) {
				mat_free(&m);
				mat_free(&u);
				free(alone);
				free(one);
				free(y2);
				continue;
			}
			for (uint32_t t = 0; t < T; t++)
				y2[t] = malloc(R * sizeof(float));
			for (uint32_t t = 0; t < T; t += 5) {
				/* token t alone */
				const float *xt = m.x[t];

				ro_gemm_ptrs(&m.W, &xt, 1, &one, 0, R);
				memcpy(alone, one, R * sizeof(float));
				/* in batches of every size that hold it, at its own place */
				for (uint32_t n = t + 1; n <= T; n += 7) {
					ro_gemm_ptrs(&m.W, (const float *const *)m.x, n, m.y, 0, R);
					cr_assert_eq(memcmp(m.y[t], alone, R * sizeof(float)), 0,
						     "%s %s%s %ux%u: token %u in a batch of %u differs",
						     ro_kernels_name(), fp8 ? "fp8" : "bf16",
						     pan ? " panels" : "", R, K, t, n);
				}
				/* rows in ranges cut at odd places */
				for (uint32_t r0 = 0; r0 < R;) {
					uint32_t r1 = r0 + 1 + rnd() % 37;

					r1 = r1 < R ? r1 : R;
					ro_gemm_ptrs(&m.W, (const float *const *)m.x + t, 1, &one,
						     r0, r1);
					r0 = r1;
				}
				cr_assert_eq(memcmp(one, alone, R * sizeof(float)), 0,
					     "%s %s%s %ux%u: token %u by row ranges differs",
					     ro_kernels_name(), fp8 ? "fp8" : "bf16",
					     pan ? " panels" : "", R, K, t);
			}
			/* two matrices on shared inputs: each bitwise its own call */
			ro_gemm_ptrs(&m.W, (const float *const *)m.x, T, m.y, 0, R);
			{
				float **yu = malloc(T * sizeof(*yu));
				float **y1 = malloc(T * sizeof(*y1));

				for (uint32_t t = 0; t < T; t++) {
					yu[t] = malloc(R * sizeof(float));
					y1[t] = malloc(R * sizeof(float));
				}
				ro_gemm_ptrs(&u.W, (const float *const *)m.x, T, yu, 0, R);
				ro_gemm_ptrs2(&m.W, &u.W, (const float *const *)m.x, T, y1, y2, 0,
					      R);
				for (uint32_t t = 0; t < T; t++) {
					cr_assert_eq(memcmp(y1[t], m.y[t], R * sizeof(float)), 0);
					cr_assert_eq(memcmp(y2[t], yu[t], R * sizeof(float)), 0);
					free(yu[t]);
					free(y1[t]);
				}
				free(yu);
				free(y1);
			}
			for (uint32_t t = 0; t < T; t++)
				free(y2[t]);
			free(y2);
			free(alone);
			free(one);
			mat_free(&m);
			mat_free(&u);
		}
	}
	cr_assert_geq(ran, 1);
	cr_assert_eq(unsetenv("RO_KERNELS"), 0);
	ro_kernels_force_scalar(false);
}

/* Past one pass of 256 tokens (AMX packs a call's tokens 256 at a time): a token in the
 * second pass is bitwise itself alone, bf16 and FP8, row-major and in panels. */
Test(gemm, a_token_past_one_pass_is_itself_alone)
{
	static const uint32_t picks[] = {0, 15, 255, 256, 271, 299};
	const uint32_t R = 272, K = 96, T = 300;
	int ran = 0;

	for (size_t c = 0; c < 4; c++) {
		if (!use(caps[c]))
			continue;
		ran++;
		for (int v = 0; v < 4; v++) {
			struct mat m;
			float *one = malloc(R * sizeof(float));

			mat_new_dt(&m, R, K, T, v & 1);
			if (v >= 2)
				cr_assert(mat_panel(&m));
			ro_gemm_ptrs(&m.W, (const float *const *)m.x, T, m.y, 0, R);
			for (size_t i = 0; i < sizeof(picks) / sizeof(picks[0]); i++) {
				const float *xt = m.x[picks[i]];

				ro_gemm_ptrs(&m.W, &xt, 1, &one, 0, R);
				cr_assert_eq(memcmp(one, m.y[picks[i]], R * sizeof(float)), 0,
					     "%s %s%s: token %u of %u differs from itself alone",
					     ro_kernels_name(), v & 1 ? "fp8" : "bf16",
					     v >= 2 ? " panels" : "", picks[i], T);
			}
			free(one);
			mat_free(&m);
		}
	}
	cr_assert_geq(ran, 1);
	cr_assert_eq(unsetenv("RO_KERNELS"), 0);
	ro_kernels_force_scalar(false);
}

/* The AVX-512 BF16 kernel's contract: each output element is one FMA chain in k order
 * (acc = w[k] x[k] + acc from 0), bitwise, whether the weights are row-major (packed into
 * panels a group at a time) or in the loader's panels (ro_panel_pack), for any rows (a
 * partial last panel), inputs (tails past 32) and row range; the portable path reads
 * panels too; ro_panel_index is the packing's inverse. */
Test(gemm, panels_are_fma_chains_in_k_order)
{
	static const uint32_t shapes[][2] = {{16, 32},	{48, 40},   {7, 96},  {64, 1024},
					     {257, 256}, {100, 288}, {32, 2}, {1024, 66}};
	static const uint32_t Ts[] = {1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 16, 23, 25, 37, 40};

	if (!use("avx512")) {
		cr_log_info("no AVX-512: the panel kernel does not run here");
		cr_assert_eq(unsetenv("RO_KERNELS"), 0);
		ro_kernels_force_scalar(false);
		return;
	}
	for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
		for (size_t i = 0; i < sizeof(Ts) / sizeof(Ts[0]); i++) {
			const uint32_t R = shapes[s][0], K = shapes[s][1], T = Ts[i];
			const uint32_t r0 = R > 20 ? 3 : 0, r1 = R > 20 ? R - 2 : R;
			struct mat m;
			uint16_t *pw = NULL;

			mat_new(&m, R, K, T);
			run_range(&m, r0, r1); /* right, nothing outside written */
			for (uint32_t t = 0; t < T; t++)
				for (uint32_t r = r0; r < r1; r++) {
					float acc = 0;

					for (uint32_t k = 0; k < K; k++)
						acc = fmaf(bf16_f(m.w[(size_t)r * K + k]), m.x[t][k],
							   acc);
					cr_assert(!memcmp(&acc, &m.y[t][r], sizeof(acc)),
						  "%ux%u T=%u: token %u row %u: %.9g, the chain %.9g",
						  R, K, T, t, r, m.y[t][r], acc);
				}
			if (R % 16 == 0) {
				struct ro_mat P = m.W;
				float **y0 = malloc(T * sizeof(*y0));

				pw = malloc((size_t)R * K * 2);
				ro_panel_pack(m.w, R, K, 2, pw);
				for (uint64_t e = 0; e < (uint64_t)R * K; e++)
					cr_assert_eq(pw[e], m.w[ro_panel_index(e, K, 2)]);
				for (uint32_t t = 0; t < T; t++) {
					y0[t] = m.y[t];
					m.y[t] = malloc(R * sizeof(float));
					for (uint32_t r = 0; r < R; r++)
						m.y[t][r] = NAN;
				}
				P.w = pw;
				P.panel = true;
				ro_gemm_ptrs(&P, (const float *const *)m.x, T, m.y, r0, r1);
				for (uint32_t t = 0; t < T; t++) {
					cr_assert_eq(memcmp(m.y[t] + r0, y0[t] + r0,
							    (r1 - r0) * sizeof(float)),
						     0, "%ux%u T=%u: token %u: panels differ", R, K,
						     T, t);
					for (uint32_t r = 0; r < R; r++)
						cr_assert(r >= r0 && r < r1 ? 1 : isnan(m.y[t][r]),
							  "%ux%u T=%u: row %u written", R, K, T, r);
				}
				/* forced portable: the same panels read element by element */
				ro_kernels_force_scalar(true);
				ro_gemm_ptrs(&P, (const float *const *)m.x, T, m.y, 0, R);
				ro_kernels_force_scalar(false);
				check_exact(&m, 0, R, "panels, portable");
				for (uint32_t t = 0; t < T; t++) {
					free(m.y[t]);
					m.y[t] = y0[t];
				}
				free(y0);
				free(pw);
			}
			mat_free(&m);
		}
	cr_assert_eq(unsetenv("RO_KERNELS"), 0);
	ro_kernels_force_scalar(false);
}

/* The same for FP8 (e4m3fn with a scale per 128 x 128 block): each element one FMA chain
 * in k order over the byte's value exactly and x times its block's scale (one rounding),
 * row-major or in panels, with shapes that cross 128-row and 128-input blocks and inputs
 * that leave a tail of words: by both of the panel kernel's routes at every T (the FP8
 * bytes widened on every pass; each 128-row block converted to bf16 first, through the
 * VBMI byte tables or, capped, without them). */
static void fp8_chains(const char *cap, uint32_t via)
{
	static const uint32_t shapes[][2] = {{16, 32},	{48, 40},  {7, 96},   {64, 1024},
					     {257, 256}, {144, 132}, {32, 4}, {272, 384}};
	static const uint32_t Ts[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 14, 15, 16, 17, 33};

	if (!use(cap)) {
		cr_log_info("no AVX-512: the panel kernel does not run here");
		cr_assert_eq(unsetenv("RO_KERNELS"), 0);
		ro_kernels_force_scalar(false);
		return;
	}
	ro_f8_via_bf16 = via;
	for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
		const uint32_t R = shapes[s][0], K = shapes[s][1], SR = (R + 127) / 128,
			       SC = (K + 127) / 128;
		uint8_t *w = malloc((size_t)R * K), *pw = malloc((size_t)R * K);
		float *scale = malloc((size_t)SR * SC * sizeof(float));

		for (size_t i = 0; i < (size_t)R * K; i++) {
			w[i] = (uint8_t)(rnd() & 0xff);
			if ((w[i] & 0x7f) == 0x7f) /* NaN in e4m3fn: not a weight */
				w[i] ^= 1;
		}
		for (uint32_t i = 0; i < SR * SC; i++)
			scale[i] = 1e-3f * (float)(1 + rnd() % 1000);
		if (s == 1)
			scale[0] = 300; /* 2^8 or more (the old widening's limit) */
		for (size_t i = 0; i < sizeof(Ts) / sizeof(Ts[0]); i++) {
			const uint32_t T = Ts[i], r0 = R > 20 ? 3 : 0, r1 = R > 20 ? R - 2 : R;
			struct ro_mat W = {.w = w, .dtype = RO_F8E4M3, .rows = R, .cols = K,
					   .scale = scale, .scale_cols = SC};
			float **x = malloc(T * sizeof(*x)), **y = malloc(T * sizeof(*y)),
			      **y2 = malloc(T * sizeof(*y2));

			for (uint32_t t = 0; t < T; t++) {
				x[t] = malloc(K * sizeof(float));
				y[t] = malloc(R * sizeof(float));
				y2[t] = malloc(R * sizeof(float));
				for (uint32_t k = 0; k < K; k++)
					x[t][k] = frnd();
				for (uint32_t r = 0; r < R; r++)
					y[t][r] = y2[t][r] = NAN;
			}
			ro_gemm_ptrs(&W, (const float *const *)x, T, y, r0, r1);
			for (uint32_t t = 0; t < T; t++)
				for (uint32_t r = 0; r < R; r++) {
					float acc = 0;

					if (r < r0 || r >= r1) {
						cr_assert(isnan(y[t][r]), "%ux%u: row %u written", R,
							  K, r);
						continue;
					}
					for (uint32_t k = 0; k < K; k++)
						acc = fmaf(ro_f8e4m3_to_f32(w[(size_t)r * K + k]),
							   x[t][k] * scale[(r / 128) * SC + k / 128],
							   acc);
					cr_assert(!memcmp(&acc, &y[t][r], sizeof(acc)),
						  "%s via %u: fp8 %ux%u T=%u: token %u row %u: %.9g, "
						  "the chain %.9g",
						  cap, via, R, K, T, t, r, y[t][r], acc);
				}
			if (R % 16 == 0) {
				struct ro_mat P = W;

				ro_panel_pack(w, R, K, 1, pw);
				for (uint64_t e = 0; e < (uint64_t)R * K; e++)
					cr_assert_eq(pw[e], w[ro_panel_index(e, K, 1)]);
				P.w = pw;
				P.panel = true;
				ro_gemm_ptrs(&P, (const float *const *)x, T, y2, r0, r1);
				for (uint32_t t = 0; t < T; t++)
					cr_assert_eq(memcmp(y2[t] + r0, y[t] + r0,
							    (r1 - r0) * sizeof(float)),
						     0, "fp8 %ux%u T=%u: token %u: panels differ", R,
						     K, T, t);
			}
			for (uint32_t t = 0; t < T; t++) {
				free(x[t]);
				free(y[t]);
				free(y2[t]);
			}
			free(x);
			free(y);
			free(y2);
		}
		free(w);
		free(pw);
		free(scale);
	}
	cr_assert_eq(unsetenv("RO_KERNELS"), 0);
	ro_kernels_force_scalar(false);
}

Test(gemm, fp8_panels_are_fma_chains_in_k_order)
{
	const uint32_t dflt = ro_f8_via_bf16;

	fp8_chains("avx512", UINT32_MAX); /* widened on every pass */
	fp8_chains("avx512", 1);	  /* converted to bf16 */
	fp8_chains("avx512-novbmi", 1);
	ro_f8_via_bf16 = dflt;
}

/* The elementwise steps beside the matrices: RMSNorm's sum of squares is the same bits in
 * its AVX-512 lanes as in the portable loop (an exact square, one rounding either way);
 * SwiGLU's result for an element does not depend on where in a call it falls (a masked
 * tail, not a scalar one). */
Test(gemm, norm_and_swiglu_bits)
{
	static const uint32_t ns[] = {64, 70, 1024, 5};
	float x[1024], w[1024], a[1024], b[1024], g[1024], u[1024], one[1024];

	for (uint32_t i = 0; i < 1024; i++) {
		x[i] = frnd() * (i % 7 == 3 ? 1e4f : 1.0f);
		w[i] = frnd();
		g[i] = frnd() * 20;
		u[i] = frnd();
	}
	for (size_t c = 0; c < sizeof(ns) / sizeof(ns[0]); c++) {
		const bool vec = use("avx512") || use("none");

		ro_rmsnorm(x, w, ns[c], 1e-6, a);
		(void)use("scalar");
		ro_rmsnorm(x, w, ns[c], 1e-6, b);
		cr_assert_eq(memcmp(a, b, ns[c] * sizeof(float)), 0, "rmsnorm of %u (vector: %d)",
			     ns[c], vec);
	}
	for (size_t c = 0; c < 4; c++) {
		if (!use(caps[c]))
			continue;
		memcpy(a, g, sizeof(g));
		ro_swiglu(a, u, 1000);
		for (uint32_t i = 0; i < 1000; i++) {
			one[i] = g[i];
			ro_swiglu(one + i, u + i, 1);
			cr_assert_eq(memcmp(&one[i], &a[i], sizeof(float)), 0,
				     "%s: swiglu element %u alone differs", ro_kernels_name(), i);
			cr_assert(fabsf(a[i] - g[i] / (1 + expf(-g[i])) * u[i]) <=
				      1e-6f * (fabsf(g[i] * u[i]) + 1e-30f),
				  "%s: swiglu element %u: %g", ro_kernels_name(), i, a[i]);
		}
	}
	cr_assert_eq(unsetenv("RO_KERNELS"), 0);
	ro_kernels_force_scalar(false);
}

/* The loader's panels and row-major weights in place (`weights-hugepages false`, an EP
 * rank's other experts) give the same bits wherever the AVX-512 kernels run, with AMX or
 * without: on AMX, the panels as B tiles and row-major tiles as A are the same products in
 * the same order; a shape AMX does not fit (inputs not a multiple of 32) runs the FMA panel
 * kernel either way, as it does without AMX. So a model's logits do not depend on how its
 * weights were loaded. */
Test(gemm, panels_are_the_row_major_bits)
{
	static const uint32_t shapes[][2] = {{64, 1024}, {144, 160}, {272, 96},
					     {32, 32},	 {32, 48},   {32, 200}, {16, 8320}};
	static const uint32_t Ts[] = {1, 3, 5, 16, 17, 40, 70};
	int ran = 0;

	for (size_t c = 2; c < 4; c++) {
		if (!use(caps[c]))
			continue;
		ran++;
		for (size_t s = 0; s < 2 * sizeof(shapes) / sizeof(shapes[0]); s++) {
			const size_t ns = sizeof(shapes) / sizeof(shapes[0]), sh = s % ns;
			const uint32_t R = shapes[sh][0], K = shapes[sh][1];

			for (size_t i = 0; i < sizeof(Ts) / sizeof(Ts[0]); i++) {
				struct mat m;
				float **yr = malloc(Ts[i] * sizeof(*yr));

				mat_new_dt(&m, R, K, Ts[i], s >= ns); /* bf16, then FP8 */
				for (uint32_t t = 0; t < Ts[i]; t++)
					yr[t] = malloc(R * sizeof(float));
				ro_gemm_ptrs(&m.W, (const float *const *)m.x, Ts[i], yr, 0, R);
				cr_assert(mat_panel(&m));
				ro_gemm_ptrs(&m.W, (const float *const *)m.x, Ts[i], m.y, 0, R);
				for (uint32_t t = 0; t < Ts[i]; t++) {
					cr_assert_eq(
					    memcmp(yr[t], m.y[t], R * sizeof(float)), 0,
					    "%s %s %ux%u T=%u: token %u: panels differ from row-major",
					    ro_kernels_name(), m.w8 ? "fp8" : "bf16", R, K, Ts[i], t);
					free(yr[t]);
				}
				free(yr);
				mat_free(&m);
			}
		}
	}
	if (!ran)
		cr_log_info("no AVX-512: the loader makes no panels here");
	cr_assert_eq(unsetenv("RO_KERNELS"), 0);
	ro_kernels_force_scalar(false);
}

/* The kernels this CPU runs, for the log: a machine with AMX must run it, for bf16 and
 * for FP8 with its block scales (the two tests above then check AMX's results). */
Test(gemm, amx_runs_where_the_cpu_has_it)
{
	struct mat b, f;

	ro_kernels_force_scalar(false);
	cr_log_info("kernels: %s", ro_kernels_name());
	if (ro_amx_available()) {
		cr_expect_str_eq(ro_kernels_name(), "amx-bf16+avx512+fma");
		mat_new_dt(&b, 64, 1024, 1, false);
		mat_new_dt(&f, 64, 1024, 1, true);
		cr_expect(ro_amx_fits(&b.W));
		cr_expect(ro_amx_fits(&f.W));
		f.W.scale = NULL;
		cr_expect(!ro_amx_fits(&f.W), "FP8 without its scales");
		f.W.scale = f.scale;
		/* the loader copies both into panels, which AMX runs as B tiles */
		cr_expect(ro_panel_wanted(&b.W));
		cr_expect(ro_panel_wanted(&f.W));
		cr_assert(mat_panel(&b) && mat_panel(&f));
		cr_expect(ro_amx_panel_fits(&b.W));
		cr_expect(ro_amx_panel_fits(&f.W));
		cr_expect(!ro_amx_fits(&f.W), "panels are not row-major tiles");
		mat_free(&b);
		mat_free(&f);
	} else
		cr_skip_test("no AMX-BF16 here (or the kernel did not grant it)");
}
