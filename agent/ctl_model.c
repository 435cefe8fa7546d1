/* rolloutctl make-model and generate: write a random Qwen3-MoE or Mixtral model in Hugging
 * Face layout, and run a model with no queue (samples as JSON, and the raw float32 logits of
 * every prompt position for checking against other implementations). */
#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agent/ctl.h"
#include "kernels/model.h"

static bool num_u32(const char *s, uint32_t *ret)
{
	char *end;
	unsigned long long v;

	if (!s || !*s || *s == '-')
		return false;
	errno = 0;
	v = strtoull(s, &end, 0);
	if (errno || *end || v > UINT32_MAX)
		return false;
	*ret = (uint32_t)v;
	return true;
}

static bool num_u64(const char *s, uint64_t *ret)
{
	char *end;

	if (!s || !*s || *s == '-')
		return false;
	errno = 0;
	*ret = strtoull(s, &end, 0);
	return !errno && !*end;
}

static bool num_f(const char *s, double *ret)
{
	char *end;

	if (!s || !*s)
		return false;
	*ret = strtod(s, &end);
	return !*end && *ret == *ret;
}

/* "1,2,3" -> ids; false on anything else */
static bool id_list(const char *s, int32_t **ret, uint32_t *ret_n)
{
	uint32_t n = 0, cap = 16;
	int32_t *v = malloc(cap * sizeof(*v));

	if (!v)
		return false;
	while (s && *s) {
		char *end;
		long x;

		errno = 0;
		x = strtol(s, &end, 10);
		if (errno || end == s || x < 0 || x > INT32_MAX || (*end && *end != ',')) {
			free(v);
			return false;
		}
		if (n == cap) {
			int32_t *nv = realloc(v, (cap *= 2) * sizeof(*v));

			if (!nv) {
				free(v);
				return false;
			}
			v = nv;
		}
		v[n++] = (int32_t)x;
		s = *end ? end + 1 : end;
	}
	*ret = v;
	*ret_n = n;
	return n > 0;
}

static int usage_err(const char *what, const char *val)
{
	(void)fprintf(stderr, "rolloutctl: %s: bad value \"%s\"\n", what, val ? val : "");
	return EXIT_USAGE;
}

int ro_ctl_make_model(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"arch", required_argument, NULL, 'a'},	  {"layers", required_argument, NULL, 'l'},
	    {"hidden", required_argument, NULL, 'H'},	  {"heads", required_argument, NULL, 'q'},
	    {"kv-heads", required_argument, NULL, 'k'},	  {"head-dim", required_argument, NULL, 'd'},
	    {"experts", required_argument, NULL, 'e'},	  {"top-k", required_argument, NULL, 't'},
	    {"expert-ffn", required_argument, NULL, 'f'}, {"vocab", required_argument, NULL, 'v'},
	    {"dense-ffn", required_argument, NULL, 'F'},  {"dense-layers", required_argument, NULL, 'D'},
	    {"dtype", required_argument, NULL, 'T'},	  {"seed", required_argument, NULL, 's'},
	    {"shards", required_argument, NULL, 'S'},	  {"rope-theta", required_argument, NULL, 'r'},
	    {"no-norm-topk", no_argument, NULL, 'N'},	  {"help", no_argument, NULL, 'h'},
	    {0},
	};
	struct ro_make_model_opts o;
	char err[512] = "";
	int ch, r;

	ro_make_model_defaults(&o);
	optind = 1;
	while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		uint32_t *u = NULL;

		switch (ch) {
		case 'a':
			if (!strcmp(optarg, "qwen3_moe"))
				o.arch = RO_ARCH_QWEN3_MOE;
			else if (!strcmp(optarg, "mixtral"))
				o.arch = RO_ARCH_MIXTRAL;
			else
				return usage_err("--arch (qwen3_moe|mixtral)", optarg);
			continue;
		case 'l': u = &o.layers; break;
		case 'H': u = &o.hidden; break;
		case 'q': u = &o.heads; break;
		case 'k': u = &o.kv_heads; break;
		case 'd': u = &o.head_dim; break;
		case 'e': u = &o.experts; break;
		case 't': u = &o.top_k; break;
		case 'f': u = &o.expert_ffn; break;
		case 'v': u = &o.vocab; break;
		case 'F': u = &o.dense_ffn; break;
		case 'S': u = &o.shards; break;
		case 'D': {
			int32_t *ids;
			uint32_t n;

			if (!id_list(optarg, &ids, &n))
				return usage_err("--dense-layers", optarg);
			for (uint32_t i = 0; i < n; i++)
				if (ids[i] < 64)
					o.dense_layers |= 1ULL << ids[i];
			free(ids);
			continue;
		}
		case 'T':
			o.dtype = optarg;
			continue;
		case 's':
			if (!num_u64(optarg, &o.seed))
				return usage_err("--seed", optarg);
			continue;
		case 'r':
			if (!num_f(optarg, &o.rope_theta) || !(o.rope_theta > 0))
				return usage_err("--rope-theta", optarg);
			continue;
		case 'N':
			o.norm_topk = false;
			continue;
		case 'h':
			(void)puts(
			    "usage: rolloutctl make-model [--arch qwen3_moe|mixtral] [--layers L]\n"
			    "  [--hidden H] [--heads N] [--kv-heads N] [--head-dim D]\n"
			    "  [--experts E] [--top-k K] [--expert-ffn F] [--vocab V]\n"
			    "  [--dense-ffn F] [--dense-layers 0,3] [--dtype BF16|F32|F16|FP8]\n"
			    "  [--seed S] [--shards N] [--rope-theta X] [--no-norm-topk] DIR");
			return 0;
		default:
			return EXIT_USAGE;
		}
		if (!num_u32(optarg, u)) {
			const char *name = "option";

			for (const struct option *q = opts; q->name; q++)
				if (q->val == ch)
					name = q->name;
			return usage_err(name, optarg);
		}
	}
	if (optind != argc - 1) {
		(void)fprintf(stderr, "rolloutctl: make-model wants one DIR\n");
		return EXIT_USAGE;
	}
	r = ro_make_model(&o, argv[optind], err, sizeof(err));
	if (r) {
		(void)fprintf(stderr, "rolloutctl: make-model: %s\n", err[0] ? err : strerror(-r));
		return r == -EINVAL ? EXIT_USAGE : EXIT_FAILURE;
	}
	return 0;
}

static double now_s(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int ro_ctl_generate(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"model", required_argument, NULL, 'm'},	   {"prompt", required_argument, NULL, 'p'},
	    {"n", required_argument, NULL, 'n'},	   {"max-new-tokens", required_argument, NULL, 'T'},
	    {"temperature", required_argument, NULL, 't'}, {"top-p", required_argument, NULL, 'P'},
	    {"top-k", required_argument, NULL, 'K'},	   {"seed", required_argument, NULL, 's'},
	    {"stop", required_argument, NULL, 'S'},	   {"unit", required_argument, NULL, 'u'},
	    {"dump-logits", required_argument, NULL, 'L'}, {"threads", required_argument, NULL, 'j'},
	    {"scalar", no_argument, NULL, 'C'},		   {"help", no_argument, NULL, 'h'},
	    {"prefix", required_argument, NULL, 'X'},	   {"first-idx", required_argument, NULL, 'I'},
	    {0},
	};
	const char *dir = NULL, *dump = NULL, *unit = "generate";
	int32_t *prefix = NULL;
	uint32_t n_prefix = 0, first = 0;
	struct ro_sampling sp = {.temperature = 1.0, .top_p = 1.0};
	struct ro_model_opts mo = {0};
	uint32_t n = 1, max_new = 16, plen = 0, n_stop = 0;
	int32_t *prompt = NULL, *stop = NULL;
	struct ro_model *m = NULL;
	struct ro_seq *base = NULL, **seqs = NULL;
	int32_t **toks = NULL;
	float **lps = NULL, *logits = NULL, *all = NULL;
	uint32_t *len = NULL;
	bool *done = NULL;
	char err[512] = "";
	int ch, r, rc = EXIT_FAILURE;
	double t0, t_prefill, t_end;
	uint64_t key;
	uint32_t V;

	optind = 1;
	while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (ch) {
		case 'm': dir = optarg; break;
		case 'p':
			free(prompt);
			if (!id_list(optarg, &prompt, &plen))
				return usage_err("--prompt (ids like 1,2,3)", optarg);
			break;
		case 'S':
			free(stop);
			if (!id_list(optarg, &stop, &n_stop))
				return usage_err("--stop", optarg);
			break;
		case 'n':
			if (!num_u32(optarg, &n) || !n || n > 4096)
				return usage_err("--n", optarg);
			break;
		case 'T':
			if (!num_u32(optarg, &max_new))
				return usage_err("--max-new-tokens", optarg);
			break;
		case 't':
			if (!num_f(optarg, &sp.temperature) || sp.temperature < 0)
				return usage_err("--temperature", optarg);
			break;
		case 'P':
			if (!num_f(optarg, &sp.top_p) || !(sp.top_p > 0) || sp.top_p > 1)
				return usage_err("--top-p", optarg);
			break;
		case 'K':
			if (!num_u32(optarg, &sp.top_k))
				return usage_err("--top-k", optarg);
			break;
		case 's':
			if (!num_u64(optarg, &sp.seed))
				return usage_err("--seed", optarg);
			break;
		case 'u': unit = optarg; break;
		case 'X':
			free(prefix);
			if (!id_list(optarg, &prefix, &n_prefix))
				return usage_err("--prefix (generated ids like 7,8,9)", optarg);
			break;
		case 'I':
			if (!num_u32(optarg, &first))
				return usage_err("--first-idx", optarg);
			break;
		case 'L': dump = optarg; break;
		case 'j':
			if (!num_u32(optarg, &mo.threads))
				return usage_err("--threads", optarg);
			break;
		case 'C': mo.scalar = true; break;
		case 'h':
			(void)puts("usage: rolloutctl generate --model DIR --prompt 1,2,3 [--n N]\n"
				   "  [--max-new-tokens T] [--temperature X] [--top-p P] [--top-k K]\n"
				   "  [--seed S] [--stop 2,5] [--unit ID] [--dump-logits FILE]\n"
				   "  [--threads N] [--scalar] [--prefix 7,8,9] [--first-idx I]\n"
				   "--prefix: tokens every sample already generated (another policy's, say):\n"
				   "they are prefilled and sampling goes on from position len(prefix);\n"
				   "the samples are --first-idx, --first-idx + 1, ... of --unit (their\n"
				   "sampler streams); tokens and logprobs are those drawn after the prefix");
			return 0;
		default:
			return EXIT_USAGE;
		}
	}
	if (!dir || !prompt || optind != argc) {
		(void)fprintf(stderr, "rolloutctl: generate wants --model DIR and --prompt IDS\n");
		free(prompt);
		free(stop);
		return EXIT_USAGE;
	}
	r = ro_model_load(dir, &mo, &m, err, sizeof(err));
	if (r) {
		(void)fprintf(stderr, "rolloutctl: %s\n", err[0] ? err : strerror(-r));
		goto out;
	}
	V = ro_model_config(m)->vocab;
	if ((uint64_t)plen + max_new > ro_model_config(m)->max_pos) {
		(void)fprintf(stderr,
			      "rolloutctl: --max-new-tokens %u: the prompt's %u tokens and %u new ones "
			      "exceed the model's max_position_embeddings (%u)\n",
			      max_new, plen, max_new, ro_model_config(m)->max_pos);
		rc = EXIT_USAGE;
		goto out;
	}
	for (uint32_t i = 0; i < plen; i++)
		if ((uint32_t)prompt[i] >= V) {
			(void)fprintf(stderr, "rolloutctl: prompt token %d is outside the vocab (%u)\n",
				      prompt[i], V);
			rc = EXIT_USAGE;
			goto out;
		}
	key = ro_sample_key(unit);
	seqs = calloc(n, sizeof(*seqs));
	toks = calloc(n, sizeof(*toks));
	lps = calloc(n, sizeof(*lps));
	len = calloc(n, sizeof(*len));
	done = calloc(n, sizeof(*done));
	logits = malloc((size_t)n * V * sizeof(float));
	all = dump ? malloc((size_t)plen * V * sizeof(float)) : NULL;
	if (!seqs || !toks || !lps || !len || !done || !logits || (dump && !all))
		goto out;
	t0 = now_s();
	for (uint32_t i = 0; i < n_prefix; i++)
		if ((uint32_t)prefix[i] >= V || n_prefix >= max_new) {
			(void)fprintf(stderr, "rolloutctl: --prefix: token %d outside the vocab (%u), "
					      "or the prefix not below --max-new-tokens\n",
				      prefix[i], V);
			rc = EXIT_USAGE;
			goto out;
		}
	r = ro_seq_new(m, plen + max_new + 1, &base);
	if (!r) {
		struct ro_fwd_item it = {base, prompt, plen, dump ? all : logits, dump != NULL};

		r = ro_model_forward(m, &it, 1);
		if (!r && dump)
			memcpy(logits, all + (size_t)(plen - 1) * V, V * sizeof(float));
	}
	if (r) {
		(void)fprintf(stderr, "rolloutctl: prefill: %s\n", strerror(-r));
		goto out;
	}
	t_prefill = now_s();
	if (dump) {
		FILE *f = fopen(dump, "wb");

		if (!f || fwrite(all, sizeof(float), (size_t)plen * V, f) != (size_t)plen * V) {
			(void)fprintf(stderr, "rolloutctl: %s: %s\n", dump, strerror(errno));
			if (f)
				(void)fclose(f);
			goto out;
		}
		if (fclose(f))
			goto out;
	}
	/* the n samples share the prompt's prefill: each forks its KV cache */
	for (uint32_t i = 0; i < n; i++) {
		if (ro_seq_fork(base, &seqs[i]))
			goto out;
		toks[i] = malloc((max_new + 1) * sizeof(int32_t));
		lps[i] = malloc((max_new + 1) * sizeof(float));
		if (!toks[i] || !lps[i])
			goto out;
		if (i)
			memcpy(logits + (size_t)i * V, logits, V * sizeof(float));
	}
	/* what the samples already hold, as a worker that took them over replays it */
	for (uint32_t i = 0; i < n && n_prefix; i++) {
		struct ro_fwd_item it = {seqs[i], prefix, n_prefix, logits + (size_t)i * V, false};

		memcpy(toks[i], prefix, n_prefix * sizeof(int32_t));
		len[i] = n_prefix;
		if (ro_model_forward(m, &it, 1))
			goto out;
	}
	for (;;) {
		struct ro_fwd_item *items = calloc(n, sizeof(*items));
		size_t k = 0;

		if (!items)
			goto out;
		for (uint32_t i = 0; i < n; i++) {
			int32_t t;

			if (done[i])
				continue;
			if (len[i] == max_new) {
				done[i] = true;
				continue;
			}
			t = ro_sample(logits + (size_t)i * V, V, &sp, key, first + i, len[i],
				      &lps[i][len[i]]);
			if (t < 0) {
				(void)fprintf(stderr,
					      "rolloutctl: sample %u, token %u: %s\n", first + i,
					      len[i],
					      t == -EDOM ? "the logits are not finite (NaN or "
							   "infinity in the forward pass)"
							 : strerror(-t));
				free(items);
				goto out;
			}
			toks[i][len[i]++] = t;
			for (uint32_t s = 0; s < n_stop; s++)
				done[i] = done[i] || t == stop[s];
			if (done[i] || len[i] == max_new) {
				done[i] = true;
				continue;
			}
			items[k++] = (struct ro_fwd_item){seqs[i], &toks[i][len[i] - 1], 1,
							  logits + (size_t)i * V, false};
		}
		r = k ? ro_model_forward(m, items, k) : 0;
		free(items);
		if (r) {
			(void)fprintf(stderr, "rolloutctl: decode: %s\n", strerror(-r));
			goto out;
		}
		if (!k)
			break;
	}
	t_end = now_s();
	{
		uint64_t gen = 0;

		for (uint32_t i = 0; i < n; i++)
			gen += len[i];
		(void)printf("{\"model\":\"%s\",\"arch\":\"%s\",\"kernels\":\"%s\",\"threads\":%u,"
			     "\"prompt_tokens\":%u,\"prefill_ms\":%.3f,\"decode_tokens_per_s\":%.1f,"
			     "\"samples\":[",
			     dir,
			     ro_model_config(m)->arch == RO_ARCH_QWEN3_MOE ? "qwen3_moe" : "mixtral",
			     ro_model_kernels(m), ro_model_threads(m), plen,
			     (t_prefill - t0) * 1e3,
			     t_end > t_prefill ? (double)gen / (t_end - t_prefill) : 0.0);
		for (uint32_t i = 0; i < n; i++) {
			bool stopped = false;

			for (uint32_t s = 0; s < n_stop && len[i]; s++)
				stopped = stopped || toks[i][len[i] - 1] == stop[s];
			(void)printf("%s{\"idx\":%u,\"prefix_len\":%u,\"tokens\":[", i ? "," : "",
				     first + i, n_prefix);
			for (uint32_t j = n_prefix; j < len[i]; j++)
				(void)printf("%s%d", j > n_prefix ? "," : "", toks[i][j]);
			(void)printf("],\"logprobs\":[");
			for (uint32_t j = n_prefix; j < len[i]; j++)
				(void)printf("%s%.9g", j > n_prefix ? "," : "", lps[i][j]);
			(void)printf("],\"finish\":\"%s\"}", stopped ? "stop" : "length");
		}
		(void)printf("]}\n");
	}
	rc = 0;
out:
	for (uint32_t i = 0; seqs && i < n; i++) {
		ro_seq_free(seqs[i]);
		free(toks[i]);
		free(lps[i]);
	}
	free(seqs);
	free(toks);
	free(lps);
	free(len);
	free(done);
	free(logits);
	free(all);
	ro_seq_free(base);
	ro_model_free(m);
	free(prompt);
	free(stop);
	free(prefix);
	return rc;
}
