/* The benchmarks' model: a Qwen3-MoE of ~0.9B total / ~0.2B active parameters (16 layers,
 * hidden 1024, 64 experts top-8, expert FFN 256, vocab 32768, bf16), as decode_bench and
 * policy_bench generate it. */
#pragma once

#include <stdio.h>
#include <sys/stat.h>

#include "kernels/model.h"

static inline void ro_bench_model(struct ro_make_model_opts *o, uint64_t seed)
{
	ro_make_model_defaults(o);
	o->arch = RO_ARCH_QWEN3_MOE;
	o->layers = 16;
	o->hidden = 1024;
	o->heads = 16;
	o->kv_heads = 4;
	o->head_dim = 64;
	o->experts = 64;
	o->top_k = 8;
	o->expert_ffn = 256;
	o->vocab = 32768;
	o->dtype = "BF16";
	o->seed = seed;
}

/* dir holds the bench model made with seed (written now unless its config.json is there);
 * tool names the program in its messages. 0 or -1. */
static inline int ro_bench_model_ensure_dtype(const char *tool, const char *dir, uint64_t seed,
					      const char *dtype);

static inline int ro_bench_model_ensure(const char *tool, const char *dir, uint64_t seed)
{
	return ro_bench_model_ensure_dtype(tool, dir, seed, "BF16");
}

/* The same with the weights in dtype ("BF16", "FP8", ...). */
static inline int ro_bench_model_ensure_dtype(const char *tool, const char *dir, uint64_t seed,
					      const char *dtype)
{
	struct ro_make_model_opts o;
	char p[4096], err[512];
	struct stat st;

	(void)snprintf(p, sizeof(p), "%s/config.json", dir);
	if (stat(p, &st) == 0)
		return 0;
	ro_bench_model(&o, seed);
	o.dtype = dtype;
	(void)fprintf(stderr, "%s: writing the model to %s ...\n", tool, dir);
	if (ro_make_model(&o, dir, err, sizeof(err))) {
		(void)fprintf(stderr, "%s: %s\n", tool, err);
		return -1;
	}
	return 0;
}
