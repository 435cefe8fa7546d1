/* ep_bench's baseline: the same dispatch/combine through MPI_Alltoall (counts) and
 * MPI_Alltoallv (rows), as a user without a MoE-specific transport would write it, with the
 * same packed rows ([K int16 expert ids | bf16 hidden]) and the same bytes as rolloutd's
 * throughput mode. Run by ep_bench under mpirun; prints one line from rank 0:
 *   mpi dispatch_us D combine_us C   (the slowest rank's median)
 * Combine ends, as rolloutd's, with each token's weighted sum. With a 6th argument "sum",
 * combine returns one row per (token, rank), as combine_sum; with "dup", a token goes once
 * per selected expert (the generic permute + all-to-all). Compiled -O3 (vectorized). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/bench/ep_routing.h"

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static uint16_t bf16(float f)
{
	union {
		float f;
		uint32_t u;
	} v = {.f = f};
	return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

int main(int argc, char **argv)
{
	int W, me;
	uint32_t H, K, E, T, iters;
	size_t meta, drow, crow;

	MPI_Init(&argc, &argv);
	MPI_Comm_size(MPI_COMM_WORLD, &W);
	MPI_Comm_rank(MPI_COMM_WORLD, &me);
	if (argc != 6 && argc != 7) {
		if (!me)
			fprintf(stderr, "usage: ep_mpi HIDDEN TOPK EXPERTS TOKENS ITERS\n");
		MPI_Finalize();
		return 2;
	}
	H = (uint32_t)atoi(argv[1]);
	K = (uint32_t)atoi(argv[2]);
	E = (uint32_t)atoi(argv[3]);
	T = (uint32_t)atoi(argv[4]);
	iters = (uint32_t)atoi(argv[5]);
	const int sum = argc == 7 && !strcmp(argv[6], "sum");
	/* "dup": the generic way (Megatron's all-to-all token dispatcher): a token goes once
	 * per selected expert, not once per rank */
	const int dup = argc == 7 && !strcmp(argv[6], "dup");
	meta = (K * 2 + 15) & ~(size_t)15;
	drow = meta + ((H * 2 + 15) & ~(size_t)15);
	crow = (size_t)H * 2;
	{
		float *x = malloc((size_t)T * H * sizeof(float));
		int32_t *ids = malloc((size_t)T * K * sizeof(int32_t));
		uint8_t *sbuf = malloc((size_t)T * K * drow);
		uint8_t *rbuf = malloc((size_t)W * T * K * drow);
		uint8_t *cs = malloc((size_t)W * T * K * crow), *cr = malloc((size_t)T * K * crow);
		float *out = malloc((size_t)T * H * sizeof(float));
		uint32_t *hp = malloc((size_t)T * K * sizeof(uint32_t));
		uint32_t *ht = malloc((size_t)T * K * sizeof(uint32_t));
		uint32_t *pos = malloc((size_t)T * K * sizeof(uint32_t));
		float *y = malloc((size_t)W * T * K * H * sizeof(float)), *acc = malloc(H * 4);
		const float wk = 1.0f / (float)K;
		int *scnt = calloc(W, sizeof(int)), *sdsp = calloc(W, sizeof(int)),
		    *rcnt = calloc(W, sizeof(int)), *rdsp = calloc(W, sizeof(int)),
		    *cnt2 = calloc(2 * W, sizeof(int)), *rcnt2 = calloc(2 * W, sizeof(int)),
		    *cscnt = calloc(W, sizeof(int)), *csdsp = calloc(W, sizeof(int)),
		    *crcnt = calloc(W, sizeof(int)), *crdsp = calloc(W, sizeof(int));
		double *td = malloc(iters * sizeof(double)), *tc = malloc(iters * sizeof(double));
		double md, mc, maxd, maxc;

		for (size_t i = 0; i < (size_t)T * H; i++)
			x[i] = (float)(epb_mix(i + me) % 1000) / 100.0f;
		epb_routing((uint32_t)me, T, K, E, ids);
		for (uint32_t it = 0; it < iters + 3; it++) {
			uint32_t rows[64] = {0}, pairs[64] = {0}, off[65] = {0}, poff[65] = {0},
				 cur[64] = {0}, pc[64] = {0};
			size_t rtot = 0, ptot = 0;
			double t0, t1, t2;

			MPI_Barrier(MPI_COMM_WORLD);
			t0 = MPI_Wtime();
			for (uint32_t t = 0; t < T; t++) {
				uint64_t m = 0;

				for (uint32_t j = 0; j < K; j++) {
					pairs[ids[t * K + j] % W]++;
					m |= 1ull << (ids[t * K + j] % W);
				}
				for (int d = 0; d < W; d++)
					rows[d] += (m >> d) & 1;
				if (dup)
					memcpy(rows, pairs, sizeof(rows));
			}
			for (int d = 0; d < W; d++) {
				off[d + 1] = off[d] + rows[d];
				poff[d + 1] = poff[d] + pairs[d];
			}
			for (uint32_t t = 0; t < T; t++) {
				uint8_t *row[64];
				uint32_t nk[64];
				uint64_t st = 0;

				for (uint32_t j = 0; j < K; j++) {
					int32_t e = ids[t * K + j];
					int d = e % W;

					if (dup || !((st >> d) & 1)) {
						st |= 1ull << d;
						ht[off[d] + cur[d]] = t;
						row[d] = sbuf + (size_t)(off[d] + cur[d]++) * drow;
						memset(row[d], 0xff, meta);
						nk[d] = 0;
						for (uint32_t k = 0; k < H; k++)
							((uint16_t *)(row[d] + meta))[k] =
							    bf16(x[(size_t)t * H + k]);
					}
					((int16_t *)row[d])[nk[d]++] = (int16_t)e;
					hp[poff[d] + pc[d]++] = t * K + j;
				}
			}
			for (int d = 0; d < W; d++) {
				cnt2[2 * d] = (int)rows[d];
				cnt2[2 * d + 1] = (int)pairs[d];
				scnt[d] = (int)(rows[d] * drow);
				sdsp[d] = (int)(off[d] * drow);
			}
			MPI_Alltoall(cnt2, 2, MPI_INT, rcnt2, 2, MPI_INT, MPI_COMM_WORLD);
			for (int s = 0; s < W; s++) {
				rcnt[s] = (int)(rcnt2[2 * s] * drow);
				rdsp[s] = (int)(rtot * drow);
				rtot += (size_t)rcnt2[2 * s];
			}
			MPI_Alltoallv(sbuf, scnt, sdsp, MPI_BYTE, rbuf, rcnt, rdsp, MPI_BYTE,
				      MPI_COMM_WORLD);
			t1 = MPI_Wtime();
			/* combine: each received pair's output (here: zeros) back to its home */
			for (int s = 0; s < W; s++) {
				int back = sum ? rcnt2[2 * s] : rcnt2[2 * s + 1];

				cscnt[s] = (int)(back * crow);
				csdsp[s] = (int)(ptot * crow);
				ptot += (size_t)back;
				crcnt[s] = (int)((sum ? rows[s] : pairs[s]) * crow);
				crdsp[s] = (int)((sum ? off[s] : poff[s]) * crow);
			}
			/* the experts' f32 outputs to bf16 rows, as rolloutd: one per (row,
			 * expert), or with sum the weighted sum of each row's experts */
			{
				size_t p = 0;

				for (size_t r = 0; r < rtot; r++) {
					const int16_t *m = (const int16_t *)(rbuf + r * drow);
					uint16_t *c = (uint16_t *)(cs + (sum ? r : p) * crow);

					if (sum) {
						memset(acc, 0, H * sizeof(float));
						for (uint32_t k = 0; k < K && m[k] >= 0; k++, p++)
							for (uint32_t d = 0; d < H; d++)
								acc[d] = acc[d] + wk * y[p * H + d];
						for (uint32_t d = 0; d < H; d++)
							c[d] = bf16(acc[d]);
					} else {
						for (uint32_t k = 0; k < K && m[k] >= 0; k++, p++) {
							c = (uint16_t *)(cs + p * crow);
							for (uint32_t d = 0; d < H; d++)
								c[d] = bf16(y[p * H + d]);
						}
					}
				}
			}
			MPI_Alltoallv(cs, cscnt, csdsp, MPI_BYTE, cr, crcnt, crdsp, MPI_BYTE,
				      MPI_COMM_WORLD);
			/* the output rolloutd's combine gives: each token's weighted sum */
			memset(out, 0, (size_t)T * H * sizeof(float));
			if (!sum)
				for (size_t p = 0; p < poff[W]; p++)
					pos[hp[p]] = (uint32_t)p;
			for (size_t p = 0; p < (sum ? off[W] : (size_t)T * K); p++) {
				const uint16_t *src =
				    (const uint16_t *)(cr + (sum ? p : pos[p]) * crow);
				float *dst = out + (size_t)(sum ? ht[p] : p / K) * H;
				const float wt = sum ? 1.0f : 1.0f / (float)K;

				for (uint32_t k = 0; k < H; k++) {
					union {
						uint32_t u;
						float f;
					} v = {.u = (uint32_t)src[k] << 16};
					dst[k] = dst[k] + wt * v.f;
				}
			}
			t2 = MPI_Wtime();
			if (it >= 3) {
				td[it - 3] = (t1 - t0) * 1e6;
				tc[it - 3] = (t2 - t1) * 1e6;
			}
		}
		qsort(td, iters, sizeof(double), cmp_d);
		qsort(tc, iters, sizeof(double), cmp_d);
		md = td[iters / 2];
		mc = tc[iters / 2];
		MPI_Reduce(&md, &maxd, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
		MPI_Reduce(&mc, &maxc, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
		if (!me)
			printf("mpi dispatch_us %.1f combine_us %.1f\n", maxd, maxc);
		free(x);
		free(ids);
		free(sbuf);
		free(rbuf);
		free(cs);
		free(cr);
		free(out);
		free(hp);
		free(ht);
		free(pos);
		free(y);
		free(acc);
		free(td);
		free(tc);
	}
	MPI_Finalize();
	return 0;
}
