/* The model the agent tests, the chaos soak and probe_bench run: a random Qwen3-MoE small
 * enough that a few hundred tokens take a second at batch 16 on one thread. */
#pragma once

#include "kernels/model.h"

static inline void ro_test_agent_model(struct ro_make_model_opts *o)
{
	ro_make_model_defaults(o);
	o->layers = 4;
	o->hidden = 256;
	o->heads = 4;
	o->kv_heads = 2;
	o->head_dim = 64;
	o->experts = 8;
	o->top_k = 2;
	o->expert_ffn = 256;
	o->vocab = 1024;
}
