/* ep_bench: expert-parallel dispatch and combine between W real processes (W = 2, 4) over
 * libfabric shm and tcp-on-lo, at DeepEP's standard shapes scaled to this machine:
 *   low-latency  hidden 7168, top-8, 256 experts, 128 tokens per rank (decode)
 *   throughput   hidden 2048, top-8,  64 experts, 4096 tokens per rank (prefill)
 * bf16 payloads both ways, as DeepEP's benchmarks. In the same run, the baselines:
 *   MPI_Alltoallv  the same exchange (same rows, same bytes) through Debian's OpenMPI,
 *                  over shared memory for the shm rows and TCP on lo for the tcp rows
 *   dense          every token to every rank over the same libfabric endpoints
 *   8 KB round     one 8 KB message from every rank to every rank (the latency floor),
 *                  against which the low-latency exchange of one token per rank (decode
 *                  at batch 1, combine_sum) is put
 *   memcpy         one core's copy bandwidth (the ceiling of a shared-memory transfer)
 * Times are the slowest rank's median ("pack": the part of dispatch spent on the layout and
 * the bf16 packing, the mean over ranks); GB/s counts logical bytes as DeepEP does: rows this
 * rank sends x hidden x 2 bytes (dispatch), (token, expert) outputs it returns (combine).
 *   ep_bench [--quick] [--only low-latency|throughput] [--prov shm|tcp] [--iters N]
 *   (--quick: fewer iterations, W = 2 only) */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/model.h"
#include "tests/bench/ep_routing.h"

struct cfg {
	const char *mode_name;
	enum ro_ep_mode mode;
	uint32_t H, K, E, T, iters;
};

struct res {
	double d_us, c_us, d_bytes, c_bytes, pack_us;
};

#define NRES 5
static char rdv[64];
static char mpi_bin[512];

static double now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static void die(const char *what, const char *msg)
{
	fprintf(stderr, "ep_bench: %s: %s\n", what, msg);
	_exit(1);
}

/* Rendezvous through files: each rank writes its card, then reads everyone's. */
static struct ro_ep *join(const char *provider, const char *tag, uint32_t rank, uint32_t W,
			  uint32_t H, uint32_t K, uint32_t E, uint32_t T, enum ro_ep_dtype dt,
			  enum ro_ep_mode mode, bool sum)
{
	struct ro_ep_opts o;
	struct ro_ep *ep;
	uint8_t card[RO_EP_CARD_MAX], all[64][RO_EP_CARD_MAX];
	const void *cards[64];
	size_t len, lens[64];
	char err[256], path[160], tmp[170];
	FILE *f;

	ro_ep_opts_default(&o);
	o.provider = provider;
	o.rank = rank;
	o.world = W;
	o.hidden = H;
	o.top_k = K;
	o.experts = E;
	o.max_tokens = T;
	o.ll_tokens = T;
	o.mode = mode;
	o.dispatch_dtype = o.combine_dtype = dt;
	o.timeout_ms = 60000;
	o.combine_sum = sum;
	if (ro_ep_new(&o, &ep, err, sizeof(err)))
		die("ro_ep_new", err);
	if (ro_ep_card(ep, card, &len))
		die("card", ro_ep_errmsg(ep));
	(void)snprintf(path, sizeof(path), "%s/%s.%u", rdv, tag, rank);
	(void)snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	f = fopen(tmp, "wb");
	if (!f || fwrite(card, 1, len, f) != len || fclose(f) || rename(tmp, path))
		die("card file", strerror(errno));
	for (uint32_t r = 0; r < W; r++) {
		(void)snprintf(path, sizeof(path), "%s/%s.%u", rdv, tag, r);
		for (int i = 0; !(f = fopen(path, "rb")); i++) {
			if (i > 60000)
				die("rendezvous", path);
			usleep(1000);
		}
		lens[r] = fread(all[r], 1, sizeof(all[r]), f);
		(void)fclose(f);
		cards[r] = all[r];
	}
	if (ro_ep_connect(ep, cards, lens))
		die("connect", ro_ep_errmsg(ep));
	ro_ep_set_mode(ep, mode);
	return ep;
}

/* iters timed exchanges (after 3 warm-up ones), each started together (a group round). */
static struct res measure(struct ro_ep *ep, const float *x, const int32_t *ids, const float *w,
			  uint32_t T, uint32_t H, uint32_t iters)
{
	double *td = malloc(iters * sizeof(double)), *tc = malloc(iters * sizeof(double));
	float *out = malloc((size_t)T * 8 * H * sizeof(float) + (size_t)T * 64 * H * 4);
	struct ro_ep_stats s0, s1;
	struct res r;

	ro_ep_stats(ep, &s0);
	for (uint32_t it = 0; it < iters + 3; it++) {
		const struct ro_ep_batch *b;
		double t0, t1, t2;

		if (ro_ep_round_end(ep, NULL, NULL))
			die("round", ro_ep_errmsg(ep));
		if (it == 3)
			ro_ep_stats(ep, &s0);
		t0 = now_us();
		if (ro_ep_dispatch(ep, it % 32, x, ids, w, T, &b))
			die("dispatch", ro_ep_errmsg(ep));
		t1 = now_us();
		(void)ro_ep_combine_buffer(ep); /* the experts would write here */
		if (ro_ep_combine(ep, out))
			die("combine", ro_ep_errmsg(ep));
		t2 = now_us();
		if (it >= 3) {
			td[it - 3] = t1 - t0;
			tc[it - 3] = t2 - t1;
		}
	}
	ro_ep_stats(ep, &s1);
	qsort(td, iters, sizeof(double), cmp_d);
	qsort(tc, iters, sizeof(double), cmp_d);
	r.d_us = td[iters / 2];
	r.c_us = tc[iters / 2];
	r.d_bytes = (double)(s1.dispatch_bytes - s0.dispatch_bytes) / iters;
	r.c_bytes = (double)(s1.combine_bytes - s0.combine_bytes) / iters;
	r.pack_us = (s1.pack_ms - s0.pack_ms) * 1e3 / iters;
	free(td);
	free(tc);
	free(out);
	return r;
}

/* One rank: the routed exchange (exact combine, then combine_sum), the dense one, and
 * (low-latency) the 8 KB round. */
static void rank_main(const char *prov, const struct cfg *c, uint32_t rank, uint32_t W, int fd)
{
	const uint32_t T = c->T, H = c->H, KK = c->K > W ? c->K : W;
	float *x = malloc((size_t)T * H * sizeof(float)), *w = malloc((size_t)T * KK * 4);
	int32_t *ids = malloc((size_t)T * KK * sizeof(int32_t));
	struct res out[NRES] = {0};
	struct ro_ep *ep;
	char tag[64];

	for (size_t i = 0; i < (size_t)T * H; i++)
		x[i] = (float)(epb_mix(i + rank) % 1000) / 100.0f;
	for (size_t i = 0; i < (size_t)T * KK; i++)
		w[i] = 1.0f / (float)c->K;
	epb_routing(rank, T, c->K, c->E, ids);
	for (int sum = 0; sum < 2; sum++) {
		(void)snprintf(tag, sizeof(tag), "%s-%s-%u-routed%d", prov, c->mode_name, W, sum);
		ep = join(prov, tag, rank, W, H, c->K, c->E, T, RO_EP_BF16, c->mode, sum);
		out[sum] = measure(ep, x, ids, w, T, H, c->iters);
		(void)ro_ep_free(ep);
	}
	/* dense: every token to every rank */
	for (uint32_t t = 0; t < T; t++)
		for (uint32_t j = 0; j < W; j++)
			ids[(size_t)t * W + j] = (int32_t)j;
	(void)snprintf(tag, sizeof(tag), "%s-%s-%u-dense", prov, c->mode_name, W);
	ep = join(prov, tag, rank, W, H, W, W, T, RO_EP_BF16, c->mode, false);
	out[2] = measure(ep, x, ids, NULL, T, H, c->iters);
	(void)ro_ep_free(ep);
	if (c->mode == RO_EP_LOW_LATENCY) {
		/* one 8 KB message to every rank: 2048 f32 */
		(void)snprintf(tag, sizeof(tag), "%s-%u-8k", prov, W);
		ep = join(prov, tag, rank, W, 2048, W, W, 1, RO_EP_F32, RO_EP_LOW_LATENCY, false);
		out[3] = measure(ep, x, ids, NULL, 1, 2048, c->iters * 2);
		(void)ro_ep_free(ep);
		/* decode at batch 1: one token per rank, the routed exchange with combine_sum */
		epb_routing(rank, 1, c->K, c->E, ids);
		(void)snprintf(tag, sizeof(tag), "%s-%u-one", prov, W);
		ep =
		    join(prov, tag, rank, W, H, c->K, c->E, 1, RO_EP_BF16, RO_EP_LOW_LATENCY, true);
		out[4] = measure(ep, x, ids, w, 1, H, c->iters * 2);
		(void)ro_ep_free(ep);
	}
	if (write(fd, out, sizeof(out)) != (ssize_t)sizeof(out))
		_exit(1);
	free(x);
	free(w);
	free(ids);
	_exit(0);
}

static int run(const char *prov, const struct cfg *c, uint32_t W, struct res agg[NRES])
{
	int fds[2];
	pid_t pid[8];
	int rc = 0;

	if (pipe(fds))
		return -errno;
	memset(agg, 0, NRES * sizeof(*agg));
	for (uint32_t r = 0; r < W; r++) {
		pid[r] = fork();
		if (!pid[r]) {
			(void)close(fds[0]);
			rank_main(prov, c, r, W, fds[1]);
		}
	}
	(void)close(fds[1]);
	for (uint32_t r = 0; r < W; r++) {
		struct res one[NRES];

		if (read(fds[0], one, sizeof(one)) != (ssize_t)sizeof(one)) {
			rc = -EIO;
			break;
		}
		for (int k = 0; k < NRES; k++) {
			if (one[k].d_us > agg[k].d_us)
				agg[k].d_us = one[k].d_us;
			if (one[k].c_us > agg[k].c_us)
				agg[k].c_us = one[k].c_us;
			agg[k].pack_us += one[k].pack_us / W;
			agg[k].d_bytes += one[k].d_bytes / W;
			agg[k].c_bytes += one[k].c_bytes / W;
		}
	}
	(void)close(fds[0]);
	for (uint32_t r = 0; r < W; r++) {
		int st;

		(void)waitpid(pid[r], &st, 0);
		if (!WIFEXITED(st) || WEXITSTATUS(st))
			rc = -EIO;
	}
	return rc;
}

/* The MPI baseline, under mpirun, bound to this host: over shared memory (vader) for the
 * shm rows, over TCP on lo for the tcp rows. */
static bool run_mpi(const struct cfg *c, uint32_t W, const char *variant, const char *btl,
		    double *d_us, double *c_us)
{
	char cmd[1024], line[256];
	const char *self = getenv("RO_EP_MPI") ? getenv("RO_EP_MPI") : mpi_bin;
	FILE *p;
	bool ok = false;

	if (!self || !*self || access(self, X_OK))
		return false;
	(void)snprintf(cmd, sizeof(cmd),
		       "mpirun --allow-run-as-root --oversubscribe -np %u --bind-to none "
		       "--mca btl self,%s --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo "
		       "%s %u %u %u %u %u %s 2>/dev/null",
		       W, btl, self, c->H, c->K, c->E, c->T, c->iters, variant);
	p = popen(cmd, "r");
	if (!p)
		return false;
	while (fgets(line, sizeof(line), p))
		if (sscanf(line, "mpi dispatch_us %lf combine_us %lf", d_us, c_us) == 2)
			ok = true;
	return pclose(p) == 0 && ok;
}

static double memcpy_gbs(void)
{
	const size_t n = 256u << 20;
	char *a = malloc(n), *b = malloc(n);
	double best = 0;

	memset(a, 1, n);
	memset(b, 2, n);
	for (int i = 0; i < 5; i++) {
		double t0 = now_us(), s;

		memcpy(b, a, n);
		s = (now_us() - t0) / 1e6;
		if (n / s / 1e9 > best)
			best = n / s / 1e9;
	}
	free(a);
	free(b);
	return best;
}

int main(int argc, char **argv)
{
	bool quick = false;
	const char *only = NULL, *prov_only = NULL;
	uint32_t iters = 0;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--quick"))
			quick = true;
		else if (!strcmp(argv[i], "--only") && i + 1 < argc)
			only = argv[++i];
		else if (!strcmp(argv[i], "--prov") && i + 1 < argc)
			prov_only = argv[++i];
		else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
			iters = (uint32_t)atoi(argv[++i]);
		else {
			fprintf(stderr, "usage: ep_bench [--quick] [--only low-latency|throughput] "
					"[--prov shm|tcp] [--iters N]\n");
			return 2;
		}
	}
	struct cfg cfgs[] = {
	    {"low-latency", RO_EP_LOW_LATENCY, 7168, 8, 256, 128, quick ? 10 : 50},
	    {"throughput", RO_EP_THROUGHPUT, 2048, 8, 64, 4096, quick ? 3 : 8},
	};
	const char *provs[] = {"shm", "tcp"};
	double mem = memcpy_gbs();

	{
		const char *slash = strrchr(argv[0], '/');

		/* the MPI baseline is built beside us (make bench, with OpenMPI installed) */
		(void)snprintf(mpi_bin, sizeof(mpi_bin), "%.*sep_mpi",
			       slash ? (int)(slash - argv[0] + 1) : 0, argv[0]);
	}
	setenv("FI_TCP_IFACE", "lo", 1);
	setenv("FI_SOCKETS_IFACE", "lo", 1);
	(void)snprintf(rdv, sizeof(rdv), "/tmp/ep-bench-XXXXXX");
	if (!mkdtemp(rdv))
		return 1;
	printf("ep_bench: memcpy ceiling %.1f GB/s (one core), %ld CPUs, MPI baseline %s\n", mem,
	       sysconf(_SC_NPROCESSORS_ONLN),
	       access(mpi_bin, X_OK) ? "not built (scripts/deps --bench; make bench)" : mpi_bin);
	printf("%-11s %-5s %-4s %-2s | %8s %6s %6s %8s %6s | %13s %9s | %6s %7s %7s | %s\n", "mode",
	       "comb", "prov", "W", "disp us", "pack", "GB/s", "comb us", "GB/s", "mpi disp/comb",
	       "dense d+c", "x mpi", "x mpi-k", "x dense", "goal");
	for (size_t ci = 0; ci < 2; ci++) {
		if (only && strcmp(only, cfgs[ci].mode_name))
			continue;
		if (iters)
			cfgs[ci].iters = iters;
		for (uint32_t W = 2; W <= (quick ? 2u : 4u); W += 2) {
			for (size_t pi = 0; pi < 2; pi++) {
				struct res a[NRES];
				double md[3] = {0}, mc[3] = {0};
				bool have_mpi[3];

				if (prov_only && strcmp(prov_only, provs[pi]))
					continue;
				/* MPI: the same rows as exact, as sum, and the generic per-expert
				 * copies, over the same kind of link */
				for (int v = 0; v < 3; v++)
					have_mpi[v] =
					    run_mpi(&cfgs[ci], W,
						    v == 0   ? ""
						    : v == 1 ? "sum"
							     : "dup",
						    pi == 0 ? "vader" : "tcp", &md[v], &mc[v]);
				if (run(provs[pi], &cfgs[ci], W, a)) {
					printf("%-11s %-5s %-4s %-2u | failed\n",
					       cfgs[ci].mode_name, "", provs[pi], W);
					continue;
				}
				for (int sum = 0; sum < 2; sum++) {
					const struct res *o = &a[sum];
					double ours = o->d_us + o->c_us;

					printf("%-11s %-5s %-4s %-2u | %8.0f %6.0f %6.2f %8.0f "
					       "%6.2f | ",
					       cfgs[ci].mode_name, sum ? "sum" : "exact", provs[pi],
					       W, o->d_us, o->pack_us, o->d_bytes / o->d_us / 1e3,
					       o->c_us, o->c_bytes / o->c_us / 1e3);
					if (have_mpi[sum])
						printf("%6.0f/%6.0f ", md[sum], mc[sum]);
					else
						printf("%13s ", "n/a");
					printf("%9.0f | ", a[2].d_us + a[2].c_us);
					if (have_mpi[sum])
						printf("%6.2f ", (md[sum] + mc[sum]) / ours);
					else
						printf("%6s ", "n/a");
					if (have_mpi[2])
						printf("%7.2f ", (md[2] + mc[2]) / ours);
					else
						printf("%7s ", "n/a");
					printf("%7.2f | ", (a[2].d_us + a[2].c_us) / ours);
					if (cfgs[ci].mode == RO_EP_THROUGHPUT)
						printf("dispatch %.0f%% of memcpy (>= 50%% on "
						       "shm), x mpi "
						       ">= 1.5\n",
						       o->d_bytes / o->d_us / 1e3 / mem * 100);
					else
						printf("8 KB round %.0f us; d+c at 1 token/rank "
						       "%.0f us "
						       "= %.1f x (< 2)\n",
						       a[3].d_us, a[4].d_us + a[4].c_us,
						       (a[4].d_us + a[4].c_us) / a[3].d_us);
				}
				fflush(stdout);
			}
		}
	}
	{
		char cmd[128];

		(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", rdv);
		(void)system(cmd);
	}
	printf("x mpi: MPI_Alltoallv moving the same rows; x mpi-k: MPI_Alltoallv the generic way, "
	       "a token once per selected expert;\nx dense: every token to every rank. Each is the "
	       "baseline's dispatch+combine time over ours (above 1: we are faster).\n");
	return 0;
}
