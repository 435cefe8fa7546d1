/* kernels/: numeric agreement with the independent numpy reference (tests/ref/ref_moe.py)
 * for Qwen3-MoE and Mixtral in f32 and bf16, greedy decoding token for token, batch
 * invariance and prefill-chunk invariance bitwise (short prompts and prompts of hundreds of
 * tokens, chunks mixed with other sequences' decode tokens), long prompts with bounded
 * scratch, the memory estimates against what malloc is asked for, resume from a prefix
 * bitwise, the sampler, and every bad model file refused with a message naming what is
 * wrong. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/model.h"

/* ---- counting allocator ------------------------------------------------------------------ *
 * malloc, calloc, realloc and free of this process, passed on to glibc's; while counting is
 * on, the size asked for of every block allocated since is kept by address, with the live
 * total and its peak. Blocks from before are not counted when freed. Not under ASan, whose
 * own allocator must see every block. */
#if defined(__SANITIZE_ADDRESS__)
#define NO_COUNTING 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NO_COUNTING 1
#endif
#endif

#ifndef NO_COUNTING
#include <pthread.h>

extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t n);
extern void *__libc_memalign(size_t align, size_t n);
extern void __libc_free(void *p);

#define NSLOT (1u << 16)
#define TOMB ((void *)1)

static struct {
	void *p;
	size_t n;
} slots[NSLOT];
static pthread_mutex_t count_mu = PTHREAD_MUTEX_INITIALIZER;
static volatile int counting;
static size_t live, peak;

static size_t slot_of(const void *p)
{
	return ((uintptr_t)p >> 4) * 0x9E3779B97F4A7C15ull >> 48;
}

static void count_add(void *p, size_t n)
{
	size_t i = slot_of(p);

	if (!p || !counting)
		return;
	pthread_mutex_lock(&count_mu);
	while (slots[i].p && slots[i].p != TOMB)
		i = (i + 1) % NSLOT;
	slots[i].p = p;
	slots[i].n = n;
	live += n;
	if (live > peak)
		peak = live;
	pthread_mutex_unlock(&count_mu);
}

static void count_del(void *p)
{
	size_t i = slot_of(p);

	if (!p || !counting)
		return;
	pthread_mutex_lock(&count_mu);
	for (; slots[i].p; i = (i + 1) % NSLOT)
		if (slots[i].p == p) {
			live -= slots[i].n;
			slots[i].p = TOMB;
			break;
		}
	pthread_mutex_unlock(&count_mu);
}

void *malloc(size_t n)
{
	void *p = __libc_malloc(n);

	count_add(p, n);
	return p;
}

void *calloc(size_t n, size_t size)
{
	void *p = __libc_calloc(n, size);

	count_add(p, n * size);
	return p;
}

void *realloc(void *old, size_t n)
{
	void *p;

	count_del(old);
	p = __libc_realloc(old, n);
	count_add(p, n);
	return p;
}

void *aligned_alloc(size_t align, size_t n)
{
	void *p = __libc_memalign(align, n);

	count_add(p, n);
	return p;
}

void free(void *p)
{
	count_del(p);
	__libc_free(p);
}

static void count_start(void)
{
	pthread_mutex_lock(&count_mu);
	memset(slots, 0, sizeof(slots));
	live = peak = 0;
	counting = 1;
	pthread_mutex_unlock(&count_mu);
}

static void count_stop(void)
{
	counting = 0;
}

#endif

static char tmp[64];

static void mk_tmp(void)
{
	(void)snprintf(tmp, sizeof(tmp), "/tmp/ro-model-XXXXXX");
	cr_assert_not_null(mkdtemp(tmp));
}

static void rm_tmp(void)
{
	char cmd[128];

	(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", tmp);
	(void)system(cmd);
}

TestSuite(model, .init = mk_tmp, .fini = rm_tmp, .timeout = 120);

static const char *path(const char *sub)
{
	static char buf[4][256];
	static int i;

	i = (i + 1) % 4;
	(void)snprintf(buf[i], sizeof(buf[i]), "%s/%s", tmp, sub);
	return buf[i];
}

static void make(const char *sub, enum ro_arch arch, const char *dtype, uint32_t shards,
		 uint64_t dense)
{
	struct ro_make_model_opts o;
	char err[256];

	ro_make_model_defaults(&o);
	o.arch = arch;
	o.dtype = dtype;
	o.shards = shards;
	o.layers = 3;
	o.dense_layers = dense;
	o.seed = 7;
	cr_assert_eq(ro_make_model(&o, path(sub), err, sizeof(err)), 0, "%s", err);
}

static struct ro_model *load(const char *sub, bool scalar)
{
	struct ro_model_opts mo = {.threads = 2, .scalar = scalar};
	struct ro_model *m = NULL;
	char err[512] = "";

	cr_assert_eq(ro_model_load(path(sub), &mo, &m, err, sizeof(err)), 0, "%s", err);
	return m;
}

/* The python with numpy: $RO_PYTHON, else python3 if it has numpy, else /usr/bin/python3. */
static const char *python(void)
{
	const char *p = getenv("RO_PYTHON");

	if (p && *p)
		return p;
	if (system("python3 -c 'import numpy' >/dev/null 2>&1") == 0)
		return "python3";
	return "/usr/bin/python3";
}

static const char *ref_script(void)
{
	static char buf[512];
	const char *src = getenv("RO_SRCDIR");

	(void)snprintf(buf, sizeof(buf), "%s/tests/ref/ref_moe.py", src && *src ? src : RO_SRCDIR);
	return buf;
}

/* Reference logits for prompt (and its greedy continuation into greedy[], n_greedy). */
static float *reference(const char *sub, const int32_t *prompt, uint32_t n, uint32_t V,
			int32_t *greedy, uint32_t n_greedy)
{
	const size_t idlen = (size_t)n * 12 + 1, cmdlen = idlen + 2048;
	char *cmd = malloc(cmdlen), *ids = malloc(idlen), *out = NULL;
	size_t cap = 0, got;
	FILE *f;
	float *l = malloc((size_t)n * V * sizeof(float));
	size_t off = 0;

	ids[0] = 0;
	for (uint32_t i = 0; i < n; i++)
		off += (size_t)snprintf(ids + off, idlen - off, "%s%d", i ? "," : "", prompt[i]);
	(void)snprintf(cmd, cmdlen, "%s %s --model %s --prompt %s --logits %s --greedy %u",
		       python(), ref_script(), path(sub), ids, path("ref.f32"), n_greedy);
	f = popen(cmd, "r");
	cr_assert_not_null(f);
	cr_assert_neq(getline(&out, &cap, f), -1, "no output from %s", cmd);
	cr_assert_eq(pclose(f), 0, "%s failed", cmd);
	if (n_greedy) {
		const char *p = strchr(out, '[');

		cr_assert_not_null(p, "%s", out);
		for (uint32_t i = 0; i < n_greedy; i++) {
			greedy[i] = (int32_t)strtol(p + 1, (char **)&p, 10);
		}
	}
	free(out);
	free(cmd);
	free(ids);
	f = fopen(path("ref.f32"), "rb");
	cr_assert_not_null(f);
	got = fread(l, sizeof(float), (size_t)n * V, f);
	(void)fclose(f);
	cr_assert_eq(got, (size_t)n * V);
	return l;
}

static const int32_t ref_prompt[] = {5, 17, 200, 3, 3, 99, 150, 42, 7, 255, 0, 64};
#define N_REF_PROMPT (sizeof(ref_prompt) / sizeof(ref_prompt[0]))

/* The model in sub against the numpy reference: every prompt position's logits, and a
 * greedy continuation token for token. */
static void agree_dir(const char *sub, const char *dtype, bool scalar)
{
	const int32_t *prompt = ref_prompt;
	const uint32_t n = N_REF_PROMPT, G = 8;
	struct ro_model *m;
	struct ro_seq *s;
	float *ref, *got, maxerr = 0, maxabs = 0;
	int32_t greedy[8], tok;
	uint32_t V;

	m = load(sub, scalar);
	V = ro_model_config(m)->vocab;
	ref = reference(sub, prompt, n, V, greedy, G);
	got = malloc((size_t)n * V * sizeof(float));
	cr_assert_eq(ro_seq_new(m, 64, &s), 0);
	{
		struct ro_fwd_item it = {s, prompt, n, got, true};

		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
	}
	for (size_t i = 0; i < (size_t)n * V; i++) {
		float e = fabsf(got[i] - ref[i]);

		maxerr = e > maxerr ? e : maxerr;
		maxabs = fabsf(ref[i]) > maxabs ? fabsf(ref[i]) : maxabs;
	}
	/* weights are exact in both (bf16 widens exactly); only the f32 arithmetic differs
	 * from the float64 reference, so the bf16 bound is the f32 one */
	cr_expect_leq(maxerr / maxabs, 1e-4, "%s %s: max abs error %g of max |logit| %g", sub,
		      dtype, maxerr, maxabs);
	(void)fprintf(stderr, "ref agreement %-12s %-4s %s: max abs err %.3g, relative %.3g\n",
		      sub, dtype, ro_model_kernels(m), maxerr, maxerr / maxabs);
	/* greedy decode token for token */
	tok = ro_sample(got + (size_t)(n - 1) * V, V, &(struct ro_sampling){0}, 0, 0, 0, NULL);
	for (uint32_t i = 0; i < G; i++) {
		struct ro_fwd_item it = {s, &tok, 1, got, false};

		cr_expect_eq(tok, greedy[i], "%s: greedy token %u: %d, reference %d", sub, i, tok,
			     greedy[i]);
		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
		tok = ro_sample(got, V, &(struct ro_sampling){0}, 0, 0, 0, NULL);
	}
	ro_seq_free(s);
	ro_model_free(m);
	free(ref);
	free(got);
}

static void agree(const char *sub, enum ro_arch arch, const char *dtype, uint32_t shards,
		  uint64_t dense, bool scalar)
{
	make(sub, arch, dtype, shards, dense);
	agree_dir(sub, dtype, scalar);
}

Test(model, qwen3_f32_matches_reference)
{
	agree("q3f32", RO_ARCH_QWEN3_MOE, "F32", 1, 0, false);
}

Test(model, qwen3_bf16_dense_layer_sharded_matches_reference)
{
	agree("q3bf16", RO_ARCH_QWEN3_MOE, "BF16", 3, 1ULL << 1, false);
}

Test(model, mixtral_f32_matches_reference)
{
	agree("mxf32", RO_ARCH_MIXTRAL, "F32", 1, 0, false);
}

Test(model, mixtral_bf16_matches_reference)
{
	agree("mxbf16", RO_ARCH_MIXTRAL, "BF16", 1, 0, false);
}

Test(model, f16_and_portable_kernels_match_reference)
{
	agree("q3f16", RO_ARCH_QWEN3_MOE, "F16", 1, 0, true);
}

/* Block FP8 (Hugging Face's F8_E4M3 + weight_scale_inv per 128 x 128): a model wide enough
 * for several blocks per matrix and a partial one (FFN 160), a dense layer, two shards;
 * the reference dequantizes the same files and runs in float64. */
static void make_fp8(const char *sub, enum ro_arch arch)
{
	struct ro_make_model_opts o;
	char err[256];

	ro_make_model_defaults(&o);
	o.arch = arch;
	o.dtype = "FP8";
	o.shards = 2;
	o.layers = 3;
	o.hidden = 256;
	o.heads = 4;
	o.kv_heads = 2;
	o.head_dim = 64;
	o.expert_ffn = 160;
	o.dense_layers = arch == RO_ARCH_QWEN3_MOE ? 1ULL << 1 : 0;
	o.dense_ffn = 288;
	o.seed = 7;
	cr_assert_eq(ro_make_model(&o, path(sub), err, sizeof(err)), 0, "%s", err);
}

Test(model, qwen3_fp8_matches_reference)
{
	struct ro_model *m;

	make_fp8("q3fp8", RO_ARCH_QWEN3_MOE);
	m = load("q3fp8", false);
	cr_expect_str_eq(ro_model_config(m)->dtype, "F8_E4M3");
	ro_model_free(m);
	agree_dir("q3fp8", "FP8", false);
	agree_dir("q3fp8", "FP8", true);
}

Test(model, mixtral_fp8_matches_reference)
{
	make_fp8("mxfp8", RO_ARCH_MIXTRAL);
	agree_dir("mxfp8", "FP8", false);
}

/* ---- invariance -------------------------------------------------------------------------- */

static void run_chunks(struct ro_model *m, struct ro_seq *s, const int32_t *p, uint32_t n,
		       uint32_t chunk, float *last)
{
	for (uint32_t i = 0; i < n; i += chunk) {
		uint32_t c = i + chunk < n ? chunk : n - i;
		struct ro_fwd_item it = {s, p + i, c, last, false};

		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
	}
}

/* FP8 weights through the same kernels: chunking and batch-mates change no bit. */
static void fp8_invariance(const char *sub)
{
	struct ro_model *m;
	struct ro_seq *s[7];
	int32_t p[40], tok[7];
	float *a, *b, *rows;
	struct ro_fwd_item it[7];
	uint32_t V;

	make_fp8(sub, RO_ARCH_QWEN3_MOE);
	m = load(sub, false);
	V = ro_model_config(m)->vocab;
	a = malloc(V * sizeof(float));
	b = malloc(V * sizeof(float));
	rows = malloc(7 * (size_t)V * sizeof(float));
	for (int i = 0; i < 40; i++)
		p[i] = (i * 37 + 5) % (int32_t)V;
	cr_assert_eq(ro_seq_new(m, 64, &s[0]), 0);
	run_chunks(m, s[0], p, 40, 40, a);
	ro_seq_truncate(s[0], 0);
	run_chunks(m, s[0], p, 40, 7, b);
	cr_expect_eq(memcmp(a, b, V * sizeof(float)), 0, "chunks of 7");
	/* one decode step alone, then beside six others */
	tok[0] = 3;
	it[0] = (struct ro_fwd_item){s[0], &tok[0], 1, a, false};
	cr_assert_eq(ro_model_forward(m, it, 1), 0);
	ro_seq_truncate(s[0], 40);
	for (int i = 1; i < 7; i++) {
		cr_assert_eq(ro_seq_new(m, 64, &s[i]), 0);
		run_chunks(m, s[i], p + i, 20 + i, 5, rows);
		tok[i] = i * 11;
	}
	for (int i = 0; i < 7; i++)
		it[i] = (struct ro_fwd_item){s[i], &tok[i], 1, rows + (size_t)i * V, false};
	cr_assert_eq(ro_model_forward(m, it, 7), 0);
	cr_expect_eq(memcmp(a, rows, V * sizeof(float)), 0, "decode in a batch of 7");
	for (int i = 0; i < 7; i++)
		ro_seq_free(s[i]);
	ro_model_free(m);
	free(a);
	free(b);
	free(rows);
}

Test(model, fp8_is_bitwise_invariant)
{
	fp8_invariance("fp8inv");
}

/* The expert layer runs whole experts as tasks when enough are active and none dominates,
 * else (expert, panel) tasks in two passes: a row's output is the same bits either way, and
 * the same as the row run alone. */
static void experts_paths_agree(const char *sub)
{
	struct ro_model *m = load(sub, false);
	const struct ro_model_config *c = ro_model_config(m);
	const uint32_t H = c->hidden, E = c->experts, n = 3 * E;
	float *x = malloc((size_t)n * H * sizeof(float)), *y = malloc((size_t)n * H * sizeof(float)),
	      *one = malloc(H * sizeof(float));
	const float **rows = malloc(n * sizeof(*rows));
	int32_t *ex = malloc(n * sizeof(*ex));
	uint32_t seed = 12345;

	cr_assert(x && y && one && rows && ex);
	for (size_t i = 0; i < (size_t)n * H; i++) {
		seed = seed * 1664525u + 1013904223u;
		x[i] = (float)(seed >> 8) / (float)(1u << 24) - 0.5f;
	}
	for (uint32_t i = 0; i < n; i++)
		rows[i] = x + (size_t)i * H;
	/* balanced: 3 rows an expert (whole-expert tasks); skewed: most rows on expert 1 (the
	 * split); each against the row alone (one expert active: the split) */
	for (int skew = 0; skew < 2; skew++) {
		for (uint32_t i = 0; i < n; i++)
			ex[i] = skew && i % 4 ? 1 : (int32_t)((i * 5) % E);
		cr_assert_eq(ro_model_experts(m, 0, rows, ex, n, y), 0);
		for (uint32_t i = 0; i < n; i++) {
			cr_assert_eq(ro_model_experts(m, 0, rows + i, ex + i, 1, one), 0);
			cr_expect_eq(memcmp(one, y + (size_t)i * H, H * sizeof(float)), 0,
				     "%s: row %u (expert %d, %s batch) differs from the row alone", sub,
				     i, ex[i], skew ? "skewed" : "balanced");
		}
	}
	free(x);
	free(y);
	free(one);
	free(rows);
	free(ex);
	ro_model_free(m);
}

Test(model, expert_task_shapes_are_bitwise_the_same)
{
	make("xpaths", RO_ARCH_MIXTRAL, "BF16", 1, 0);
	experts_paths_agree("xpaths");
	make_fp8("xpaths8", RO_ARCH_QWEN3_MOE);
	experts_paths_agree("xpaths8");
}

/* ---- the linear weights in huge pages (ro_model_opts.hugepages) ------------------------- */

static bool thp_never(void)
{
	char buf[128] = "";
	FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "re");

	if (!f)
		return true;
	if (!fgets(buf, sizeof(buf), f))
		buf[0] = 0;
	(void)fclose(f);
	return strstr(buf, "[never]") != NULL;
}

static struct ro_model *load_opts(const char *sub, bool hugepages, uint32_t rank, uint32_t world)
{
	struct ro_model_opts mo = {
	    .threads = 2, .hugepages = hugepages, .ep_rank = rank, .ep_world = world};
	struct ro_model *m = NULL;
	char err[512] = "";

	cr_assert_eq(ro_model_load(path(sub), &mo, &m, err, sizeof(err)), 0, "%s", err);
	return m;
}

/* Bytes of the linear weights one rank of `world` reads (the experts e % world == rank),
 * at `size` bytes per parameter: what the loader should copy. */
static uint64_t linear_bytes(const struct ro_model_config *c, uint32_t rank, uint32_t world,
			     uint64_t size)
{
	const uint64_t H = c->hidden, qd = (uint64_t)c->heads * c->head_dim,
		       kvd = (uint64_t)c->kv_heads * c->head_dim;
	uint64_t n = c->tie_embeddings ? 0 : (uint64_t)c->vocab * H;

	for (uint32_t l = 0; l < c->layers; l++) {
		n += 2 * qd * H + 2 * kvd * H;
		if (c->dense_layers >> l & 1) {
			n += 3 * (uint64_t)c->dense_ffn * H;
			continue;
		}
		n += (uint64_t)c->experts * H;
		for (uint32_t e = 0; e < c->experts; e++)
			if (e % world == rank)
				n += 3 * (uint64_t)c->expert_ffn * H;
	}
	return n * size;
}

/* A prefill of 30 tokens in chunks of 11, then a decode step of 5 sequences: every logit. */
static float *hp_run(struct ro_model *m)
{
	const uint32_t V = ro_model_config(m)->vocab;
	float *out = malloc(6 * (size_t)V * sizeof(float));
	struct ro_seq *s[5];
	struct ro_fwd_item it[5];
	int32_t p[30], tok[5];

	for (int i = 0; i < 30; i++)
		p[i] = (i * 53 + 11) % (int32_t)V;
	for (int i = 0; i < 5; i++) {
		cr_assert_eq(ro_seq_new(m, 64, &s[i]), 0);
		run_chunks(m, s[i], p + i, 25, 11, i ? out + (size_t)5 * V : out);
		tok[i] = (i * 19 + 2) % (int32_t)V;
	}
	for (int i = 0; i < 5; i++)
		it[i] = (struct ro_fwd_item){s[i], &tok[i], 1, out + (size_t)(i + 1) * V, false};
	cr_assert_eq(ro_model_forward(m, it, 5), 0);
	for (int i = 0; i < 5; i++)
		ro_seq_free(s[i]);
	return out;
}

/* The weights copied into huge pages give bitwise the logits of the mapped ones, for
 * bf16, f32 with a tied head, FP8 (weights and scales copied) and f16 (widened at load:
 * nothing left to copy), and for an EP rank that copies only its own experts (the others,
 * still mapped, read as before). The bytes copied are exactly the linear weights. */
Test(model, hugepage_weights_are_bitwise_the_mapped_ones)
{
	static const struct {
		const char *sub, *dtype;
		enum ro_arch arch;
		bool fp8;
		uint64_t size;
	} cases[] = {
	    {"hpbf", "BF16", RO_ARCH_QWEN3_MOE, false, 2},
	    {"hpf32", "F32", RO_ARCH_MIXTRAL, false, 4},
	    {"hpfp8", "FP8", RO_ARCH_QWEN3_MOE, true, 0},
	    {"hpf16", "F16", RO_ARCH_QWEN3_MOE, false, 0},
	};
	const bool never = thp_never();

	for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
		struct ro_model *a, *b;
		struct ro_model_pin pin;
		struct ro_model_config cc;
		const struct ro_model_config *c = &cc;
		float *la, *lb;
		uint32_t V;

		if (cases[k].fp8) {
			make_fp8(cases[k].sub, cases[k].arch);
		} else {
			struct ro_make_model_opts o;
			char err[256];

			ro_make_model_defaults(&o);
			o.arch = cases[k].arch;
			o.dtype = cases[k].dtype;
			o.layers = 3;
			o.dense_layers = cases[k].arch == RO_ARCH_QWEN3_MOE ? 1ULL << 1 : 0;
			o.dense_ffn = 96;
			o.seed = 7;
			/* f32: the head tied to the embedding, which stays mapped */
			o.tie_embeddings = !strcmp(cases[k].dtype, "F32");
			cr_assert_eq(ro_make_model(&o, path(cases[k].sub), err, sizeof(err)), 0,
				     "%s", err);
		}
		a = load_opts(cases[k].sub, false, 0, 1);
		b = load_opts(cases[k].sub, true, 0, 1);
		cc = *ro_model_config(b);
		V = c->vocab;
		ro_model_pinned(a, &pin);
		cr_expect_eq(pin.bytes, 0, "%s: off copies nothing", cases[k].sub);
		ro_model_pinned(b, &pin);
		if (never) {
			cr_expect_eq(pin.bytes, 0);
			cr_expect_neq(strstr(pin.why, "never"), NULL, "%s", pin.why);
		} else if (!strcmp(cases[k].dtype, "F16")) {
			cr_expect_eq(pin.bytes, 0, "f16 is widened into owned copies: %s", pin.why);
		} else if (cases[k].fp8) {
			/* a byte per weight and the blocks' scales, each rounded to 64 bytes */
			cr_expect_geq(pin.bytes, linear_bytes(c, 0, 1, 1), "%s", cases[k].sub);
			cr_expect_lt(pin.bytes, linear_bytes(c, 0, 1, 2), "%s", cases[k].sub);
		} else {
			cr_expect_eq(pin.bytes, linear_bytes(c, 0, 1, cases[k].size),
				     "%s: %llu copied (%s)", cases[k].sub,
				     (unsigned long long)pin.bytes, pin.why);
		}
		la = hp_run(a);
		lb = hp_run(b);
		cr_expect_eq(memcmp(la, lb, 6 * (size_t)V * sizeof(float)), 0, "%s: logits differ",
			     cases[k].sub);
		free(lb);
		ro_model_free(b);
		if (!strcmp(cases[k].dtype, "BF16")) {
			/* rank 1 of 3: its experts copied, the other two thirds read mapped */
			b = load_opts(cases[k].sub, true, 1, 3);
			ro_model_pinned(b, &pin);
			if (!never)
				cr_expect_eq(pin.bytes, linear_bytes(c, 1, 3, 2),
					     "rank 1 of 3: %llu copied, want %llu",
					     (unsigned long long)pin.bytes,
					     (unsigned long long)linear_bytes(c, 1, 3, 2));
			lb = hp_run(b);
			cr_expect_eq(memcmp(la, lb, 6 * (size_t)V * sizeof(float)), 0,
				     "rank 1 of 3: logits differ");
			free(lb);
			ro_model_free(b);
		}
		free(la);
		ro_model_free(a);
	}
}

/* Resident bytes of this process's mappings of files under dir (smaps "Rss:"). */
static uint64_t mapped_rss(const char *dir)
{
	FILE *f = fopen("/proc/self/smaps", "re");
	char line[1024];
	bool in = false;
	uint64_t sum = 0;

	cr_assert_not_null(f);
	while (fgets(line, sizeof(line), f)) {
		unsigned long lo, hi;
		unsigned long long v;

		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
			in = strstr(line, dir) != NULL;
		else if (in && sscanf(line, "Rss: %llu kB", &v) == 1)
			sum += (uint64_t)v << 10;
	}
	(void)fclose(f);
	return sum;
}

/* With the weights copied, the pages of the file they came from never enter the process
 * (read into the region with pread, the NaN scan reading the copy), where in place every
 * page is (the scan reads them all): the model is resident once, not twice. */
Test(model, hugepage_weights_leave_the_mapping)
{
	struct ro_make_model_opts o;
	struct ro_model *m;
	struct ro_model_pin pin;
	struct stat st;
	char err[256], file[300];
	uint64_t rss_map, rss_pin;

	if (thp_never())
		cr_skip_test("transparent huge pages are off here (never)");
	ro_make_model_defaults(&o);
	o.hidden = 512;
	o.expert_ffn = 256;
	o.head_dim = 64;
	o.heads = 8;
	o.kv_heads = 2;
	o.vocab = 128;
	o.layers = 2;
	cr_assert_eq(ro_make_model(&o, path("hprss"), err, sizeof(err)), 0, "%s", err);
	(void)snprintf(file, sizeof(file), "%s/model.safetensors", path("hprss"));
	cr_assert_eq(stat(file, &st), 0);
	m = load_opts("hprss", false, 0, 1);
	rss_map = mapped_rss(path("hprss"));
	ro_model_free(m);
	m = load_opts("hprss", true, 0, 1);
	rss_pin = mapped_rss(path("hprss"));
	ro_model_pinned(m, &pin);
	ro_model_free(m);
	/* in place: every page was read; copied: the embedding (128 x 512 bf16, 128 KiB),
	 * the norms and the header are all that is read through the mapping */
	cr_expect_geq(rss_map, (uint64_t)st.st_size * 9 / 10, "mapped: %llu of %lld",
		      (unsigned long long)rss_map, (long long)st.st_size);
	cr_expect_geq(pin.bytes, (uint64_t)st.st_size * 9 / 10, "copied %llu of %lld",
		      (unsigned long long)pin.bytes, (long long)st.st_size);
	cr_expect_lt(rss_pin, (uint64_t)st.st_size / 10, "copied: %llu of %lld still mapped",
		     (unsigned long long)rss_pin, (long long)st.st_size);
}

/* The AVX2+FMA kernels (RO_KERNELS=avx2 caps an AVX-512 machine at them): FP8 and bf16
 * against the reference, FP8 batch and chunk invariance. */
Test(model, avx2_kernels_match_reference)
{
	struct ro_model *m;

#if defined(__x86_64__)
	__builtin_cpu_init();
	if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
#endif
		cr_skip_test("this CPU has no AVX2+FMA");
	cr_assert_eq(setenv("RO_KERNELS", "avx2", 1), 0);
	make_fp8("q3fp8a", RO_ARCH_QWEN3_MOE);
	m = load("q3fp8a", false);
	cr_expect_str_eq(ro_model_kernels(m), "avx2+fma");
	ro_model_free(m);
	agree_dir("q3fp8a", "FP8", false);
	agree("q3bf16a", RO_ARCH_QWEN3_MOE, "BF16", 1, 1ULL << 1, false);
	fp8_invariance("fp8inva");
	cr_assert_eq(unsetenv("RO_KERNELS"), 0);
}

/* The AVX-512 FMA kernels where AMX would run the bf16 and FP8 matrices (RO_KERNELS=avx512
 * caps a machine with AMX at them): bf16 and FP8 against the reference. (tests/test_gemm
 * checks every kernel's batch invariance on its own.) */
Test(model, avx512_kernels_match_reference)
{
	struct ro_model *m;

#if defined(__x86_64__)
	__builtin_cpu_init();
	if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
	    !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl"))
#endif
		cr_skip_test("this CPU has no AVX-512");
	cr_assert_eq(setenv("RO_KERNELS", "avx512", 1), 0);
	make("q3bf16x", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	m = load("q3bf16x", false);
	cr_expect_str_eq(ro_model_kernels(m), "avx512+fma");
	ro_model_free(m);
	agree_dir("q3bf16x", "BF16", false);
	agree("mxbf16x", RO_ARCH_MIXTRAL, "BF16", 1, 0, false);
	agree("q3fp8x", RO_ARCH_QWEN3_MOE, "FP8", 1, 0, false);
	cr_assert_eq(unsetenv("RO_KERNELS"), 0);
}

Test(model, prefill_chunking_is_bitwise_invariant)
{
	static const int32_t p[] = {1, 9, 8, 100, 31, 4, 4, 4, 250, 17, 66, 12, 90};
	const uint32_t n = sizeof(p) / sizeof(p[0]);
	const uint32_t chunks[] = {n, 1, 3, 5};
	struct ro_model *m;
	float *base, *cur;
	uint32_t V;

	make("inv", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	m = load("inv", false);
	V = ro_model_config(m)->vocab;
	base = malloc(V * sizeof(float));
	cur = malloc(V * sizeof(float));
	for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
		struct ro_seq *s;

		cr_assert_eq(ro_seq_new(m, 64, &s), 0);
		run_chunks(m, s, p, n, chunks[c], c ? cur : base);
		if (c)
			cr_expect_eq(memcmp(base, cur, V * sizeof(float)), 0,
				     "chunk %u differs from one prefill", chunks[c]);
		ro_seq_free(s);
	}
	free(base);
	free(cur);
	ro_model_free(m);
}

Test(model, batch_is_bitwise_invariant)
{
	/* sequence A decoded alone, then inside batches with other sequences in prefill and
	 * decode: A's logits are the same bits at every step */
	static const int32_t pa[] = {3, 1, 4, 1, 5, 9, 2, 6}, pb[] = {2, 7, 1, 8, 2, 8, 1, 8, 2, 8},
			     pc[] = {100, 101};
	struct ro_model *m;
	struct ro_seq *a1, *a2, *b, *c;
	float *la1, *la2, *lb, *lc;
	int32_t t1, t2, tb = 0, tc = 0;
	uint32_t V;

	make("batch", RO_ARCH_MIXTRAL, "BF16", 1, 0);
	m = load("batch", false);
	V = ro_model_config(m)->vocab;
	la1 = malloc(V * sizeof(float));
	la2 = malloc(V * sizeof(float));
	lb = malloc(V * sizeof(float));
	lc = malloc(V * sizeof(float));
	cr_assert_eq(ro_seq_new(m, 64, &a1), 0);
	cr_assert_eq(ro_seq_new(m, 64, &a2), 0);
	cr_assert_eq(ro_seq_new(m, 64, &b), 0);
	cr_assert_eq(ro_seq_new(m, 64, &c), 0);
	{
		struct ro_fwd_item alone = {a1, pa, 8, la1, false};
		struct ro_fwd_item mixed[2] = {{b, pb, 10, lb, false}, {a2, pa, 8, la2, false}};

		cr_assert_eq(ro_model_forward(m, &alone, 1), 0);
		cr_assert_eq(ro_model_forward(m, mixed, 2), 0);
	}
	cr_expect_eq(memcmp(la1, la2, V * sizeof(float)), 0, "prefill next to another prefill");
	for (int step = 0; step < 6; step++) {
		struct ro_fwd_item alone, mixed[3];
		size_t k = 0;

		t1 = ro_sample(la1, V, &(struct ro_sampling){0}, 0, 0, 0, NULL);
		t2 = ro_sample(la2, V, &(struct ro_sampling){0}, 0, 0, 0, NULL);
		cr_assert_eq(t1, t2);
		tb = ro_sample(lb, V, &(struct ro_sampling){0}, 0, 0, 0, NULL);
		alone = (struct ro_fwd_item){a1, &t1, 1, la1, false};
		cr_assert_eq(ro_model_forward(m, &alone, 1), 0);
		/* varying company: B decoding, C prefilling at step 2, C decoding after */
		mixed[k++] = (struct ro_fwd_item){b, &tb, 1, lb, false};
		if (step == 2)
			mixed[k++] = (struct ro_fwd_item){c, pc, 2, lc, false};
		else if (step > 2) {
			tc = ro_sample(lc, V, &(struct ro_sampling){0}, 0, 0, 0, NULL);
			mixed[k++] = (struct ro_fwd_item){c, &tc, 1, lc, false};
		}
		mixed[k++] = (struct ro_fwd_item){a2, &t2, 1, la2, false};
		cr_assert_eq(ro_model_forward(m, mixed, k), 0);
		cr_expect_eq(memcmp(la1, la2, V * sizeof(float)), 0, "step %d: batch of %zu", step,
			     k);
	}
	ro_seq_free(a1);
	ro_seq_free(a2);
	ro_seq_free(b);
	ro_seq_free(c);
	free(la1);
	free(la2);
	free(lb);
	free(lc);
	ro_model_free(m);
}

/* A decode step of many sequences runs each one's K/V store and attention as one task
 * (ro_rope_attend_run): 12 sequences of different lengths (crossing a 64-position block
 * during the steps), some of them taking 2 or 3 tokens in a step, give the same bits as
 * each sequence run alone. */
Test(model, many_sequence_decode_is_bitwise_invariant)
{
	enum { N = 12, STEPS = 8 };
	struct ro_model *m;
	struct ro_seq *alone[N], *batch[N];
	float *la[N], *lb[N];
	int32_t prompt[80], tok[N][3];
	uint32_t V;

	make("many", RO_ARCH_MIXTRAL, "BF16", 1, 0);
	m = load("many", false);
	V = ro_model_config(m)->vocab;
	for (uint32_t i = 0; i < 80; i++)
		prompt[i] = (int32_t)((i * 37 + 11) % V);
	for (int s = 0; s < N; s++) {
		/* 55 .. 66 tokens: the steps take most across position 64 */
		const uint32_t plen = 55 + (uint32_t)s;
		struct ro_fwd_item it;

		la[s] = malloc(V * sizeof(float));
		lb[s] = malloc(V * sizeof(float));
		cr_assert_eq(ro_seq_new(m, 128, &alone[s]), 0);
		cr_assert_eq(ro_seq_new(m, 128, &batch[s]), 0);
		it = (struct ro_fwd_item){alone[s], prompt + s, plen, la[s], false};
		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
		it = (struct ro_fwd_item){batch[s], prompt + s, plen, lb[s], false};
		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
		cr_assert_eq(memcmp(la[s], lb[s], V * sizeof(float)), 0);
	}
	for (int step = 0; step < STEPS; step++) {
		struct ro_fwd_item items[N];

		for (int s = 0; s < N; s++) {
			/* sequence s takes 1 + (s + step) % 3 tokens at odd steps, else 1 */
			const uint32_t n = step % 2 ? 1 + (uint32_t)(s + step) % 3 : 1;
			struct ro_fwd_item it;

			tok[s][0] = ro_sample(la[s], V, &(struct ro_sampling){0}, 0, 0, 0, NULL);
			for (uint32_t j = 1; j < n; j++)
				tok[s][j] = (int32_t)((tok[s][0] + 7 * j) % V);
			it = (struct ro_fwd_item){alone[s], tok[s], n, la[s], false};
			cr_assert_eq(ro_model_forward(m, &it, 1), 0);
			items[s] = (struct ro_fwd_item){batch[s], tok[s], n, lb[s], false};
		}
		cr_assert_eq(ro_model_forward(m, items, N), 0);
		for (int s = 0; s < N; s++)
			cr_expect_eq(memcmp(la[s], lb[s], V * sizeof(float)), 0,
				     "step %d: sequence %d (position %u)", step, s,
				     ro_seq_len(batch[s]));
	}
	for (int s = 0; s < N; s++) {
		ro_seq_free(alone[s]);
		ro_seq_free(batch[s]);
		free(la[s]);
		free(lb[s]);
	}
	ro_model_free(m);
}

/* A sequence truncated inside a block (50 tokens, back to 40, as the engine undoes a failed
 * batch) decodes the same bits as a sequence that only ever held the 40: what the cache
 * holds past the new length is overwritten, never read. */
Test(model, truncation_then_decode_is_bitwise_a_fresh_run)
{
	struct ro_model *m;
	struct ro_seq *a, *b;
	int32_t p[50], t;
	float *la, *lb;
	uint32_t V;

	make("trunc", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	m = load("trunc", false);
	V = ro_model_config(m)->vocab;
	la = malloc(V * sizeof(float));
	lb = malloc(V * sizeof(float));
	for (int i = 0; i < 50; i++)
		p[i] = (i * 29 + 3) % (int32_t)V;
	cr_assert_eq(ro_seq_new(m, 128, &a), 0);
	cr_assert_eq(ro_seq_new(m, 128, &b), 0);
	{
		struct ro_fwd_item ia = {a, p, 50, la, false}, ib = {b, p, 40, lb, false};

		cr_assert_eq(ro_model_forward(m, &ia, 1), 0);
		cr_assert_eq(ro_model_forward(m, &ib, 1), 0);
	}
	ro_seq_truncate(a, 40);
	for (int step = 0; step < 12; step++) {
		struct ro_fwd_item ia, ib;

		t = (step * 13 + 1) % (int32_t)V;
		ia = (struct ro_fwd_item){a, &t, 1, la, false};
		ib = (struct ro_fwd_item){b, &t, 1, lb, false};
		cr_assert_eq(ro_model_forward(m, &ia, 1), 0);
		cr_assert_eq(ro_model_forward(m, &ib, 1), 0);
		cr_expect_eq(memcmp(la, lb, V * sizeof(float)), 0, "position %u", 40 + step);
	}
	ro_seq_free(a);
	ro_seq_free(b);
	free(la);
	free(lb);
	ro_model_free(m);
}

/* Sample n tokens after prompt + prefix, drawing positions from prefix_len on. */
static void sample_from(struct ro_model *m, const int32_t *prompt, uint32_t plen,
			const int32_t *prefix, uint32_t k, const struct ro_sampling *sp, uint32_t n,
			int32_t *out, float *lp)
{
	const uint32_t V = ro_model_config(m)->vocab;
	float *l = malloc(V * sizeof(float));
	struct ro_seq *s;
	int32_t *all = malloc((plen + k) * sizeof(*all));
	uint64_t key = ro_sample_key("u-resume");

	memcpy(all, prompt, plen * sizeof(*all));
	if (k)
		memcpy(all + plen, prefix, k * sizeof(*all));
	cr_assert_eq(ro_seq_new(m, 128, &s), 0);
	{
		struct ro_fwd_item it = {s, all, plen + k, l, false};

		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
	}
	for (uint32_t i = 0; i < n; i++) {
		struct ro_fwd_item it;

		out[i] = ro_sample(l, V, sp, key, 3, k + i, &lp[i]);
		it = (struct ro_fwd_item){s, &out[i], 1, l, false};
		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
	}
	ro_seq_free(s);
	free(all);
	free(l);
}

Test(model, resume_from_prefix_is_bitwise_identical)
{
	static const int32_t prompt[] = {11, 22, 33, 44, 55};
	const struct ro_sampling sps[] = {
	    {.temperature = 1.0, .top_p = 1.0, .seed = 42},
	    {.temperature = 0.7, .top_p = 0.9, .top_k = 20, .seed = 43},
	};
	struct ro_model *m;

	make("resume", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	m = load("resume", false);
	for (size_t c = 0; c < 2; c++) {
		int32_t full[24], tail[24];
		float lpf[24], lpt[24];

		sample_from(m, prompt, 5, NULL, 0, &sps[c], 24, full, lpf);
		for (uint32_t k = 1; k < 24; k += 7) {
			sample_from(m, prompt, 5, full, k, &sps[c], 24 - k, tail, lpt);
			cr_expect_eq(memcmp(full + k, tail, (24 - k) * sizeof(int32_t)), 0,
				     "sampling %zu, resumed at %u: tokens differ", c, k);
			cr_expect_eq(memcmp(lpf + k, lpt, (24 - k) * sizeof(float)), 0,
				     "sampling %zu, resumed at %u: logprobs differ", c, k);
		}
	}
	ro_model_free(m);
}

Test(model, fork_shares_the_prompt_prefill)
{
	static const int32_t prompt[] = {1, 2, 3, 4, 5, 6};
	struct ro_model *m;
	struct ro_seq *a, *b, *f;
	float *la, *lf;
	int32_t t = 9;
	uint32_t V;

	make("fork", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	m = load("fork", false);
	V = ro_model_config(m)->vocab;
	la = malloc(V * sizeof(float));
	lf = malloc(V * sizeof(float));
	cr_assert_eq(ro_seq_new(m, 32, &a), 0);
	cr_assert_eq(ro_seq_new(m, 32, &b), 0);
	run_chunks(m, a, prompt, 6, 6, la);
	run_chunks(m, b, prompt, 6, 6, la);
	cr_assert_eq(ro_seq_fork(b, &f), 0);
	cr_expect_eq(ro_seq_len(f), 6);
	run_chunks(m, a, &t, 1, 1, la);
	run_chunks(m, f, &t, 1, 1, lf);
	cr_expect_eq(memcmp(la, lf, V * sizeof(float)), 0);
	/* a full sequence refuses more */
	{
		int32_t many[32] = {0};
		struct ro_fwd_item it = {f, many, 32, lf, false};

		cr_expect_eq(ro_model_forward(m, &it, 1), -ENOSPC);
		cr_expect_eq(ro_seq_len(f), 7, "a refused batch writes nothing");
	}
	{
		int32_t bad = 100000;
		struct ro_fwd_item it = {f, &bad, 1, lf, false};

		cr_expect_eq(ro_model_forward(m, &it, 1), -EINVAL, "token outside the vocab");
	}
	ro_seq_free(a);
	ro_seq_free(b);
	ro_seq_free(f);
	free(la);
	free(lf);
	ro_model_free(m);
}

/* ---- long prompts: tiled attention, chunking, bounded scratch ------------------------------- */

/* A prompt of n tokens below V, different for each salt. */
static int32_t *prompt_of(uint32_t n, uint32_t V, uint32_t salt)
{
	int32_t *p = malloc(n * sizeof(*p));

	for (uint32_t i = 0; i < n; i++)
		p[i] = (int32_t)(((uint64_t)i * 104729 + salt * 7919 + 17) % V);
	return p;
}

/* The logits of every position of p[n], prefilled into a fresh sequence in chunks. */
static float *prefill_rows(struct ro_model *m, const int32_t *p, uint32_t n, uint32_t chunk)
{
	const uint32_t V = ro_model_config(m)->vocab;
	float *rows = malloc((size_t)n * V * sizeof(float));
	struct ro_seq *s;

	cr_assert_eq(ro_seq_new(m, n, &s), 0);
	for (uint32_t i = 0; i < n; i += chunk) {
		uint32_t c = i + chunk < n ? chunk : n - i;
		struct ro_fwd_item it = {s, p + i, c, rows + (size_t)i * V, true};

		cr_assert_eq(ro_model_forward(m, &it, 1), 0, "chunk of %u at %u", c, i);
	}
	ro_seq_free(s);
	return rows;
}

/* The logits rows of the concatenation a[na] + b[nb], prefilled in chunks of 37. */
static float *rows_of(struct ro_model *m, const int32_t *a, uint32_t na, const int32_t *b,
		      uint32_t nb)
{
	int32_t *all = malloc((na + nb + 1) * sizeof(*all));
	float *rows;

	if (na)
		memcpy(all, a, na * sizeof(*all));
	if (nb)
		memcpy(all + na, b, nb * sizeof(*all));
	rows = prefill_rows(m, all, na + nb, 37);
	free(all);
	return rows;
}

/* Paged KV: forks hold the prompt's blocks once, a shared block is copied only when a fork
 * writes into it, and what each fork computes is bitwise what a sequence of its own would.
 * The model in sub decides where its blocks come from (malloc, or mappings of their own). */
static void paged_kv_forks(const char *sub)
{
	enum { P = 130, N = 4, D = 80 };
	struct ro_model *m;
	struct ro_seq *b, *f[N], *g;
	struct ro_kv_stats st;
	int32_t *prompt, *tok[N], *q;
	float *l[N], *want[N];
	uint64_t bytes, shared;
	uint32_t V;

	m = load(sub, false);
	V = ro_model_config(m)->vocab;
	prompt = prompt_of(P, V, 9);
	cr_assert_eq(ro_seq_new(m, 400, &b), 0);
	for (uint32_t i = 0; i < P; i += 50) {
		struct ro_fwd_item it = {b, prompt + i, i + 50 < P ? 50 : P - i, NULL, false};

		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
	}
	ro_model_kv_stats(m, &st);
	cr_expect_eq(st.block_positions, 64);
	cr_expect_eq(st.blocks, 3, "130 positions: 3 blocks, not %llu",
		     (unsigned long long)st.blocks);
	for (int i = 0; i < N; i++) {
		cr_assert_eq(ro_seq_fork(b, &f[i]), 0);
		tok[i] = prompt_of(D, V, 20 + (uint32_t)i);
		l[i] = malloc(V * sizeof(float));
		want[i] = rows_of(m, prompt, P, tok[i], D);
	}
	ro_model_kv_stats(m, &st);
	cr_expect_eq(st.blocks, 3, "forks copy nothing: %llu blocks",
		     (unsigned long long)st.blocks);
	bytes = ro_seq_kv_bytes(f[1], &shared);
	cr_expect_eq(bytes, 3 * st.block_bytes);
	cr_expect_eq(shared, bytes, "every block of a fork is shared");
	b = ro_seq_free(b);
	/* decode the forks together, each its own tokens */
	for (uint32_t j = 0; j < D; j++) {
		struct ro_fwd_item it[N];

		for (int i = 0; i < N; i++)
			it[i] = (struct ro_fwd_item){f[i], &tok[i][j], 1, l[i], false};
		cr_assert_eq(ro_model_forward(m, it, N), 0);
		for (int i = 0; i < N; i++)
			cr_expect_eq(memcmp(l[i], want[i] + (size_t)(P + j) * V, V * sizeof(float)),
				     0, "fork %d, token %u: logits differ from its own sequence's",
				     i, j);
		if (j == 0) {
			/* the prompt's partly filled block: copied by all but the last holder */
			ro_model_kv_stats(m, &st);
			cr_expect_eq(st.blocks, 2 + N, "after one token: %llu blocks",
				     (unsigned long long)st.blocks);
			cr_expect_eq(st.copied_on_write, N - 1);
		}
	}
	ro_model_kv_stats(m, &st);
	cr_expect_eq(st.blocks, 2 + 2 * N, "210 positions each, 2 shared: %llu blocks",
		     (unsigned long long)st.blocks);
	/* a fork cut back into a shared block and grown again copies the kept part only */
	cr_assert_eq(ro_seq_fork(f[3], &g), 0);
	ro_seq_truncate(g, 100);
	cr_expect_eq(ro_seq_len(g), 100);
	q = prompt_of(20, V, 77);
	{
		float *w = rows_of(m, prompt, 100, q, 20), *lg = malloc((size_t)20 * V * 4);
		struct ro_fwd_item it = {g, q, 20, lg, true};

		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
		cr_expect_eq(memcmp(lg, w + (size_t)100 * V, (size_t)20 * V * sizeof(float)), 0,
			     "a truncated fork grown again differs from its own sequence");
		free(w);
		free(lg);
	}
	/* the others still see their own caches */
	for (int i = 0; i < N; i++) {
		int32_t *all = malloc((P + D + 1) * sizeof(*all));
		struct ro_fwd_item it = {f[i], &all[P + D], 1, l[i], false};
		float *r;

		memcpy(all, prompt, P * sizeof(*all));
		memcpy(all + P, tok[i], D * sizeof(*all));
		all[P + D] = 5;
		r = rows_of(m, all, P + D + 1, NULL, 0);
		cr_assert_eq(ro_model_forward(m, &it, 1), 0);
		cr_expect_eq(memcmp(l[i], r + (size_t)(P + D) * V, V * sizeof(float)), 0,
			     "fork %d after another fork wrote its shared block", i);
		free(r);
		free(all);
	}
	g = ro_seq_free(g);
	for (int i = 0; i < N; i++) {
		ro_seq_free(f[i]);
		free(tok[i]);
		free(l[i]);
		free(want[i]);
	}
	ro_model_kv_stats(m, &st);
	cr_expect_eq(st.blocks, 0, "every block freed: %llu left", (unsigned long long)st.blocks);
	free(prompt);
	free(q);
	ro_model_free(m);
}

Test(model, paged_kv_forks_share_blocks_and_copy_on_write)
{
	make("paged", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	paged_kv_forks("paged");
}

/* The same with blocks of 2 MiB (8 layers x K and V x 64 positions x 512 floats): each is
 * a mapping of its own, 2 MiB-aligned for a huge page, its reference count in the page
 * before it; the copies on write, the truncation and the frees go through those. */
Test(model, paged_kv_in_blocks_of_their_own_mappings)
{
	struct ro_make_model_opts o;
	struct ro_model *m;
	struct ro_kv_stats st;
	char err[256];

	ro_make_model_defaults(&o);
	o.layers = 8;
	o.heads = 8;
	o.kv_heads = 8;
	o.head_dim = 64;
	o.seed = 11;
	cr_assert_eq(ro_make_model(&o, path("paged2m"), err, sizeof(err)), 0, "%s", err);
	m = load("paged2m", false);
	ro_model_kv_stats(m, &st);
	cr_assert_eq(st.block_bytes, (uint64_t)2 << 20);
	/* a block's data and the page of its head, counted in what a sequence may take */
	cr_expect_eq(ro_model_seq_bytes(m, 64) - ro_model_seq_bytes(m, 1), 0);
	cr_expect_geq(ro_model_seq_bytes(m, 65) - ro_model_seq_bytes(m, 64),
		      ((uint64_t)2 << 20) + 4096, "a second block: %llu bytes more",
		      (unsigned long long)(ro_model_seq_bytes(m, 65) - ro_model_seq_bytes(m, 64)));
	ro_model_free(m);
	paged_kv_forks("paged2m");
}

/* A prompt of several attention tiles, against the reference at every position. */
Test(model, long_prompt_matches_reference)
{
	const uint32_t n = 200;
	struct ro_model *m;
	float *ref, *got, maxerr = 0, maxabs = 0;
	int32_t *p;
	uint32_t V;

	make("long", RO_ARCH_QWEN3_MOE, "F32", 1, 0);
	m = load("long", false);
	V = ro_model_config(m)->vocab;
	p = prompt_of(n, V, 1);
	ref = reference("long", p, n, V, NULL, 0);
	got = prefill_rows(m, p, n, n);
	for (size_t i = 0; i < (size_t)n * V; i++) {
		float e = fabsf(got[i] - ref[i]);

		maxerr = e > maxerr ? e : maxerr;
		maxabs = fabsf(ref[i]) > maxabs ? fabsf(ref[i]) : maxabs;
	}
	cr_expect_leq(maxerr / maxabs, 1e-4, "max abs error %g of max |logit| %g", maxerr, maxabs);
	(void)fprintf(stderr, "ref agreement %u tokens: max abs err %.3g, relative %.3g\n", n,
		      maxerr, maxerr / maxabs);
	free(p);
	free(ref);
	free(got);
	ro_model_free(m);
}

/* A prompt of 300 tokens (tiles of attention and a partial one) prefilled whole, in chunks
 * of 1 (token-by-token decode), 7, 64 and 100, and in chunks of 50 inside batches where
 * other sequences decode (and one prefills): every position's logits the same bits. The
 * decoding sequences get the bits they get alone, too. */
static void set_config(const char *sub, const char *key, const char *value);

/* window: a sliding_window (Mixtral) that is not a multiple of the KV block, so the keys a
 * query sees start inside a block and the tokens of one chunk start in different ones */
static void chunked_prefill_w(const char *sub, enum ro_arch arch, uint64_t dense,
			      const char *window)
{
	const uint32_t n = 300, chunks[] = {1, 7, 64, 100};
	struct ro_model *m;
	float *base;
	int32_t *p;
	uint32_t V;

	make(sub, arch, "BF16", 1, dense);
	if (window)
		set_config(sub, "sliding_window", window);
	m = load(sub, false);
	V = ro_model_config(m)->vocab;
	p = prompt_of(n, V, 2);
	base = prefill_rows(m, p, n, n);
	for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
		float *rows = prefill_rows(m, p, n, chunks[c]);

		for (uint32_t i = 0; i < n; i++)
			cr_expect_eq(
			    memcmp(base + (size_t)i * V, rows + (size_t)i * V, V * sizeof(float)),
			    0, "%s: chunks of %u: position %u differs from one prefill", sub,
			    chunks[c], i);
		free(rows);
	}
	{
		/* the prompt in chunks of 50, each in one batch with three decoding sequences
		 * (alone twins beside them) and, once, another sequence's prefill */
		enum { D = 3 };
		struct ro_seq *x, *d[D], *twin[D], *o;
		float *rows = malloc((size_t)n * V * sizeof(float)),
		      *ld = malloc(D * V * sizeof(float));
		float *lt = malloc(D * V * sizeof(float)), *lo = malloc(V * sizeof(float));
		int32_t tok[D], *po = prompt_of(40, V, 3);

		cr_assert_eq(ro_seq_new(m, n, &x), 0);
		cr_assert_eq(ro_seq_new(m, 64, &o), 0);
		for (int k = 0; k < D; k++) {
			int32_t *pd = prompt_of(5 + 3 * k, V, 10 + k);
			struct ro_fwd_item it;

			cr_assert_eq(ro_seq_new(m, 64, &d[k]), 0);
			it = (struct ro_fwd_item){d[k], pd, 5 + 3 * k, ld + (size_t)k * V, false};
			cr_assert_eq(ro_model_forward(m, &it, 1), 0);
			cr_assert_eq(ro_seq_fork(d[k], &twin[k]), 0);
			memcpy(lt + (size_t)k * V, ld + (size_t)k * V, V * sizeof(float));
			free(pd);
		}
		for (uint32_t i = 0, step = 0; i < n; i += 50, step++) {
			struct ro_fwd_item b[D + 2];
			size_t k = 0;

			for (int j = 0; j < D; j++) {
				tok[j] = ro_sample(ld + (size_t)j * V, V, &(struct ro_sampling){0},
						   0, 0, 0, NULL);
				cr_assert_eq(tok[j],
					     ro_sample(lt + (size_t)j * V, V,
						       &(struct ro_sampling){0}, 0, 0, 0, NULL));
			}
			/* the prompt's chunk between decode items; another prefill at step 2 */
			b[k++] = (struct ro_fwd_item){d[0], &tok[0], 1, ld, false};
			b[k++] = (struct ro_fwd_item){x, p + i, 50, rows + (size_t)i * V, true};
			if (step == 2)
				b[k++] = (struct ro_fwd_item){o, po, 40, lo, false};
			for (int j = 1; j < D; j++)
				b[k++] = (struct ro_fwd_item){d[j], &tok[j], 1, ld + (size_t)j * V,
							      false};
			cr_assert_eq(ro_model_forward(m, b, k), 0);
			for (int j = 0; j < D; j++) {
				struct ro_fwd_item it = {twin[j], &tok[j], 1, lt + (size_t)j * V,
							 false};

				cr_assert_eq(ro_model_forward(m, &it, 1), 0);
			}
			cr_expect_eq(memcmp(ld, lt, D * V * sizeof(float)), 0,
				     "%s: step %u: a decoding sequence differs from its twin alone",
				     sub, step);
		}
		for (uint32_t i = 0; i < n; i++)
			cr_expect_eq(
			    memcmp(base + (size_t)i * V, rows + (size_t)i * V, V * sizeof(float)),
			    0, "%s: mixed batches: position %u differs from one prefill", sub, i);
		ro_seq_free(x);
		ro_seq_free(o);
		for (int k = 0; k < D; k++) {
			ro_seq_free(d[k]);
			ro_seq_free(twin[k]);
		}
		free(rows);
		free(ld);
		free(lt);
		free(lo);
		free(po);
	}
	free(base);
	free(p);
	ro_model_free(m);
}

static void chunked_prefill(const char *sub, enum ro_arch arch, uint64_t dense)
{
	chunked_prefill_w(sub, arch, dense, NULL);
}

Test(model, chunked_prefill_qwen3_is_bitwise_invariant)
{
	chunked_prefill("chq3", RO_ARCH_QWEN3_MOE, 1ULL << 1);
}

Test(model, chunked_prefill_mixtral_is_bitwise_invariant)
{
	chunked_prefill("chmx", RO_ARCH_MIXTRAL, 0);
}

/* What one forward of n tokens allocates beyond the sequence's cache, and that cache: the
 * cache is what ro_seq_free gives back, the forward's part the peak less the cache. */
struct fwd_mem {
	size_t peak, cache, kept; /* kept: what the model holds after (its workspace) */
};

#ifndef NO_COUNTING
static void measure_forward(struct ro_model *m, const int32_t *p, uint32_t n, bool all,
			    float *logits, struct fwd_mem *ret)
{
	struct ro_seq *s;
	struct ro_fwd_item it;
	size_t after;
	int r1, r2;

	count_start();
	r1 = ro_seq_new(m, n, &s);
	it = (struct ro_fwd_item){s, p, n, logits, all};
	r2 = r1 ? r1 : ro_model_forward(m, &it, 1);
	after = live;
	ro_seq_free(s);
	ret->kept = live;
	ret->cache = after - live;
	ret->peak = peak - ret->cache;
	count_stop();
	cr_assert_eq(r1, 0);
	cr_assert_eq(r2, 0);
}
#endif

Test(model, memory_estimates_bound_what_is_allocated)
{
#ifdef NO_COUNTING
	cr_skip_test("the counting allocator is off under ASan");
#else
	static const struct {
		uint32_t n;
		bool all;
	} cases[] = {{1, false}, {37, false}, {300, true}, {1000, false}, {2000, true}};
	static const uint32_t lens[] = {1, 50, 64, 100, 300};
	const enum ro_arch archs[] = {RO_ARCH_QWEN3_MOE, RO_ARCH_MIXTRAL};

	for (size_t a = 0; a < 2; a++) {
		const char *sub = a ? "memmx" : "memq3";
		uint32_t V;

		make(sub, archs[a], "BF16", 1, a ? 0 : 1ULL << 2);
		for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
			/* a fresh model each time: its workspace is allocated while counting */
			struct ro_model *m = load(sub, false);
			const uint32_t n = cases[c].n;
			uint64_t fb, sb;
			struct fwd_mem fm;
			float *logits;
			int32_t *p;

			V = ro_model_config(m)->vocab;
			p = prompt_of(n, V, 4);
			logits = malloc((size_t)n * V * sizeof(float));
			measure_forward(m, p, n, cases[c].all, logits, &fm);
			fb = ro_model_forward_bytes(m, n);
			sb = ro_model_seq_bytes(m, n);
			(void)fprintf(stderr,
				      "%s forward of %4u tokens%s: peak %zu bytes, estimate %llu; "
				      "cache %zu, estimate %llu\n",
				      sub, n, cases[c].all ? " (all logits)" : "", fm.peak,
				      (unsigned long long)fb, fm.cache, (unsigned long long)sb);
			cr_expect_leq(fm.peak, fb, "%s, %u tokens: forward allocated %zu > %llu",
				      sub, n, fm.peak, (unsigned long long)fb);
			cr_expect_leq(fm.kept, fm.peak);
			cr_expect_leq(fm.cache, sb, "%s, %u tokens: cache %zu > %llu", sub, n,
				      fm.cache, (unsigned long long)sb);
			if (n >= 300) /* past the fixed job lists: within a sane factor */
				cr_expect_geq(fm.peak * 2, fb,
					      "%s, %u tokens: %zu of estimate %llu", sub, n,
					      fm.peak, (unsigned long long)fb);
			free(p);
			free(logits);
			ro_model_free(m);
		}
		/* a sequence growing a token at a time (its cache doubling, the old and the new
		 * copy held together at each step) to max_len */
		for (size_t c = 0; c < sizeof(lens) / sizeof(lens[0]); c++) {
			struct ro_model *m = load(sub, false);
			const uint32_t n = lens[c];
			int32_t *p;
			float *l;
			struct ro_seq *s, *w;
			size_t full, most, kept;
			uint64_t sb = ro_model_seq_bytes(m, n);
			int r = 0;

			V = ro_model_config(m)->vocab;
			p = prompt_of(n, V, 5);
			l = malloc(V * sizeof(float));
			/* the one-token workspace first, outside the count */
			cr_assert_eq(ro_seq_new(m, 4, &w), 0);
			cr_assert_eq(
			    ro_model_forward(m, &(struct ro_fwd_item){w, p, 1, l, false}, 1), 0);
			ro_seq_free(w);
			count_start();
			r = ro_seq_new(m, n, &s);
			for (uint32_t i = 0; !r && i < n; i++)
				r = ro_model_forward(
				    m, &(struct ro_fwd_item){s, p + i, 1, l, false}, 1);
			full = live;
			most = peak;
			ro_seq_free(s);
			kept = live;
			count_stop();
			(void)fprintf(stderr,
				      "%s sequence of %3u grown a token at a time: peak %zu bytes "
				      "(with one-token forwards), cache %zu; estimate %llu\n",
				      sub, n, most - kept, full - kept, (unsigned long long)sb);
			cr_assert_eq(r, 0);
			cr_expect_leq(most - kept, sb + ro_model_forward_bytes(m, 1),
				      "%s, max_len %u: %zu > %llu + one token's forward", sub, n,
				      most - kept, (unsigned long long)sb);
			cr_expect_leq(full - kept, sb, "%s, max_len %u", sub, n);
			cr_expect_geq((full - kept) * 2, sb, "%s, max_len %u: %zu of %llu", sub, n,
				      full - kept, (unsigned long long)sb);
			free(p);
			free(l);
			ro_model_free(m);
		}
		{
			struct ro_model *m = load(sub, false);

			cr_expect_eq(ro_model_seq_bytes(m, 0),
				     ro_model_seq_bytes(m, ro_model_config(m)->max_pos));
			/* linear in the tokens: nothing grows with the square of the context */
			cr_expect_leq(ro_model_forward_bytes(m, 16000),
				      2 * ro_model_forward_bytes(m, 8000));
			ro_model_free(m);
		}
	}
#endif
}

/* 4096 tokens on the tiny model: the score buffer of old (tokens x heads x context floats,
 * 268 MB here) is gone; the forward's own allocations stay within the estimate, which is
 * linear in the tokens, and the last logits are those of a prefill in chunks. */
Test(model, long_prompt_prefills_with_bounded_scratch)
{
	const uint32_t n = 4096;
	struct ro_model *m;
	float *whole = NULL, *chunked;
	int32_t *p;
	uint32_t V;

	make("big", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	m = load("big", false);
	V = ro_model_config(m)->vocab;
	p = prompt_of(n, V, 6);
	whole = malloc(V * sizeof(float));
	chunked = malloc(V * sizeof(float));
#ifndef NO_COUNTING
	{
		struct fwd_mem fm;
		uint64_t fb = ro_model_forward_bytes(m, n);

		measure_forward(m, p, n, false, whole, &fm);
		(void)fprintf(stderr, "forward of %u tokens: peak %zu bytes, estimate %llu\n", n,
			      fm.peak, (unsigned long long)fb);
		cr_expect_leq(fm.peak, fb);
		cr_expect_lt(fb, (uint64_t)n * 16384, "%llu bytes: more than 16 KiB a token",
			     (unsigned long long)fb);
	}
#else
	{
		struct ro_seq *s;

		cr_assert_eq(ro_seq_new(m, n, &s), 0);
		cr_assert_eq(ro_model_forward(m, &(struct ro_fwd_item){s, p, n, whole, false}, 1),
			     0);
		ro_seq_free(s);
	}
#endif
	{
		struct ro_seq *s;

		cr_assert_eq(ro_seq_new(m, n, &s), 0);
		run_chunks(m, s, p, n, 1000, chunked);
		ro_seq_free(s);
	}
	cr_expect_eq(memcmp(whole, chunked, V * sizeof(float)), 0);
	free(whole);
	free(chunked);
	free(p);
	ro_model_free(m);
}

/* ---- sampler ----------------------------------------------------------------------------- */

Test(model, sampler)
{
	float l[6] = {0.5f, 2.0f, 1.0f, 2.0f, -1.0f, 0.0f}, lp;
	struct ro_sampling g = {0}, s = {.temperature = 1.0, .top_p = 1.0, .seed = 1};
	struct ro_sampling k1 = {.temperature = 1.0, .top_k = 1, .top_p = 1.0, .seed = 1};
	struct ro_sampling p0 = {.temperature = 1.0, .top_p = 0.01, .seed = 1};
	int counts[6] = {0};
	double z = 0;

	cr_expect_eq(ro_sample(l, 6, &g, 1, 0, 0, &lp), 1, "greedy: the first of the largest");
	for (int i = 0; i < 6; i++)
		z += exp(l[i]);
	cr_expect_float_eq(lp, (float)(2.0 - log(z)), 1e-6);
	for (uint32_t pos = 0; pos < 50; pos++) {
		cr_expect_eq(ro_sample(l, 6, &k1, 7, 0, pos, NULL), 1, "top_k 1 is greedy");
		cr_expect_eq(ro_sample(l, 6, &p0, 7, 0, pos, NULL), 1, "tiny top_p is greedy");
	}
	/* the draw is a function of (seed, unit, sample, position) alone */
	cr_expect_eq(ro_sample(l, 6, &s, 99, 2, 17, NULL), ro_sample(l, 6, &s, 99, 2, 17, NULL));
	for (uint32_t pos = 0; pos < 4000; pos++)
		counts[ro_sample(l, 6, &s, 5, 0, pos, NULL)]++;
	for (int i = 0; i < 6; i++) {
		double want = 4000 * exp(l[i]) / z;

		/* 6 sigma of a binomial: a broken stream fails, a fair one does not */
		cr_expect_leq(fabs(counts[i] - want), 6 * sqrt(want) + 1, "token %d: %d, want %.0f",
			      i, counts[i], want);
	}
	{
		struct ro_sampling k2 = {.temperature = 1.0, .top_k = 2, .top_p = 1.0, .seed = 3};

		for (uint32_t pos = 0; pos < 200; pos++) {
			int32_t t = ro_sample(l, 6, &k2, 5, 0, pos, NULL);

			cr_expect(t == 1 || t == 3, "top_k 2 keeps the two largest: got %d", t);
		}
	}
	cr_expect_neq(ro_sample_key("u-1"), ro_sample_key("u-2"));
}

/* ---- bad model files ---------------------------------------------------------------------- */

static void write_file(const char *p, const void *data, size_t len)
{
	FILE *f = fopen(p, "wb");

	cr_assert_not_null(f);
	cr_assert_eq(fwrite(data, 1, len, f), len);
	cr_assert_eq(fclose(f), 0);
}

static void write_str(const char *p, const char *s)
{
	write_file(p, s, strlen(s));
}

static void expect_refused(const char *sub, int want, const char *mention)
{
	struct ro_model_opts mo = {.threads = 1};
	struct ro_model *m = NULL;
	char err[512] = "";
	int r = ro_model_load(path(sub), &mo, &m, err, sizeof(err));

	cr_expect_eq(r, want, "%s: got %d (%s), want %d", sub, r, err, want);
	cr_expect_null(m);
	cr_expect(strstr(err, mention) != NULL, "%s: message \"%s\" should name \"%s\"", sub, err,
		  mention);
}

/* A small valid safetensors file with one header edit applied, written over a model. */
static void corrupt_header(const char *sub, const char *header, long data_len)
{
	char p[256];
	uint8_t le[8];
	size_t hl = strlen(header), pad = (8 - hl % 8) % 8; /* the data 8-byte aligned */
	char *zeros = calloc(1, data_len > 0 ? (size_t)data_len : 1);
	FILE *f;

	(void)snprintf(p, sizeof(p), "%s/model.safetensors", path(sub));
	for (int i = 0; i < 8; i++)
		le[i] = (uint8_t)((uint64_t)(hl + pad) >> (8 * i));
	f = fopen(p, "wb");
	cr_assert_not_null(f);
	fwrite(le, 1, 8, f);
	fwrite(header, 1, hl, f);
	fwrite("        ", 1, pad, f);
	if (data_len > 0)
		fwrite(zeros, 1, (size_t)data_len, f);
	fclose(f);
	free(zeros);
}

Test(model, bad_model_files)
{
	char p[256];

	/* no directory, no config */
	expect_refused("nothing", -ENOENT, "config.json");
	/* unknown architecture */
	make("arch", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	write_str(path("arch/config.json"), "{\"architectures\": [\"LlamaForCausalLM\"]}");
	expect_refused("arch", -ENOTSUP, "LlamaForCausalLM");
	/* config with a wrong type */
	make("cfgtype", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	write_str(path("cfgtype/config.json"),
		  "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"vocab_size\": \"big\"}");
	expect_refused("cfgtype", -EINVAL, "vocab_size");
	/* config not JSON */
	make("cfgjson", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	write_str(path("cfgjson/config.json"), "{\"architectures\": [");
	expect_refused("cfgjson", -EBADMSG, "config.json");
	/* inconsistent sizes */
	make("sizes", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	write_str(path("sizes/config.json"),
		  "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"vocab_size\": 256, "
		  "\"hidden_size\": 64, \"num_hidden_layers\": 3, \"num_attention_heads\": 4, "
		  "\"num_key_value_heads\": 3, \"head_dim\": 16, \"num_experts_per_tok\": 2, "
		  "\"num_experts\": 8, \"moe_intermediate_size\": 32}");
	expect_refused("sizes", -EINVAL, "num_key_value_heads: 3 does not divide");
	/* missing tensor: config says 4 layers, the file has 3 */
	make("missing", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	(void)snprintf(p, sizeof(p), "sed -i 's/\"num_hidden_layers\": 3/\"num_hidden_layers\": 4/' "
				     "%s",
		       path("missing/config.json"));
	cr_assert_eq(system(p), 0);
	expect_refused("missing", -ENOENT, "model.layers.3.input_layernorm.weight");
	/* wrong shape: config says more experts' width */
	make("shape", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	(void)snprintf(p, sizeof(p), "sed -i 's/\"moe_intermediate_size\": 32/"
				     "\"moe_intermediate_size\": 48/' %s",
		       path("shape/config.json"));
	cr_assert_eq(system(p), 0);
	expect_refused("shape", -EINVAL, "gate_proj.weight has shape [32, 64], want [48, 64]");
	/* truncated file */
	make("trunc", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	{
		struct stat st;

		cr_assert_eq(stat(path("trunc/model.safetensors"), &st), 0);
		cr_assert_eq(truncate(path("trunc/model.safetensors"), st.st_size - 1000), 0);
	}
	expect_refused("trunc", -EBADMSG, "outside");
	/* shorter than the length field */
	make("tiny", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	write_str(path("tiny/model.safetensors"), "abc");
	expect_refused("tiny", -EBADMSG, "truncated");
	/* header length larger than the file */
	make("hlen", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	write_file(path("hlen/model.safetensors"), "\xff\xff\xff\x00\x00\x00\x00\x00{}", 10);
	expect_refused("hlen", -EBADMSG, "header of");
	/* header not JSON */
	make("hjson", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header("hjson", "{\"a\": [1, 2", 0);
	expect_refused("hjson", -EBADMSG, "header: the JSON text ends early");
	/* offsets that lie: past the data */
	make("lie", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header("lie",
		       "{\"model.embed_tokens.weight\": {\"dtype\": \"BF16\", \"shape\": [256, 64], "
		       "\"data_offsets\": [0, 32768]}}",
		       100);
	expect_refused("lie", -EBADMSG, "data_offsets");
	/* offsets that disagree with the shape */
	make("lie2", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header("lie2",
		       "{\"model.embed_tokens.weight\": {\"dtype\": \"BF16\", \"shape\": [256, 64], "
		       "\"data_offsets\": [0, 16]}}",
		       100);
	expect_refused("lie2", -EBADMSG, "16 bytes for 16384 elements");
	/* begin after end, negative, huge shape */
	make("lie3", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header("lie3",
		       "{\"x\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [16, 0]}}", 32);
	expect_refused("lie3", -EBADMSG, "data_offsets");
	make("lie4", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header("lie4",
		       "{\"x\": {\"dtype\": \"F32\", \"shape\": [-4], \"data_offsets\": [0, 16]}}", 32);
	expect_refused("lie4", -EBADMSG, "shape[0] is not a size");
	make("lie5", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header("lie5",
		       "{\"x\": {\"dtype\": \"F32\", \"shape\": [1099511627776, 1099511627776], "
		       "\"data_offsets\": [0, 16]}}",
		       32);
	expect_refused("lie5", -EBADMSG, "shape");
	/* unsupported dtype */
	make("dtype", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header(
	    "dtype", "{\"x\": {\"dtype\": \"F8_E5M2\", \"shape\": [4], \"data_offsets\": [0, 4]}}",
	    4);
	expect_refused("dtype", -ENOTSUP, "F8_E5M2");
	/* a tensor twice */
	make("dup", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header("dup",
		       "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
		       "\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
		       4);
	/* json-c keeps the last of duplicate keys: one tensor, then the model lacks the rest */
	expect_refused("dup", -ENOENT, "missing");
	/* a shard the index names is gone */
	make("shard", RO_ARCH_QWEN3_MOE, "BF16", 2, 0);
	cr_assert_eq(unlink(path("shard/model-00002-of-00002.safetensors")), 0);
	expect_refused("shard", -ENOENT, "model-00002-of-00002.safetensors");
	/* the index points outside the directory */
	make("escape", RO_ARCH_QWEN3_MOE, "BF16", 2, 0);
	write_str(path("escape/model.safetensors.index.json"),
		  "{\"weight_map\": {\"x\": \"../../etc/passwd\"}}");
	expect_refused("escape", -EBADMSG, "bad shard name");
}

/* ---- hostile checkpoints ------------------------------------------------------------------ *
 * What a checkpoint written by someone else can hold: sizes that overflow, data that is not
 * aligned, files that are FIFOs, keys of config.json this runtime must implement exactly as
 * Hugging Face does (sliding_window, attention_bias, tie_word_embeddings, the classes'
 * defaults) or refuse, tensors the config does not describe, NaN weights. Each generated
 * directory is refused with a message naming the file and the key or tensor, or loaded and
 * compared with the reference. */

TestSuite(hostile, .init = mk_tmp, .fini = rm_tmp, .timeout = 120);

#include <json-c/json.h>

/* config.json of sub with key set to the JSON text value (NULL: removed). */
static void set_config(const char *sub, const char *key, const char *value)
{
	char p[256];
	struct json_object *o;

	(void)snprintf(p, sizeof(p), "%s/config.json", path(sub));
	o = json_object_from_file(p);
	cr_assert_not_null(o, "%s", p);
	if (value) {
		struct json_object *v = json_tokener_parse(value);

		cr_assert(v || !strcmp(value, "null"), "bad JSON in the test: %s", value);
		json_object_object_add(o, key, v);
	} else {
		json_object_object_del(o, key);
	}
	cr_assert_eq(json_object_to_file_ext(p, o, JSON_C_TO_STRING_PRETTY), 0);
	json_object_put(o);
}

/* model.safetensors of sub read whole: the header parsed, the data section kept. */
struct st_image {
	struct json_object *hdr;
	uint8_t *data;
	size_t data_len;
};

static struct st_image st_read(const char *sub)
{
	char p[256];
	struct st_image im = {0};
	FILE *f;
	long size;
	uint64_t hl = 0;
	uint8_t le[8];
	char *h;

	(void)snprintf(p, sizeof(p), "%s/model.safetensors", path(sub));
	f = fopen(p, "rb");
	cr_assert_not_null(f);
	cr_assert_eq(fseek(f, 0, SEEK_END), 0);
	size = ftell(f);
	rewind(f);
	cr_assert_eq(fread(le, 1, 8, f), 8);
	for (int i = 7; i >= 0; i--)
		hl = hl << 8 | le[i];
	h = calloc(1, hl + 1);
	cr_assert_eq(fread(h, 1, hl, f), hl);
	im.hdr = json_tokener_parse(h);
	cr_assert_not_null(im.hdr);
	im.data_len = (size_t)size - 8 - hl;
	im.data = malloc(im.data_len + 1);
	cr_assert_eq(fread(im.data, 1, im.data_len, f), im.data_len);
	(void)fclose(f);
	free(h);
	return im;
}

/* ... and written back, the header padded to a multiple of 8 and then `extra` spaces more
 * (which misaligns every element when extra is not a multiple of the element size). */
static void st_write(const char *sub, struct st_image *im, size_t extra)
{
	char p[256];
	const char *h = json_object_to_json_string_ext(im->hdr, JSON_C_TO_STRING_PLAIN);
	size_t hl = strlen(h), pad = (8 - hl % 8) % 8 + extra;
	uint8_t le[8];
	FILE *f;

	(void)snprintf(p, sizeof(p), "%s/model.safetensors", path(sub));
	f = fopen(p, "wb");
	cr_assert_not_null(f);
	for (int i = 0; i < 8; i++)
		le[i] = (uint8_t)((uint64_t)(hl + pad) >> (8 * i));
	cr_assert_eq(fwrite(le, 1, 8, f), 8);
	cr_assert_eq(fwrite(h, 1, hl, f), hl);
	for (size_t i = 0; i < pad; i++)
		cr_assert_eq(fputc(' ', f), ' ');
	cr_assert_eq(fwrite(im->data, 1, im->data_len, f), im->data_len);
	cr_assert_eq(fclose(f), 0);
	json_object_put(im->hdr);
	free(im->data);
}

static struct json_object *st_desc(struct st_image *im, const char *tensor)
{
	struct json_object *d;

	cr_assert(json_object_object_get_ex(im->hdr, tensor, &d), "no tensor %s", tensor);
	return d;
}

static uint64_t st_begin(struct st_image *im, const char *tensor)
{
	struct json_object *o;

	cr_assert(json_object_object_get_ex(st_desc(im, tensor), "data_offsets", &o));
	return (uint64_t)json_object_get_int64(json_object_array_get_idx(o, 0));
}

static void st_set(struct st_image *im, const char *tensor, const char *field, const char *json)
{
	json_object_object_add(st_desc(im, tensor), field, json_tokener_parse(json));
}

static void make_opts(const char *sub, const struct ro_make_model_opts *o)
{
	char err[256];

	cr_assert_eq(ro_make_model(o, path(sub), err, sizeof(err)), 0, "%s", err);
}

static void small_opts(struct ro_make_model_opts *o, enum ro_arch arch, const char *dtype)
{
	ro_make_model_defaults(o);
	o->arch = arch;
	o->dtype = dtype;
	o->layers = 2;
	o->seed = 11;
}

/* Every prompt position's logits of the model in sub. */
static float *all_logits(const char *sub)
{
	struct ro_model *m = load(sub, false);
	const uint32_t V = ro_model_config(m)->vocab;
	float *l = malloc((size_t)N_REF_PROMPT * V * sizeof(float));
	struct ro_seq *s;
	struct ro_fwd_item it;

	cr_assert_eq(ro_seq_new(m, 64, &s), 0);
	it = (struct ro_fwd_item){s, ref_prompt, N_REF_PROMPT, l, true};
	cr_assert_eq(ro_model_forward(m, &it, 1), 0);
	ro_seq_free(s);
	ro_model_free(m);
	return l;
}

/* The largest difference between two models' logits, relative to the largest logit. */
static float rel_diff(const char *a, const char *b, uint32_t V)
{
	float *x = all_logits(a), *y = all_logits(b), d = 0, mx = 0;

	for (size_t i = 0; i < (size_t)N_REF_PROMPT * V; i++) {
		d = fabsf(x[i] - y[i]) > d ? fabsf(x[i] - y[i]) : d;
		mx = fabsf(x[i]) > mx ? fabsf(x[i]) : mx;
	}
	free(x);
	free(y);
	return d / mx;
}

Test(hostile, sizes_that_overflow_are_refused)
{
	/* heads x head_dim wrapped to 0 in 32 bits, and passed the q_proj shape check */
	make("wrap", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	set_config("wrap", "num_attention_heads", "4194304");
	set_config("wrap", "num_key_value_heads", "1");
	set_config("wrap", "head_dim", "1024");
	expect_refused("wrap", -EINVAL, "config.json: num_attention_heads: 4194304 is out of range");
	make("hd", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	set_config("hd", "head_dim", "1048576");
	expect_refused("hd", -EINVAL, "config.json: head_dim: 1048576 is out of range");
	make("vocab", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	set_config("vocab", "vocab_size", "-3");
	expect_refused("vocab", -EINVAL, "config.json: vocab_size: -3 is out of range");
	make("odd", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	set_config("odd", "head_dim", "15");
	expect_refused("odd", -EINVAL, "config.json: head_dim: 15 is odd");
}

Test(hostile, threads_out_of_range_are_refused)
{
	struct ro_model_opts mo = {.threads = 4294967295u};
	struct ro_model *m = NULL;
	char err[256] = "";

	make("thr", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	cr_assert_eq(ro_model_load(path("thr"), &mo, &m, err, sizeof(err)), -EINVAL);
	cr_assert_null(m);
	cr_assert(strstr(err, "threads 4294967295: at most"), "%s", err);
}

Test(hostile, a_sequence_past_max_position_embeddings_is_refused)
{
	struct ro_model *m;
	struct ro_seq *s = NULL;

	make("maxpos", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	set_config("maxpos", "max_position_embeddings", "100");
	m = load("maxpos", false);
	cr_assert_eq(ro_seq_new(m, 4294967295u, &s), -E2BIG);
	cr_assert_null(s);
	cr_assert_eq(ro_seq_new(m, 102, &s), -E2BIG);
	cr_assert_eq(ro_seq_new(m, 101, &s), 0);
	ro_seq_free(s);
	ro_model_free(m);
}

Test(hostile, shapes_are_checked_in_every_dimension)
{
	struct st_image im;

	/* a 1-D weight given as 2-D (the same bytes) */
	make("2d", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	im = st_read("2d");
	st_set(&im, "model.norm.weight", "shape", "[32, 2]");
	st_write("2d", &im, 0);
	expect_refused("2d", -EINVAL,
		       "model.safetensors: tensor model.norm.weight has shape [32, 2], want [64]");
	/* 1-D against 1-D: no stray 0 */
	make("1d", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	im = st_read("1d");
	st_set(&im, "model.norm.weight", "dtype", "\"F32\"");
	st_set(&im, "model.norm.weight", "shape", "[32]");
	st_write("1d", &im, 0);
	expect_refused("1d", -EINVAL, "tensor model.norm.weight has shape [32], want [64]");
	/* 3-D shown whole */
	make("3d", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	im = st_read("3d");
	st_set(&im, "model.layers.0.self_attn.q_proj.weight", "shape", "[64, 8, 8]");
	st_write("3d", &im, 0);
	expect_refused("3d", -EINVAL, "has shape [64, 8, 8], want [64, 64]");
	/* an o_proj that is 1-D where the config's sizes would have wanted 2-D */
	make("o1d", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	im = st_read("o1d");
	st_set(&im, "model.layers.1.self_attn.o_proj.weight", "shape", "[4096]");
	st_write("o1d", &im, 0);
	expect_refused("o1d", -EINVAL, "o_proj.weight has shape [4096], want [64, 64]");
}

Test(hostile, misaligned_data_is_refused)
{
	struct st_image im;

	/* F32 elements at an offset = 2 mod 4: the header length moves every tensor */
	make("mis32", RO_ARCH_QWEN3_MOE, "F32", 1, 0);
	im = st_read("mis32");
	st_write("mis32", &im, 2);
	expect_refused("mis32", -EBADMSG, "is not 4-byte aligned");
	/* BF16 at an odd offset */
	make("mis16", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	im = st_read("mis16");
	st_write("mis16", &im, 1);
	expect_refused("mis16", -EBADMSG, "is not 2-byte aligned");
	/* control: the same rewrite without extra bytes loads */
	make("ok", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	im = st_read("ok");
	st_write("ok", &im, 0);
	ro_model_free(load("ok", false));
}

Test(hostile, overlapping_or_holed_offsets_are_refused)
{
	struct st_image im;
	uint64_t b;
	char v[64];

	make("overlap", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	im = st_read("overlap");
	/* model.norm.weight re-pointed at the first 128 bytes of the embedding */
	b = st_begin(&im, "model.embed_tokens.weight");
	(void)snprintf(v, sizeof(v), "[%llu, %llu]", (unsigned long long)b,
		       (unsigned long long)b + 128);
	st_set(&im, "model.norm.weight", "data_offsets", v);
	st_write("overlap", &im, 0);
	expect_refused("overlap", -EBADMSG, "overlap");
	/* trailing bytes after the last tensor */
	make("trail", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	im = st_read("trail");
	im.data = realloc(im.data, im.data_len + 64);
	memset(im.data + im.data_len, 0, 64);
	im.data_len += 64;
	st_write("trail", &im, 0);
	expect_refused("trail", -EBADMSG, "trailing bytes");
}

Test(hostile, fifos_do_not_hang_the_loader)
{
	make("fifo1", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	cr_assert_eq(unlink(path("fifo1/model.safetensors")), 0);
	cr_assert_eq(mkfifo(path("fifo1/model.safetensors"), 0600), 0);
	expect_refused("fifo1", -EBADMSG, "model.safetensors: not a regular file");
	make("fifo2", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	cr_assert_eq(unlink(path("fifo2/config.json")), 0);
	cr_assert_eq(mkfifo(path("fifo2/config.json"), 0600), 0);
	expect_refused("fifo2", -EINVAL, "config.json: not a regular file");
	make("fifo3", RO_ARCH_QWEN3_MOE, "BF16", 2, 0);
	cr_assert_eq(unlink(path("fifo3/model.safetensors.index.json")), 0);
	cr_assert_eq(mkfifo(path("fifo3/model.safetensors.index.json"), 0600), 0);
	expect_refused("fifo3", -EINVAL, "model.safetensors.index.json: not a regular file");
}

Test(hostile, mixtral_sliding_window_matches_reference)
{
	struct ro_make_model_opts o;

	small_opts(&o, RO_ARCH_MIXTRAL, "F32");
	o.sliding_window = 4; /* shorter than the 12-token prompt and its greedy continuation */
	make_opts("swin", &o);
	agree_dir("swin", "F32", false);
	o.sliding_window = 0;
	make_opts("full", &o);
	/* the window changes the answer: the test can tell an ignored window */
	cr_expect_gt(rel_diff("swin", "full", o.vocab), 1e-2);
	/* a window as long as the sequence is full attention, bit for bit */
	o.sliding_window = 64;
	make_opts("swin64", &o);
	cr_expect_eq(rel_diff("swin64", "full", o.vocab), 0);
	set_config("swin", "sliding_window", "0");
	expect_refused("swin", -EINVAL, "config.json: sliding_window: 0 is out of range");
}

Test(hostile, sliding_window_chunked_prefill_is_bitwise_invariant)
{
	chunked_prefill_w("swchunk", RO_ARCH_MIXTRAL, 0, "100");
}

Test(hostile, qwen3_use_sliding_window_is_refused)
{
	make("q3swin", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	set_config("q3swin", "sliding_window", "4");
	ro_model_free(load("q3swin", false)); /* without use_sliding_window: Hugging Face ignores it */
	set_config("q3swin", "use_sliding_window", "true");
	expect_refused("q3swin", -EINVAL, "config.json: use_sliding_window");
}

Test(hostile, qwen3_attention_bias_matches_reference)
{
	struct ro_make_model_opts o;

	small_opts(&o, RO_ARCH_QWEN3_MOE, "F32");
	o.attn_bias = true;
	make_opts("bias", &o);
	agree_dir("bias", "F32", false);
	/* the same weights without the biases answer differently */
	set_config("bias", "attention_bias", "false");
	expect_refused("bias", -EINVAL, "_proj.bias is not part of the model");
	set_config("bias", "attention_bias", "true");
	o.attn_bias = false;
	make_opts("nobias", &o);
	cr_expect_gt(rel_diff("bias", "nobias", o.vocab), 1e-2);
	/* attention_bias without the tensors */
	set_config("nobias", "attention_bias", "true");
	expect_refused("nobias", -ENOENT, "tensor model.layers.0.self_attn.q_proj.bias is missing");
}

Test(hostile, tie_word_embeddings_uses_the_embedding)
{
	struct ro_make_model_opts o;

	small_opts(&o, RO_ARCH_QWEN3_MOE, "F32");
	o.tie_embeddings = true; /* and an lm_head.weight in the file, as Hugging Face ignores */
	make_opts("tied", &o);
	agree_dir("tied", "F32", false);
	o.tie_embeddings = false;
	make_opts("untied", &o);
	cr_expect_gt(rel_diff("tied", "untied", o.vocab), 1e-2);
}

Test(hostile, class_defaults_are_hugging_faces)
{
	struct ro_model *m;

	/* MixtralConfig's rms_norm_eps is 1e-5; Qwen3MoeConfig's 1e-6 */
	make("mxeps", RO_ARCH_MIXTRAL, "F32", 1, 0);
	set_config("mxeps", "rms_norm_eps", NULL);
	set_config("mxeps", "max_position_embeddings", NULL);
	m = load("mxeps", false);
	cr_expect_eq(ro_model_config(m)->rms_eps, 1e-5);
	cr_expect_eq(ro_model_config(m)->max_pos, 131072);
	ro_model_free(m);
	agree_dir("mxeps", "F32", false);
	make("q3eps", RO_ARCH_QWEN3_MOE, "F32", 1, 0);
	set_config("q3eps", "rms_norm_eps", NULL);
	m = load("q3eps", false);
	cr_expect_eq(ro_model_config(m)->rms_eps, 1e-6);
	ro_model_free(m);
	/* num_key_value_heads: absent is the class default (Qwen3-MoE 4), null is the heads */
	make("kv", RO_ARCH_QWEN3_MOE, "F32", 1, 0); /* 4 heads, 2 kv heads */
	set_config("kv", "num_key_value_heads", NULL);
	expect_refused("kv", -EINVAL, "k_proj.weight has shape [32, 64], want [64, 64]");
	set_config("kv", "num_key_value_heads", "null");
	expect_refused("kv", -EINVAL, "k_proj.weight has shape [32, 64], want [64, 64]");
}

Test(hostile, what_the_runtime_does_not_implement_is_refused)
{
	static const struct {
		const char *key, *value, *mention;
	} cases[] = {
	    {"rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0}",
	     "config.json: rope_scaling: RoPE scaling \"linear\" is not supported"},
	    {"rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4.0}",
	     "config.json: rope_scaling: RoPE scaling \"yarn\""},
	    {"rope_parameters", "{\"rope_type\": \"dynamic\"}", "config.json: rope_parameters"},
	    {"hidden_act", "\"gelu\"", "config.json: hidden_act: gelu is not supported"},
	    {"decoder_sparse_step", "0", "config.json: decoder_sparse_step: 0 is out of range"},
	    {"max_position_embeddings", "0", "config.json: max_position_embeddings: 0 is out of range"},
	    {"model_type", "\"deepseek_v3\"", "config.json: model_type: deepseek_v3 does not match"},
	    {"mlp_only_layers", "[\"x\"]", "config.json: mlp_only_layers: entry 0"},
	    {"mlp_only_layers", "[7]", "config.json: mlp_only_layers: layer 7 is not below"},
	    {"quantization_config", "{\"quant_method\": \"fp8\"}", "config.json: quantization_config"},
	    {"layer_types", "[\"sliding_attention\", \"full_attention\"]", "config.json: layer_types"},
	    {"tie_word_embeddings", "1", "config.json: tie_word_embeddings: 1 is not true or false"},
	    {"rms_norm_eps", "-1", "config.json: rms_norm_eps"},
	};
	char sub[32];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		(void)snprintf(sub, sizeof(sub), "ni%zu", i);
		make(sub, RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
		set_config(sub, cases[i].key, cases[i].value);
		expect_refused(sub, -EINVAL, cases[i].mention);
	}
	/* rope_scaling null and rope_type default load */
	make("ropedef", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	set_config("ropedef", "rope_scaling", "{\"rope_type\": \"default\"}");
	ro_model_free(load("ropedef", false));
}

/* In a file of sub, the first occurrence of `from` replaced by `to` (same length), or the
 * last byte set to `last` when from is NULL. */
static void patch_file(const char *sub, const char *file, const char *from, const char *to,
		       int last)
{
	char p[256];
	FILE *f;
	long n;
	char *b;

	(void)snprintf(p, sizeof(p), "%s/%s", path(sub), file);
	f = fopen(p, "r+b");
	cr_assert_not_null(f);
	cr_assert_eq(fseek(f, 0, SEEK_END), 0);
	n = ftell(f);
	b = malloc((size_t)n);
	rewind(f);
	cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
	if (from) {
		char *at = memmem(b, (size_t)n, from, strlen(from));

		cr_assert_not_null(at, "%s not in %s", from, p);
		memcpy(at, to, strlen(to));
	} else {
		b[n - 1] = (char)last;
	}
	rewind(f);
	cr_assert_eq(fwrite(b, 1, (size_t)n, f), (size_t)n);
	cr_assert_eq(fclose(f), 0);
	free(b);
}

Test(hostile, fp8_fields_are_checked)
{
	static const struct {
		const char *value, *mention;
	} cfgs[] = {
	    {"{\"quant_method\": \"fp8\", \"weight_block_size\": [64, 64]}",
	     "weight_block_size [64,64] is not supported"},
	    {"{\"quant_method\": \"fp8\", \"weight_block_size\": [128]}", "weight_block_size"},
	    {"{\"quant_method\": \"fp8\"}", "weight_block_size is missing"},
	    {"{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128], "
	     "\"activation_scheme\": \"static\"}",
	     "activation_scheme \"static\""},
	    {"{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128], \"fmt\": \"e5m2\"}",
	     "fmt \"e5m2\""},
	    {"{\"quant_method\": \"awq\", \"weight_block_size\": [128, 128]}", "quant_method"},
	    {"{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128], \"x\": 1}",
	     "key x is not supported"},
	    {"[1]", "quantization_config: [1] is not an object"},
	    {NULL, "is F8_E4M3 but config.json has no fp8 quantization_config"},
	};
	char sub[32];
	struct ro_make_model_opts o;
	char err[256];

	for (size_t i = 0; i < sizeof(cfgs) / sizeof(cfgs[0]); i++) {
		(void)snprintf(sub, sizeof(sub), "fp8c%zu", i);
		ro_make_model_defaults(&o);
		o.dtype = "FP8";
		cr_assert_eq(ro_make_model(&o, path(sub), err, sizeof(err)), 0, "%s", err);
		set_config(sub, "quantization_config", cfgs[i].value);
		expect_refused(sub, -EINVAL, cfgs[i].mention);
	}
	ro_make_model_defaults(&o);
	o.dtype = "FP8";
	/* a weight without its scales (the renamed scales are then a tensor nobody reads) */
	cr_assert_eq(ro_make_model(&o, path("fp8s"), err, sizeof(err)), 0, "%s", err);
	patch_file("fp8s", "model.safetensors", "q_proj.weight_scale_inv",
		   "q_proj.weight_scale_inx", 0);
	expect_refused("fp8s", -ENOENT, "q_proj.weight_scale_inv is missing");
	/* scales of another dtype */
	cr_assert_eq(ro_make_model(&o, path("fp8d"), err, sizeof(err)), 0, "%s", err);
	patch_file("fp8d", "model.safetensors",
		   "k_proj.weight_scale_inv\":{\"dtype\":\"F32\",\"shape\":[1,1],",
		   "k_proj.weight_scale_inv\":{\"dtype\":\"I32\",\"shape\":[1,1],", 0);
	expect_refused("fp8d", -ENOTSUP, "I32");
	/* scales of the wrong shape (the file's sizes then disagree too: either refusal) */
	cr_assert_eq(ro_make_model(&o, path("fp8h"), err, sizeof(err)), 0, "%s", err);
	patch_file("fp8h", "model.safetensors",
		   "v_proj.weight_scale_inv\":{\"dtype\":\"F32\",\"shape\":[1,1],",
		   "v_proj.weight_scale_inv\":{\"dtype\":\"F32\",\"shape\":[2,1],", 0);
	expect_refused("fp8h", -EBADMSG, "v_proj.weight_scale_inv");
	/* a NaN code (0x7f) in a weight: the file's last byte is the last FP8 weight's */
	cr_assert_eq(ro_make_model(&o, path("fp8n"), err, sizeof(err)), 0, "%s", err);
	patch_file("fp8n", "model.safetensors", NULL, NULL, 0x7f);
	expect_refused("fp8n", -EINVAL, "is NaN");
}

Test(hostile, tensors_the_config_does_not_describe_are_refused)
{
	/* config: 2 layers, checkpoint: 3 */
	make("layers", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	set_config("layers", "num_hidden_layers", "2");
	expect_refused("layers", -EINVAL,
		       "model.safetensors: tensor model.layers.2.input_layernorm.weight is not part "
		       "of the model");
	/* config: 7 experts, checkpoint: 8 (the router is checked first, by shape) */
	make("experts", RO_ARCH_MIXTRAL, "BF16", 1, 0);
	set_config("experts", "num_local_experts", "7");
	expect_refused("experts", -EINVAL, "gate.weight has shape [8, 64], want [7, 64]");
}

static void poke16(const char *sub, const char *tensor, size_t idx, uint16_t bits)
{
	struct st_image im = st_read(sub);
	const uint64_t b = st_begin(&im, tensor);

	memcpy(im.data + b + 2 * idx, &bits, 2);
	st_write(sub, &im, 0);
}

Test(hostile, non_finite_weights_are_refused)
{
	make("nan", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	poke16("nan", "model.layers.1.mlp.experts.3.down_proj.weight", 17, 0x7fc0);
	expect_refused("nan", -EINVAL,
		       "model.safetensors: tensor model.layers.1.mlp.experts.3.down_proj.weight: "
		       "element 17 is NaN");
	make("inf", RO_ARCH_MIXTRAL, "BF16", 1, 0);
	poke16("inf", "model.embed_tokens.weight", 5, 0xff80);
	expect_refused("inf", -EINVAL, "model.embed_tokens.weight: element 5 is infinite");
}

Test(hostile, the_sampler_refuses_non_finite_logits)
{
	float l[8] = {0, 1, 2, NAN, 4, 5, 6, 7}, lp = 0;
	struct ro_sampling greedy = {0}, hot = {.temperature = 1.0, .top_p = 1.0};

	cr_expect_eq(ro_sample(l, 8, &greedy, 1, 0, 0, &lp), -EDOM);
	cr_expect_eq(ro_sample(l, 8, &hot, 1, 0, 0, &lp), -EDOM);
	l[3] = INFINITY;
	cr_expect_eq(ro_sample(l, 8, &hot, 1, 0, 0, &lp), -EDOM);
	l[3] = 3;
	cr_expect_eq(ro_sample(l, 8, &greedy, 1, 0, 0, &lp), 7);
}

Test(hostile, messages_name_what_is_wrong)
{
	struct st_image im;

	/* a header that is JSON but not an object, and one cut short */
	make("arr", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header("arr", "[1, 2]", 0);
	expect_refused("arr", -EBADMSG, "model.safetensors: header: a JSON array, not an object");
	make("cut", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	corrupt_header("cut", "{\"x\": {\"dtype\": ", 0);
	expect_refused("cut", -EBADMSG, "model.safetensors: header: the JSON text ends early");
	make("cfgarr", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	write_str(path("cfgarr/config.json"), "[]");
	expect_refused("cfgarr", -EBADMSG, "config.json: a JSON array, not an object");
	/* a bad shard name is reported as itself, not against the shard before it */
	make("badshard", RO_ARCH_QWEN3_MOE, "BF16", 2, 0);
	write_str(path("badshard/model.safetensors.index.json"),
		  "{\"weight_map\": {\"model.norm.weight\": \"model-00001-of-00002.safetensors\", "
		  "\"lm_head.weight\": \"../x.safetensors\"}}");
	expect_refused("badshard", -EBADMSG,
		       "weight_map: tensor lm_head.weight: bad shard name \"../x.safetensors\"");
	/* the index says one shard, the tensor is in the other */
	make("wrongshard", RO_ARCH_QWEN3_MOE, "BF16", 2, 0);
	write_str(path("wrongshard/model.safetensors.index.json"),
		  "{\"weight_map\": {\"model.embed_tokens.weight\": "
		  "\"model-00002-of-00002.safetensors\", \"lm_head.weight\": "
		  "\"model-00001-of-00002.safetensors\"}}");
	expect_refused("wrongshard", -EBADMSG, "weight_map puts");
	(void)im;
}

Test(hostile, qwen3_use_sliding_window_without_a_window_is_refused)
{
	/* Qwen3MoeConfig's sliding_window defaults to 4096: absent is a window, not none */
	make("q3swdef", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	set_config("q3swdef", "use_sliding_window", "true");
	expect_refused("q3swdef", -EINVAL, "config.json: use_sliding_window");
	/* an explicit null is no window (Qwen3-30B-A3B's own config.json says so, with false) */
	set_config("q3swdef", "sliding_window", "null");
	ro_model_free(load("q3swdef", false));
}

Test(hostile, model_safetensors_beside_an_index_is_what_loads)
{
	char p[256];
	struct st_image im;

	/* as from_pretrained: the single file wins over an index left beside it (here a stale
	 * one whose shards are gone) */
	make("one", RO_ARCH_QWEN3_MOE, "F32", 1, 0);
	make("both", RO_ARCH_QWEN3_MOE, "F32", 2, 0);
	cr_assert_eq(unlink(path("both/model-00001-of-00002.safetensors")), 0);
	cr_assert_eq(unlink(path("both/model-00002-of-00002.safetensors")), 0);
	im = st_read("one");
	(void)snprintf(p, sizeof(p), "%s", path("both/model.safetensors.index.json"));
	st_write("both", &im, 0);
	cr_assert_eq(access(p, F_OK), 0);
	cr_expect_eq(rel_diff("both", "one", 256), 0);
	/* neither: the message names both */
	cr_assert_eq(unlink(path("both/model.safetensors")), 0);
	cr_assert_eq(unlink(p), 0);
	expect_refused("both", -ENOENT, "no model.safetensors or model.safetensors.index.json");
}

Test(hostile, mixtral_ignores_mlp_only_layers)
{
	/* MixtralConfig has no mlp_only_layers: every Mixtral layer is sparse */
	make("mxmlp", RO_ARCH_MIXTRAL, "F32", 1, 0);
	make("mx", RO_ARCH_MIXTRAL, "F32", 1, 0);
	set_config("mxmlp", "mlp_only_layers", "[0]");
	cr_expect_eq(rel_diff("mxmlp", "mx", 256), 0);
}

Test(hostile, generate_on_non_finite_logits_fails_and_frees)
{
	const char *ctl = getenv("RO_ROLLOUTCTL");
	char cmd[1024], text[8192] = "";
	struct st_image im;
	FILE *f;
	int st;

	/* finite weights, but a final norm at bf16's largest overflows the hidden state, and
	 * the logits come out NaN: the sampler refuses, rolloutctl says so and frees (a leak
	 * is what LeakSanitizer reports in a --enable-sanitizers build) */
	make("nanlogit", RO_ARCH_QWEN3_MOE, "BF16", 1, 0);
	im = st_read("nanlogit");
	for (size_t i = 0; i < 64; i++)
		memcpy(im.data + st_begin(&im, "model.norm.weight") + 2 * i, &(uint16_t){0x7f7f},
		       2);
	st_write("nanlogit", &im, 0);
	(void)snprintf(cmd, sizeof(cmd), "%s generate --model %s --prompt 1,2,3 2>%s",
		       ctl && *ctl ? ctl : "./rolloutctl", path("nanlogit"), path("err"));
	st = system(cmd);
	cr_assert(WIFEXITED(st), "%s", cmd);
	f = fopen(path("err"), "r");
	cr_assert_not_null(f);
	(void)fread(text, 1, sizeof(text) - 1, f);
	(void)fclose(f);
	cr_expect_eq(WEXITSTATUS(st), 1, "%s", text);
	cr_expect(strstr(text, "the logits are not finite"), "%s", text);
	cr_expect(!strstr(text, "LeakSanitizer"), "%s", text);
}

Test(hostile, batches_past_32_bit_pair_counts_are_refused)
{
	struct ro_make_model_opts o;
	const uint32_t T = (1u << 22) + 1; /* x 1024 heads: past 2^32 (token, head) pairs */
	int32_t *tok = calloc(T, sizeof(*tok)), e = 0;
	const float *x[1] = {NULL};
	struct ro_model *m;
	struct ro_seq *s;
	struct ro_fwd_item it;

	ro_make_model_defaults(&o);
	o.layers = 1;
	o.hidden = 2;
	o.heads = 1024;
	o.kv_heads = 1;
	o.head_dim = 2;
	o.experts = o.top_k = 64; /* the most num_experts_per_tok may be */
	o.expert_ffn = 1;
	o.vocab = 2;
	make_opts("pairs", &o);
	set_config("pairs", "max_position_embeddings", "8388608");
	m = load("pairs", false);
	cr_assert_eq(ro_seq_new(m, T, &s), 0);
	it = (struct ro_fwd_item){s, tok, T, NULL, false};
	cr_expect_eq(ro_model_forward(m, &it, 1), -E2BIG);
	cr_expect_eq(ro_seq_len(s), 0);
	/* and the experts' entry point, before it reads a row */
	cr_expect_eq(ro_model_experts(m, 0, x, &e, (size_t)UINT32_MAX + 1, NULL), -E2BIG);
	ro_seq_free(s);
	ro_model_free(m);
	free(tok);
}
