/* The sampler: greedy, temperature, top-k and top-p over one row of logits, with the
 * log-probability of the chosen token. Its randomness is a counter-based stream: the
 * uniform draw for (seed, unit, sample, position) is a pure function of those four, so a
 * sample resumed from a checkpointed prefix draws exactly what it would have drawn had it
 * never stopped, on any worker. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/model.h"

static uint64_t mix64(uint64_t x)
{
	/* splitmix64's finalizer: a bijection with full avalanche */
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebULL;
	x ^= x >> 31;
	return x;
}

uint64_t ro_sample_key(const char *unit_id)
{
	uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a */

	for (const unsigned char *p = (const unsigned char *)unit_id; *p; p++) {
		h ^= *p;
		h *= 0x100000001b3ULL;
	}
	return h;
}

static double uniform(uint64_t seed, uint64_t unit, uint32_t sample, uint32_t pos)
{
	uint64_t x = mix64(seed ^ 0x9e3779b97f4a7c15ULL);

	x = mix64(x ^ unit);
	x = mix64(x ^ ((uint64_t)sample << 32 | pos));
	return (double)(x >> 11) * 0x1.0p-53;
}

struct cand {
	double p;
	int32_t i;
};

static int by_p_desc(const void *a, const void *b)
{
	const struct cand *x = a, *y = b;

	if (x->p != y->p)
		return x->p > y->p ? -1 : 1;
	return x->i < y->i ? -1 : x->i > y->i;
}

/* The k largest into c[0..k), sorted: a min-heap of k over one pass. */
static uint32_t top_k_select(const double *p, uint32_t V, uint32_t k, struct cand *c)
{
	uint32_t n = 0;

	for (uint32_t i = 0; i < V; i++) {
		struct cand x = {p[i], (int32_t)i};

		if (n < k) {
			uint32_t j = n++;

			c[j] = x;
			while (j > 0 && by_p_desc(&c[(j - 1) / 2], &c[j]) < 0) {
				struct cand t = c[j];

				c[j] = c[(j - 1) / 2];
				c[(j - 1) / 2] = t;
				j = (j - 1) / 2;
			}
		} else if (by_p_desc(&x, &c[0]) < 0) {
			uint32_t j = 0;

			c[0] = x;
			for (;;) {
				uint32_t l = 2 * j + 1, r = l + 1, w = j;

				if (l < n && by_p_desc(&c[l], &c[w]) > 0)
					w = l;
				if (r < n && by_p_desc(&c[r], &c[w]) > 0)
					w = r;
				if (w == j)
					break;
				struct cand t = c[j];

				c[j] = c[w];
				c[w] = t;
				j = w;
			}
		}
	}
	qsort(c, n, sizeof(*c), by_p_desc);
	return n;
}

int32_t ro_sample(const float *logits, uint32_t V, const struct ro_sampling *s, uint64_t unit,
		  uint32_t sample, uint32_t pos, float *ret_logprob)
{
	const bool greedy = !(s->temperature > 0);
	const double temp = greedy ? 1.0 : s->temperature;
	double mx = -INFINITY, Z = 0, *p;
	int32_t tok = 0;

	for (uint32_t i = 0; i < V; i++) {
		if (!isfinite(logits[i]))
			return -EDOM; /* no token and no logprob can come of it */
		if (logits[i] > mx) {
			mx = logits[i];
			tok = (int32_t)i; /* greedy: the first of the largest */
		}
	}
	p = malloc(V * sizeof(*p));
	if (!p)
		return -ENOMEM;
	for (uint32_t i = 0; i < V; i++) {
		p[i] = exp(((double)logits[i] - mx) / temp);
		Z += p[i];
	}
	if (!greedy) {
		const bool filter = (s->top_k && s->top_k < V) || (s->top_p > 0 && s->top_p < 1);
		double u = uniform(s->seed, unit, sample, pos);

		if (!filter) {
			double target = u * Z, cum = 0;

			tok = -1;
			for (uint32_t i = 0; i < V && tok < 0; i++) {
				cum += p[i];
				if (cum > target)
					tok = (int32_t)i;
			}
			if (tok < 0) /* rounding left the draw past the end */
				for (uint32_t i = V; i-- > 0 && tok < 0;)
					if (p[i] > 0)
						tok = (int32_t)i;
		} else {
			uint32_t k = s->top_k && s->top_k < V ? s->top_k : V, n;
			struct cand *c = malloc(k * sizeof(*c));
			double mass = 0, kept = 0, cum = 0;

			if (!c) {
				free(p);
				return -ENOMEM;
			}
			if (k < V) {
				n = top_k_select(p, V, k, c);
			} else {
				for (uint32_t i = 0; i < V; i++)
					c[i] = (struct cand){p[i], (int32_t)i};
				qsort(c, V, sizeof(*c), by_p_desc);
				n = V;
			}
			for (uint32_t i = 0; i < n; i++)
				mass += c[i].p;
			/* nucleus: the smallest prefix whose mass reaches top_p (at least one) */
			if (s->top_p > 0 && s->top_p < 1) {
				uint32_t keep = 0;

				for (; keep < n && (keep == 0 || cum < s->top_p * mass); keep++)
					cum += c[keep].p;
				n = keep;
			}
			for (uint32_t i = 0; i < n; i++)
				kept += c[i].p;
			cum = 0;
			tok = c[n - 1].i;
			for (uint32_t i = 0; i < n; i++) {
				cum += c[i].p;
				if (cum > u * kept) {
					tok = c[i].i;
					break;
				}
			}
			free(c);
		}
	}
	if (ret_logprob)
		*ret_logprob = (float)(((double)logits[tok] - mx) / temp - log(Z));
	free(p);
	return tok;
}
