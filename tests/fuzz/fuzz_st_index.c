/* Fuzz target: the sharded-model index (model.safetensors.index.json, kernels/
 * safetensors.c) beside two real shards of a tiny random model. The bytes are the index;
 * an accepted index must leave every tensor it names findable, inside its shard. */
#include "tests/fuzz/fuzz.h"

#include <json-c/json.h>

#include "kernels/internal.h"
#include "kernels/model.h"

static char dir[512];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	struct ro_make_model_opts o;
	char err[256];

	(void)argc;
	(void)argv;
	(void)snprintf(dir, sizeof(dir), "%s", fuzz_tmpdir());
	ro_make_model_defaults(&o);
	o.layers = 1;
	o.hidden = 8;
	o.heads = 2;
	o.kv_heads = 1;
	o.head_dim = 4;
	o.experts = 2;
	o.top_k = 1;
	o.expert_ffn = 4;
	o.vocab = 8;
	o.shards = 2; /* model-00001-of-00002.safetensors, model-00002-of-00002.safetensors */
	if (ro_make_model(&o, dir, err, sizeof(err))) {
		(void)fprintf(stderr, "fuzz_st_index: %s\n", err);
		abort();
	}
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct json_object *idx, *map;
	struct ro_st_set *s = NULL;
	char err[512], *text;
	int r;

	fuzz_write("model.safetensors.index.json", data, size);
	r = ro_st_open_dir(dir, &s, err, sizeof(err));
	if (r) {
		FUZZ_ASSERT(r < 0 && !s);
		return 0;
	}
	text = fuzz_cstr(data, size);
	idx = json_tokener_parse(text);
	free(text);
	FUZZ_ASSERT(idx && json_object_object_get_ex(idx, "weight_map", &map));
	json_object_object_foreach(map, name, file)
	{
		const struct ro_tensor *t = ro_st_find(s, name);
		volatile uint8_t sink;

		(void)file;
		FUZZ_ASSERT(t);
		if (t->bytes) {
			sink = ((const uint8_t *)t->data)[0];
			sink = ((const uint8_t *)t->data)[t->bytes - 1];
			(void)sink;
		}
	}
	json_object_put(idx);
	ro_st_free(s);
	return 0;
}
