/* The MoE model runtime: Hugging Face model directories (config.json + safetensors) of
 * Qwen3-MoE and Mixtral, a batched forward pass on CPU whose every token's result is bitwise
 * independent of the batch it shares and of prefill chunking, an expert layer behind one
 * route -> dispatch -> experts -> combine interface, and a counter-based sampler. This
 * header is the whole face of kernels/.
 *
 * Functions return 0 (or a count) on success and -errno on failure; loaders also fill a
 * human message (err, errlen) naming the file, tensor or field at fault:
 *   -ENOENT   a file or tensor is missing      -EINVAL  config or shape does not fit
 *   -EBADMSG  a file is malformed or truncated -ENOTSUP an architecture or dtype we lack
 *   -ENOSPC   a sequence is full (max_len)     -ENOMEM */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum ro_arch { RO_ARCH_QWEN3_MOE, RO_ARCH_MIXTRAL };

struct ro_model_config {
	enum ro_arch arch;
	uint32_t vocab, hidden, layers, heads, kv_heads, head_dim;
	uint32_t experts, top_k, expert_ffn; /* moe_intermediate_size (Mixtral: intermediate) */
	uint32_t dense_ffn;		      /* intermediate_size of dense (mlp_only) layers */
	uint32_t sparse_step;		      /* decoder_sparse_step */
	uint64_t dense_layers;		      /* bit i: layer i is dense (mlp_only_layers) */
	bool norm_topk, tie_embeddings;
	double rope_theta, rms_eps;
	uint32_t max_pos;
	char dtype[8]; /* of the weights: F32, BF16, F16 */
};

struct ro_model_opts {
	uint32_t threads; /* 0: one per online CPU */
	bool scalar;	  /* force the portable kernels (no AVX2/FMA) */
};

struct ro_model;
struct ro_seq;

int ro_model_load(const char *dir, const struct ro_model_opts *o, struct ro_model **ret,
		  char *err, size_t errlen);
struct ro_model *ro_model_free(struct ro_model *m);
const struct ro_model_config *ro_model_config(const struct ro_model *m);
/* "avx2+fma" or "scalar", and the thread count in use. */
const char *ro_model_kernels(const struct ro_model *m);
uint32_t ro_model_threads(const struct ro_model *m);
/* Bytes of weights, total and touched by one token (attention, top_k experts, head). */
void ro_model_sizes(const struct ro_model *m, uint64_t *ret_total, uint64_t *ret_active);

/* (layer, expert) pairs the last forward ran locally: the expert weights it read. */
uint32_t ro_model_last_experts(const struct ro_model *m);

/* A sequence: its KV cache (max_len positions) and length. */
int ro_seq_new(struct ro_model *m, uint32_t max_len, struct ro_seq **ret);
struct ro_seq *ro_seq_free(struct ro_seq *s);
/* A copy of src's cache (the n samples of a unit share one prompt prefill). */
int ro_seq_fork(const struct ro_seq *src, struct ro_seq **ret);
uint32_t ro_seq_len(const struct ro_seq *s);
uint32_t ro_seq_max(const struct ro_seq *s);
/* Forget positions from len on (len <= current length). */
void ro_seq_truncate(struct ro_seq *s, uint32_t len);

/* One entry of a batch: n tokens appended to seq. logits (vocab floats) receives the
 * logits after the last token; with all_logits, n * vocab floats, one row per token. */
struct ro_fwd_item {
	struct ro_seq *seq;
	const int32_t *tokens;
	uint32_t n;
	float *logits;
	bool all_logits;
};

/* Run every item's tokens through the model as one batch (prefill chunks and decode tokens
 * mixed). Each token's logits are bitwise the same whatever else is in the batch and
 * however its sequence's prompt was chunked. */
int ro_model_forward(struct ro_model *m, struct ro_fwd_item *items, size_t count);

/* ---- expert layer ---------------------------------------------------------------------- */

/* The expert-parallel transport: with none, every expert is local. dispatch sends each
 * token's hidden state to the ranks owning its experts; combine brings back each (token,
 * expert) output. A later transport plugs in here without touching the forward pass. */
struct ro_moe_exchange {
	void *ctx;
	uint32_t rank, world; /* experts e with e % world == rank are local */
	/* x: [tokens][hidden]; ids: [tokens][top_k] expert ids. Fills out[tokens][top_k][hidden]
	 * with each selected expert's output for that token (unweighted). */
	int (*exchange)(void *ctx, uint32_t layer, const float *x, const int32_t *ids,
			uint32_t tokens, uint32_t top_k, uint32_t hidden, float *out);
};
void ro_model_set_exchange(struct ro_model *m, const struct ro_moe_exchange *x);
/* Run expert e of layer on rows x[n][hidden] into y[n][hidden] (for a transport's remote
 * side; the local path uses it too). */
int ro_model_expert(struct ro_model *m, uint32_t layer, uint32_t e, const float *x, uint32_t n,
		    float *y);

/* ---- sampling -------------------------------------------------------------------------- */

struct ro_sampling {
	double temperature; /* 0: greedy */
	double top_p;	    /* 1: off */
	uint32_t top_k;	    /* 0: off */
	uint64_t seed;
};

/* The random stream is keyed by (seed, unit, sample, position) and nothing else, so a
 * sample resumed from a prefix draws what it would have drawn uninterrupted. */
uint64_t ro_sample_key(const char *unit_id);
/* Pick a token from logits[vocab]; *ret_logprob is its log-probability under the
 * sampling distribution (softmax of logits / temperature; of logits when greedy). */
int32_t ro_sample(const float *logits, uint32_t vocab, const struct ro_sampling *s,
		  uint64_t unit_key, uint32_t sample, uint32_t pos, float *ret_logprob);

/* ---- random models (rolloutctl make-model, tests, the demo) --------------------------- */

struct ro_make_model_opts {
	enum ro_arch arch;
	uint32_t layers, hidden, heads, kv_heads, head_dim, experts, top_k, expert_ffn, vocab;
	uint32_t dense_ffn;	/* 0: 4 * hidden */
	uint64_t dense_layers;	/* Qwen3-MoE mlp_only_layers as bits */
	const char *dtype;	/* "BF16" (default), "F32", "F16" */
	uint64_t seed;
	uint32_t shards;	/* > 1: model-0000N-of-0000M.safetensors + index */
	double rope_theta;
	bool norm_topk;
};
void ro_make_model_defaults(struct ro_make_model_opts *o);
int ro_make_model(const struct ro_make_model_opts *o, const char *dir, char *err, size_t errlen);
