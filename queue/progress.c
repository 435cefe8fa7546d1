/* The checkpoint format of an unfinished sample, as stored in the unit hash (p:<idx>):
 * {"tokens":[...],"logprobs":[...],"pos":N,"pv":V}. pos is the counter-based sampler's
 * position, so a sample resumed from its prefix continues exactly where it stopped. */
#include "queue/queue.h"
#include "queue/internal.h"

#include <errno.h>
#include <math.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t put_ints(char *s, size_t cap, const int32_t *v, uint32_t n)
{
	size_t off = 0;

	s[off++] = '[';
	for (uint32_t i = 0; i < n; i++)
		off += (size_t)snprintf(s + off, cap - off, i ? ",%d" : "%d", v[i]);
	s[off++] = ']';
	s[off] = '\0';
	return off;
}

/* %.9g round-trips every float32; -0.0 is spelled so a JSON parser keeps its sign, and a
 * non-finite value (never a sampled token's logprob) becomes the most negative float */
static size_t put_floats(char *s, size_t cap, const float *v, uint32_t n)
{
	size_t off = 0;

	s[off++] = '[';
	for (uint32_t i = 0; i < n; i++) {
		float x = isfinite(v[i]) ? v[i] : -3.40282347e38f;

		if (i)
			s[off++] = ',';
		if (x == 0 && signbit(x))
			off += (size_t)snprintf(s + off, cap - off, "-0.0");
		else
			off += (size_t)snprintf(s + off, cap - off, "%.9g", (double)x);
	}
	s[off++] = ']';
	s[off] = '\0';
	return off;
}

char *ro_json_ints(const int32_t *v, uint32_t n)
{
	size_t cap = (size_t)n * 12 + 3;
	char *s = malloc(cap);

	if (s)
		(void)put_ints(s, cap, v, n);
	return s;
}

char *ro_json_floats(const float *v, uint32_t n)
{
	size_t cap = (size_t)n * 18 + 3;
	char *s = malloc(cap);

	if (s)
		(void)put_floats(s, cap, v, n);
	return s;
}

char *ro_json_pv(const struct ro_pv *pv, uint32_t n_pv, uint32_t len, int64_t dflt)
{
	struct ro_pv one = {0, dflt};
	size_t cap = (size_t)(n_pv ? n_pv : 1) * 48 + 3, off = 0;
	char *s = malloc(cap);

	if (!s)
		return NULL;
	if (!n_pv) {
		pv = &one;
		n_pv = 1;
	}
	off += (size_t)snprintf(s + off, cap - off, "[");
	for (uint32_t i = 0; i < n_pv; i++) {
		uint32_t end = i + 1 < n_pv ? pv[i + 1].start : len;

		off += (size_t)snprintf(s + off, cap - off, "%s[%u,%u,%" PRId64 "]", i ? "," : "",
					pv[i].start, end, pv[i].version);
	}
	(void)snprintf(s + off, cap - off, "]");
	return s;
}

/* What ro_progress_encode() allocates for len tokens: 12 bytes per token id and 16 per
 * logprob at most, with their commas, plus the fixed fields and the policy ranges. */
static size_t encoded_cap(uint32_t len)
{
	return (size_t)len * 30 + 96 + RO_MAX_PV * 48;
}

size_t ro_progress_max_bytes(uint32_t max_new_tokens)
{
	return encoded_cap(max_new_tokens);
}

char *ro_progress_encode(const struct ro_progress *p)
{
	size_t cap = encoded_cap(p->len), off = 0;
	char *s = malloc(cap);

	if (!s)
		return NULL;
	off += (size_t)snprintf(s + off, cap - off, "{\"tokens\":");
	off += put_ints(s + off, cap - off, p->tokens, p->len);
	off += (size_t)snprintf(s + off, cap - off, ",\"logprobs\":");
	off += put_floats(s + off, cap - off, p->logprobs, p->len);
	off += (size_t)snprintf(s + off, cap - off, ",\"pos\":%" PRIu64 ",\"pv\":%" PRId64,
				p->sampler_pos, p->policy_version);
	if (p->n_pv) {
		off += (size_t)snprintf(s + off, cap - off, ",\"pvs\":[");
		for (uint32_t i = 0; i < p->n_pv && i < RO_MAX_PV; i++)
			off += (size_t)snprintf(s + off, cap - off, "%s[%u,%" PRId64 "]",
						i ? "," : "", p->pv[i].start, p->pv[i].version);
		off += (size_t)snprintf(s + off, cap - off, "]");
	}
	(void)snprintf(s + off, cap - off, "}");
	return s;
}

void ro_progress_clear(struct ro_progress *p)
{
	free(p->tokens);
	free(p->logprobs);
	memset(p, 0, sizeof(*p));
}

int ro_progress_decode(const char *s, uint32_t idx, struct ro_progress *ret)
{
	struct json_object *o = json_tokener_parse(s), *t, *l, *pos, *pv;
	struct ro_progress p = {.idx = idx};
	int r = -EINVAL;
	size_t n;

	if (!o || !json_object_object_get_ex(o, "tokens", &t) ||
	    !json_object_object_get_ex(o, "logprobs", &l) ||
	    !json_object_object_get_ex(o, "pos", &pos) ||
	    !json_object_is_type(t, json_type_array) || !json_object_is_type(l, json_type_array))
		goto out;
	n = json_object_array_length(t);
	if (json_object_array_length(l) != n || n > UINT32_MAX)
		goto out;
	p.len = (uint32_t)n;
	p.tokens = calloc(n + 1, sizeof(*p.tokens));
	p.logprobs = calloc(n + 1, sizeof(*p.logprobs));
	if (!p.tokens || !p.logprobs) {
		r = -ENOMEM;
		goto out;
	}
	/* every element of the type it must have: anyone may have written the hash */
	for (size_t i = 0; i < n; i++) {
		struct json_object *tk = json_object_array_get_idx(t, i),
				   *lp = json_object_array_get_idx(l, i);
		int64_t v;

		if (!json_object_is_type(tk, json_type_int) ||
		    (!json_object_is_type(lp, json_type_double) &&
		     !json_object_is_type(lp, json_type_int)))
			goto out;
		v = json_object_get_int64(tk);
		if (v < 0 || v > INT32_MAX)
			goto out;
		p.tokens[i] = (int32_t)v;
		p.logprobs[i] = (float)json_object_get_double(lp);
	}
	if (!json_object_is_type(pos, json_type_int) || json_object_get_int64(pos) < 0)
		goto out;
	p.sampler_pos = (uint64_t)json_object_get_int64(pos);
	if (json_object_object_get_ex(o, "pv", &pv)) {
		if (!json_object_is_type(pv, json_type_int))
			goto out;
		p.policy_version = json_object_get_int64(pv);
	}
	if (json_object_object_get_ex(o, "pvs", &pv) && json_object_is_type(pv, json_type_array)) {
		size_t k = json_object_array_length(pv);

		for (size_t i = 0; i < k && p.n_pv < RO_MAX_PV; i++) {
			struct json_object *e = json_object_array_get_idx(pv, i);
			int64_t st;

			if (!json_object_is_type(e, json_type_array) ||
			    json_object_array_length(e) != 2 ||
			    !json_object_is_type(json_object_array_get_idx(e, 0), json_type_int) ||
			    !json_object_is_type(json_object_array_get_idx(e, 1), json_type_int))
				goto out;
			st = json_object_get_int64(json_object_array_get_idx(e, 0));
			/* in order, inside the prefix */
			if (st < 0 || st > (int64_t)p.len ||
			    (p.n_pv && st < (int64_t)p.pv[p.n_pv - 1].start))
				goto out;
			p.pv[p.n_pv].start = (uint32_t)st;
			p.pv[p.n_pv++].version = json_object_get_int64(json_object_array_get_idx(e, 1));
		}
	}
	*ret = p;
	memset(&p, 0, sizeof(p));
	r = 0;
out:
	ro_progress_clear(&p);
	json_object_put(o);
	return r;
}
