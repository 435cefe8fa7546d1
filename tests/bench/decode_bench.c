/* decode_bench: decode tokens/s at batch 1, 8, 32, 128 and prefill tokens/s on a generated
 * Qwen3-MoE of ~0.9B total / ~0.2B active parameters (16 layers, hidden 1024, 64 experts
 * top-8, expert FFN 256, vocab 32768, bf16), each beside the roofline floor measured in the
 * same run: the larger of (bytes of weights and KV touched per step / the machine's measured
 * copy bandwidth) and (FLOPs per step / the machine's measured FMA throughput).
 *
 *   decode_bench [--model DIR] [--steps N] [--threads N] [--batches 1,8,32,128] */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/model.h"

static double now(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- the machine ------------------------------------------------------------------------ */

struct bw_arg {
	char *src, *dst;
	size_t len;
	int reps;
};

static void *copy_thread(void *p)
{
	struct bw_arg *a = p;

	for (int i = 0; i < a->reps; i++)
		memcpy(a->dst, a->src, a->len);
	return NULL;
}

/* Bytes moved (read + written) per second by memcpy over all threads, best of 5. */
static double copy_bandwidth(uint32_t threads)
{
	const size_t per = 256u << 20;
	pthread_t th[64];
	struct bw_arg a[64];
	double best = 0;

	for (uint32_t t = 0; t < threads; t++) {
		a[t].src = malloc(per / threads);
		a[t].dst = malloc(per / threads);
		a[t].len = per / threads;
		a[t].reps = 2;
		memset(a[t].src, 1, a[t].len);
		memset(a[t].dst, 2, a[t].len);
	}
	for (int rep = 0; rep < 5; rep++) {
		double t0 = now(), s;

		for (uint32_t t = 0; t < threads; t++)
			pthread_create(&th[t], NULL, copy_thread, &a[t]);
		for (uint32_t t = 0; t < threads; t++)
			pthread_join(th[t], NULL);
		s = 2.0 * 2 * per / (now() - t0);
		best = s > best ? s : best;
	}
	for (uint32_t t = 0; t < threads; t++) {
		free(a[t].src);
		free(a[t].dst);
	}
	return best;
}

#if defined(__x86_64__)
/* Ten independent FMA chains in named registers: enough to cover the FMA latency on both
 * pipes, so this is the core's peak, not a dependency chain. */
__attribute__((target("avx2,fma"))) static void *fma_thread(void *p)
{
	long iters = *(long *)p;
	__m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
	__m256 a0 = _mm256_set1_ps(0), a1 = _mm256_set1_ps(1), a2 = _mm256_set1_ps(2),
	       a3 = _mm256_set1_ps(3), a4 = _mm256_set1_ps(4), a5 = _mm256_set1_ps(5),
	       a6 = _mm256_set1_ps(6), a7 = _mm256_set1_ps(7), a8 = _mm256_set1_ps(8),
	       a9 = _mm256_set1_ps(9);

	for (long k = 0; k < iters; k++) {
		a0 = _mm256_fmadd_ps(a0, x, y);
		a1 = _mm256_fmadd_ps(a1, x, y);
		a2 = _mm256_fmadd_ps(a2, x, y);
		a3 = _mm256_fmadd_ps(a3, x, y);
		a4 = _mm256_fmadd_ps(a4, x, y);
		a5 = _mm256_fmadd_ps(a5, x, y);
		a6 = _mm256_fmadd_ps(a6, x, y);
		a7 = _mm256_fmadd_ps(a7, x, y);
		a8 = _mm256_fmadd_ps(a8, x, y);
		a9 = _mm256_fmadd_ps(a9, x, y);
	}
	a0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
			   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
	a0 = _mm256_add_ps(a0, _mm256_add_ps(a8, a9));
	*(float *)p = a0[0]; /* keep the work */
	return NULL;
}
#endif

/* f32 FLOPs per second (an FMA is two) over all threads, best of 3. */
static double fma_throughput(uint32_t threads)
{
#if defined(__x86_64__)
	const long iters = 20000000;
	pthread_t th[64];
	long arg[64];
	double best = 0;

	for (int rep = 0; rep < 3; rep++) {
		double t0 = now(), f;

		for (uint32_t t = 0; t < threads; t++) {
			arg[t] = iters;
			pthread_create(&th[t], NULL, fma_thread, &arg[t]);
		}
		for (uint32_t t = 0; t < threads; t++)
			pthread_join(th[t], NULL);
		f = (double)threads * iters * 10 * 8 * 2 / (now() - t0);
		best = f > best ? f : best;
	}
	return best;
#else
	(void)threads;
	return 0;
#endif
}

/* ---- the model's work --------------------------------------------------------------------- */

struct shape {
	double attn_bytes, router_bytes, expert_bytes, head_bytes, embed_row_bytes;
	double attn_params, router_params, expert_params, head_params;
	uint32_t layers, heads, kv_row, head_dim, top_k;
};

static void shape_of(const struct ro_model_config *c, struct shape *s)
{
	const double H = c->hidden, qd = (double)c->heads * c->head_dim,
		     kvd = (double)c->kv_heads * c->head_dim;

	s->attn_params = H * qd * 2 + H * kvd * 2;
	s->router_params = H * c->experts;
	s->expert_params = 3.0 * H * c->expert_ffn;
	s->head_params = H * c->vocab;
	s->attn_bytes = s->attn_params * 2;
	s->router_bytes = s->router_params * 2;
	s->expert_bytes = s->expert_params * 2;
	s->head_bytes = s->head_params * 2;
	s->embed_row_bytes = H * 2;
	s->layers = c->layers;
	s->heads = c->heads;
	s->kv_row = c->kv_heads * c->head_dim;
	s->head_dim = c->head_dim;
	s->top_k = c->top_k;
}

/* Bytes and FLOPs of one forward of `tokens` tokens over contexts summing to ctx_sum
 * positions, that ran `experts` (layer, expert) pairs and produced `rows` logit rows. */
static void work(const struct shape *s, double tokens, double ctx_sum, double experts,
		 double rows, double *bytes, double *flops)
{
	*bytes = s->layers * (s->attn_bytes + s->router_bytes) + experts * s->expert_bytes +
		 s->head_bytes + tokens * s->embed_row_bytes +
		 /* the KV cache read by attention, written for the new tokens */
		 s->layers * (ctx_sum + tokens) * s->kv_row * 4.0 * 2;
	*flops = 2.0 * tokens *
		     (s->layers * (s->attn_params + s->router_params + s->top_k * s->expert_params)) +
		 2.0 * rows * s->head_params +
		 /* scores and the weighted sum of V, per head */
		 s->layers * 4.0 * ctx_sum * s->head_dim * s->heads;
}

static int ensure_model(const char *dir)
{
	struct ro_make_model_opts o;
	char p[4096], err[512];
	struct stat st;

	(void)snprintf(p, sizeof(p), "%s/config.json", dir);
	if (stat(p, &st) == 0)
		return 0;
	ro_make_model_defaults(&o);
	o.arch = RO_ARCH_QWEN3_MOE;
	o.layers = 16;
	o.hidden = 1024;
	o.heads = 16;
	o.kv_heads = 4;
	o.head_dim = 64;
	o.experts = 64;
	o.top_k = 8;
	o.expert_ffn = 256;
	o.vocab = 32768;
	o.dtype = "BF16";
	o.seed = 2026;
	(void)fprintf(stderr, "decode_bench: writing the model to %s ...\n", dir);
	if (ro_make_model(&o, dir, err, sizeof(err))) {
		(void)fprintf(stderr, "decode_bench: %s\n", err);
		return -1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"model", required_argument, NULL, 'm'},
	    {"steps", required_argument, NULL, 's'},
	    {"threads", required_argument, NULL, 't'},
	    {"batches", required_argument, NULL, 'b'},
	    {"prompt", required_argument, NULL, 'p'},
	    {0},
	};
	const char *dir = "/tmp/rolloutd-decode-bench-model";
	uint32_t steps = 8, threads = 0, batches[16] = {1, 8, 32, 128}, nb = 4, plen = 32;
	uint32_t prefill_len = 512;
	struct ro_model_opts mo = {0};
	struct ro_model *m;
	const struct ro_model_config *c;
	struct shape sh;
	char err[512];
	double bw, fl;
	uint64_t total, active;
	int ch;

	while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (ch == 'm') {
			dir = optarg;
		} else if (ch == 's') {
			steps = (uint32_t)atoi(optarg);
		} else if (ch == 't') {
			threads = (uint32_t)atoi(optarg);
		} else if (ch == 'p') {
			prefill_len = (uint32_t)atoi(optarg);
		} else if (ch == 'b') {
			char *s = optarg;

			nb = 0;
			while (*s && nb < 16) {
				batches[nb++] = (uint32_t)strtoul(s, &s, 10);
				if (*s == ',')
					s++;
			}
		} else {
			return 2;
		}
	}
	if (!steps || !nb || prefill_len < 2 || prefill_len > 8192)
		return 2;
	if (ensure_model(dir))
		return 1;
	mo.threads = threads;
	if (ro_model_load(dir, &mo, &m, err, sizeof(err))) {
		(void)fprintf(stderr, "decode_bench: %s\n", err);
		return 1;
	}
	c = ro_model_config(m);
	shape_of(c, &sh);
	ro_model_sizes(m, &total, &active);
	threads = ro_model_threads(m);
	(void)fprintf(stderr, "decode_bench: measuring the machine (%u threads) ...\n", threads);
	bw = copy_bandwidth(threads);
	fl = fma_throughput(threads);
	(void)printf("model: %s, %u layers, hidden %u, %u experts top-%u, expert FFN %u, vocab %u, "
		     "%s\n       %.2fB parameters in all, %.3fB touched per token; kernels %s, "
		     "%u threads\n",
		     dir, c->layers, c->hidden, c->experts, c->top_k, c->expert_ffn, c->vocab,
		     c->dtype, total / 2e9, active / 2e9, ro_model_kernels(m), threads);
	(void)printf("machine: memcpy %.1f GB/s (bytes read + written), FMA %.1f GFLOP/s (f32)\n\n",
		     bw / 1e9, fl / 1e9);
	(void)printf("%-22s %12s %12s %10s %10s %12s %9s  %s\n", "run", "tokens/s", "ms/step",
		     "GB/step", "GFLOP/step", "floor tok/s", "x floor", "bound");
	for (uint32_t bi = 0; bi < nb; bi++) {
		const uint32_t B = batches[bi], V = c->vocab;
		struct ro_seq **seq = calloc(B, sizeof(*seq));
		struct ro_fwd_item *it = calloc(B, sizeof(*it));
		int32_t *prompt = malloc(plen * sizeof(int32_t)), *tok = malloc(B * sizeof(int32_t));
		float *logits = malloc((size_t)B * V * sizeof(float));
		double t = 0, bytes = 0, flops = 0, b1, f1, floor_s;
		uint32_t ctx;

		for (uint32_t i = 0; i < B; i++) {
			for (uint32_t j = 0; j < plen; j++)
				prompt[j] = (int32_t)((i * 7919 + j * 104729) % V);
			ro_seq_new(m, plen + steps + 4, &seq[i]);
			it[i] = (struct ro_fwd_item){seq[i], prompt, plen, logits + (size_t)i * V, false};
			if (ro_model_forward(m, &it[i], 1))
				return 1;
		}
		for (uint32_t s = 0; s < steps + 1; s++) {
			double t0;

			for (uint32_t i = 0; i < B; i++) {
				tok[i] = ro_sample(logits + (size_t)i * V, V,
						   &(struct ro_sampling){.temperature = 1.0, .top_p = 1.0,
									 .seed = 1},
						   i, 0, s, NULL);
				it[i] = (struct ro_fwd_item){seq[i], &tok[i], 1,
							     logits + (size_t)i * V, false};
			}
			ctx = ro_seq_len(seq[0]);
			t0 = now();
			if (ro_model_forward(m, it, B))
				return 1;
			if (s == 0)
				continue; /* warm-up */
			t += now() - t0;
			work(&sh, B, (double)B * (ctx + 1), ro_model_last_experts(m), B, &b1, &f1);
			bytes += b1;
			flops += f1;
		}
		bytes /= steps;
		flops /= steps;
		t /= steps;
		floor_s = bytes / bw > flops / fl ? bytes / bw : flops / fl;
		{
			char name[32];

			(void)snprintf(name, sizeof(name), "decode, batch %u", B);
			(void)printf("%-22s %12.1f %12.2f %10.3f %10.2f %12.1f %9.2f  %s\n", name, B / t,
				     t * 1e3, bytes / 1e9, flops / 1e9, B / floor_s, t / floor_s,
				     bytes / bw > flops / fl ? "memory" : "compute");
		}
		for (uint32_t i = 0; i < B; i++)
			ro_seq_free(seq[i]);
		free(seq);
		free(it);
		free(prompt);
		free(tok);
		free(logits);
		fflush(stdout);
	}
	{
		struct ro_seq *s;
		int32_t *p = malloc(prefill_len * sizeof(int32_t));
		float *logits = malloc(c->vocab * sizeof(float));
		double best = 1e30, bytes = 0, flops = 0, floor_s;

		for (uint32_t j = 0; j < prefill_len; j++)
			p[j] = (int32_t)((j * 104729 + 17) % c->vocab);
		for (int rep = 0; rep < 3; rep++) {
			struct ro_fwd_item it;
			double t0;

			ro_seq_new(m, prefill_len, &s);
			it = (struct ro_fwd_item){s, p, prefill_len, logits, false};
			t0 = now();
			if (ro_model_forward(m, &it, 1))
				return 1;
			if (now() - t0 < best)
				best = now() - t0;
			ro_seq_free(s);
		}
		/* context sum of a causal prefill: 1 + 2 + ... + n */
		work(&sh, prefill_len, (double)prefill_len * (prefill_len + 1) / 2,
		     ro_model_last_experts(m), 1, &bytes, &flops);
		floor_s = bytes / bw > flops / fl ? bytes / bw : flops / fl;
		char name[32];

		(void)snprintf(name, sizeof(name), "prefill, %u tokens", prefill_len);
		(void)printf("%-22s %12.1f %12.2f %10.3f %10.2f %12.1f %9.2f  %s\n", name,
			     prefill_len / best, best * 1e3, bytes / 1e9, flops / 1e9,
			     prefill_len / floor_s, best / floor_s,
			     bytes / bw > flops / fl ? "memory" : "compute");
		free(p);
		free(logits);
	}
	(void)printf("\nx floor = measured time / floor time (1.00 is the machine's limit; goal "
		     "<= 2.00).\nfloor = max(bytes touched / memcpy bandwidth, FLOPs / FMA "
		     "throughput); bytes count the weights of the\nexperts the step really ran "
		     "(all 64 per layer from batch ~32 on), attention, router, head, KV.\n");
	ro_model_free(m);
	return 0;
}
