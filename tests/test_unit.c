/* Unit validation and the checkpoint format: every bad unit is refused with a reason
 * naming the field; progress survives encoding bit for bit. No Redis needed. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "queue/queue.h"

static struct ro_unit_bounds B;

static void setup(void)
{
	ro_unit_bounds_default(&B);
	B.max_prompt = 1000;
	B.max_n = 16;
	B.max_new_tokens = 4096;
}

TestSuite(unit, .init = setup);

static int parse(const char *json, char *why, size_t wl)
{
	struct ro_unit u;
	int r = ro_unit_parse(json, strlen(json), &B, &u, why, wl);

	if (!r)
		ro_unit_clear(&u);
	return r;
}

#define REFUSED(json, needle)                                                               \
	do {                                                                                \
		char why[256];                                                              \
		cr_assert_eq(parse(json, why, sizeof(why)), -EINVAL, "accepted: %s", json); \
		cr_assert(strstr(why, needle), "reason \"%s\" lacks \"%s\"", why, needle);  \
	} while (0)

Test(unit, accepts_full_unit)
{
	const char *j =
	    "{\"id\":\"u-000123\",\"prompt\":[1,2,3],\"n\":8,\"max_new_tokens\":512,"
	    "\"sampling\":{\"temperature\":0.7,\"top_p\":0.9,\"top_k\":50,\"seed\":42},"
	    "\"stop\":[7],\"min_policy_version\":3,\"meta\":{\"task\":\"gsm8k\",\"k\":[1]}}";
	struct ro_unit u;
	char why[128];

	cr_assert_eq(ro_unit_parse(j, strlen(j), &B, &u, why, sizeof(why)), 0, "%s", why);
	cr_assert_str_eq(u.id, "u-000123");
	cr_assert_eq(u.prompt_len, 3);
	cr_assert_eq(u.prompt[2], 3);
	cr_assert_eq(u.n, 8);
	cr_assert_eq(u.max_new_tokens, 512);
	cr_assert_float_eq(u.temperature, 0.7, 1e-12);
	cr_assert_float_eq(u.top_p, 0.9, 1e-12);
	cr_assert_eq(u.top_k, 50);
	cr_assert_eq(u.seed, 42);
	cr_assert_eq(u.stop_len, 1);
	cr_assert_eq(u.min_policy_version, 3);
	cr_assert_str_eq(u.meta, "{\"task\":\"gsm8k\",\"k\":[1]}");
	cr_assert(strstr(u.body, "\"id\":\"u-000123\""));
	ro_unit_clear(&u);
}

Test(unit, defaults_for_optional_fields)
{
	const char *j = "{\"id\":\"a\",\"prompt\":[0],\"n\":1,\"max_new_tokens\":1}";
	struct ro_unit u;

	cr_assert_eq(ro_unit_parse(j, strlen(j), &B, &u, NULL, 0), 0);
	cr_assert_float_eq(u.temperature, 1.0, 0);
	cr_assert_float_eq(u.top_p, 1.0, 0);
	cr_assert_eq(u.top_k, 0);
	cr_assert_null(u.meta);
	cr_assert_eq(u.stop_len, 0);
	ro_unit_clear(&u);
}

Test(unit, malformed_json)
{
	REFUSED("{\"id\":\"a\",\"prompt\":[1,2", "not valid JSON");
	REFUSED("{\"id\":\"a\"}}", "trailing data");
	REFUSED("not json at all", "not valid JSON");
	REFUSED("", "not valid JSON");
	REFUSED("[1,2,3]", "must be a JSON object");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1} {\"id\":\"b\"}",
		"trailing data");
}

Test(unit, nesting_bomb_is_refused)
{
	size_t n = 100000;
	char *s = malloc(2 * n + 1);

	memset(s, '[', n);
	memset(s + n, ']', n);
	s[2 * n] = '\0';
	REFUSED(s, "not valid JSON");
	free(s);
}

Test(unit, wrong_types)
{
	REFUSED("{\"id\":5,\"prompt\":[1],\"n\":1,\"max_new_tokens\":1}", "id must be a string");
	REFUSED("{\"id\":\"a\",\"prompt\":\"1 2 3\",\"n\":1,\"max_new_tokens\":1}",
		"prompt must be an array");
	REFUSED("{\"id\":\"a\",\"prompt\":[1,\"x\"],\"n\":1,\"max_new_tokens\":1}",
		"prompt[1] must be an integer");
	REFUSED("{\"id\":\"a\",\"prompt\":[1.5],\"n\":1,\"max_new_tokens\":1}",
		"prompt[0] must be an integer");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":\"8\",\"max_new_tokens\":1}",
		"n must be an integer");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1,\"sampling\":[]}",
		"sampling must be an object");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1,"
		"\"sampling\":{\"temperature\":\"hot\"}}",
		"sampling.temperature must be a number");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1,\"stop\":7}",
		"stop must be an array");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":true,\"max_new_tokens\":1}",
		"n must be an integer");
}

Test(unit, missing_and_unknown_fields)
{
	REFUSED("{\"prompt\":[1],\"n\":1,\"max_new_tokens\":1}", "missing field id");
	REFUSED("{\"id\":\"a\",\"n\":1,\"max_new_tokens\":1}", "missing field prompt");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"max_new_tokens\":1}", "missing field n");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1}", "missing field max_new_tokens");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_token\":1}",
		"unknown field \"max_new_token\"");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1,"
		"\"sampling\":{\"temp\":1}}",
		"unknown field sampling.temp");
}

Test(unit, bounds_and_ranges)
{
	char *big = malloc(20000);
	size_t off =
	    (size_t)sprintf(big, "{\"id\":\"a\",\"n\":1,\"max_new_tokens\":1,\"prompt\":[");

	for (int i = 0; i < 1001; i++)
		off += (size_t)sprintf(big + off, i ? ",%d" : "%d", i);
	(void)sprintf(big + off, "]}");
	REFUSED(big, "prompt has 1001 tokens, above the bound 1000");
	free(big);
	REFUSED("{\"id\":\"a\",\"prompt\":[],\"n\":1,\"max_new_tokens\":1}", "prompt is empty");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":0,\"max_new_tokens\":1}",
		"n must be at least 1");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":17,\"max_new_tokens\":1}",
		"above the bound 16");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":-2,\"max_new_tokens\":1}",
		"n must not be negative");
	REFUSED("{\"id\":\"a\",\"prompt\":[-1],\"n\":1,\"max_new_tokens\":1}",
		"prompt[0] must not be negative");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":-5}",
		"max_new_tokens must not be negative");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":0}",
		"max_new_tokens must be at least 1");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":5000}",
		"above the bound 4096");
	REFUSED("{\"id\":\"a\",\"prompt\":[4294967296],\"n\":1,\"max_new_tokens\":1}",
		"above the bound");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":99999999999999999999999,\"max_new_tokens\":1}",
		"above the bound");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1,"
		"\"sampling\":{\"top_p\":0}}",
		"sampling.top_p is 0");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1,"
		"\"sampling\":{\"temperature\":-1}}",
		"sampling.temperature is -1");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1,"
		"\"sampling\":{\"seed\":-3}}",
		"sampling.seed must not be negative");
	REFUSED("{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1,"
		"\"min_policy_version\":-1}",
		"min_policy_version must not be negative");
}

Test(unit, ids)
{
	REFUSED("{\"id\":\"has space\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1}",
		"must be 1-128 characters");
	REFUSED("{\"id\":\"\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1}",
		"must be 1-128 characters");
	REFUSED("{\"id\":\"a/b\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1}",
		"must be 1-128 characters");
	REFUSED("{\"id\":\"a\\u0000b\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1}",
		"must be 1-128 characters");
	cr_assert(ro_unit_id_valid("A-z_0.9:x"));
	{
		char id[130];

		memset(id, 'x', 129);
		id[129] = '\0';
		cr_assert_not(ro_unit_id_valid(id));
		id[128] = '\0';
		cr_assert(ro_unit_id_valid(id));
	}
}

Test(unit, ten_megabyte_line)
{
	size_t n = 10u << 20;
	char *s = malloc(n + 1);
	char why[256];
	struct ro_unit u;

	memset(s, ' ', n);
	memcpy(s, "{\"id\":\"a\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1}", 48);
	s[n] = '\0';
	cr_assert_eq(ro_unit_parse(s, n, &B, &u, why, sizeof(why)), -EINVAL);
	cr_assert(strstr(why, "10485760 bytes, above the bound 1048576"), "%s", why);
	free(s);
}

Test(unit, progress_round_trip_is_bitwise)
{
	int32_t tok[6] = {0, 1, 151645, 2147483647, 42, 7};
	float lp[6] = {-0.0f, -1e-38f, -3.4028235e38f, -0.1f, -1.17549435e-38f, -12.345678f};
	struct ro_progress p = {.idx = 3,
				.len = 6,
				.tokens = tok,
				.logprobs = lp,
				.sampler_pos = 18446744073709551ull,
				.policy_version = 9};
	struct ro_progress d;
	char *s = ro_progress_encode(&p);

	cr_assert_not_null(s);
	cr_assert_eq(ro_progress_decode(s, 3, &d), 0, "%s", s);
	cr_assert_eq(d.idx, 3);
	cr_assert_eq(d.len, 6);
	cr_assert_eq(memcmp(d.tokens, tok, sizeof(tok)), 0);
	cr_assert_eq(memcmp(d.logprobs, lp, sizeof(lp)), 0, "logprobs differ bitwise: %s", s);
	cr_assert_eq(d.sampler_pos, p.sampler_pos);
	cr_assert_eq(d.policy_version, 9);
	ro_progress_clear(&d);
	free(s);
	cr_assert_eq(ro_progress_decode("{\"tokens\":[1]}", 0, &d), -EINVAL);
	cr_assert_eq(ro_progress_decode("garbage", 0, &d), -EINVAL);
	cr_assert_eq(ro_progress_decode("{\"tokens\":[1,2],\"logprobs\":[1],\"pos\":1}", 0, &d),
		     -EINVAL);
}
