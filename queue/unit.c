/* Work unit validation: a unit is JSON with typed, bounded fields (DESIGN.md "Work unit").
 * Everything that enters the queue passes through ro_unit_parse(), so a bad unit is
 * refused with a reason that names the field before anything is written. */
#include "queue/queue.h"

#include <errno.h>
#include <json-c/json.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ro_unit_bounds_default(struct ro_unit_bounds *b)
{
	b->max_prompt = 32768;
	b->max_n = 64;
	b->max_new_tokens = 32768;
	b->max_body = 1u << 20;
}

bool ro_unit_id_valid(const char *id)
{
	size_t n = 0;

	for (const char *p = id; *p; p++, n++) {
		char c = *p;
		bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
			  (c >= '0' && c <= '9') || c == '.' || c == '_' || c == ':' || c == '-';
		if (!ok || n >= 128)
			return false;
	}
	return n > 0;
}

void ro_unit_clear(struct ro_unit *u)
{
	free(u->id);
	free(u->body);
	free(u->meta);
	free(u->prompt);
	free(u->stop);
	memset(u, 0, sizeof(*u));
}

static int why(char *buf, size_t len, const char *fmt, ...)
{
	va_list ap;

	if (buf && len) {
		va_start(ap, fmt);
		(void)vsnprintf(buf, len, fmt, ap);
		va_end(ap);
	}
	return -EINVAL;
}

/* A non-negative JSON integer within max (json-c gives doubles for 1.5 and saturates huge
 * integers, so both the type and the range are checked). */
static int get_uint(struct json_object *o, const char *name, int64_t max, int64_t *ret, char *w,
		    size_t wl)
{
	int64_t v;

	if (!json_object_is_type(o, json_type_int))
		return why(w, wl, "%s must be an integer", name);
	errno = 0;
	v = json_object_get_int64(o);
	if (v < 0)
		return why(w, wl, "%s must not be negative (got %lld)", name, (long long)v);
	if (v > max || errno == ERANGE)
		return why(w, wl, "%s is %lld, above the bound %lld", name, (long long)v,
			   (long long)max);
	*ret = v;
	return 0;
}

static int get_int_array(struct json_object *o, const char *name, uint32_t max, bool nonempty,
			 int32_t **ret, uint32_t *ret_len, char *w, size_t wl)
{
	size_t n;
	int32_t *a;

	if (!json_object_is_type(o, json_type_array))
		return why(w, wl, "%s must be an array of token ids", name);
	n = json_object_array_length(o);
	if (nonempty && n == 0)
		return why(w, wl, "%s is empty", name);
	if (n > max)
		return why(w, wl, "%s has %zu tokens, above the bound %u", name, n, max);
	a = calloc(n ? n : 1, sizeof(*a));
	if (!a)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++) {
		int64_t v;
		char nm[64];
		int r;

		(void)snprintf(nm, sizeof(nm), "%s[%zu]", name, i);
		r = get_uint(json_object_array_get_idx(o, i), nm, INT32_MAX, &v, w, wl);
		if (r) {
			free(a);
			return r;
		}
		a[i] = (int32_t)v;
	}
	*ret = a;
	*ret_len = (uint32_t)n;
	return 0;
}

static int get_real(struct json_object *o, const char *name, double lo, double hi, bool lo_open,
		    double *ret, char *w, size_t wl)
{
	double v;

	if (!json_object_is_type(o, json_type_double) && !json_object_is_type(o, json_type_int))
		return why(w, wl, "%s must be a number", name);
	v = json_object_get_double(o);
	if (!isfinite(v) || v < lo || v > hi || (lo_open && v == lo))
		return why(w, wl, "%s is %g, outside %c%g, %g]", name, v, lo_open ? '(' : '[', lo,
			   hi);
	*ret = v;
	return 0;
}

static int parse_sampling(struct json_object *s, struct ro_unit *u, char *w, size_t wl)
{
	int r = 0;

	if (!json_object_is_type(s, json_type_object))
		return why(w, wl, "sampling must be an object");
	json_object_object_foreach (s, key, val) {
		int64_t v;

		if (!strcmp(key, "temperature")) {
			r = get_real(val, "sampling.temperature", 0, 100, false, &u->temperature, w,
				     wl);
		} else if (!strcmp(key, "top_p")) {
			r = get_real(val, "sampling.top_p", 0, 1, true, &u->top_p, w, wl);
		} else if (!strcmp(key, "top_k")) {
			r = get_uint(val, "sampling.top_k", INT32_MAX, &v, w, wl);
			u->top_k = (uint32_t)v;
		} else if (!strcmp(key, "seed")) {
			r = get_uint(val, "sampling.seed", INT64_MAX, &v, w, wl);
			u->seed = (uint64_t)v;
		} else {
			r = why(w, wl, "unknown field sampling.%s", key);
		}
		if (r)
			return r;
	}
	return 0;
}

static int parse_fields(struct json_object *root, const struct ro_unit_bounds *b, struct ro_unit *u,
			char *w, size_t wl)
{
	bool have_prompt = false, have_n = false, have_max = false;
	int r = 0;

	json_object_object_foreach (root, key, val) {
		int64_t v;

		if (!strcmp(key, "id")) {
			const char *id;

			if (!json_object_is_type(val, json_type_string))
				return why(w, wl, "id must be a string");
			id = json_object_get_string(val);
			/* an embedded NUL would make the C id differ from the JSON one */
			if (strlen(id) != (size_t)json_object_get_string_len(val) ||
			    !ro_unit_id_valid(id))
				return why(
				    w, wl,
				    "id \"%.40s\" must be 1-128 characters of [A-Za-z0-9._:-]", id);
			u->id = strdup(id);
			if (!u->id)
				return -ENOMEM;
		} else if (!strcmp(key, "prompt")) {
			r = get_int_array(val, "prompt", b->max_prompt, true, &u->prompt,
					  &u->prompt_len, w, wl);
			have_prompt = true;
		} else if (!strcmp(key, "n")) {
			r = get_uint(val, "n", b->max_n, &v, w, wl);
			if (!r && v == 0)
				r = why(w, wl, "n must be at least 1");
			u->n = (uint32_t)v;
			have_n = true;
		} else if (!strcmp(key, "max_new_tokens")) {
			r = get_uint(val, "max_new_tokens", b->max_new_tokens, &v, w, wl);
			if (!r && v == 0)
				r = why(w, wl, "max_new_tokens must be at least 1");
			u->max_new_tokens = (uint32_t)v;
			have_max = true;
		} else if (!strcmp(key, "sampling")) {
			r = parse_sampling(val, u, w, wl);
		} else if (!strcmp(key, "stop")) {
			r = get_int_array(val, "stop", 1024, false, &u->stop, &u->stop_len, w, wl);
		} else if (!strcmp(key, "min_policy_version")) {
			r = get_uint(val, "min_policy_version", INT64_MAX, &v, w, wl);
			u->min_policy_version = v;
		} else if (!strcmp(key, "meta")) {
			u->meta =
			    strdup(json_object_to_json_string_ext(val, JSON_C_TO_STRING_PLAIN));
			if (!u->meta)
				return -ENOMEM;
		} else {
			r = why(w, wl, "unknown field \"%.40s\"", key);
		}
		if (r)
			return r;
	}
	if (!u->id)
		return why(w, wl, "missing field id");
	if (!have_prompt)
		return why(w, wl, "missing field prompt");
	if (!have_n)
		return why(w, wl, "missing field n");
	if (!have_max)
		return why(w, wl, "missing field max_new_tokens");
	return 0;
}

/* A JSON number as RFC 8259 spells it: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static bool json_number(const char *s)
{
	if (*s == '-')
		s++;
	if (*s == '0')
		s++;
	else if (*s >= '1' && *s <= '9')
		while (*s >= '0' && *s <= '9')
			s++;
	else
		return false;
	if (*s == '.') {
		if (!(*++s >= '0' && *s <= '9'))
			return false;
		while (*s >= '0' && *s <= '9')
			s++;
	}
	if (*s == 'e' || *s == 'E') {
		if (*++s == '+' || *s == '-')
			s++;
		if (!(*s >= '0' && *s <= '9'))
			return false;
		while (*s >= '0' && *s <= '9')
			s++;
	}
	return !*s;
}

/* json-c reads numbers no JSON parser takes ("1.", "NaN", "Infinity", "1e400") and writes
 * each back as it was spelled, so the body stored and the meta copied into every sample
 * would not be JSON to the trainer. Every real number must be a finite JSON number. The
 * tokener's depth bounds the recursion. */
static bool numbers_valid(struct json_object *o)
{
	switch (json_object_get_type(o)) {
	case json_type_double:
		return isfinite(json_object_get_double(o)) &&
		       json_number(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN));
	case json_type_object: {
		json_object_object_foreach (o, key, val) {
			(void)key;
			if (!numbers_valid(val))
				return false;
		}
		return true;
	}
	case json_type_array:
		for (size_t i = 0; i < json_object_array_length(o); i++)
			if (!numbers_valid(json_object_array_get_idx(o, i)))
				return false;
		return true;
	default:
		return true;
	}
}

int ro_unit_parse(const char *json, size_t len, const struct ro_unit_bounds *b, struct ro_unit *ret,
		  char *w, size_t wl)
{
	struct json_tokener *tok;
	struct json_object *root;
	struct ro_unit u = {.temperature = 1.0, .top_p = 1.0};
	int r;

	if (w && wl)
		w[0] = '\0';
	if (len > b->max_body)
		return why(w, wl, "unit is %zu bytes, above the bound %u", len, b->max_body);
	if (len > INT32_MAX)
		return why(w, wl, "unit too large");
	tok = json_tokener_new_ex(16);
	if (!tok)
		return -ENOMEM;
	/* strings must be UTF-8: the body and meta go on to the trainer as JSON */
	json_tokener_set_flags(tok, JSON_TOKENER_VALIDATE_UTF8);
	root = json_tokener_parse_ex(tok, json, (int)len);
	if (!root) {
		enum json_tokener_error e = json_tokener_get_error(tok);

		r = why(w, wl, "not valid JSON: %s at byte %zu",
			e == json_tokener_continue ? "unexpected end of input"
						   : json_tokener_error_desc(e),
			json_tokener_get_parse_end(tok));
		json_tokener_free(tok);
		return r;
	}
	/* trailing bytes after the object: only whitespace may follow */
	for (size_t i = json_tokener_get_parse_end(tok); i < len; i++) {
		if (json[i] != ' ' && json[i] != '\t' && json[i] != '\r' && json[i] != '\n') {
			r = why(w, wl, "not valid JSON: trailing data at byte %zu", i);
			goto out;
		}
	}
	if (!json_object_is_type(root, json_type_object)) {
		r = why(w, wl, "a unit must be a JSON object");
		goto out;
	}
	if (!numbers_valid(root)) {
		r = why(w, wl, "not valid JSON: a number that is not a finite JSON number");
		goto out;
	}
	r = parse_fields(root, b, &u, w, wl);
	if (r)
		goto out;
	u.body = strdup(json_object_to_json_string_ext(root, JSON_C_TO_STRING_PLAIN));
	if (!u.body) {
		r = -ENOMEM;
		goto out;
	}
	*ret = u;
	memset(&u, 0, sizeof(u));
out:
	ro_unit_clear(&u);
	json_object_put(root);
	json_tokener_free(tok);
	return r;
}
