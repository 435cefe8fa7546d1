/* Fuzz target: the work-unit parser and validator (queue/unit.c). Any bytes must give a
 * unit or a refusal with a reason, never a crash; an accepted unit's canonical body (what
 * enqueue stores and a claim parses again) must hold only JSON numbers and be accepted
 * again, to the same fields. */
#include "tests/fuzz/fuzz.h"

#include <errno.h>
#include <json-c/json.h>
#include <stdbool.h>

#include "queue/queue.h"

/* RFC 8259's number, checked apart from queue/unit.c's own check */
static bool strict_number(const char *s)
{
	size_t d;

	s += *s == '-';
	d = strspn(s, "0123456789");
	if (!d || (s[0] == '0' && d > 1))
		return false;
	s += d;
	if (*s == '.') {
		d = strspn(++s, "0123456789");
		if (!d)
			return false;
		s += d;
	}
	if (*s == 'e' || *s == 'E') {
		s += s[1] == '+' || s[1] == '-' ? 2 : 1;
		d = strspn(s, "0123456789");
		if (!d)
			return false;
		s += d;
	}
	return !*s;
}

/* what the trainer will parse: every number of the stored body a JSON number */
static void json_numbers(struct json_object *o)
{
	if (json_object_is_type(o, json_type_double) || json_object_is_type(o, json_type_int))
		FUZZ_ASSERT(strict_number(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN)));
	if (json_object_is_type(o, json_type_object)) {
		json_object_object_foreach (o, k, v) {
			(void)k;
			json_numbers(v);
		}
	}
	if (json_object_is_type(o, json_type_array))
		for (size_t i = 0; i < json_object_array_length(o); i++)
			json_numbers(json_object_array_get_idx(o, i));
}

static void same_unit(const struct ro_unit *a, const struct ro_unit *b)
{
	FUZZ_ASSERT(!strcmp(a->id, b->id));
	FUZZ_ASSERT(a->prompt_len == b->prompt_len && a->stop_len == b->stop_len);
	FUZZ_ASSERT(!memcmp(a->prompt, b->prompt, a->prompt_len * sizeof(*a->prompt)));
	FUZZ_ASSERT(!a->stop_len || !memcmp(a->stop, b->stop, a->stop_len * sizeof(*a->stop)));
	FUZZ_ASSERT(a->n == b->n && a->max_new_tokens == b->max_new_tokens);
	FUZZ_ASSERT(a->top_k == b->top_k && a->seed == b->seed);
	FUZZ_ASSERT(a->min_policy_version == b->min_policy_version);
	FUZZ_ASSERT(!strcmp(a->body, b->body));
	FUZZ_ASSERT((!a->meta && !b->meta) || (a->meta && b->meta && !strcmp(a->meta, b->meta)));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct ro_unit_bounds b;
	struct ro_unit u, again;
	char why[256];
	int r;

	ro_unit_bounds_default(&b);
	/* tight bounds too, so the limits are reached by small inputs */
	if (size && data[0] == ' ') { /* leading space: still the same JSON */
		b.max_prompt = 8;
		b.max_n = 4;
		b.max_new_tokens = 16;
		b.max_body = 512;
	}
	r = ro_unit_parse((const char *)data, size, &b, &u, why, sizeof(why));
	if (r) {
		FUZZ_ASSERT(r == -EINVAL || r == -ENOMEM);
		FUZZ_ASSERT(r != -EINVAL || why[0]);
		return 0;
	}
	FUZZ_ASSERT(u.id && ro_unit_id_valid(u.id) && u.body);
	FUZZ_ASSERT(u.prompt_len >= 1 && u.prompt_len <= b.max_prompt);
	FUZZ_ASSERT(u.n >= 1 && u.n <= b.max_n);
	FUZZ_ASSERT(u.max_new_tokens >= 1 && u.max_new_tokens <= b.max_new_tokens);
	{
		struct json_object *o = json_tokener_parse(u.body);

		FUZZ_ASSERT(o);
		json_numbers(o);
		json_object_put(o);
	}
	if (strlen(u.body) <= b.max_body) {
		r = ro_unit_parse(u.body, strlen(u.body), &b, &again, why, sizeof(why));
		if (r)
			(void)fprintf(stderr, "canonical body refused: %s\n  %s\n", why, u.body);
		FUZZ_ASSERT(r == 0);
		same_unit(&u, &again);
		ro_unit_clear(&again);
	}
	ro_unit_clear(&u);
	return 0;
}
