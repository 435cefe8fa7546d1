/* Fuzz target: the safetensors reader (kernels/safetensors.c): the bytes are a directory's
 * model.safetensors (8-byte header length, JSON header, data). An accepted file's every
 * tensor must lie inside it: each one the header names is looked up and its first and
 * last bytes read, and its size must be its shape times its dtype's. */
#include "tests/fuzz/fuzz.h"

#include <errno.h>
#include <json-c/json.h>

#include "kernels/internal.h"

static char dir[512];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	(void)snprintf(dir, sizeof(dir), "%s", fuzz_tmpdir());
	return 0;
}

/* Read every tensor the accepted header names (the reader's own checks, redone). */
static void check_tensors(const struct ro_st_set *s, const uint8_t *data, size_t size)
{
	uint64_t hlen = 0;
	struct json_object *h;
	size_t named = 0;

	for (int i = 7; i >= 0; i--)
		hlen = hlen << 8 | data[i];
	{
		struct json_tokener *tok = json_tokener_new();

		FUZZ_ASSERT(tok);
		h = json_tokener_parse_ex(tok, (const char *)data + 8, (int)hlen);
		json_tokener_free(tok);
	}
	FUZZ_ASSERT(h && json_object_is_type(h, json_type_object));
	json_object_object_foreach(h, name, desc)
	{
		const struct ro_tensor *t;
		volatile uint8_t sink;
		uint64_t elems = 1;

		(void)desc;
		if (!strcmp(name, "__metadata__"))
			continue;
		named++;
		t = ro_st_find(s, name);
		FUZZ_ASSERT(t);
		for (uint32_t d = 0; d < t->ndim; d++)
			elems *= t->shape[d];
		FUZZ_ASSERT(t->bytes == elems * ro_dtype_size(t->dtype));
		if (t->bytes) {
			sink = ((const uint8_t *)t->data)[0];
			sink = ((const uint8_t *)t->data)[t->bytes - 1];
			(void)sink;
		}
		FUZZ_ASSERT(t->bytes <= size - 8 - hlen);
	}
	FUZZ_ASSERT(named == ro_st_count(s));
	json_object_put(h);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct ro_st_set *s = NULL;
	char err[512];
	int r;

	fuzz_write("model.safetensors", data, size);
	r = ro_st_open_dir(dir, &s, err, sizeof(err));
	if (r) {
		FUZZ_ASSERT(r < 0 && s == NULL);
		return 0;
	}
	check_tensors(s, data, size);
	ro_st_free(s);
	return 0;
}
