/* Fuzz target: config.json of a model directory (kernels/model.c) and the loader that
 * checks the weights against it. Beside the bytes (the config) lie the weights of a tiny
 * random Qwen3-MoE model, or of a Mixtral one when the bytes mention Mixtral. A config
 * the weights fit loads; the model then runs a two-token prompt. */
#include "tests/fuzz/fuzz.h"

#include <errno.h>
#include <sys/stat.h>

#include "kernels/model.h"

static char qwen[512], mixtral[512];

static void make(enum ro_arch arch, char *dir, size_t len)
{
	struct ro_make_model_opts o;
	char err[256];

	(void)snprintf(dir, len, "%s/%s", fuzz_tmpdir(), arch == RO_ARCH_MIXTRAL ? "mx" : "qw");
	if (mkdir(dir, 0700))
		abort();
	ro_make_model_defaults(&o);
	o.arch = arch;
	o.layers = 2;
	o.hidden = 16;
	o.heads = 2;
	o.kv_heads = 1;
	o.head_dim = 8;
	o.experts = 4;
	o.top_k = 2;
	o.expert_ffn = 8;
	o.dense_ffn = 16;
	o.vocab = 32;
	if (ro_make_model(&o, dir, err, sizeof(err))) {
		(void)fprintf(stderr, "fuzz_model_config: %s\n", err);
		abort();
	}
}

static void rm_model(const char *dir)
{
	static const char *const files[] = {"config.json", "model.safetensors",
					    "generation_config.json"};
	char p[600];

	for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
		(void)snprintf(p, sizeof(p), "%s/%s", dir, files[i]);
		(void)unlink(p);
	}
	(void)rmdir(dir);
}

static void rm_models(void)
{
	rm_model(qwen);
	rm_model(mixtral);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	make(RO_ARCH_QWEN3_MOE, qwen, sizeof(qwen));
	make(RO_ARCH_MIXTRAL, mixtral, sizeof(mixtral));
	(void)atexit(rm_models); /* before the directory above them goes */
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *dir = memmem(data, size, "Mixtral", 7) ? mixtral : qwen;
	struct ro_model_opts o = {.threads = 1};
	struct ro_model *m = NULL;
	struct ro_seq *seq = NULL;
	char path[600], err[512];
	float *logits;
	int fd, r;

	(void)snprintf(path, sizeof(path), "%s/config.json", dir);
	fd = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC);
	if (fd < 0 || (size && write(fd, data, size) != (ssize_t)size) || close(fd))
		abort();
	r = ro_model_load(dir, &o, &m, err, sizeof(err));
	if (r) {
		FUZZ_ASSERT(r < 0 && !m);
		return 0;
	}
	{
		const struct ro_model_config *c = ro_model_config(m);
		int32_t prompt[2] = {1, (int32_t)(c->vocab - 1)};
		struct ro_fwd_item it = {.tokens = prompt, .n = 2};

		logits = calloc(c->vocab, sizeof(*logits));
		FUZZ_ASSERT(logits);
		r = ro_seq_new(m, 4, &seq);
		if (!r) {
			it.seq = seq;
			it.logits = logits;
			r = ro_model_forward(m, &it, 1);
			FUZZ_ASSERT(r >= 0 || r == -ENOMEM || r == -ENOSPC || r == -EINVAL);
		}
		free(logits);
	}
	ro_seq_free(seq);
	ro_model_free(m);
	return 0;
}
