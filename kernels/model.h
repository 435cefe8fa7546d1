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
	bool attn_bias;		 /* Qwen3-MoE attention_bias: q, k, v and o projections */
	uint32_t sliding_window; /* Mixtral: attend to the last N positions; 0: all */
	double rope_theta, rms_eps;
	uint32_t max_pos;
	char dtype[8]; /* of the weights: F32, BF16, F16, or F8_E4M3 (block FP8: see fp8) */
	bool fp8;      /* quantization_config fp8, 128x128 blocks: F8_E4M3 linear weights with
			* an F32 weight_scale_inv each; the rest (norms, embedding) as stored */
};

struct ro_model_opts {
	uint32_t threads; /* 0: one per online CPU */
	bool scalar;	  /* force the portable kernels (no AVX2/FMA) */
	/* Read the linear weights (attention, router, experts, head) from the files into one
	 * anonymous region advised for transparent huge pages (2 MiB pages: a TLB entry per
	 * 2 MiB of a weight stream, not per 4 KiB), read-only; their mapped pages are never
	 * touched. Off, or where THP is disabled ("never"), or if the region
	 * cannot be had: the weights are read in place from the mapping. Bitwise the same
	 * results either way. */
	bool hugepages;
	/* With hugepages: of the experts, copy only those this rank of an EP group of
	 * ep_world ranks owns (e % ep_world == ep_rank); 0 or 1: all. */
	uint32_t ep_rank, ep_world;
};

struct ro_model;
struct ro_seq;

int ro_model_load(const char *dir, const struct ro_model_opts *o, struct ro_model **ret,
		  char *err, size_t errlen);
struct ro_model *ro_model_free(struct ro_model *m);
const struct ro_model_config *ro_model_config(const struct ro_model *m);
/* "avx512+fma", "avx2+fma" or "scalar", and the thread count in use. */
const char *ro_model_kernels(const struct ro_model *m);
/* Whether this build was configured with CUDA (--with-cuda; today that builds the probe
 * only): for --version and rolloutd_build_info. */
bool ro_kernels_cuda_built(void);
uint32_t ro_model_threads(const struct ro_model *m);
/* Bytes of weights, total and touched by one token (attention, top_k experts, head). */
void ro_model_sizes(const struct ro_model *m, uint64_t *ret_total, uint64_t *ret_active);
/* Weights copied into the huge-page region (0: read from the mapping) and how many bytes
 * of it the kernel backs with huge pages now (AnonHugePages in /proc/self/smaps; the
 * kernel may split or collapse them later); why is "" or says why there is no region. */
struct ro_model_pin {
	uint64_t bytes, huge_bytes;
	char why[96];
};
void ro_model_pinned(const struct ro_model *m, struct ro_model_pin *ret);

/* (layer, expert) pairs the last forward ran locally: the expert weights it read. */
uint32_t ro_model_last_experts(const struct ro_model *m);

/* Where the last forward's wall time went, in seconds (summed over layers): attention (the
 * norms, q/k/v/o projections, RoPE and attention over the cache), router (its GEMM and the
 * top-k), experts (the expert layer or the exchange, and the combine), head (the final norm
 * and the LM head), other (embedding and set-up). */
struct ro_model_split {
	double attention, router, experts, head, other;
};
void ro_model_last_split(const struct ro_model *m, struct ro_model_split *ret);

/* A sequence: its KV cache (up to max_len positions) and length. The cache is paged: blocks
 * of 64 positions, taken as the sequence grows. Free a model's sequences before the model. */
int ro_seq_new(struct ro_model *m, uint32_t max_len, struct ro_seq **ret);
struct ro_seq *ro_seq_free(struct ro_seq *s);
/* A sequence with src's cache (the n samples of a unit share one prompt prefill): it shares
 * src's blocks, and a shared block is copied only when one of them writes into it (the
 * partly filled last block of the prompt, at the first decoded token). Sequences that
 * share blocks may be used from different threads, but one sequence from one at a time. */
int ro_seq_fork(const struct ro_seq *src, struct ro_seq **ret);
uint32_t ro_seq_len(const struct ro_seq *s);
uint32_t ro_seq_max(const struct ro_seq *s);
/* Forget positions from len on (len <= current length). */
void ro_seq_truncate(struct ro_seq *s, uint32_t len);

/* Memory for admission control, in bytes. ro_model_seq_bytes: the most a sequence made by
 * ro_seq_new(m, max_len) holds at once (its K and V blocks, grown to max_len, and its
 * table; growing copies nothing). ro_model_forward_bytes: the
 * most one ro_model_forward with `tokens` tokens in all allocates at once, its logits rows
 * included (not the sequences' caches, not the caller's logits). The model keeps the
 * largest workspace a forward needed until it is freed, so that much stays held after such
 * a call. Without an expert-parallel transport; with one, a rank also runs the (token,
 * expert) pairs other ranks send it, and the transport has its own buffers. */
uint64_t ro_model_seq_bytes(const struct ro_model *m, uint32_t max_len);
/* The most a prompt's sequence of prompt_len positions and n forks of it growing to max_len
 * hold at once: the prompt's blocks once, and each fork's own blocks past them. */
uint64_t ro_model_forks_bytes(const struct ro_model *m, uint32_t prompt_len, uint32_t max_len,
			      uint32_t n);

/* What a sequence's cache holds: bytes of its blocks, and of them those shared with
 * another sequence (*ret_shared, may be NULL). */
uint64_t ro_seq_kv_bytes(const struct ro_seq *s, uint64_t *ret_shared);
/* The KV blocks all of a model's sequences hold now (each shared block once). */
struct ro_kv_stats {
	uint32_t block_positions;
	uint64_t block_bytes, blocks, bytes;
	uint64_t copied_on_write; /* shared blocks copied because a sequence wrote (ever) */
};
void ro_model_kv_stats(const struct ro_model *m, struct ro_kv_stats *ret);
uint64_t ro_model_forward_bytes(const struct ro_model *m, uint32_t tokens);

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
 * however its sequence's prompt was chunked. -E2BIG: the batch's tokens times the larger of
 * heads and top_k pass 2^32 (the pairs are counted in 32 bits). */
int ro_model_forward(struct ro_model *m, struct ro_fwd_item *items, size_t count);

/* ---- expert layer ---------------------------------------------------------------------- */

/* The expert-parallel transport: with none, every expert is local. exchange sends each
 * token's hidden state to the ranks owning its experts and brings back each (token,
 * expert) output; ro_ep_attach() plugs the libfabric one in. With a transport attached,
 * ro_model_forward with no tokens still joins every MoE layer's exchange (tokens = 0,
 * x/ids/out NULL): every rank takes part in every layer. */
struct ro_moe_exchange {
	void *ctx;
	uint32_t rank, world; /* experts e with e % world == rank are local */
	/* x: [tokens][hidden]; ids, w: [tokens][top_k] expert ids and routing weights. Fills
	 * out[tokens][top_k][hidden] with each selected expert's output for that token
	 * (unweighted), or with summed set, out[tokens][hidden] with the weighted sum. */
	int (*exchange)(void *ctx, uint32_t layer, const float *x, const int32_t *ids,
			const float *w, uint32_t tokens, uint32_t top_k, uint32_t hidden,
			float *out);
	bool summed;
};
void ro_model_set_exchange(struct ro_model *m, const struct ro_moe_exchange *x);
/* Run expert e of layer on rows x[n][hidden] into y[n][hidden]. */
int ro_model_expert(struct ro_model *m, uint32_t layer, uint32_t e, const float *x, uint32_t n,
		    float *y);
/* Run n (row, expert) pairs of a MoE layer: y[i][hidden] = expert experts[i] applied to the
 * row x[i] (hidden floats). Bitwise what the single-rank forward computes for that pair. */
int ro_model_experts(struct ro_model *m, uint32_t layer, const float *const *x,
		     const int32_t *experts, size_t n, float *y);

/* ---- expert parallelism over libfabric (kernels/ep/) ---------------------------------- *
 * An EP group of `world` ranks (processes): attention stays with each rank's own sequences;
 * expert e of every MoE layer lives on rank e % world. Per layer each token's hidden state
 * goes once to each rank that owns one of its experts (dispatch), and each selected
 * expert's output comes back to the token's home rank (combine), which sums them in expert
 * order: the EP forward is bitwise the single-rank forward (with f32 payloads).
 * Transport: libfabric RDM endpoints, RMA writes into one pre-registered region per rank,
 * completion by 4 bytes of remote CQ data (never by "the last byte arrived"). Every wait
 * has a deadline; on expiry the error (-ETIMEDOUT) names the late peer. */

enum ro_ep_mode {
	RO_EP_AUTO,	    /* low-latency when every rank's exchange fits ll_tokens */
	RO_EP_LOW_LATENCY,  /* fixed per-source slots, no count round trip (decode) */
	RO_EP_THROUGHPUT,   /* counts first, then exact-size packed rows (prefill) */
};
enum ro_ep_dtype { RO_EP_F32, RO_EP_BF16 };

struct ro_ep_opts {
	const char *provider; /* "efa", "tcp", "shm", ...; NULL, "" or "auto": best available */
	uint32_t rank, world; /* world <= 64 */
	uint32_t hidden, top_k, experts;
	uint32_t max_tokens; /* per rank and exchange; larger batches go in several passes */
	uint32_t ll_tokens;  /* per rank, the low-latency slot (the decode batch) */
	enum ro_ep_mode mode;
	enum ro_ep_dtype dispatch_dtype, combine_dtype; /* BF16: half the bytes, not bitwise */
	uint32_t timeout_ms;				/* any wait past it fails, naming the peer */
	/* Combine per-(token, rank) weighted sums, as DeepEP does: up to top_k / (ranks a
	 * token reaches) times fewer bytes back, summed at home in rank order (deterministic,
	 * but not bitwise the single-rank forward: it groups the additions differently).
	 * Off: every (token, expert) output comes back and home sums them in expert order. */
	bool combine_sum;
	/* With shm, ranks of one host store rows and results straight into each other's
	 * regions and the fabric only signals; fabric_only sends every byte through it. */
	bool fabric_only;
	/* The group's id (any string, e.g. the ep-group setting): a rank refuses a card of
	 * another group, and a peer's region is mapped only when its memfd is named for it. */
	const char *group;
	/* The group secret (secret_len bytes, copied): every card is signed with
	 * HMAC-SHA256 under it, and a card that is not refuses the connect (-EPERM). NULL:
	 * cards go unsigned (and a signed one is refused). */
	const uint8_t *secret;
	size_t secret_len;
};
void ro_ep_opts_default(struct ro_ep_opts *o);

struct ro_ep;
int ro_ep_new(const struct ro_ep_opts *o, struct ro_ep **ret, char *err, size_t errlen);
struct ro_ep *ro_ep_free(struct ro_ep *ep);
/* The provider in use ("tcp;ofi_rxm", "shm", "efa") and the last error's message. */
const char *ro_ep_provider(const struct ro_ep *ep);
const char *ro_ep_errmsg(const struct ro_ep *ep);
uint32_t ro_ep_rank(const struct ro_ep *ep);
/* An exchange failed (a peer late, gone or out of step): the group cannot go on. */
bool ro_ep_broken(const struct ro_ep *ep);
uint32_t ro_ep_world(const struct ro_ep *ep);

/* Rendezvous: this rank's card (fabric address, region address and key; at most
 * RO_EP_CARD_MAX bytes), then every rank's card, by rank, own included. */
#define RO_EP_CARD_MAX 512
int ro_ep_card(struct ro_ep *ep, void *buf, size_t *ret_len);
int ro_ep_connect(struct ro_ep *ep, const void *const *cards, const size_t *lens);

/* One exchange, for tests and benchmarks (the model calls it through ro_ep_attach).
 * Every rank calls dispatch then combine with the same layer and mode. dispatch packs
 * x[tokens][hidden] for the ranks that own ids[tokens][top_k] and returns what this rank
 * received: rows by source rank, and the (row, local expert) pairs to run. combine sends
 * y[pairs][hidden] (the outputs in pair order, written in ro_ep_combine_buffer) back and
 * fills the dispatching call's out[tokens][top_k][hidden]. */
struct ro_ep_batch {
	uint32_t rows;
	const float *const *x;	  /* [rows] -> hidden floats; bf16: NULL until ro_ep_decode */
	const uint32_t *row_src;  /* [rows] source rank */
	size_t pairs;
	const uint32_t *pair_row; /* [pairs] */
	const int32_t *pair_expert;
	const float *pair_w;	    /* [pairs] routing weight (combine_sum only) */
	const float *const *pair_x; /* [pairs] -> that pair's row (as x) */
};
void ro_ep_set_mode(struct ro_ep *ep, enum ro_ep_mode mode); /* LOW_LATENCY or THROUGHPUT */
/* w: [tokens][top_k] routing weights. With them, combine fills out[tokens][hidden] with
 * each token's weighted sum: exact combine adds its (token, expert) outputs at home in
 * expert order, bitwise as the single-rank forward; combine_sum adds the per-rank sums in
 * rank order. Without them (exact combine only), out[tokens][top_k][hidden] receives each
 * output unweighted. */
int ro_ep_dispatch(struct ro_ep *ep, uint32_t layer, const float *x, const int32_t *ids,
		   const float *w, uint32_t tokens, const struct ro_ep_batch **ret);
/* bf16 dispatch: decode the received rows to float for CPU experts (a GPU expert reads
 * the bf16 rows as they arrived). Not part of dispatch's time; a no-op for f32. */
int ro_ep_decode(struct ro_ep *ep);
float *ro_ep_combine_buffer(struct ro_ep *ep);
int ro_ep_combine(struct ro_ep *ep, float *out);

/* Counters: exchanges, payload bytes sent (logical: rows x hidden x element size). */
struct ro_ep_stats {
	uint64_t exchanges, ll_exchanges, dispatch_bytes, combine_bytes, syncs;
	double dispatch_ms, combine_ms, sync_ms;
	double pack_ms, decode_ms; /* of dispatch_ms: layout and packing; not in it: decode */
	uint32_t direct_peers;	   /* peers this rank stores into directly (shm, one host) */
};
void ro_ep_stats(const struct ro_ep *ep, struct ro_ep_stats *ret);

/* ---- the group step: what rolloutd runs ---- *
 * Ranks call the model a different number of times per loop (prefills, decode steps);
 * each forward is a collective. ro_ep_forward first all-gathers one small record (so
 * every rank learns the group's largest batch: the mode and the pass count), then runs
 * the forward with the EP exchange. ro_ep_round_end joins the forwards other ranks still
 * make (with no tokens) until every rank has ended its round, and returns what the group
 * said: the in-band drain (the earliest deadline) and whether every rank is done. */
struct ro_ep_note {
	bool draining;
	bool done;	     /* drained and holding nothing: ready to exit */
	int64_t deadline_ms; /* when draining: ms since the epoch */
	int64_t ready;	     /* the newest weights version this rank could serve now */
};
struct ro_ep_group {
	bool draining, all_done;
	bool busy; /* some other rank ran a forward in this round */
	int64_t deadline_ms; /* the earliest of the draining ranks */
	uint32_t first_draining;
	int64_t ready; /* the lowest of the ranks' ready: every rank has it (swap together) */
};
void ro_ep_attach(struct ro_ep *ep, struct ro_model *m);
int ro_ep_forward(struct ro_ep *ep, struct ro_fwd_item *items, size_t count,
		  const struct ro_ep_note *mine);
int ro_ep_round_end(struct ro_ep *ep, const struct ro_ep_note *mine, struct ro_ep_group *ret);

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
 * sampling distribution (softmax of logits / temperature; of logits when greedy).
 * Negative: -EDOM when a logit is NaN or infinite, -ENOMEM. */
int32_t ro_sample(const float *logits, uint32_t vocab, const struct ro_sampling *s,
		  uint64_t unit_key, uint32_t sample, uint32_t pos, float *ret_logprob);

/* ---- random models (rolloutctl make-model, tests, the demo) --------------------------- */

struct ro_make_model_opts {
	enum ro_arch arch;
	uint32_t layers, hidden, heads, kv_heads, head_dim, experts, top_k, expert_ffn, vocab;
	uint32_t dense_ffn;	/* 0: 4 * hidden */
	uint64_t dense_layers;	/* Qwen3-MoE mlp_only_layers as bits */
	const char *dtype;	/* "BF16" (default), "F32", "F16", "FP8" (block FP8, BF16 rest) */
	uint64_t seed;
	uint32_t shards;	/* > 1: model-0000N-of-0000M.safetensors + index */
	double rope_theta;
	bool norm_topk;
	uint32_t sliding_window; /* Mixtral: "sliding_window" (0: null) */
	bool attn_bias;		 /* Qwen3-MoE: "attention_bias" and the q/k/v/o biases */
	bool tie_embeddings;	 /* "tie_word_embeddings": true (lm_head.weight still written) */
};
void ro_make_model_defaults(struct ro_make_model_opts *o);
int ro_make_model(const struct ro_make_model_opts *o, const char *dir, char *err, size_t errlen);
