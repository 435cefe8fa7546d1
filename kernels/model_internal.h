/* Private to kernels/: the model's structures and the pieces its files share. loader.c
 * reads config.json and the weights, model.c owns sequences and the batched forward,
 * cpu/attention.c and cpu/moe.c the attention over the cache and the expert layer. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/internal.h"
#include "kernels/model.h"

struct layer {
	float *in_norm, *post_norm, *q_norm, *k_norm; /* owned f32 copies; q/k norm Qwen3 only */
	float *bq, *bk, *bv, *bo; /* attention_bias (Qwen3-MoE), else NULL */
	struct ro_mat q, k, v, o, router;
	struct ro_mat *gate, *up, *down; /* experts entries, or 1 for a dense layer */
	uint32_t n_mlp, ffn;
	bool dense;
};

struct ro_model {
	struct ro_model_config c;
	struct ro_st_set *st;
	struct ro_pool *pool;
	struct layer *L;
	const struct ro_tensor *embed;
	struct ro_mat head;
	float *final_norm;
	bool *used;   /* per tensor of st: read by the model (the rest is refused) */
	const char *dir; /* while loading: the directory, for messages */
	void **owned; /* widened f16 matrices */
	size_t n_owned;
	struct ro_moe_exchange xch;
	bool have_xch;
	uint32_t experts_run; /* by the last forward */
	struct ro_model_split split; /* of the last forward */
	/* workspace, grown to the largest batch seen */
	float *ws;
	size_t ws_len;
	float *ews; /* ro_model_experts scratch (called from inside a forward) */
	size_t ews_len;
	uint64_t kv_blocks; /* KV blocks held by this model's sequences (atomic) */
	uint64_t kv_cow;    /* blocks copied on write (atomic) */
	void *pin;	    /* the huge-page copy of the linear weights (opts.hugepages) */
	size_t pin_len;
	uint64_t pin_bytes;
	char pin_why[96];
};

/* The KV cache in blocks of RO_KV_BLOCK positions, as vLLM pages it: a block holds, for
 * each layer, K transposed ([kv_heads * head_dim][RO_KV_BLOCK] floats: ro_kv_kt) then V by
 * KV head ([kv_heads][RO_KV_BLOCK][head_dim]: ro_kv_v), 64 bytes after its reference count.
 * A sequence's table lists its blocks by position / RO_KV_BLOCK; ro_seq_fork shares every
 * block (the n samples of a unit hold one copy of the prompt's cache), and a block is
 * copied the first time a sequence that shares it writes into it (ro_seq_reserve, before a
 * forward: the forward's tasks only store). Blocks are taken as positions come. */
#define RO_KV_BLOCK 64
/* Query rows of one attention task at most (AVX-512): a run of a sequence's consecutive
 * tokens, the heads of one KV group each. Each K/V tile a task reads feeds all of its rows:
 * at 16 rows a long prompt's attention streamed K and V at ~8 FLOP a byte, more than the
 * caches deliver beside the FMAs. A prefill's attention core (store, RoPE, attention; in
 * one process, 16 -> 128 rows): 512 tokens 47 -> 41 ms, 2,048 600 -> 541, 4,096
 * 2,700 -> 2,180. */
#define RO_ATT_ROWS 128

/* The most experts a layer may have (the loader refuses more; routing keeps a bit each). */
#define RO_MAX_EXPERTS 4096

struct ro_seq {
	struct ro_model *m;
	uint32_t len, max;
	uint32_t n_blk, cap_blk; /* blocks held, the table's room */
	float **blk;
};

/* V of position pos at a layer for KV head h: head_dim floats. A KV head's V rows of a block
 * are contiguous (head_dim apart), so attention reads each head's values as one stream
 * (rows of all heads together, a head's values were 256-byte pieces 1 KiB apart: with K^T,
 * a cold decode task ran 42,000 cycles, the same task warm 8,600). */
static inline float *ro_kv_v(const struct ro_seq *s, uint32_t layer, uint32_t h, uint32_t pos)
{
	const size_t hd = s->m->c.head_dim, row = (size_t)s->m->c.kv_heads * hd;

	return s->blk[pos / RO_KV_BLOCK] + ((size_t)layer * 2 + 1) * RO_KV_BLOCK * row +
	       ((size_t)h * RO_KV_BLOCK + pos % RO_KV_BLOCK) * hd;
}

/* K at a layer is stored transposed in each block, [kv_heads * head_dim][RO_KV_BLOCK]: element
 * i of position p is at ro_kv_kt(s, layer, p)[i * RO_KV_BLOCK + p % RO_KV_BLOCK], so the
 * keys of a tile lie along vector lanes and a query's scores against 16 keys are 16-lane
 * FMAs with no horizontal sums. This returns the block's K part for the layer. */
static inline float *ro_kv_kt(const struct ro_seq *s, uint32_t layer, uint32_t pos)
{
	const size_t row = (size_t)s->m->c.kv_heads * s->m->c.head_dim;

	return s->blk[pos / RO_KV_BLOCK] + (size_t)layer * 2 * RO_KV_BLOCK * row;
}

/* Element i of a tensor as f32, whatever its stored dtype. */
static inline float ro_elem(const struct ro_tensor *t, size_t i)
{
	/* (F8E4M3 is unscaled here: the loader takes it for linear weights only) */
	return t->dtype == RO_F8E4M3 ? ro_f8e4m3_to_f32(((const uint8_t *)t->data)[i])
	       : t->dtype == RO_F32  ? ((const float *)t->data)[i]
	       : t->dtype == RO_BF16 ? ro_bf16_to_f32(((const uint16_t *)t->data)[i])
				     : ro_f16_to_f32(((const uint16_t *)t->data)[i]);
}

/* ---- shared pieces ----------------------------------------------------------------------- */

void ro_rmsnorm(const float *x, const float *w, uint32_t n, double eps, float *out);
void ro_rope(float *v, const float *cs, const float *sn, uint32_t hd);
void ro_swiglu(float *g, const float *u, size_t n);

size_t ro_kv_row(const struct ro_model *m);
int ro_seq_reserve(struct ro_seq *s, uint32_t need);

struct gemm_job {
	const struct ro_mat *W;
	const float *x;
	uint32_t T;
	float *y;
	uint32_t ldy, r0, r1;
	float *const *yp; /* when set, token t's output row is yp[t] (T <= RO_JOB_PTRS), not y */
};

#define RO_JOB_PTRS 256

struct jobs {
	struct gemm_job *j;
	uint32_t n, cap;
};

int ro_jobs_add(struct jobs *J, const struct ro_mat *W, const float *x, uint32_t T, float *y,
		uint32_t ldy, uint32_t chunk);
uint32_t ro_chunk_for(const struct ro_model *m, uint32_t rows, uint32_t T, uint32_t mats);
int ro_run_jobs(struct ro_model *m, struct jobs *J);

/* One forward's state, as the attention tasks see it. */
struct fwd {
	struct ro_model *m;
	uint32_t T, layer;
	struct ro_seq **seq;
	uint32_t *pos;
	float *x, *h, *q, *k, *v, *att, *cs, *sn;
	const float *rw, *moe_out; /* the routing weights and expert outputs, for the combine */
	bool avx2;
	bool avx512; /* attention by KV group (ro_attend_group); head_dim % 16 == 0 */
	/* ro_attend_group's token runs: tokens [tb[i], tb[i + 1]) are consecutive positions of
	 * one sequence (at most RO_ATT_ROWS query rows in all), i < n_tb */
	uint32_t *tb, n_tb;
	/* the K/V stores' runs: tokens [sb[i], sb[i + 1]) are consecutive positions of one
	 * sequence in one 16-position line of K^T, i < n_sb */
	uint32_t *sb, n_sb;
	bool combine512; /* the combine in 16 lanes: AVX-512, hidden % 64 == 0 */
	bool runs_whole; /* each sequence's tokens are one run (a decode step): ro_rope_attend_run */
};

/* cpu/attention.c: per token, the biases, q/k norms and RoPE, stored into the cache; per
 * (token, head), attention over the cache. Both are ro_pool_for tasks over struct fwd. */
void ro_qk_rope_store(void *arg, uint32_t t);
/* ro_qk_rope_store for the tokens of store run i (struct fwd's sb) */
void ro_qk_rope_store_run(void *arg, uint32_t i);
void ro_attend_one(void *arg, uint32_t i);
/* The same with AVX-512 for a (token run, KV head): its tokens' query heads together. */
void ro_attend_group(void *arg, uint32_t i);
/* ro_attend_group with task i as (KV head, token run from the last): a prefill's order */
void ro_attend_head_major(void *arg, uint32_t i);
/* Both for token run i, when no sequence has two runs in the forward (a decode step). */
void ro_rope_attend_run(void *arg, uint32_t i);

/* cpu/moe.c: routing, the local expert layer, and a rank's empty turn in an exchange. */
void ro_route(const struct ro_model_config *c, const float *logits, int32_t *ids, float *w);
int ro_local_experts(struct ro_model *m, uint32_t l, const float *x, const int32_t *ids,
		     uint32_t T, float *out);
int ro_forward_idle(struct ro_model *m);
