/* The model: config.json and safetensors of a Qwen3-MoE or Mixtral model in Hugging Face
 * layout become weight views (bf16 and f32 used in place from the mapping), and a batched
 * forward pass runs every token of a batch through embedding, attention with a KV cache,
 * the expert layer and the LM head. Every per-token step (norms, RoPE, attention over the
 * cache, routing, the experts, the combine in expert order) is computed the same way
 * whatever shares the batch: that is what makes a sample independent of its batch and of
 * how its prompt was chunked. */
#include <errno.h>
#include <json-c/json.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
	/* workspace, grown to the largest batch seen */
	float *ws;
	size_t ws_len;
	float *ews; /* ro_model_experts scratch (called from inside a forward) */
	size_t ews_len;
};

struct ro_seq {
	struct ro_model *m;
	uint32_t len, cap, max;
	float *k, *v; /* [layers][cap][kv_heads * head_dim] */
};

/* ---- config ----------------------------------------------------------------------------
 * config.json as Hugging Face's Qwen3MoeConfig / MixtralConfig read it: the same defaults
 * for what is absent, and every key that changes the computation either implemented as
 * the modeling code does it or refused with the file and the key named. */

#define MAX_CONFIG (1u << 20)

struct cfg {
	const char *path;
	struct json_object *o;
	char *err;
	size_t errlen;
};

static int cfg_bad(const struct cfg *x, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int cfg_bad(const struct cfg *x, const char *key, const char *fmt, ...)
{
	char msg[512];
	va_list ap;

	va_start(ap, fmt);
	(void)vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	return ro_errf(x->err, x->errlen, -EINVAL, "%s: %s: %s", x->path, key, msg);
}

/* The value of key, or NULL when it is absent or null. */
static struct json_object *cfg_get(const struct cfg *x, const char *key)
{
	struct json_object *v;

	if (!json_object_object_get_ex(x->o, key, &v) || json_object_is_type(v, json_type_null))
		return NULL;
	return v;
}

static const char *cfg_show(struct json_object *v)
{
	return json_object_to_json_string_ext(v, JSON_C_TO_STRING_PLAIN);
}

/* An integer in [lo, hi]; absent (or null) leaves *ret, unless required. */
static int cfg_u32(const struct cfg *x, const char *key, uint32_t *ret, bool required,
		   uint32_t lo, uint32_t hi)
{
	struct json_object *v = cfg_get(x, key);
	int64_t n;

	if (!v)
		return required ? cfg_bad(x, key, "missing") : 0;
	if (!json_object_is_type(v, json_type_int))
		return cfg_bad(x, key, "%.64s is not an integer", cfg_show(v));
	n = json_object_get_int64(v);
	if (n < lo || n > hi)
		return cfg_bad(x, key, "%lld is out of range [%u, %u]", (long long)n, lo, hi);
	*ret = (uint32_t)n;
	return 0;
}

static int cfg_num(const struct cfg *x, const char *key, double *ret, double lo)
{
	struct json_object *v = cfg_get(x, key);

	if (!v)
		return 0;
	if (!json_object_is_type(v, json_type_double) && !json_object_is_type(v, json_type_int))
		return cfg_bad(x, key, "%.64s is not a number", cfg_show(v));
	*ret = json_object_get_double(v);
	if (!isfinite(*ret) || *ret < lo)
		return cfg_bad(x, key, "%.64s is out of range", cfg_show(v));
	return 0;
}

static int cfg_bool(const struct cfg *x, const char *key, bool *ret)
{
	struct json_object *v = cfg_get(x, key);

	if (!v)
		return 0;
	if (!json_object_is_type(v, json_type_boolean))
		return cfg_bad(x, key, "%.64s is not true or false", cfg_show(v));
	*ret = json_object_get_boolean(v);
	return 0;
}

static int cfg_str(const struct cfg *x, const char *key, const char **ret)
{
	struct json_object *v = cfg_get(x, key);

	*ret = NULL;
	if (!v)
		return 0;
	if (!json_object_is_type(v, json_type_string))
		return cfg_bad(x, key, "%.64s is not a string", cfg_show(v));
	*ret = json_object_get_string(v);
	return 0;
}

/* RoPE: only the default kind (rope_scaling null, or rope_type "default"); the
 * transformers-5 form rope_parameters may also carry rope_theta. */
static int cfg_rope(const struct cfg *x, struct ro_model_config *c)
{
	static const char *const keys[] = {"rope_scaling", "rope_parameters"};

	for (int i = 0; i < 2; i++) {
		struct json_object *v = cfg_get(x, keys[i]), *t, *th;
		const char *kind = "default";

		if (!v)
			continue;
		if (!json_object_is_type(v, json_type_object))
			return cfg_bad(x, keys[i], "%.64s is not an object", cfg_show(v));
		if ((json_object_object_get_ex(v, "rope_type", &t) ||
		     json_object_object_get_ex(v, "type", &t)) &&
		    !json_object_is_type(t, json_type_null))
			kind = json_object_is_type(t, json_type_string) ? json_object_get_string(t)
									: "?";
		if (strcmp(kind, "default"))
			return cfg_bad(x, keys[i],
				       "RoPE scaling \"%.32s\" is not supported (only the default "
				       "rotary embedding)",
				       kind);
		if (json_object_object_get_ex(v, "rope_theta", &th)) {
			if ((!json_object_is_type(th, json_type_double) &&
			     !json_object_is_type(th, json_type_int)) ||
			    !(json_object_get_double(th) > 0) ||
			    !isfinite(json_object_get_double(th)))
				return cfg_bad(x, keys[i], "rope_theta %.64s is not a positive number",
					       cfg_show(th));
			c->rope_theta = json_object_get_double(th);
		}
	}
	return 0;
}

static int cfg_layers(const struct cfg *x, struct ro_model_config *c)
{
	/* mlp_only_layers is Qwen3-MoE's: MixtralConfig has none, and Hugging Face's Mixtral
	 * makes every layer sparse whatever config.json says */
	struct json_object *v = c->arch == RO_ARCH_QWEN3_MOE ? cfg_get(x, "mlp_only_layers") : NULL,
			   *lt = cfg_get(x, "layer_types");

	if (v) {
		if (!json_object_is_type(v, json_type_array))
			return cfg_bad(x, "mlp_only_layers", "%.64s is not a list", cfg_show(v));
		for (size_t i = 0; i < json_object_array_length(v); i++) {
			struct json_object *e = json_object_array_get_idx(v, i);
			int64_t l;

			if (!json_object_is_type(e, json_type_int))
				return cfg_bad(x, "mlp_only_layers", "entry %zu (%.32s) is not a layer",
					       i, cfg_show(e));
			l = json_object_get_int64(e);
			if (l < 0 || l >= (int64_t)c->layers)
				return cfg_bad(x, "mlp_only_layers",
					       "layer %lld is not below num_hidden_layers %u",
					       (long long)l, c->layers);
			if (l >= 64)
				return cfg_bad(x, "mlp_only_layers",
					       "layer %lld: dense layers past 63 are not supported",
					       (long long)l);
			c->dense_layers |= 1ULL << l;
		}
	}
	if (lt) {
		if (!json_object_is_type(lt, json_type_array))
			return cfg_bad(x, "layer_types", "%.64s is not a list", cfg_show(lt));
		for (size_t i = 0; i < json_object_array_length(lt); i++) {
			struct json_object *e = json_object_array_get_idx(lt, i);

			if (!json_object_is_type(e, json_type_string) ||
			    strcmp(json_object_get_string(e), "full_attention"))
				return cfg_bad(x, "layer_types",
					       "entry %zu (%.32s): only full_attention is supported", i,
					       cfg_show(e));
		}
	}
	return 0;
}

static int cfg_parse(const struct cfg *x, struct ro_model_config *c)
{
	struct json_object *arch = cfg_get(x, "architectures"), *v;
	const char *an, *mt, *act;
	bool q3, swin = false;
	int r;

	if (!arch || !json_object_is_type(arch, json_type_array) ||
	    json_object_array_length(arch) < 1 ||
	    !json_object_is_type(json_object_array_get_idx(arch, 0), json_type_string))
		return cfg_bad(x, "architectures", "want a list naming the model class");
	an = json_object_get_string(json_object_array_get_idx(arch, 0));
	if (!strcmp(an, "Qwen3MoeForCausalLM"))
		c->arch = RO_ARCH_QWEN3_MOE;
	else if (!strcmp(an, "MixtralForCausalLM"))
		c->arch = RO_ARCH_MIXTRAL;
	else
		return ro_errf(x->err, x->errlen, -ENOTSUP,
			       "%s: architectures: %.64s is not supported (Qwen3MoeForCausalLM, "
			       "MixtralForCausalLM)",
			       x->path, an);
	q3 = c->arch == RO_ARCH_QWEN3_MOE;
	if ((r = cfg_str(x, "model_type", &mt)))
		return r;
	if (mt && strcmp(mt, q3 ? "qwen3_moe" : "mixtral"))
		return cfg_bad(x, "model_type", "%.64s does not match architectures %s (want %s)", mt,
			       an, q3 ? "qwen3_moe" : "mixtral");
	if (cfg_get(x, "quantization_config"))
		return cfg_bad(x, "quantization_config",
			       "quantized checkpoints are not supported (F32, BF16, F16 weights)");
	/* Hugging Face's defaults for what config.json leaves out */
	c->rope_theta = q3 ? 10000.0 : 1e6;
	c->rms_eps = q3 ? 1e-6 : 1e-5;
	c->sparse_step = 1;
	c->norm_topk = !q3;
	c->max_pos = q3 ? 32768 : 4096 * 32;
	c->kv_heads = q3 ? 4 : 8;
	if ((r = cfg_u32(x, "vocab_size", &c->vocab, true, 2, 1u << 24)) ||
	    (r = cfg_u32(x, "hidden_size", &c->hidden, true, 1, 65536)) ||
	    (r = cfg_u32(x, "num_hidden_layers", &c->layers, true, 1, 1024)) ||
	    (r = cfg_u32(x, "num_attention_heads", &c->heads, true, 1, 1024)) ||
	    (r = cfg_u32(x, "head_dim", &c->head_dim, false, 2, 1024)) ||
	    (r = cfg_u32(x, "num_experts_per_tok", &c->top_k, true, 1, 64)) ||
	    (r = cfg_u32(x, "intermediate_size", &c->dense_ffn, !q3, 1, 1u << 20)) ||
	    (r = cfg_u32(x, "max_position_embeddings", &c->max_pos, false, 1, 1u << 24)) ||
	    (r = cfg_num(x, "rope_theta", &c->rope_theta, 0)) ||
	    (r = cfg_num(x, "rms_norm_eps", &c->rms_eps, 0)) ||
	    (r = cfg_bool(x, "tie_word_embeddings", &c->tie_embeddings)) ||
	    (r = cfg_str(x, "hidden_act", &act)) || (r = cfg_rope(x, c)))
		return r;
	/* num_key_value_heads: absent is the class default (4, 8); null is num_attention_heads */
	if (json_object_object_get_ex(x->o, "num_key_value_heads", &v) &&
	    json_object_is_type(v, json_type_null))
		c->kv_heads = c->heads;
	else if ((r = cfg_u32(x, "num_key_value_heads", &c->kv_heads, false, 1, 1024)))
		return r;
	if (!(c->rope_theta > 0))
		return cfg_bad(x, "rope_theta", "%g is not positive", c->rope_theta);
	if (act && strcmp(act, "silu") && strcmp(act, "swish"))
		return cfg_bad(x, "hidden_act", "%.32s is not supported (silu)", act);
	if (!c->head_dim) {
		c->head_dim = c->hidden / c->heads;
		if (c->head_dim < 2)
			return cfg_bad(x, "head_dim", "hidden_size / num_attention_heads is %u",
				       c->head_dim);
	}
	if (c->head_dim % 2)
		return cfg_bad(x, "head_dim", "%u is odd (RoPE rotates halves)", c->head_dim);
	if (c->kv_heads > c->heads || c->heads % c->kv_heads)
		return cfg_bad(x, "num_key_value_heads", "%u does not divide num_attention_heads %u",
			       c->kv_heads, c->heads);
	if (q3) {
		if ((r = cfg_u32(x, "num_experts", &c->experts, true, 1, 4096)) ||
		    (r = cfg_u32(x, "moe_intermediate_size", &c->expert_ffn, true, 1, 1u << 20)) ||
		    (r = cfg_u32(x, "decoder_sparse_step", &c->sparse_step, false, 1, 1u << 20)) ||
		    (r = cfg_bool(x, "norm_topk_prob", &c->norm_topk)) ||
		    (r = cfg_bool(x, "attention_bias", &c->attn_bias)) ||
		    (r = cfg_bool(x, "use_sliding_window", &swin)))
			return r;
		/* Qwen3-MoE's window applies from max_window_layers in some transformers
		 * releases and to every layer in others: not a thing to guess. Absent,
		 * sliding_window is Qwen3MoeConfig's 4096: only an explicit null is none. */
		if (swin && !(json_object_object_get_ex(x->o, "sliding_window", &v) &&
			      json_object_is_type(v, json_type_null)))
			return cfg_bad(x, "use_sliding_window",
				       "sliding-window attention is not supported for Qwen3-MoE "
				       "(sliding_window %s)",
				       cfg_get(x, "sliding_window") ? "set" : "absent: 4096");
	} else {
		if ((r = cfg_u32(x, "num_local_experts", &c->experts, true, 1, 4096)) ||
		    (r = cfg_u32(x, "sliding_window", &c->sliding_window, false, 1, UINT32_MAX)))
			return r;
		c->expert_ffn = c->dense_ffn;
	}
	if (c->top_k > c->experts)
		return cfg_bad(x, "num_experts_per_tok", "%u is more than the %u experts", c->top_k,
			       c->experts);
	if ((r = cfg_layers(x, c)))
		return r;
	for (uint32_t l = 0; l < c->layers && l < 64; l++)
		if ((l + 1) % c->sparse_step)
			c->dense_layers |= 1ULL << l;
	if (c->layers > 64 && c->sparse_step > 1)
		return cfg_bad(x, "decoder_sparse_step",
			       "%u with %u layers: dense layers past 63 are not supported",
			       c->sparse_step, c->layers);
	if (c->dense_layers && !c->dense_ffn)
		return cfg_bad(x, "intermediate_size", "missing, and dense layers need it");
	return 0;
}

static int parse_config(const char *dir, struct ro_model_config *c, char *err, size_t errlen)
{
	char path[4096], *text;
	size_t len;
	struct cfg x = {.path = path, .err = err, .errlen = errlen};
	int r;

	(void)snprintf(path, sizeof(path), "%s/config.json", dir);
	r = ro_read_small(path, MAX_CONFIG, &text, &len, err, errlen);
	if (r)
		return r;
	r = ro_parse_json_object(path, text, len, &x.o, err, errlen);
	free(text);
	if (r)
		return r;
	memset(c, 0, sizeof(*c));
	r = cfg_parse(&x, c);
	json_object_put(x.o);
	return r;
}

/* ---- weights --------------------------------------------------------------------------- */

static void shape_str(char *buf, size_t len, uint32_t ndim, const uint64_t *d)
{
	size_t at = 0;

	at += (size_t)snprintf(buf + at, len - at, "[");
	for (uint32_t i = 0; i < ndim && at < len; i++)
		at += (size_t)snprintf(buf + at, len - at, "%s%llu", i ? ", " : "",
				       (unsigned long long)d[i]);
	if (at < len)
		(void)snprintf(buf + at, len - at, "]");
}

/* The tensor `name` with exactly the shape [d0] (d1 == 0 is not "1-D": ndim says) or
 * [d0, d1]; it is counted as used. */
static int tensor(struct ro_model *m, const char *name, uint32_t ndim, uint64_t d0, uint64_t d1,
		  const struct ro_tensor **ret, char *err, size_t errlen)
{
	const struct ro_tensor *t = ro_st_find(m->st, name);
	const uint64_t want[2] = {d0, d1};

	if (!t)
		return ro_errf(err, errlen, -ENOENT, "%s: tensor %s is missing", m->dir, name);
	if (t->ndim != ndim || t->shape[0] != d0 || (ndim > 1 && t->shape[1] != d1)) {
		char have[96], w[64];

		shape_str(have, sizeof(have), t->ndim, t->shape);
		shape_str(w, sizeof(w), ndim, want);
		return ro_errf(err, errlen, -EINVAL, "%s: tensor %s has shape %s, want %s",
			       ro_st_file(m->st, t), name, have, w);
	}
	m->used[ro_st_index(m->st, t)] = true;
	*ret = t;
	return 0;
}

static int own(struct ro_model *m, void *p)
{
	void **o = realloc(m->owned, (m->n_owned + 1) * sizeof(*o));

	if (!o) {
		free(p);
		return -ENOMEM;
	}
	m->owned = o;
	m->owned[m->n_owned++] = p;
	return 0;
}

/* Element i of a tensor as f32, whatever its stored dtype. */
static float elem(const struct ro_tensor *t, size_t i)
{
	return t->dtype == RO_F32    ? ((const float *)t->data)[i]
	       : t->dtype == RO_BF16 ? ro_bf16_to_f32(((const uint16_t *)t->data)[i])
				     : ro_f16_to_f32(((const uint16_t *)t->data)[i]);
}

static int vec(struct ro_model *m, const char *name, uint64_t n, float **ret, char *err,
	       size_t errlen)
{
	const struct ro_tensor *t;
	float *v;
	int r = tensor(m, name, 1, n, 0, &t, err, errlen);

	if (r)
		return r;
	v = malloc(n * sizeof(*v));
	if (!v)
		return -ENOMEM;
	for (uint64_t i = 0; i < n; i++)
		v[i] = elem(t, i);
	*ret = v;
	return own(m, v);
}

static int mat(struct ro_model *m, const char *name, uint32_t rows, uint32_t cols,
	       struct ro_mat *ret, char *err, size_t errlen)
{
	const struct ro_tensor *t;
	int r = tensor(m, name, 2, rows, cols, &t, err, errlen);

	if (r)
		return r;
	ret->rows = rows;
	ret->cols = cols;
	if (t->dtype == RO_F16) { /* no f16 kernel: widen once */
		size_t n = (size_t)rows * cols;
		float *w = malloc(n * sizeof(*w));

		if (!w)
			return -ENOMEM;
		for (size_t i = 0; i < n; i++)
			w[i] = ro_f16_to_f32(((const uint16_t *)t->data)[i]);
		ret->w = w;
		ret->dtype = RO_F32;
		return own(m, w);
	}
	ret->w = t->data;
	ret->dtype = t->dtype;
	return 0;
}

static int load_layer(struct ro_model *m, uint32_t l, char *err, size_t errlen)
{
	const struct ro_model_config *c = &m->c;
	struct layer *L = &m->L[l];
	const uint32_t H = c->hidden, qd = c->heads * c->head_dim, kvd = c->kv_heads * c->head_dim;
	char n[256];
	int r;

#define NAME(...) (snprintf(n, sizeof(n), __VA_ARGS__), n)
	if ((r = vec(m, NAME("model.layers.%u.input_layernorm.weight", l), H, &L->in_norm, err,
		     errlen)) ||
	    (r = vec(m, NAME("model.layers.%u.post_attention_layernorm.weight", l), H,
		     &L->post_norm, err, errlen)) ||
	    (r = mat(m, NAME("model.layers.%u.self_attn.q_proj.weight", l), qd, H, &L->q, err,
		     errlen)) ||
	    (r = mat(m, NAME("model.layers.%u.self_attn.k_proj.weight", l), kvd, H, &L->k, err,
		     errlen)) ||
	    (r = mat(m, NAME("model.layers.%u.self_attn.v_proj.weight", l), kvd, H, &L->v, err,
		     errlen)) ||
	    (r = mat(m, NAME("model.layers.%u.self_attn.o_proj.weight", l), H, qd, &L->o, err,
		     errlen)))
		return r;
	if (c->attn_bias &&
	    ((r = vec(m, NAME("model.layers.%u.self_attn.q_proj.bias", l), qd, &L->bq, err,
		      errlen)) ||
	     (r = vec(m, NAME("model.layers.%u.self_attn.k_proj.bias", l), kvd, &L->bk, err,
		      errlen)) ||
	     (r = vec(m, NAME("model.layers.%u.self_attn.v_proj.bias", l), kvd, &L->bv, err,
		      errlen)) ||
	     (r = vec(m, NAME("model.layers.%u.self_attn.o_proj.bias", l), H, &L->bo, err,
		      errlen))))
		return r;
	if (c->arch == RO_ARCH_QWEN3_MOE &&
	    ((r = vec(m, NAME("model.layers.%u.self_attn.q_norm.weight", l), c->head_dim,
		      &L->q_norm, err, errlen)) ||
	     (r = vec(m, NAME("model.layers.%u.self_attn.k_norm.weight", l), c->head_dim,
		      &L->k_norm, err, errlen))))
		return r;
	L->dense = l < 64 && (c->dense_layers >> l & 1);
	L->n_mlp = L->dense ? 1 : c->experts;
	L->ffn = L->dense ? c->dense_ffn : c->expert_ffn;
	L->gate = calloc(L->n_mlp, sizeof(*L->gate));
	L->up = calloc(L->n_mlp, sizeof(*L->up));
	L->down = calloc(L->n_mlp, sizeof(*L->down));
	if (!L->gate || !L->up || !L->down)
		return -ENOMEM;
	if (L->dense) {
		return (r = mat(m, NAME("model.layers.%u.mlp.gate_proj.weight", l), L->ffn, H,
				&L->gate[0], err, errlen)) ||
			       (r = mat(m, NAME("model.layers.%u.mlp.up_proj.weight", l), L->ffn, H,
					&L->up[0], err, errlen)) ||
			       (r = mat(m, NAME("model.layers.%u.mlp.down_proj.weight", l), H,
					L->ffn, &L->down[0], err, errlen))
			   ? r
			   : 0;
	}
	{
		const bool q3 = c->arch == RO_ARCH_QWEN3_MOE;
		const char *blk = q3 ? "mlp" : "block_sparse_moe";
		const char *g = q3 ? "gate_proj" : "w1", *u = q3 ? "up_proj" : "w3",
			   *d = q3 ? "down_proj" : "w2";

		r = mat(m, NAME("model.layers.%u.%s.gate.weight", l, blk), c->experts, H, &L->router,
			err, errlen);
		for (uint32_t e = 0; !r && e < c->experts; e++) {
			if ((r = mat(m, NAME("model.layers.%u.%s.experts.%u.%s.weight", l, blk, e, g),
				     L->ffn, H, &L->gate[e], err, errlen)) ||
			    (r = mat(m, NAME("model.layers.%u.%s.experts.%u.%s.weight", l, blk, e, u),
				     L->ffn, H, &L->up[e], err, errlen)) ||
			    (r = mat(m, NAME("model.layers.%u.%s.experts.%u.%s.weight", l, blk, e, d),
				     H, L->ffn, &L->down[e], err, errlen)))
				break;
		}
	}
#undef NAME
	return r;
}

/* ---- checks over the whole checkpoint ------------------------------------------------------ */

struct scan {
	const struct ro_tensor **t;
	uint64_t *bad; /* per tensor: first non-finite element + 1, or 0 */
};

static void scan_one(void *arg, uint32_t i)
{
	struct scan *sc = arg;
	const struct ro_tensor *t = sc->t[i];
	const uint64_t n = t->bytes / ro_dtype_size(t->dtype);

	for (uint64_t k = 0; k < n; k++) {
		bool inf_nan;

		if (t->dtype == RO_F32) {
			uint32_t u;

			memcpy(&u, (const uint8_t *)t->data + 4 * k, 4);
			inf_nan = (u & 0x7f800000u) == 0x7f800000u;
		} else {
			const uint16_t h = ((const uint16_t *)t->data)[k];

			inf_nan = t->dtype == RO_BF16 ? (h & 0x7f80u) == 0x7f80u
						      : (h & 0x7c00u) == 0x7c00u;
		}
		if (inf_nan) {
			sc->bad[i] = k + 1;
			return;
		}
	}
}

/* NaN or infinity anywhere in a weight the model reads makes every logit downstream
 * meaningless: refused at load, with the tensor and the element named. */
static int check_finite(struct ro_model *m, char *err, size_t errlen)
{
	const size_t n = ro_st_count(m->st);
	struct scan sc = {.t = calloc(n, sizeof(*sc.t)), .bad = calloc(n, sizeof(*sc.bad))};
	uint32_t k = 0;
	int r = 0;

	if (!sc.t || !sc.bad) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < n; i++)
		if (m->used[i])
			sc.t[k++] = ro_st_at(m->st, i);
	ro_pool_for(m->pool, k, scan_one, &sc);
	for (uint32_t i = 0; i < k && !r; i++)
		if (sc.bad[i]) {
			const struct ro_tensor *t = sc.t[i];
			float v = t->dtype == RO_F32 ? 0 : elem(t, sc.bad[i] - 1);

			if (t->dtype == RO_F32)
				memcpy(&v, (const uint8_t *)t->data + 4 * (sc.bad[i] - 1), 4);
			r = ro_errf(err, errlen, -EINVAL, "%s: tensor %s: element %llu is %s",
				    ro_st_file(m->st, t), t->name,
				    (unsigned long long)(sc.bad[i] - 1), isnan(v) ? "NaN" : "infinite");
		}
out:
	free(sc.t);
	free(sc.bad);
	return r;
}

/* Every tensor of the checkpoint is one the config describes: a checkpoint with more
 * layers or experts than config.json says, or weights this runtime does not implement
 * (biases, another architecture's tensors), is not silently half-used. */
static int check_all_used(struct ro_model *m, char *err, size_t errlen)
{
	const struct ro_model_config *c = &m->c;

	for (size_t i = 0; i < ro_st_count(m->st); i++) {
		const struct ro_tensor *t = ro_st_at(m->st, i);
		const size_t nl = strlen(t->name), sl = strlen(".rotary_emb.inv_freq");

		if (m->used[i])
			continue;
		if (nl > sl && !strcmp(t->name + nl - sl, ".rotary_emb.inv_freq"))
			continue; /* a buffer older transformers saved; recomputed as HF does */
		if (c->tie_embeddings && !strcmp(t->name, "lm_head.weight"))
			continue; /* tied: Hugging Face uses the embedding, as here */
		return ro_errf(err, errlen, -EINVAL,
			       "%s: tensor %s is not part of the model config.json describes (%u "
			       "layers, %u experts%s): refusing a checkpoint it does not match",
			       ro_st_file(m->st, t), t->name, c->layers, c->experts,
			       c->attn_bias ? ", attention biases" : "");
	}
	return 0;
}

#define MAX_THREADS 1024

int ro_model_load(const char *dir, const struct ro_model_opts *o, struct ro_model **ret,
		  char *err, size_t errlen)
{
	struct ro_model *m = calloc(1, sizeof(*m));
	long ncpu;
	uint32_t threads;
	int r;

	if (!m)
		return -ENOMEM;
	m->dir = dir;
	ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	threads = o && o->threads ? o->threads : (uint32_t)(ncpu > 0 ? ncpu : 1);
	if (threads > MAX_THREADS) {
		r = ro_errf(err, errlen, -EINVAL, "threads %u: at most %u", threads, MAX_THREADS);
		goto fail;
	}
	r = parse_config(dir, &m->c, err, errlen);
	if (r)
		goto fail;
	r = ro_st_open_dir(dir, &m->st, err, errlen);
	if (r)
		goto fail;
	m->used = calloc(ro_st_count(m->st) + 1, sizeof(*m->used));
	if (!m->used) {
		r = -ENOMEM;
		goto fail;
	}
	r = tensor(m, "model.embed_tokens.weight", 2, m->c.vocab, m->c.hidden, &m->embed, err,
		   errlen);
	if (r)
		goto fail;
	(void)snprintf(m->c.dtype, sizeof(m->c.dtype), "%s",
		       m->embed->dtype == RO_F32 ? "F32" : m->embed->dtype == RO_BF16 ? "BF16"
										      : "F16");
	m->L = calloc(m->c.layers, sizeof(*m->L));
	if (!m->L) {
		r = -ENOMEM;
		goto fail;
	}
	for (uint32_t l = 0; l < m->c.layers; l++) {
		r = load_layer(m, l, err, errlen);
		if (r)
			goto fail;
	}
	r = vec(m, "model.norm.weight", m->c.hidden, &m->final_norm, err, errlen);
	if (r)
		goto fail;
	/* tie_word_embeddings: the head is the embedding, whatever lm_head.weight holds */
	r = mat(m, m->c.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight",
		m->c.vocab, m->c.hidden, &m->head, err, errlen);
	if (r)
		goto fail;
	r = check_all_used(m, err, errlen);
	if (r)
		goto fail;
	ro_kernels_force_scalar(o && o->scalar);
	r = ro_pool_new(threads, &m->pool);
	if (r)
		goto fail;
	r = check_finite(m, err, errlen);
	if (r)
		goto fail;
	m->dir = NULL;
	*ret = m;
	return 0;
fail:
	if (r == -ENOMEM)
		(void)ro_errf(err, errlen, r, "%s: out of memory", dir);
	ro_model_free(m);
	return r;
}

struct ro_model *ro_model_free(struct ro_model *m)
{
	if (!m)
		return NULL;
	ro_pool_free(m->pool);
	for (uint32_t l = 0; m->L && l < m->c.layers; l++) {
		free(m->L[l].gate);
		free(m->L[l].up);
		free(m->L[l].down);
	}
	free(m->L);
	for (size_t i = 0; i < m->n_owned; i++)
		free(m->owned[i]);
	free(m->owned);
	free(m->ws);
	free(m->ews);
	ro_st_free(m->st);
	free(m->used);
	free(m);
	return NULL;
}

const struct ro_model_config *ro_model_config(const struct ro_model *m)
{
	return &m->c;
}

const char *ro_model_kernels(const struct ro_model *m)
{
	(void)m;
	return ro_kernels_name();
}

uint32_t ro_model_threads(const struct ro_model *m)
{
	return ro_pool_size(m->pool);
}

static uint64_t mat_bytes(const struct ro_mat *w)
{
	return (uint64_t)w->rows * w->cols * ro_dtype_size(w->dtype);
}

void ro_model_sizes(const struct ro_model *m, uint64_t *ret_total, uint64_t *ret_active)
{
	uint64_t total = m->embed->bytes, active = 0;

	if (m->head.w != m->embed->data)
		total += mat_bytes(&m->head);
	active += mat_bytes(&m->head);
	for (uint32_t l = 0; l < m->c.layers; l++) {
		const struct layer *L = &m->L[l];
		uint64_t attn = mat_bytes(&L->q) + mat_bytes(&L->k) + mat_bytes(&L->v) +
				mat_bytes(&L->o);
		uint64_t one = mat_bytes(&L->gate[0]) + mat_bytes(&L->up[0]) + mat_bytes(&L->down[0]);

		total += attn + one * L->n_mlp + (L->dense ? 0 : mat_bytes(&L->router));
		active += attn + one * (L->dense ? 1 : m->c.top_k) +
			  (L->dense ? 0 : mat_bytes(&L->router));
	}
	*ret_total = total;
	*ret_active = active;
}

uint32_t ro_model_last_experts(const struct ro_model *m)
{
	return m->experts_run;
}

/* ---- sequences ------------------------------------------------------------------------- */

static size_t kv_row(const struct ro_model *m)
{
	return (size_t)m->c.kv_heads * m->c.head_dim;
}

int ro_seq_new(struct ro_model *m, uint32_t max_len, struct ro_seq **ret)
{
	struct ro_seq *s = calloc(1, sizeof(*s));

	if (!s)
		return -ENOMEM;
	/* positions 0 .. max_pos - 1, and one slot past them for the step that stops */
	if ((uint64_t)max_len > (uint64_t)m->c.max_pos + 1) {
		free(s);
		return -E2BIG;
	}
	s->m = m;
	s->max = max_len ? max_len : m->c.max_pos;
	*ret = s;
	return 0;
}

struct ro_seq *ro_seq_free(struct ro_seq *s)
{
	if (!s)
		return NULL;
	free(s->k);
	free(s->v);
	free(s);
	return NULL;
}

static int seq_reserve(struct ro_seq *s, uint32_t need)
{
	const struct ro_model *m = s->m;
	size_t row = kv_row(m), L = m->c.layers;
	uint32_t cap = s->cap ? s->cap : 64;
	float *k, *v;

	if (need <= s->cap)
		return 0;
	if (need > s->max)
		return -ENOSPC;
	while (cap < need)
		cap *= 2;
	if (cap > s->max)
		cap = s->max;
	k = malloc(L * cap * row * sizeof(float));
	v = malloc(L * cap * row * sizeof(float));
	if (!k || !v) {
		free(k);
		free(v);
		return -ENOMEM;
	}
	for (size_t l = 0; l < L && s->len; l++) {
		memcpy(k + l * cap * row, s->k + l * s->cap * row, s->len * row * sizeof(float));
		memcpy(v + l * cap * row, s->v + l * s->cap * row, s->len * row * sizeof(float));
	}
	free(s->k);
	free(s->v);
	s->k = k;
	s->v = v;
	s->cap = cap;
	return 0;
}

int ro_seq_fork(const struct ro_seq *src, struct ro_seq **ret)
{
	struct ro_seq *s;
	int r = ro_seq_new(src->m, src->max, &s);

	if (r)
		return r;
	r = seq_reserve(s, src->len ? src->len : 1);
	if (r) {
		ro_seq_free(s);
		return r;
	}
	for (size_t l = 0; l < src->m->c.layers && src->len; l++) {
		size_t row = kv_row(src->m);

		memcpy(s->k + l * s->cap * row, src->k + l * src->cap * row,
		       src->len * row * sizeof(float));
		memcpy(s->v + l * s->cap * row, src->v + l * src->cap * row,
		       src->len * row * sizeof(float));
	}
	s->len = src->len;
	*ret = s;
	return 0;
}

uint32_t ro_seq_len(const struct ro_seq *s)
{
	return s->len;
}

uint32_t ro_seq_max(const struct ro_seq *s)
{
	return s->max;
}

void ro_seq_truncate(struct ro_seq *s, uint32_t len)
{
	if (len < s->len)
		s->len = len;
}

/* ---- per-token pieces -------------------------------------------------------------------- */

static void rmsnorm(const float *x, const float *w, uint32_t n, double eps, float *out)
{
	double ss = 0;
	float scale;

	for (uint32_t i = 0; i < n; i++)
		ss += (double)x[i] * x[i];
	scale = (float)(1.0 / sqrt(ss / n + eps));
	for (uint32_t i = 0; i < n; i++)
		out[i] = w[i] * (x[i] * scale);
}

static void rope(float *v, const float *cs, const float *sn, uint32_t hd)
{
	const uint32_t h = hd / 2;

	for (uint32_t i = 0; i < h; i++) {
		float a = v[i], b = v[i + h];

		v[i] = a * cs[i] - b * sn[i];
		v[i + h] = b * cs[i] + a * sn[i];
	}
}

static float dotf(const float *a, const float *b, uint32_t n)
{
	float acc[8] = {0}, s;
	uint32_t n8 = n & ~7u;

	for (uint32_t k = 0; k < n8; k += 8)
		for (int l = 0; l < 8; l++)
			acc[l] = acc[l] + a[k + l] * b[k + l];
	s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
	for (uint32_t k = n8; k < n; k++)
		s = s + a[k] * b[k];
	return s;
}

/* g = silu(g) * u, elementwise: the experts' and dense MLP's activation */
static void swiglu(float *g, const float *u, size_t n)
{
	for (size_t i = 0; i < n; i++)
		g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* ---- the batch ------------------------------------------------------------------------- */

struct gemm_job {
	const struct ro_mat *W;
	const float *x;
	uint32_t T;
	float *y;
	uint32_t ldy, r0, r1;
};

struct jobs {
	struct gemm_job *j;
	uint32_t n, cap;
};

static int jobs_add(struct jobs *J, const struct ro_mat *W, const float *x, uint32_t T,
		    float *y, uint32_t ldy, uint32_t chunk)
{
	for (uint32_t r0 = 0; r0 < W->rows; r0 += chunk) {
		if (J->n == J->cap) {
			uint32_t cap = J->cap ? J->cap * 2 : 256;
			struct gemm_job *nj = realloc(J->j, cap * sizeof(*nj));

			if (!nj)
				return -ENOMEM;
			J->j = nj;
			J->cap = cap;
		}
		J->j[J->n++] = (struct gemm_job){W, x, T, y, ldy, r0,
						 r0 + chunk < W->rows ? r0 + chunk : W->rows};
	}
	return 0;
}

static void run_job(void *arg, uint32_t i)
{
	const struct gemm_job *j = &((const struct jobs *)arg)->j[i];

	ro_gemm_rows(j->W, j->x, j->T, j->y, j->ldy, j->r0, j->r1);
}

/* Rows per task: enough tasks to balance the threads, each big enough to amortize. */
static uint32_t chunk_for(const struct ro_model *m, uint32_t rows, uint32_t T, uint32_t mats)
{
	uint32_t th = ro_pool_size(m->pool), want = th * 4 / (mats ? mats : 1);
	uint32_t c;

	if (want < 1)
		want = 1;
	c = (rows + want - 1) / want;
	c = (c + 3) & ~3u;
	if (c < 16)
		c = 16;
	(void)T;
	return c;
}

static int run_jobs(struct ro_model *m, struct jobs *J)
{
	ro_pool_for(m->pool, J->n, run_job, J);
	J->n = 0;
	return 0;
}

struct fwd {
	struct ro_model *m;
	uint32_t T, layer;
	struct ro_seq **seq;
	uint32_t *pos;
	float *x, *h, *q, *k, *v, *att, *cs, *sn;
	bool avx2;
};

/* Keys per attention tile. Tiles are counted from position 0 of the sequence, so the tiles
 * of a query (and with them every rounding of its running softmax) follow from its own
 * position alone, never from the chunk or the batch it arrived in. */
#define ATT_TILE 64

/* One query row against keys [0, n) of its sequence, flash-attention style: keys in tiles
 * of ATT_TILE positions, a running max and sum, and the output accumulated in out (rescaled
 * whenever a tile raises the max), then divided by the sum once. The only scratch is one
 * tile of scores on the stack, whatever the context. Every float is computed the same way
 * for a given position, whether the query's neighbours in its chunk came in this call or an
 * earlier one: this is what keeps a chunked prefill bitwise a full one.
 *
 * Each output element takes its tile's terms in key order; the loops run over elements
 * first or keys first as suits the vector width, which changes no rounding. */
static void attend_portable(const float *q, const float *K, const float *V, uint32_t row,
			    uint32_t n, uint32_t hd, float scale, float *out)
{
	float sc[ATT_TILE], mx = -INFINITY, sum = 0;

	for (uint32_t d = 0; d < hd; d++)
		out[d] = 0;
	for (uint32_t p0 = 0; p0 < n; p0 += ATT_TILE) {
		const uint32_t w = n - p0 < ATT_TILE ? n - p0 : ATT_TILE;
		float tmx = mx;

		for (uint32_t j = 0; j < w; j++) {
			sc[j] = dotf(q, K + (size_t)(p0 + j) * row, hd) * scale;
			if (sc[j] > tmx)
				tmx = sc[j];
		}
		if (tmx > mx) {
			/* the max grew: rescale what is summed so far (zeros in the first tile) */
			const float a = expf(mx - tmx);

			sum = sum * a;
			for (uint32_t d = 0; d < hd; d++)
				out[d] = out[d] * a;
			mx = tmx;
		}
		for (uint32_t j = 0; j < w; j++) {
			sc[j] = expf(sc[j] - mx);
			sum = sum + sc[j];
		}
		for (uint32_t j = 0; j < w; j++) {
			const float *vr = V + (size_t)(p0 + j) * row;

			for (uint32_t d = 0; d < hd; d++)
				out[d] = out[d] + sc[j] * vr[d];
		}
	}
	for (uint32_t d = 0; d < hd; d++)
		out[d] = out[d] / sum;
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2")))

/* dotf's tree: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) */
static inline AVX2 float hsum8(__m256 v)
{
	__m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	__m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));

	return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* attend_portable with 8-wide vectors, bitwise the same: a multiply then an add for every
 * lane where the portable code has a * b + c (no FMA, -ffp-contract=off), the dot product's
 * eight accumulators as one register, the output eight elements at a time. */
static AVX2 void attend_avx2(const float *q, const float *K, const float *V, uint32_t row,
			     uint32_t n, uint32_t hd, float scale, float *out)
{
	const uint32_t h8 = hd & ~7u;
	float sc[ATT_TILE], mx = -INFINITY, sum = 0;

	for (uint32_t d = 0; d < hd; d++)
		out[d] = 0;
	for (uint32_t p0 = 0; p0 < n; p0 += ATT_TILE) {
		const uint32_t w = n - p0 < ATT_TILE ? n - p0 : ATT_TILE;
		float tmx = mx;

		for (uint32_t j = 0; j < w; j++) {
			const float *kr = K + (size_t)(p0 + j) * row;
			__m256 acc = _mm256_setzero_ps();
			float s;

			for (uint32_t k = 0; k < h8; k += 8)
				acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + k),
								       _mm256_loadu_ps(kr + k)));
			s = hsum8(acc);
			for (uint32_t k = h8; k < hd; k++)
				s = s + q[k] * kr[k];
			sc[j] = s * scale;
			if (sc[j] > tmx)
				tmx = sc[j];
		}
		if (tmx > mx) {
			const float a = expf(mx - tmx);

			sum = sum * a;
			for (uint32_t d = 0; d < hd; d++)
				out[d] = out[d] * a;
			mx = tmx;
		}
		for (uint32_t j = 0; j < w; j++) {
			sc[j] = expf(sc[j] - mx);
			sum = sum + sc[j];
		}
		for (uint32_t d = 0; d < h8; d += 8) {
			const float *vr = V + (size_t)p0 * row + d;
			__m256 o = _mm256_loadu_ps(out + d);

			for (uint32_t j = 0; j < w; j++, vr += row)
				o = _mm256_add_ps(
				    o, _mm256_mul_ps(_mm256_set1_ps(sc[j]), _mm256_loadu_ps(vr)));
			_mm256_storeu_ps(out + d, o);
		}
		for (uint32_t d = h8; d < hd; d++)
			for (uint32_t j = 0; j < w; j++)
				out[d] = out[d] + sc[j] * V[(size_t)(p0 + j) * row + d];
	}
	for (uint32_t d = 0; d < hd; d++)
		out[d] = out[d] / sum;
}
#endif

static void attend_one(void *arg, uint32_t i)
{
	struct fwd *f = arg;
	const struct ro_model_config *c = &f->m->c;
	const uint32_t hd = c->head_dim, t = i / c->heads, hh = i % c->heads;
	const uint32_t kvh = hh / (c->heads / c->kv_heads), row = c->kv_heads * hd;
	const struct ro_seq *s = f->seq[t];
	const float *q = f->q + (size_t)t * c->heads * hd + (size_t)hh * hd;
	const float *K = s->k + (size_t)f->layer * s->cap * row + (size_t)kvh * hd;
	const float *V = s->v + (size_t)f->layer * s->cap * row + (size_t)kvh * hd;
	float *out = f->att + (size_t)t * c->heads * hd + (size_t)hh * hd;
	const float scale = (float)(1.0 / sqrt((double)hd));
	uint32_t n = f->pos[t] + 1, p0 = 0;

	/* sliding_window W: position p sees p - W + 1 .. p (Hugging Face's mask) */
	if (c->sliding_window && n > c->sliding_window)
		p0 = n - c->sliding_window;
	K += (size_t)p0 * row;
	V += (size_t)p0 * row;
	n -= p0;
#if defined(__x86_64__)
	if (f->avx2) {
		attend_avx2(q, K, V, row, n, hd, scale, out);
		return;
	}
#endif
	attend_portable(q, K, V, row, n, hd, scale, out);
}

static void qk_rope_store(void *arg, uint32_t t)
{
	struct fwd *f = arg;
	const struct ro_model_config *c = &f->m->c;
	const struct layer *L = &f->m->L[f->layer];
	const uint32_t hd = c->head_dim, row = c->kv_heads * hd;
	struct ro_seq *s = f->seq[t];
	float *q = f->q + (size_t)t * c->heads * hd, *k = f->k + (size_t)t * row,
	      *v = f->v + (size_t)t * row;
	const float *cs = f->cs + (size_t)t * hd / 2, *sn = f->sn + (size_t)t * hd / 2;

	if (L->bq) { /* nn.Linear's bias, before the norms and RoPE */
		for (uint32_t i = 0; i < c->heads * hd; i++)
			q[i] = q[i] + L->bq[i];
		for (uint32_t i = 0; i < row; i++) {
			k[i] = k[i] + L->bk[i];
			v[i] = v[i] + L->bv[i];
		}
	}

	for (uint32_t hh = 0; hh < c->heads; hh++) {
		if (L->q_norm)
			rmsnorm(q + hh * hd, L->q_norm, hd, c->rms_eps, q + hh * hd);
		rope(q + hh * hd, cs, sn, hd);
	}
	for (uint32_t hh = 0; hh < c->kv_heads; hh++) {
		if (L->k_norm)
			rmsnorm(k + hh * hd, L->k_norm, hd, c->rms_eps, k + hh * hd);
		rope(k + hh * hd, cs, sn, hd);
	}
	memcpy(s->k + (size_t)f->layer * s->cap * row + (size_t)f->pos[t] * row, k,
	       row * sizeof(float));
	memcpy(s->v + (size_t)f->layer * s->cap * row + (size_t)f->pos[t] * row, v,
	       row * sizeof(float));
}

int ro_model_expert(struct ro_model *m, uint32_t layer, uint32_t e, const float *x, uint32_t n,
		    float *y)
{
	const struct layer *L;
	float *g, *u;
	struct jobs J = {0};
	int r = 0;

	if (layer >= m->c.layers || m->L[layer].dense || e >= m->c.experts)
		return -EINVAL;
	if (!n)
		return 0;
	L = &m->L[layer];
	g = malloc((size_t)n * L->ffn * sizeof(float) * 2);
	if (!g)
		return -ENOMEM;
	u = g + (size_t)n * L->ffn;
	r = jobs_add(&J, &L->gate[e], x, n, g, L->ffn, chunk_for(m, L->ffn, n, 2));
	if (!r)
		r = jobs_add(&J, &L->up[e], x, n, u, L->ffn, chunk_for(m, L->ffn, n, 2));
	if (!r) {
		run_jobs(m, &J);
		swiglu(g, u, (size_t)n * L->ffn);
		r = jobs_add(&J, &L->down[e], g, n, y, m->c.hidden,
			     chunk_for(m, m->c.hidden, n, 1));
	}
	if (!r)
		run_jobs(m, &J);
	free(J.j);
	free(g);
	return r;
}

/* Route each token: softmax over the router's logits, top-k (ties to the lower index),
 * renormalized when configured, then sorted by expert index for the combine. */
static void route(const struct ro_model_config *c, const float *logits, int32_t *ids, float *w)
{
	const uint32_t E = c->experts, K = c->top_k;
	float mx = -INFINITY;
	double sum = 0, ksum = 0;

	for (uint32_t e = 0; e < E; e++)
		if (logits[e] > mx)
			mx = logits[e];
	for (uint32_t e = 0; e < E; e++)
		sum += exp((double)logits[e] - mx);
	for (uint32_t j = 0; j < K; j++) {
		int32_t best = -1;

		for (uint32_t e = 0; e < E; e++) {
			bool taken = false;

			for (uint32_t i = 0; i < j && !taken; i++)
				taken = ids[i] == (int32_t)e;
			if (!taken && (best < 0 || logits[e] > logits[best]))
				best = (int32_t)e;
		}
		ids[j] = best;
		w[j] = (float)(exp((double)logits[best] - mx) / sum);
		ksum += w[j];
	}
	if (c->norm_topk)
		for (uint32_t j = 0; j < K; j++)
			w[j] = (float)(w[j] / ksum);
	for (uint32_t j = 1; j < K; j++) /* insertion sort by expert id */
		for (uint32_t i = j; i > 0 && ids[i - 1] > ids[i]; i--) {
			int32_t ti = ids[i];
			float tw = w[i];

			ids[i] = ids[i - 1];
			w[i] = w[i - 1];
			ids[i - 1] = ti;
			w[i - 1] = tw;
		}
}

/* Run n (row, expert) pairs of layer l: y[i] = expert[experts[i]](x[i]). Each
 * expert's rows are gathered, gate/up run for all experts at once, then down, then the
 * results scattered back. A row's result does not depend on what else is in the batch, so
 * the expert-parallel path (pairs received from other ranks) equals the local one. Uses
 * its own scratch: a transport calls it from inside ro_model_forward. */
int ro_model_experts(struct ro_model *m, uint32_t l, const float *const *x,
		     const int32_t *experts, size_t n, float *y)
{
	const struct ro_model_config *c = &m->c;
	const struct layer *L;
	const uint32_t E = c->experts, H = c->hidden;
	uint32_t F, *cnt, *off, *slot;
	float *xe, *g, *u, *ye;
	struct jobs J = {0};
	int r = 0;

	if (l >= c->layers || m->L[l].dense)
		return -EINVAL;
	if (n > UINT32_MAX) /* rows are counted in 32 bits */
		return -E2BIG;
	for (size_t i = 0; i < n; i++)
		if (experts[i] < 0 || (uint32_t)experts[i] >= E)
			return -EINVAL;
	if (!n)
		return 0;
	L = &m->L[l];
	F = L->ffn;
	if (n * (H * 2 + F * 2) > m->ews_len) {
		free(m->ews); /* scratch: nothing to keep, and no old and new block at once */
		m->ews_len = 0;
		m->ews = malloc(n * (H * 2 + F * 2) * sizeof(float));
		if (!m->ews)
			return -ENOMEM;
		m->ews_len = n * (H * 2 + F * 2);
	}
	xe = m->ews;
	g = xe + n * H;
	u = g + n * F;
	ye = u + n * F;
	cnt = calloc(E + 1, sizeof(*cnt));
	off = calloc(E + 1, sizeof(*off));
	slot = malloc(n * sizeof(*slot)); /* gathered row -> pair */
	if (!cnt || !off || !slot) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < n; i++)
		cnt[experts[i]]++;
	for (uint32_t e = 0; e < E; e++)
		off[e + 1] = off[e] + cnt[e];
	memset(cnt, 0, (E + 1) * sizeof(*cnt));
	for (size_t i = 0; i < n; i++) {
		uint32_t e = (uint32_t)experts[i], row = off[e] + cnt[e]++;

		slot[row] = (uint32_t)i;
		memcpy(xe + (size_t)row * H, x[i], H * sizeof(float));
	}
	for (uint32_t e = 0; e < E && !r; e++) {
		uint32_t k = off[e + 1] - off[e];

		if (!k)
			continue;
		m->experts_run++;
		r = jobs_add(&J, &L->gate[e], xe + (size_t)off[e] * H, k, g + (size_t)off[e] * F, F,
			     chunk_for(m, F, k, 2 * c->top_k));
		if (!r)
			r = jobs_add(&J, &L->up[e], xe + (size_t)off[e] * H, k,
				     u + (size_t)off[e] * F, F, chunk_for(m, F, k, 2 * c->top_k));
	}
	if (r)
		goto out;
	run_jobs(m, &J);
	swiglu(g, u, n * F);
	for (uint32_t e = 0; e < E && !r; e++) {
		uint32_t k = off[e + 1] - off[e];

		if (k)
			r = jobs_add(&J, &L->down[e], g + (size_t)off[e] * F, k,
				     ye + (size_t)off[e] * H, H, chunk_for(m, H, k, c->top_k));
	}
	if (r)
		goto out;
	run_jobs(m, &J);
	for (size_t row = 0; row < n; row++)
		memcpy(y + (size_t)slot[row] * H, ye + row * H, H * sizeof(float));
out:
	free(J.j);
	free(cnt);
	free(off);
	free(slot);
	return r;
}

/* Every selected expert's output for every token, computed here. */
static int local_experts(struct ro_model *m, uint32_t l, const float *x, const int32_t *ids,
			 uint32_t T, float *out)
{
	const size_t TK = (size_t)T * m->c.top_k;
	const float **rows = malloc(TK * sizeof(*rows));
	int r;

	if (!rows)
		return -ENOMEM;
	for (size_t i = 0; i < TK; i++)
		rows[i] = x + (i / m->c.top_k) * m->c.hidden;
	r = ro_model_experts(m, l, rows, ids, TK, out);
	free(rows);
	return r;
}

/* A rank with no tokens still takes part in every MoE layer's exchange, in layer order. */
static int forward_idle(struct ro_model *m)
{
	int r = 0;

	for (uint32_t l = 0; l < m->c.layers && !r; l++)
		if (!m->L[l].dense)
			r = m->xch.exchange(m->xch.ctx, l, NULL, NULL, NULL, 0, m->c.top_k,
					    m->c.hidden, NULL);
	return r;
}

static float *ws_get(struct ro_model *m, size_t floats)
{
	if (floats > m->ws_len) {
		/* free, then allocate: the contents are scratch, and realloc would hold the
		 * old and the new block at once */
		free(m->ws);
		m->ws_len = 0;
		m->ws = malloc(floats * sizeof(float));
		if (!m->ws)
			return NULL;
		m->ws_len = floats;
	}
	return m->ws;
}

void ro_model_set_exchange(struct ro_model *m, const struct ro_moe_exchange *x)
{
	m->have_xch = x != NULL;
	if (x)
		m->xch = *x;
}

/* Logit rows the LM head computes per pass: the forward's logits scratch is at most this
 * many rows whatever the batch (the head's weights are read once per pass; a decode batch
 * up to this size is one pass). */
#define HEAD_ROWS 256

/* Floats of the forward's workspace per token: x, h, q, att, k, v, the RoPE cos and sin,
 * the experts' outputs (top_k rows), the dense MLP's gate, up and down (when a layer is
 * dense), the router's logits. Shared by the forward and ro_model_forward_bytes so the two cannot
 * drift. */
static size_t ws_per_token(const struct ro_model_config *c)
{
	const size_t H = c->hidden, hd = c->head_dim, qd = (size_t)c->heads * hd,
		     kvd = (size_t)c->kv_heads * hd;
	const size_t dense = c->dense_layers ? (size_t)c->dense_ffn * 2 + H : 0;

	return H * 2 + qd * 2 + kvd * 2 + hd + (size_t)c->top_k * H + dense + c->experts;
}

/* Logit rows an item gets: one per token with all_logits, else one for its last token. */
static uint32_t item_rows(const struct ro_fwd_item *it)
{
	return it->all_logits ? it->n : (it->n ? 1 : 0);
}

static size_t ws_floats(const struct ro_model_config *c, size_t T, size_t n_out)
{
	return T * ws_per_token(c) + (n_out < HEAD_ROWS ? n_out : HEAD_ROWS) * c->vocab;
}

int ro_model_forward(struct ro_model *m, struct ro_fwd_item *items, size_t count)
{
	const struct ro_model_config *c = &m->c;
	const uint32_t H = c->hidden, hd = c->head_dim, qd = c->heads * hd,
		       kvd = c->kv_heads * hd, K = c->top_k;
	uint32_t T = 0, n_out = 0;
	struct fwd f = {.m = m};
	struct jobs J = {0};
	int32_t *ids = NULL;
	float *rw = NULL;
	uint32_t *out_tok = NULL;
	float *p;
	int r = 0;

	for (size_t i = 0; i < count; i++) {
		if (!items[i].seq || (!items[i].tokens && items[i].n))
			return -EINVAL;
		if ((uint64_t)items[i].seq->len + items[i].n > items[i].seq->max)
			return -ENOSPC;
		/* (token, head) and (token, expert) pairs are counted in 32 bits (the pool's
		 * indexes, the experts' row offsets) */
		if (((uint64_t)T + items[i].n) * (c->heads > K ? c->heads : K) > UINT32_MAX)
			return -E2BIG;
		for (uint32_t j = 0; j < items[i].n; j++)
			if (items[i].tokens[j] < 0 || (uint32_t)items[i].tokens[j] >= c->vocab)
				return -EINVAL;
		for (size_t k = 0; k < i; k++)
			if (items[k].seq == items[i].seq)
				return -EINVAL; /* one entry per sequence and batch */
		T += items[i].n;
		n_out += item_rows(&items[i]);
	}
	if (!T)
		return m->have_xch ? forward_idle(m) : 0;
	m->experts_run = 0;
	for (size_t i = 0; i < count; i++) {
		r = seq_reserve(items[i].seq, items[i].seq->len + items[i].n);
		if (r)
			return r;
	}
	/* O(tokens x hidden): attention keeps its scores in a tile on each thread's stack */
	p = ws_get(m, ws_floats(c, T, n_out));
	f.seq = malloc(T * sizeof(*f.seq));
	f.pos = malloc(T * sizeof(*f.pos));
	ids = malloc((size_t)T * K * sizeof(*ids));
	rw = malloc((size_t)T * K * sizeof(*rw));
	out_tok = malloc((size_t)n_out * sizeof(*out_tok));
	if (!p || !f.seq || !f.pos || !ids || !rw || (n_out && !out_tok)) {
		r = -ENOMEM;
		goto out;
	}
	f.T = T;
	f.avx2 = ro_kernels_avx2();
	f.x = p;
	f.h = f.x + (size_t)T * H;
	f.q = f.h + (size_t)T * H;
	f.att = f.q + (size_t)T * qd;
	f.k = f.att + (size_t)T * qd;
	f.v = f.k + (size_t)T * kvd;
	f.cs = f.v + (size_t)T * kvd;
	f.sn = f.cs + (size_t)T * hd / 2;
	{
		const size_t dense = c->dense_layers ? (size_t)c->dense_ffn * 2 + H : 0;
		float *moe_out = f.sn + (size_t)T * hd / 2;
		float *scratch = moe_out + (size_t)T * K * H;
		float *router = scratch + (size_t)T * dense;
		float *logits = router + (size_t)T * c->experts;
		uint32_t t = 0, o = 0;

		for (size_t i = 0; i < count; i++) {
			for (uint32_t j = 0; j < items[i].n; j++, t++) {
				struct ro_seq *s = items[i].seq;
				const size_t e = (size_t)items[i].tokens[j] * H;

				f.seq[t] = s;
				f.pos[t] = s->len + j;
				for (uint32_t d = 0; d < H; d++)
					f.x[(size_t)t * H + d] = elem(m->embed, e + d);
				/* HF computes inv_freq and the angles in float32 */
				for (uint32_t d = 0; d < hd / 2; d++) {
					float inv = (float)(1.0 / pow(c->rope_theta, (double)(2 * d) / hd));
					float ang = (float)f.pos[t] * inv;

					f.cs[(size_t)t * hd / 2 + d] = cosf(ang);
					f.sn[(size_t)t * hd / 2 + d] = sinf(ang);
				}
				if (items[i].all_logits || j + 1 == items[i].n)
					out_tok[o++] = t;
			}
		}
		for (uint32_t l = 0; l < c->layers; l++) {
			const struct layer *L = &m->L[l];

			f.layer = l;
			for (t = 0; t < T; t++)
				rmsnorm(f.x + (size_t)t * H, L->in_norm, H, c->rms_eps,
					f.h + (size_t)t * H);
			if ((r = jobs_add(&J, &L->q, f.h, T, f.q, qd, chunk_for(m, qd, T, 3))) ||
			    (r = jobs_add(&J, &L->k, f.h, T, f.k, kvd, chunk_for(m, kvd, T, 3))) ||
			    (r = jobs_add(&J, &L->v, f.h, T, f.v, kvd, chunk_for(m, kvd, T, 3))))
				goto out;
			run_jobs(m, &J);
			ro_pool_for(m->pool, T, qk_rope_store, &f);
			ro_pool_for(m->pool, T * c->heads, attend_one, &f);
			/* o_proj into h, then the residual */
			if ((r = jobs_add(&J, &L->o, f.att, T, f.h, H, chunk_for(m, H, T, 1))))
				goto out;
			run_jobs(m, &J);
			if (L->bo)
				for (t = 0; t < T; t++)
					for (uint32_t d = 0; d < H; d++)
						f.h[(size_t)t * H + d] = f.h[(size_t)t * H + d] + L->bo[d];
			for (size_t i = 0; i < (size_t)T * H; i++)
				f.x[i] = f.x[i] + f.h[i];
			for (t = 0; t < T; t++)
				rmsnorm(f.x + (size_t)t * H, L->post_norm, H, c->rms_eps,
					f.h + (size_t)t * H);
			if (L->dense) {
				float *g = scratch, *u = g + (size_t)T * L->ffn,
				      *y = u + (size_t)T * L->ffn;

				if ((r = jobs_add(&J, &L->gate[0], f.h, T, g, L->ffn,
						  chunk_for(m, L->ffn, T, 2))) ||
				    (r = jobs_add(&J, &L->up[0], f.h, T, u, L->ffn,
						  chunk_for(m, L->ffn, T, 2))))
					goto out;
				run_jobs(m, &J);
				swiglu(g, u, (size_t)T * L->ffn);
				if ((r = jobs_add(&J, &L->down[0], g, T, y, H, chunk_for(m, H, T, 1))))
					goto out;
				run_jobs(m, &J);
				for (size_t i = 0; i < (size_t)T * H; i++)
					f.x[i] = f.x[i] + y[i];
				continue;
			}
			if ((r = jobs_add(&J, &L->router, f.h, T, router, c->experts,
					  chunk_for(m, c->experts, T, 1))))
				goto out;
			run_jobs(m, &J);
			for (t = 0; t < T; t++)
				route(c, router + (size_t)t * c->experts, ids + (size_t)t * K,
				      rw + (size_t)t * K);
			if (m->have_xch)
				r = m->xch.exchange(m->xch.ctx, l, f.h, ids, rw, T, K, H, moe_out);
			else
				r = local_experts(m, l, f.h, ids, T, moe_out);
			if (r)
				goto out;
			if (m->have_xch && m->xch.summed) {
				/* the transport summed the weighted outputs: only the residual */
				for (size_t i = 0; i < (size_t)T * H; i++)
					f.x[i] = f.x[i] + moe_out[i];
				continue;
			}
			/* combine: the weighted outputs summed in expert order, then the residual */
			for (t = 0; t < T; t++) {
				float *xr = f.x + (size_t)t * H;

				for (uint32_t d = 0; d < H; d++) {
					float acc = 0;

					for (uint32_t j = 0; j < K; j++)
						acc = acc + rw[(size_t)t * K + j] *
								moe_out[((size_t)t * K + j) * H + d];
					xr[d] = xr[d] + acc;
				}
			}
		}
		/* final norm and the LM head, only for the rows whose logits are wanted */
		for (o = 0; o < n_out; o++)
			rmsnorm(f.x + (size_t)out_tok[o] * H, m->final_norm, H, c->rms_eps,
				f.h + (size_t)o * H);
		{
			/* the head in passes of HEAD_ROWS rows: a row's logits are the same bits
			 * whatever the pass holds (ro_gemm_rows), and the scratch stays bounded
			 * however many rows all_logits asks for */
			size_t it = 0;
			uint32_t it_row = 0;

			for (uint32_t o0 = 0; o0 < n_out && !r; o0 += HEAD_ROWS) {
				const uint32_t rows =
				    n_out - o0 > HEAD_ROWS ? HEAD_ROWS : n_out - o0;

				r = jobs_add(&J, &m->head, f.h + (size_t)o0 * H, rows, logits,
					     c->vocab, chunk_for(m, c->vocab, rows, 1));
				if (r)
					break;
				run_jobs(m, &J);
				for (o = 0; o < rows; o++, it_row++) {
					/* items own consecutive rows: find this one's */
					while (it_row == item_rows(&items[it])) {
						it++;
						it_row = 0;
					}
					if (items[it].logits)
						memcpy(items[it].logits + (size_t)it_row * c->vocab,
						       logits + (size_t)o * c->vocab,
						       c->vocab * sizeof(float));
				}
			}
		}
		for (size_t i = 0; i < count && !r; i++)
			items[i].seq->len += items[i].n;
	}
out:
	free(J.j);
	free(f.seq);
	free(f.pos);
	free(ids);
	free(rw);
	free(out_tok);
	return r;
}

/* ---- memory estimates ------------------------------------------------------------------- */

/* A sequence's cache grows by doubling from 64 positions up to max_len; while it grows the
 * old and the new cache are both held. The largest old one below max_len is the peak's
 * other half. */
uint64_t ro_model_seq_bytes(const struct ro_model *m, uint32_t max_len)
{
	const uint64_t max = max_len ? max_len : m->c.max_pos;
	const uint64_t pos = 2ULL * m->c.layers * kv_row(m) * sizeof(float); /* K and V */
	uint64_t prev = 0;

	for (uint64_t cap = 64; cap < max; cap *= 2)
		prev = cap;
	return sizeof(struct ro_seq) + pos * (max + prev);
}

/* A job array of a phase that adds n jobs: its capacity and, while realloc moves it, the
 * old half of that. */
static uint64_t jobs_bytes(uint64_t n)
{
	uint64_t cap = n * 2 > 256 ? n * 2 : 256;

	return cap * 3 / 2 * sizeof(struct gemm_job);
}

/* Rows per job are at least 16 (chunk_for): a bound on a matrix's jobs. */
static uint64_t njobs(uint64_t rows)
{
	return rows / 16 + 1;
}

/* Everything ro_model_forward allocates, as if all of it were live at once: the workspace,
 * the experts' scratch and their index arrays, the job lists. A bound, not a guess: tests
 * check it against what malloc is asked for. */
uint64_t ro_model_forward_bytes(const struct ro_model *m, uint32_t tokens)
{
	const struct ro_model_config *c = &m->c;
	const uint64_t T = tokens, TK = T * c->top_k, H = c->hidden, E = c->experts;
	const uint64_t qd = (uint64_t)c->heads * c->head_dim, kvd = kv_row(m);
	uint64_t b, fj, ej;
	bool moe = false;

	if (!tokens)
		return 0;
	for (uint32_t l = 0; l < c->layers; l++)
		moe = moe || !m->L[l].dense;
	b = ws_floats(c, T, T) * sizeof(float);
	/* f.seq, f.pos, ids, rw, out_tok */
	b += T * (sizeof(struct ro_seq *) + sizeof(uint32_t) * 2) + TK * (sizeof(int32_t) * 2);
	fj = njobs(qd) + njobs(kvd) * 2;
	fj = fj > njobs(H) ? fj : njobs(H);
	fj = fj > njobs(c->dense_ffn) * 2 ? fj : njobs(c->dense_ffn) * 2;
	fj = fj > njobs(E) ? fj : njobs(E);
	fj = fj > njobs(c->vocab) ? fj : njobs(c->vocab);
	b += jobs_bytes(fj);
	if (moe) {
		/* local_experts' row pointers; ro_model_experts' scratch, counts and slots */
		b += TK * sizeof(float *);
		b += TK * (H * 2 + (uint64_t)c->expert_ffn * 2) * sizeof(float);
		b += (E + 1) * sizeof(uint32_t) * 2 + TK * sizeof(uint32_t);
		ej = E * njobs(c->expert_ffn) * 2;
		ej = ej > E * njobs(H) ? ej : E * njobs(H);
		b += jobs_bytes(ej);
	}
	return b;
}
