/* The routing and token values both ep_bench and its MPI baseline (ep_mpi) use, so the
 * two move exactly the same exchange: top-k distinct experts per token, uniform. The EP
 * tests draw their routings with the same mixer. */
#pragma once

#include <stdint.h>

static inline uint64_t epb_mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* Top-k ids sorted ascending, as the model's router gives them. */
static inline void epb_sort_ids(int32_t *row, uint32_t K)
{
	for (uint32_t j = 1; j < K; j++)
		for (uint32_t i = j; i > 0 && row[i - 1] > row[i]; i--) {
			int32_t x = row[i];

			row[i] = row[i - 1];
			row[i - 1] = x;
		}
}

static inline void epb_routing(uint32_t rank, uint32_t T, uint32_t K, uint32_t E, int32_t *ids)
{
	for (uint32_t t = 0; t < T; t++) {
		int32_t *row = ids + (uint64_t)t * K;
		uint64_t s = epb_mix(((uint64_t)rank << 32) ^ t);
		uint32_t n = 0;

		while (n < K) {
			int32_t e;
			int dup = 0;

			s = epb_mix(s);
			e = (int32_t)(s % E);
			for (uint32_t i = 0; i < n; i++)
				dup |= row[i] == e;
			if (!dup)
				row[n++] = e;
		}
		epb_sort_ids(row, K);
	}
}
