/* The model's loader: config.json read as Hugging Face's config classes read it, the
 * safetensors weights checked against it (every shape, every tensor used, no NaN), bf16,
 * f32 and FP8 weights used in place from the mapping or copied into huge pages
 * (opts.hugepages), f16 widened once. */
#include <errno.h>
#include <json-c/json.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kernels/model_internal.h"

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

/* Block FP8 as Hugging Face's fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3) writes it:
 * quant_method "fp8", weight_block_size [128, 128], fmt "e4m3" and activation_scheme
 * "dynamic" when given, modules_to_not_convert a list of names when given (which weights are
 * FP8 is read from each tensor's dtype). Anything else (static activation scales, another
 * block size or format, unknown keys) is refused: it would not be computed as written. The
 * activations stay f32 here (the "dynamic" scheme quantizes them in HF's kernel): logits are
 * those of the dequantized weights, which is what tests/ref/ref_moe.py computes. */
static int cfg_quant(const struct cfg *x, struct ro_model_config *c)
{
	struct json_object *q = cfg_get(x, "quantization_config"), *v;
	const char *k = "quantization_config";

	if (!q)
		return 0;
	if (!json_object_is_type(q, json_type_object))
		return cfg_bad(x, k, "%.64s is not an object", cfg_show(q));
	json_object_object_foreach (q, key, val) {
		const bool str = json_object_is_type(val, json_type_string);
		const char *sv = str ? json_object_get_string(val) : "";

		if (!strcmp(key, "quant_method")) {
			if (!str || strcmp(sv, "fp8"))
				return cfg_bad(x, k, "quant_method %.64s is not supported (fp8)",
					       cfg_show(val));
		} else if (!strcmp(key, "fmt")) {
			if (!str || strcmp(sv, "e4m3"))
				return cfg_bad(x, k, "fmt %.64s is not supported (e4m3)",
					       cfg_show(val));
		} else if (!strcmp(key, "activation_scheme")) {
			if (!str || strcmp(sv, "dynamic"))
				return cfg_bad(x, k,
					       "activation_scheme %.64s is not supported (dynamic)",
					       cfg_show(val));
		} else if (!strcmp(key, "weight_block_size")) {
			if (!json_object_is_type(val, json_type_array) ||
			    json_object_array_length(val) != 2)
				return cfg_bad(x, k, "weight_block_size %.64s is not [128, 128]",
					       cfg_show(val));
			for (size_t i = 0; i < 2; i++) {
				struct json_object *e = json_object_array_get_idx(val, i);

				if (!json_object_is_type(e, json_type_int) ||
				    json_object_get_int64(e) != RO_FP8_BLOCK)
					return cfg_bad(x, k,
						       "weight_block_size %.64s is not supported "
						       "([128, 128])",
						       cfg_show(val));
			}
		} else if (!strcmp(key, "modules_to_not_convert")) {
			if (json_object_is_type(val, json_type_null))
				continue;
			if (!json_object_is_type(val, json_type_array))
				return cfg_bad(x, k, "modules_to_not_convert is not a list");
			for (size_t i = 0; i < json_object_array_length(val); i++)
				if (!json_object_is_type(json_object_array_get_idx(val, i),
							 json_type_string))
					return cfg_bad(x, k,
						       "modules_to_not_convert[%zu] is not "
						       "a string",
						       i);
		} else {
			return cfg_bad(x, k, "key %.64s is not supported", key);
		}
	}
	if (!json_object_object_get_ex(q, "quant_method", &v))
		return cfg_bad(x, k, "quant_method is missing (fp8)");
	if (!json_object_object_get_ex(q, "weight_block_size", &v))
		return cfg_bad(x, k, "weight_block_size is missing ([128, 128])");
	c->fp8 = true;
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
	if ((r = cfg_quant(x, c)))
		return r;
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
		if ((r = cfg_u32(x, "num_experts", &c->experts, true, 1, RO_MAX_EXPERTS)) ||
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
		if ((r = cfg_u32(x, "num_local_experts", &c->experts, true, 1, RO_MAX_EXPERTS)) ||
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


static int vec(struct ro_model *m, const char *name, uint64_t n, float **ret, char *err,
	       size_t errlen)
{
	const struct ro_tensor *t;
	float *v;
	int r = tensor(m, name, 1, n, 0, &t, err, errlen);

	if (r)
		return r;
	if (t->dtype == RO_F8E4M3)
		return ro_errf(err, errlen, -ENOTSUP,
			       "%s: tensor %s: F8_E4M3 is supported for linear weights only",
			       ro_st_file(m->st, t), name);
	v = malloc(n * sizeof(*v));
	if (!v)
		return -ENOMEM;
	for (uint64_t i = 0; i < n; i++)
		v[i] = ro_elem(t, i);
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
	ret->scale = NULL;
	ret->scale_cols = 0;
	ret->src = ret->src_scale = NULL;
	if (t->dtype == RO_F8E4M3) {
		const struct ro_tensor *s;
		const uint32_t sr = (rows + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK,
			       sc = (cols + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK;
		char sn[320];

		if (!m->c.fp8)
			return ro_errf(err, errlen, -EINVAL,
				       "%s: tensor %s is F8_E4M3 but config.json has no fp8 "
				       "quantization_config",
				       ro_st_file(m->st, t), name);
		(void)snprintf(sn, sizeof(sn), "%s_scale_inv", name);
		r = tensor(m, sn, 2, sr, sc, &s, err, errlen);
		if (r)
			return r;
		if (s->dtype != RO_F32)
			return ro_errf(err, errlen, -ENOTSUP,
				       "%s: tensor %s: weight_scale_inv must be F32",
				       ro_st_file(m->st, s), sn);
		ret->w = t->data;
		ret->dtype = RO_F8E4M3;
		ret->scale = s->data;
		ret->scale_cols = sc;
		ret->src = t;
		ret->src_scale = s;
		return 0;
	}
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
	ret->src = t;
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
	const void **data; /* what is scanned of each: its mapping, or the huge-page copy */
	uint64_t *bad;	   /* per tensor: first non-finite element + 1, or 0 */
	uint32_t *pcols;   /* per tensor: its cols where data is in panels, else 0 */
};

/* Whether element k of data (of dtype dt) is NaN or infinite. */
static bool non_finite(enum ro_dtype dt, const void *data, uint64_t k)
{
	if (dt == RO_F32) {
		uint32_t u;

		memcpy(&u, (const uint8_t *)data + 4 * k, 4);
		return (u & 0x7f800000u) == 0x7f800000u;
	}
	if (dt == RO_F8E4M3) /* e4m3fn has no infinity; 0x7f and 0xff are NaN */
		return (((const uint8_t *)data)[k] & 0x7f) == 0x7f;
	{
		const uint16_t h = ((const uint16_t *)data)[k];

		return dt == RO_BF16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
	}
}

/* Chunks of SCAN_CHUNK elements are tested 8 bytes at a time (the scan reads every weight
 * once at load, ~1.8 GB for the bench model: an element at a time it took 1.5 s), and
 * only a chunk that holds a bad element is searched for the first one. A lane is
 * non-finite when its exponent bits (mask E) are all set: (w & E) ^ E has a zero lane
 * then, and no other (the lanes' top bits are clear in E), which the usual zero-lane
 * test finds exactly. */
#define SCAN_CHUNK 4096

static bool chunk_bad(enum ro_dtype dt, const void *data, uint64_t k0, uint64_t n)
{
	const size_t es = ro_dtype_size(dt);
	const uint8_t *p = (const uint8_t *)data + k0 * es;
	const uint64_t words = n * es / 8;
	uint64_t E, lo, hi, bad = 0;

	if (dt == RO_F32) {
		E = 0x7f8000007f800000ull;
		lo = 0x0000000100000001ull;
	} else if (dt == RO_F8E4M3) {
		E = 0x7f7f7f7f7f7f7f7full;
		lo = 0x0101010101010101ull;
	} else {
		E = dt == RO_BF16 ? 0x7f807f807f807f80ull : 0x7c007c007c007c00ull;
		lo = 0x0001000100010001ull;
	}
	hi = lo << (8 * es - 1);
	for (uint64_t i = 0; i < words; i++) {
		uint64_t w, y;

		memcpy(&w, p + 8 * i, 8);
		y = (w & E) ^ E;
		bad |= (y - lo) & ~y & hi;
	}
	for (uint64_t k = words * 8 / es; k < n && !bad; k++)
		bad = non_finite(dt, data, k0 + k);
	return bad != 0;
}

static void scan_one(void *arg, uint32_t i)
{
	struct scan *sc = arg;
	const struct ro_tensor *t = sc->t[i];
	const void *d = sc->data[i];
	const uint64_t n = t->bytes / ro_dtype_size(t->dtype);

	for (uint64_t k0 = 0; k0 < n; k0 += SCAN_CHUNK) {
		const uint64_t c = n - k0 < SCAN_CHUNK ? n - k0 : SCAN_CHUNK;

		if (!chunk_bad(t->dtype, d, k0, c))
			continue;
		for (uint64_t k = k0; k < k0 + c; k++)
			if (non_finite(t->dtype, d, k)) {
				sc->bad[i] = k + 1;
				return;
			}
	}
}

/* NaN or infinity anywhere in a weight the model reads makes every logit downstream
 * meaningless: refused at load, with the tensor and the element named. copy[i], where
 * not NULL, is tensor i's huge-page copy: scanned instead of its mapping, which is then
 * never touched. */
static int check_finite(struct ro_model *m, const void *const *copy, const uint32_t *panel_cols,
			char *err, size_t errlen)
{
	const size_t n = ro_st_count(m->st);
	struct scan sc = {.t = calloc(n, sizeof(*sc.t)),
			  .data = calloc(n, sizeof(*sc.data)),
			  .bad = calloc(n, sizeof(*sc.bad)),
			  .pcols = calloc(n, sizeof(*sc.pcols))};
	uint32_t k = 0;
	int r = 0;

	if (!sc.t || !sc.data || !sc.bad || !sc.pcols) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < n; i++)
		if (m->used[i]) {
			sc.t[k] = ro_st_at(m->st, i);
			sc.data[k] = copy && copy[i] ? copy[i] : sc.t[k]->data;
			sc.pcols[k] = copy && copy[i] && panel_cols ? panel_cols[i] : 0;
			k++;
		}
	ro_pool_for(m->pool, k, scan_one, &sc);
	for (uint32_t i = 0; i < k && !r; i++)
		if (sc.bad[i]) {
			const struct ro_tensor *t = sc.t[i];
			/* the element as the file numbers it (a panelled copy is reordered; its
			 * first bad element in the copy's order is named) */
			const uint64_t at =
			    sc.pcols[i] ? ro_panel_index(sc.bad[i] - 1, sc.pcols[i],
						       ro_dtype_size(t->dtype))
					: sc.bad[i] - 1;
			float v = t->dtype == RO_F32	  ? 0
				  : t->dtype == RO_F8E4M3 ? NAN
							  : ro_elem(t, at);

			if (t->dtype == RO_F32)
				memcpy(&v, (const uint8_t *)sc.data[i] + 4 * (sc.bad[i] - 1), 4);
			r = ro_errf(err, errlen, -EINVAL, "%s: tensor %s: element %llu is %s",
				    ro_st_file(m->st, t), t->name, (unsigned long long)at,
				    isnan(v) ? "NaN" : "infinite");
		}
out:
	free(sc.t);
	free(sc.data);
	free(sc.bad);
	free(sc.pcols);
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

/* ---- the linear weights in huge pages (opts.hugepages) ------------------------------------
 * A decode step streams every expert it runs once: ~1.6 GB at batch 32 for the bench model,
 * read through the page cache's 4 KiB pages, a TLB miss and page walk every 4 KiB of each
 * stream. One anonymous region advised MADV_HUGEPAGE holds the same bytes in 2 MiB pages.
 * They are read into it from the files (pread: faulting the mapping in 4 KiB at a time
 * costs twice as much as the copy), so the mapped pages of the copied tensors are never
 * touched and the weights are resident once; the NaN scan then reads the copy. The region
 * is made read-only. */

#define PIN_ALIGN 64

struct pin_job {
	struct ro_mat **mat;
	uint64_t *off; /* of each mat's weights in the region; its scales follow */
	size_t n, cap;
	uint8_t *base;
	const struct ro_st_set *st;
};

static uint64_t pin_round(uint64_t n)
{
	return (n + PIN_ALIGN - 1) / PIN_ALIGN * PIN_ALIGN;
}

static uint64_t pin_size(const struct ro_mat *w)
{
	return pin_round(w->src->bytes) + (w->src_scale ? pin_round(w->src_scale->bytes) : 0);
}

static int pin_add(struct pin_job *j, struct ro_mat *w)
{
	if (!w->src)
		return 0; /* owned (f16 widened): not in the mapping */
	if (j->n == j->cap) {
		size_t cap = j->cap ? 2 * j->cap : 256;
		struct ro_mat **m = realloc(j->mat, cap * sizeof(*m));

		if (!m)
			return -ENOMEM;
		j->mat = m;
		j->cap = cap;
	}
	j->mat[j->n++] = w;
	return 0;
}

/* The linear weights this process reads: attention, router, the experts it owns, the
 * head unless it is the embedding (which stays mapped: a gather of a few rows a step). */
static int pin_collect(struct ro_model *m, const struct ro_model_opts *o, struct pin_job *j)
{
	const uint32_t world = o->ep_world > 1 ? o->ep_world : 1;
	int r = 0;

	for (uint32_t l = 0; !r && l < m->c.layers; l++) {
		struct layer *L = &m->L[l];

		if ((r = pin_add(j, &L->q)) || (r = pin_add(j, &L->k)) || (r = pin_add(j, &L->v)) ||
		    (r = pin_add(j, &L->o)) || (!L->dense && (r = pin_add(j, &L->router))))
			break;
		for (uint32_t e = 0; !r && e < L->n_mlp; e++)
			if (L->dense || e % world == o->ep_rank % world)
				if ((r = pin_add(j, &L->gate[e])) || (r = pin_add(j, &L->up[e])) ||
				    (r = pin_add(j, &L->down[e])))
					break;
	}
	if (!r && m->head.w != m->embed->data)
		r = pin_add(j, &m->head);
	return r;
}

/* From the file; should a read fail (a file shortened since it was mapped), from the
 * mapping, which then reports what it does (SIGBUS past the end, as any mapped load). */
static void pin_one(const struct ro_st_set *st, const struct ro_tensor *t, uint8_t *d)
{
	if (ro_st_read(st, t, d))
		memcpy(d, t->data, t->bytes);
}

static void pin_copy(void *arg, uint32_t i)
{
	struct pin_job *j = arg;
	struct ro_mat *w = j->mat[i];
	uint8_t *d = j->base + j->off[i];
	uint8_t *tmp;

	/* in panels where the kernels run them faster (ro_panel_wanted): read, then packed;
	 * without the memory for the read, as the file has it */
	if (ro_panel_wanted(w) && (tmp = malloc(w->src->bytes))) {
		pin_one(j->st, w->src, tmp);
		ro_panel_pack(tmp, w->rows, w->cols, ro_dtype_size(w->dtype), d);
		free(tmp);
		w->panel = true;
	} else {
		pin_one(j->st, w->src, d);
	}
	if (w->src_scale)
		pin_one(j->st, w->src_scale, d + pin_round(w->src->bytes));
}

/* "always [madvise] never" -> whether MADV_HUGEPAGE can get huge pages */
static bool thp_enabled(char *why, size_t len)
{
	char buf[128] = "";
	FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "re");

	if (!f) {
		(void)snprintf(why, len, "no transparent huge pages (%s)", strerror(errno));
		return false;
	}
	if (!fgets(buf, sizeof(buf), f))
		buf[0] = 0;
	(void)fclose(f);
	if (strstr(buf, "[never]")) {
		(void)snprintf(why, len,
			       "transparent huge pages are off (/sys/kernel/mm/"
			       "transparent_hugepage/enabled: never)");
		return false;
	}
	return true;
}

/* Copies the weights and fills copy[] (per tensor index: where its copy is; panel_cols[]:
 * its cols where the copy is in panels, else 0) for the NaN
 * scan. Never fails the load for want of a region: the weights then stay where they are
 * (pin_why says why). */
static int pin_weights(struct ro_model *m, const struct ro_model_opts *o, const void **copy,
		       uint32_t *panel_cols)
{
	struct pin_job j = {.st = m->st};
	uint64_t total = 0;
	size_t len;
	int r, madv_err;

	if (!thp_enabled(m->pin_why, sizeof(m->pin_why)))
		return 0;
	r = pin_collect(m, o, &j);
	if (!r && j.n && !(j.off = malloc(j.n * sizeof(*j.off))))
		r = -ENOMEM;
	if (r || !j.n)
		goto out;
	for (size_t i = 0; i < j.n; i++) {
		j.off[i] = total;
		total += pin_size(j.mat[i]);
	}
	len = (size_t)((total + RO_HUGE_PAGE - 1) / RO_HUGE_PAGE * RO_HUGE_PAGE);
	j.base = ro_map_huge(len, 0, &madv_err);
	if (!j.base) {
		(void)snprintf(m->pin_why, sizeof(m->pin_why), "no region of %zu bytes: %s", len,
			       strerror(errno));
		goto out;
	}
	if (madv_err)
		(void)snprintf(m->pin_why, sizeof(m->pin_why), "madvise(MADV_HUGEPAGE): %s",
			       strerror(madv_err)); /* still one contiguous copy: kept */
	ro_pool_for(m->pool, (uint32_t)j.n, pin_copy, &j);
	for (size_t i = 0; i < j.n; i++) {
		struct ro_mat *w = j.mat[i];
		const uint8_t *d = j.base + j.off[i];

		copy[ro_st_index(m->st, w->src)] = d;
		if (w->panel)
			panel_cols[ro_st_index(m->st, w->src)] = w->cols;
		w->w = d;
		if (w->src_scale) {
			d += pin_round(w->src->bytes);
			copy[ro_st_index(m->st, w->src_scale)] = d;
			w->scale = (const float *)d;
		}
		w->src = w->src_scale = NULL;
	}
	(void)mprotect(j.base, len, PROT_READ);
	m->pin = j.base;
	m->pin_len = len;
	m->pin_bytes = total;
out:
	free(j.mat);
	free(j.off);
	return r;
}

void ro_model_pinned(const struct ro_model *m, struct ro_model_pin *ret)
{
	const uintptr_t lo = (uintptr_t)m->pin, hi = lo + m->pin_len;
	FILE *f;
	char line[512];
	bool in = false;

	memset(ret, 0, sizeof(*ret));
	ret->bytes = m->pin_bytes;
	(void)snprintf(ret->why, sizeof(ret->why), "%s", m->pin_why);
	if (!m->pin || !(f = fopen("/proc/self/smaps", "re")))
		return;
	while (fgets(line, sizeof(line), f)) {
		unsigned long a, b, kb;

		if (sscanf(line, "%lx-%lx ", &a, &b) == 2 && strchr(line, '-') < strchr(line, ' '))
			in = a < hi && b > lo;
		else if (in && sscanf(line, "AnonHugePages: %lu kB", &kb) == 1)
			ret->huge_bytes += (uint64_t)kb << 10;
	}
	(void)fclose(f);
}

#define MAX_THREADS 1024

int ro_model_load(const char *dir, const struct ro_model_opts *o, struct ro_model **ret,
		  char *err, size_t errlen)
{
	struct ro_model *m = calloc(1, sizeof(*m));
	const void **copy = NULL;
	uint32_t *panel_cols = NULL;
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
	if (m->embed->dtype == RO_F8E4M3) {
		r = ro_errf(err, errlen, -ENOTSUP,
			    "%s: tensor model.embed_tokens.weight: F8_E4M3 is supported for linear "
			    "weights only",
			    ro_st_file(m->st, m->embed));
		goto fail;
	}
	(void)snprintf(m->c.dtype, sizeof(m->c.dtype), "%s",
		       m->c.fp8			    ? "F8_E4M3"
		       : m->embed->dtype == RO_F32  ? "F32"
		       : m->embed->dtype == RO_BF16 ? "BF16"
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
	if (o && o->hugepages) {
		copy = calloc(ro_st_count(m->st) + 1, sizeof(*copy));
		panel_cols = calloc(ro_st_count(m->st) + 1, sizeof(*panel_cols));
		r = copy && panel_cols ? pin_weights(m, o, copy, panel_cols) : -ENOMEM;
	} else {
		(void)snprintf(m->pin_why, sizeof(m->pin_why), "off");
	}
	if (!r)
		r = check_finite(m, copy, panel_cols, err, errlen);
	free(copy);
	free(panel_cols);
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
	if (m->pin)
		(void)munmap(m->pin, m->pin_len);
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

void ro_model_last_split(const struct ro_model *m, struct ro_model_split *ret)
{
	*ret = m->split;
}
