/* The benchmarks' model: a Qwen3-MoE of ~0.9B total / ~0.2B active parameters (16 layers,
 * hidden 1024, 64 experts top-8, expert FFN 256, vocab 32768, bf16), as decode_bench and
 * policy_bench generate it. */
#pragma once

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
