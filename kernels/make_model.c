/* Random models in Hugging Face layout (config.json + model.safetensors, or shards with
 * model.safetensors.index.json), seeded, so the tests, the benchmarks and the demo have a
 * Qwen3-MoE or Mixtral model without a download. The weights are scaled so activations and
 * logits keep a sane range through many layers. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "kernels/internal.h"
#include "kernels/model.h"

struct spec {
	char name[128];
	uint64_t d0, d1; /* d1 == 0: a vector */
	int kind;	 /* 0 linear, 1 norm, 2 embedding, 3 router, 4 bias, 5 FP8 scales */
	enum ro_dtype dt;
	size_t of; /* kind 5: the weight (spec index) these are weight_scale_inv of */
	uint32_t shard;
	uint64_t off;
};

void ro_make_model_defaults(struct ro_make_model_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->arch = RO_ARCH_QWEN3_MOE;
	o->layers = 2;
	o->hidden = 64;
	o->heads = 4;
	o->kv_heads = 2;
	o->head_dim = 16;
	o->experts = 8;
	o->top_k = 2;
	o->expert_ffn = 32;
	o->vocab = 256;
	o->dtype = "BF16";
	o->seed = 1;
	o->shards = 1;
	o->rope_theta = 10000.0;
	o->norm_topk = true;
}

static int add(struct spec **v, size_t *n, size_t *cap, int kind, uint64_t d0, uint64_t d1,
	       const char *fmt, ...) __attribute__((format(printf, 7, 8)));

static int add(struct spec **v, size_t *n, size_t *cap, int kind, uint64_t d0, uint64_t d1,
	       const char *fmt, ...)
{
	va_list ap;

	if (*n == *cap) {
		size_t c = *cap ? *cap * 2 : 64;
		struct spec *nv = realloc(*v, c * sizeof(*nv));

		if (!nv)
			return -ENOMEM;
		*v = nv;
		*cap = c;
	}
	memset(&(*v)[*n], 0, sizeof(**v));
	va_start(ap, fmt);
	(void)vsnprintf((*v)[*n].name, sizeof((*v)[*n].name), fmt, ap);
	va_end(ap);
	(*v)[*n].d0 = d0;
	(*v)[*n].d1 = d1;
	(*v)[*n].kind = kind;
	(*n)++;
	return 0;
}

static uint64_t rng(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

/* uniform in [-1, 1) */
static float unif(uint64_t *s)
{
	return (float)((double)(rng(s) >> 11) * 0x1.0p-52 - 1.0);
}

/* The tensor's values as f32, seeded by the seed and its name only. */
static void gen(const struct spec *t, uint64_t seed, float *v)
{
	uint64_t n = t->d0 * (t->d1 ? t->d1 : 1), s = seed;
	double scale;

	for (const char *p = t->name; *p; p++)
		s = s * 131 + (unsigned char)*p;
	switch (t->kind) {
	case 1:
		scale = 0.1;
		break;
	case 2:
		scale = 1.0;
		break;
	case 3:
		scale = 4.0 / sqrt((double)t->d1);
		break;
	case 4:
		scale = 0.5;
		break;
	default:
		scale = 1.7 / sqrt((double)t->d1);
		break;
	}
	for (uint64_t i = 0; i < n; i++)
		v[i] = (float)(unif(&s) * scale) + (t->kind == 1 ? 1.0f : 0.0f);
}

/* float8_e4m3fn, rounded to nearest even, saturating at +-448 (the quantizer divides by
 * amax / 448, so only rounding can reach past it) */
static uint8_t f32_to_e4m3(float v)
{
	const uint8_t sign = signbit(v) ? 0x80 : 0;
	float a = fabsf(v), m;
	int e;

	if (a >= 448.0f)
		return sign | 0x7e;
	if (a < 0x1p-6f) /* subnormal: m * 2^-9, m in 0..8 (8 is the smallest normal, 0x08) */
		return sign | (uint8_t)rintf(a * 512.0f);
	m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
	e -= 1;
	m = rintf((m * 2.0f - 1.0f) * 8.0f);
	if (m == 8.0f) {
		m = 0;
		e++;
	}
	if (e + 7 > 15 || (e + 7 == 15 && m == 7))
		return sign | 0x7e;
	return sign | (uint8_t)((e + 7) << 3) | (uint8_t)m;
}

/* Per 128 x 128 block: amax / 448, the weight_scale_inv Hugging Face's FP8 checkpoints
 * carry (the weight is q * scale); 1 for an all-zero block. */
static void fp8_scales(const struct spec *w, const float *v, float *sc)
{
	const uint64_t sr = (w->d0 + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK,
		       scn = (w->d1 + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK;

	for (uint64_t i = 0; i < sr * scn; i++)
		sc[i] = 0;
	for (uint64_t r = 0; r < w->d0; r++)
		for (uint64_t k = 0; k < w->d1; k++) {
			float *s = &sc[(r / RO_FP8_BLOCK) * scn + k / RO_FP8_BLOCK];
			float a = fabsf(v[r * w->d1 + k]);

			*s = a > *s ? a : *s;
		}
	for (uint64_t i = 0; i < sr * scn; i++)
		sc[i] = sc[i] > 0 ? sc[i] / 448.0f : 1.0f;
}

static int write_tensor(FILE *f, const struct spec *all, const struct spec *t, uint64_t seed)
{
	const struct spec *w = t->kind == 5 ? &all[t->of] : t;
	const uint64_t n = t->d0 * (t->d1 ? t->d1 : 1), nw = w->d0 * (w->d1 ? w->d1 : 1);
	const size_t es = ro_dtype_size(t->dt);
	float *v = malloc(nw * sizeof(*v)), *sc = NULL;
	uint8_t buf[8192];
	size_t used = 0;
	int r = 0;

	if (!v)
		return -ENOMEM;
	gen(w, seed, v);
	if (t->kind == 5 || t->dt == RO_F8E4M3) {
		sc = malloc(((w->d0 + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK) *
			    ((w->d1 + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK) * sizeof(*sc));
		if (!sc) {
			free(v);
			return -ENOMEM;
		}
		fp8_scales(w, v, sc);
	}
	for (uint64_t i = 0; i < n && !r; i++) {
		if (t->kind == 5) {
			memcpy(buf + used, &sc[i], 4);
		} else if (t->dt == RO_F8E4M3) {
			const uint64_t row = i / w->d1, k = i % w->d1;
			const uint64_t scn = (w->d1 + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK;

			buf[used] =
			    f32_to_e4m3(v[i] / sc[(row / RO_FP8_BLOCK) * scn + k / RO_FP8_BLOCK]);
		} else if (t->dt == RO_F32) {
			memcpy(buf + used, &v[i], 4);
		} else {
			uint16_t h = t->dt == RO_BF16 ? ro_f32_to_bf16(v[i]) : ro_f32_to_f16(v[i]);

			memcpy(buf + used, &h, 2);
		}
		used += es;
		if (used == sizeof(buf)) {
			if (fwrite(buf, 1, used, f) != used)
				r = -EIO;
			used = 0;
		}
	}
	if (!r && used && fwrite(buf, 1, used, f) != used)
		r = -EIO;
	free(v);
	free(sc);
	return r;
}

static const char *dt_name(enum ro_dtype dt)
{
	return dt == RO_F32 ? "F32" : dt == RO_BF16 ? "BF16" : dt == RO_F16 ? "F16" : "F8_E4M3";
}

/* A shard's tensors in the file by element size, largest first (F32, then 16-bit, then
 * FP8), so every tensor is aligned to its element without padding between them. */
static int write_shard(const char *path, struct spec *t, size_t n, uint32_t shard, uint64_t seed)
{
	size_t hcap = 4096 + n * 200, hl = 0;
	char *h = malloc(hcap);
	uint64_t off = 0, hlen;
	uint8_t le[8];
	FILE *f;
	int r = 0;

	if (!h)
		return -ENOMEM;
	hl += (size_t)snprintf(h + hl, hcap - hl, "{\"__metadata__\":{\"format\":\"pt\"}");
	for (size_t es = 4; es >= 1; es /= 2)
		for (size_t i = 0; i < n; i++) {
			uint64_t bytes;

			if (t[i].shard != shard || ro_dtype_size(t[i].dt) != es)
				continue;
			bytes = t[i].d0 * (t[i].d1 ? t[i].d1 : 1) * es;
			t[i].off = off;
			if (t[i].d1)
				hl += (size_t)snprintf(
				    h + hl, hcap - hl,
				    ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%llu,%llu],"
				    "\"data_offsets\":[%llu,%llu]}",
				    t[i].name, dt_name(t[i].dt), (unsigned long long)t[i].d0,
				    (unsigned long long)t[i].d1, (unsigned long long)off,
				    (unsigned long long)(off + bytes));
			else
				hl += (size_t)snprintf(
				    h + hl, hcap - hl,
				    ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%llu],"
				    "\"data_offsets\":[%llu,%llu]}",
				    t[i].name, dt_name(t[i].dt), (unsigned long long)t[i].d0,
				    (unsigned long long)off, (unsigned long long)(off + bytes));
			off += bytes;
		}
	hl += (size_t)snprintf(h + hl, hcap - hl, "}");
	while (hl % 8) /* the data starts 8-byte aligned, as the reference writer does it */
		h[hl++] = ' ';
	hlen = hl;
	for (int i = 0; i < 8; i++)
		le[i] = (uint8_t)(hlen >> (8 * i));
	f = fopen(path, "wb");
	if (!f) {
		free(h);
		return -errno;
	}
	if (fwrite(le, 1, 8, f) != 8 || fwrite(h, 1, hl, f) != hl)
		r = -EIO;
	for (size_t es = 4; es >= 1 && !r; es /= 2)
		for (size_t i = 0; i < n && !r; i++)
			if (t[i].shard == shard && ro_dtype_size(t[i].dt) == es)
				r = write_tensor(f, t, &t[i], seed);
	if (fclose(f) && !r)
		r = -EIO;
	free(h);
	return r;
}

int ro_make_model(const struct ro_make_model_opts *o, const char *dir, char *err, size_t errlen)
{
	const bool q3 = o->arch == RO_ARCH_QWEN3_MOE;
	const char *blk = q3 ? "mlp" : "block_sparse_moe";
	const uint32_t H = o->hidden, qd = o->heads * o->head_dim, kvd = o->kv_heads * o->head_dim;
	const uint32_t dffn = o->dense_ffn ? o->dense_ffn : 4 * H;
	enum ro_dtype dt;
	bool fp8 = false;
	const char *dts = o->dtype ? o->dtype : "BF16";
	struct spec *t = NULL;
	size_t n = 0, cap = 0;
	uint32_t shards = o->shards ? o->shards : 1;
	char path[4096];
	FILE *f;
	int r = 0;

	if (!strcmp(dts, "BF16") || (fp8 = !strcasecmp(dts, "FP8") || !strcmp(dts, "F8_E4M3")))
		dt = RO_BF16; /* FP8: the linear weights; the rest BF16 */
	else if (!strcmp(dts, "F32"))
		dt = RO_F32;
	else if (!strcmp(dts, "F16"))
		dt = RO_F16;
	else
		return ro_errf(err, errlen, -EINVAL, "dtype %s: want BF16, F32, F16 or FP8", dts);
	if (!o->layers || !H || !o->heads || !o->kv_heads || o->heads % o->kv_heads ||
	    !o->head_dim || o->head_dim % 2 || !o->experts || !o->top_k ||
	    o->top_k > o->experts || !o->expert_ffn || o->vocab < 2 || shards > 99 ||
	    o->layers > 64)
		return ro_errf(err, errlen, -EINVAL,
			       "inconsistent sizes: heads %% kv_heads, even head_dim, top_k <= "
			       "experts, layers <= 64");
	if (mkdir(dir, 0755) && errno != EEXIST)
		return ro_errf(err, errlen, -errno, "%s: %s", dir, strerror(errno));
	r = add(&t, &n, &cap, 2, o->vocab, H, "model.embed_tokens.weight");
	for (uint32_t l = 0; l < o->layers && !r; l++) {
		bool dense = q3 && (o->dense_layers >> l & 1);

		r = add(&t, &n, &cap, 1, H, 0, "model.layers.%u.input_layernorm.weight", l) ||
		    add(&t, &n, &cap, 1, H, 0, "model.layers.%u.post_attention_layernorm.weight",
			l) ||
		    add(&t, &n, &cap, 0, qd, H, "model.layers.%u.self_attn.q_proj.weight", l) ||
		    add(&t, &n, &cap, 0, kvd, H, "model.layers.%u.self_attn.k_proj.weight", l) ||
		    add(&t, &n, &cap, 0, kvd, H, "model.layers.%u.self_attn.v_proj.weight", l) ||
		    add(&t, &n, &cap, 0, H, qd, "model.layers.%u.self_attn.o_proj.weight", l);
		if (!r && q3 && o->attn_bias)
			r = add(&t, &n, &cap, 4, qd, 0, "model.layers.%u.self_attn.q_proj.bias", l) ||
			    add(&t, &n, &cap, 4, kvd, 0, "model.layers.%u.self_attn.k_proj.bias", l) ||
			    add(&t, &n, &cap, 4, kvd, 0, "model.layers.%u.self_attn.v_proj.bias", l) ||
			    add(&t, &n, &cap, 4, H, 0, "model.layers.%u.self_attn.o_proj.bias", l);
		if (!r && q3)
			r = add(&t, &n, &cap, 1, o->head_dim, 0,
				"model.layers.%u.self_attn.q_norm.weight", l) ||
			    add(&t, &n, &cap, 1, o->head_dim, 0,
				"model.layers.%u.self_attn.k_norm.weight", l);
		if (!r && dense) {
			r = add(&t, &n, &cap, 0, dffn, H, "model.layers.%u.mlp.gate_proj.weight", l) ||
			    add(&t, &n, &cap, 0, dffn, H, "model.layers.%u.mlp.up_proj.weight", l) ||
			    add(&t, &n, &cap, 0, H, dffn, "model.layers.%u.mlp.down_proj.weight", l);
			continue;
		}
		if (!r)
			r = add(&t, &n, &cap, 3, o->experts, H, "model.layers.%u.%s.gate.weight", l,
				blk);
		for (uint32_t e = 0; e < o->experts && !r; e++)
			r = add(&t, &n, &cap, 0, o->expert_ffn, H, "model.layers.%u.%s.experts.%u.%s.weight",
				l, blk, e, q3 ? "gate_proj" : "w1") ||
			    add(&t, &n, &cap, 0, o->expert_ffn, H, "model.layers.%u.%s.experts.%u.%s.weight",
				l, blk, e, q3 ? "up_proj" : "w3") ||
			    add(&t, &n, &cap, 0, H, o->expert_ffn, "model.layers.%u.%s.experts.%u.%s.weight",
				l, blk, e, q3 ? "down_proj" : "w2");
	}
	if (!r)
		r = add(&t, &n, &cap, 1, H, 0, "model.norm.weight") ||
		    add(&t, &n, &cap, 0, o->vocab, H, "lm_head.weight");
	for (size_t i = 0, nw = n; i < nw && !r; i++) {
		t[i].dt = dt;
		/* FP8 as Qwen3-*-FP8 ships: the linear layers' weights, not the router, the
		 * embedding or the LM head; each with its weight_scale_inv */
		if (fp8 && t[i].kind == 0 && strcmp(t[i].name, "lm_head.weight")) {
			char wn[sizeof(t[i].name)]; /* add() may move t */

			memcpy(wn, t[i].name, sizeof(wn));
			t[i].dt = RO_F8E4M3;
			r = add(&t, &n, &cap, 5, (t[i].d0 + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK,
				(t[i].d1 + RO_FP8_BLOCK - 1) / RO_FP8_BLOCK, "%s_scale_inv", wn);
			if (!r) {
				t[n - 1].dt = RO_F32;
				t[n - 1].of = i;
			}
		}
	}
	if (r) {
		free(t);
		return -ENOMEM;
	}
	for (size_t i = 0; i < n; i++) /* shards by position: a layer's tensors stay together */
		t[i].shard = (uint32_t)(i * shards / n);
	for (size_t i = 0; i < n; i++) /* a weight's scales in the weight's shard */
		if (t[i].kind == 5)
			t[i].shard = t[t[i].of].shard;
	for (uint32_t s = 0; s < shards && !r; s++) {
		if (shards == 1)
			(void)snprintf(path, sizeof(path), "%s/model.safetensors", dir);
		else
			(void)snprintf(path, sizeof(path), "%s/model-%05u-of-%05u.safetensors", dir,
				       s + 1, shards);
		r = write_shard(path, t, n, s, o->seed);
		if (r)
			(void)ro_errf(err, errlen, r, "%s: %s", path, strerror(-r));
	}
	if (!r && shards > 1) {
		(void)snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
		f = fopen(path, "w");
		if (!f) {
			r = ro_errf(err, errlen, -errno, "%s: %s", path, strerror(errno));
		} else {
			(void)fprintf(f, "{\"metadata\": {}, \"weight_map\": {");
			for (size_t i = 0; i < n; i++)
				(void)fprintf(f, "%s\n  \"%s\": \"model-%05u-of-%05u.safetensors\"",
					      i ? "," : "", t[i].name, t[i].shard + 1, shards);
			(void)fprintf(f, "\n}}\n");
			if (fclose(f))
				r = ro_errf(err, errlen, -EIO, "%s: write failed", path);
		}
	}
	if (!r) {
		(void)snprintf(path, sizeof(path), "%s/config.json", dir);
		f = fopen(path, "w");
		if (!f) {
			r = ro_errf(err, errlen, -errno, "%s: %s", path, strerror(errno));
		} else {
			(void)fprintf(f,
				      "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n"
				      "  \"vocab_size\": %u,\n  \"hidden_size\": %u,\n"
				      "  \"num_hidden_layers\": %u,\n  \"num_attention_heads\": %u,\n"
				      "  \"num_key_value_heads\": %u,\n  \"head_dim\": %u,\n"
				      "  \"num_experts_per_tok\": %u,\n  \"rope_theta\": %.1f,\n"
				      "  \"rms_norm_eps\": 1e-06,\n  \"max_position_embeddings\": 32768,\n"
				      "  \"tie_word_embeddings\": %s,\n  \"torch_dtype\": \"%s\",\n",
				      q3 ? "Qwen3MoeForCausalLM" : "MixtralForCausalLM",
				      q3 ? "qwen3_moe" : "mixtral", o->vocab, H, o->layers, o->heads,
				      o->kv_heads, o->head_dim, o->top_k, o->rope_theta,
				      o->tie_embeddings ? "true" : "false", dt == RO_BF16 ? "bfloat16" : dt == RO_F16 ? "float16" : "float32");
			if (fp8)
				(void)fprintf(f,
					      "  \"quantization_config\": {\"quant_method\": "
					      "\"fp8\", \"fmt\": \"e4m3\", \"activation_scheme\": "
					      "\"dynamic\", \"weight_block_size\": [128, 128]},\n");
			if (q3) {
				(void)fprintf(f,
					      "  \"num_experts\": %u,\n  \"moe_intermediate_size\": %u,\n"
					      "  \"intermediate_size\": %u,\n  \"decoder_sparse_step\": 1,\n"
					      "  \"norm_topk_prob\": %s,\n  \"attention_bias\": %s,\n"
					      "  \"mlp_only_layers\": [",
					      o->experts, o->expert_ffn, dffn,
					      o->norm_topk ? "true" : "false",
					      o->attn_bias ? "true" : "false");
				for (uint32_t l = 0, first = 1; l < o->layers; l++)
					if (o->dense_layers >> l & 1) {
						(void)fprintf(f, "%s%u", first ? "" : ", ", l);
						first = 0;
					}
				(void)fprintf(f, "]\n}\n");
			} else {
				(void)fprintf(f,
					      "  \"num_local_experts\": %u,\n  \"intermediate_size\": "
					      "%u,\n  \"sliding_window\": ",
					      o->experts, o->expert_ffn);
				if (o->sliding_window)
					(void)fprintf(f, "%u\n}\n", o->sliding_window);
				else
					(void)fprintf(f, "null\n}\n");
			}
			if (fclose(f))
				r = ro_errf(err, errlen, -EIO, "%s: write failed", path);
		}
	}
	free(t);
	return r;
}
