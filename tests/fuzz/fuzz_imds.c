/* Fuzz target: the IMDS reply parsers (imds/client.c) and the events the watcher makes of
 * them (imds/watch.c). The first byte picks the reply:
 *   t  token PUT: header lines up to a blank line, then the token body
 *   s  spot/instance-action        r  events/recommendations/rebalance
 *   l  autoscaling/target-lifecycle-state    i  an identity word (instance-id, ...)
 *   m  events/maintenance/scheduled          T  an RFC 3339 time alone
 * (any other byte picks one by its value). A body goes in as ro_imds_get() hands it on:
 * NUL-terminated, none inside. Every event made from a reply must print as a JSON object. */
#include "tests/fuzz/fuzz.h"

#include <errno.h>
#include <json-c/json.h>

#include "imds/imds.h"
#include "imds/internal.h"

static struct ro_imds *m;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	struct ro_imds_opts o;

	(void)argc;
	(void)argv;
	ro_imds_opts_default(&o);
	o.endpoint = "http://127.0.0.1:9"; /* never contacted */
	if (ro_imds_new(&o, &m))
		abort();
	return 0;
}

/* the event prints, and what it prints is one JSON object */
static void check_event(const struct ro_imds_event *e)
{
	char buf[1024]; /* what the agent's event log uses */
	struct json_object *o;
	int r = ro_imds_event_json(e, buf, sizeof(buf));

	if (r == -ENOSPC)
		return;
	FUZZ_ASSERT(r == 0);
	o = json_tokener_parse(buf);
	if (!o || !json_object_is_type(o, json_type_object))
		(void)fprintf(stderr, "event is not a JSON object: %s\n", buf);
	FUZZ_ASSERT(o && json_object_is_type(o, json_type_object));
	json_object_put(o);
}

static void event_from(enum ro_imds_event_kind k, int err, struct ro_imds_event *e)
{
	memset(e, 0, sizeof(*e));
	e->kind = k;
	e->at_ms = 1767225600000; /* 2026-01-01 */
	e->error = err;
	if (err)
		(void)snprintf(e->detail, sizeof(e->detail), "%s", ro_imds_errmsg(m));
}

static void token(const char *s, size_t len)
{
	const char *body = strstr(s, "\r\n\r\n"), *p = s;
	size_t skip = 4;
	int r;

	if (!body) {
		body = strstr(s, "\n\n");
		skip = 2;
	}
	if (body) {
		/* header lines as libcurl hands them: each with its line end, unterminated */
		while (p < body) {
			const char *nl = memchr(p, '\n', (size_t)(body - p));
			size_t n = nl ? (size_t)(nl - p) + 1 : (size_t)(body - p);

			ro_imds_parse_header(m, p, n);
			p += n;
		}
		body += skip;
	} else {
		body = s;
	}
	r = ro_imds_take_token(m, "token", body, len - (size_t)(body - s));
	FUZZ_ASSERT(r == 0 || r == -EBADMSG);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static const char kinds[] = "tsrlimT";
	struct ro_imds_event e;
	char kind, *s, word[64];
	size_t len;
	int r;

	if (!size)
		return 0;
	kind = strchr(kinds, data[0]) && data[0] ? (char)data[0] : kinds[data[0] % 7];
	data++;
	size--;
	if (memchr(data, '\0', size)) /* ro_imds_get() refuses a binary reply */
		return 0;
	s = fuzz_cstr(data, size);
	len = size;
	switch (kind) {
	case 't':
		token(s, len);
		break;
	case 's': {
		struct ro_imds_notice n;

		r = ro_imds_parse_spot(m, s, len, &n);
		FUZZ_ASSERT(r == 0 || r == -EBADMSG || r == -EPROTO || r == -ENOMEM);
		event_from(RO_IMDS_EV_INTERRUPTION, 0, &e);
		if (r) { /* what the watcher does with an unreadable notice */
			e.assumed = true;
			e.deadline_ms = e.at_ms + 120000;
			(void)snprintf(e.detail, sizeof(e.detail), "%s", ro_imds_errmsg(m));
		} else {
			e.action = n.action;
			e.deadline_ms = n.time_ms;
		}
		check_event(&e);
		break;
	}
	case 'r': {
		int64_t t;

		r = ro_imds_parse_rebalance(m, s, len, &t);
		FUZZ_ASSERT(r == 0 || r == -EBADMSG || r == -EPROTO || r == -ENOMEM);
		event_from(r ? RO_IMDS_EV_UNREACHABLE : RO_IMDS_EV_REBALANCE, r, &e);
		e.deadline_ms = r ? 0 : t;
		check_event(&e);
		break;
	}
	case 'l':
	case 'i':
		r = ro_imds_parse_word(m, kind == 'l' ? "lifecycle" : "identity", s, word,
				       kind == 'l' ? 32 : 16);
		FUZZ_ASSERT(r == 0 || r == -EBADMSG);
		if (!r) {
			FUZZ_ASSERT(strlen(word) < (kind == 'l' ? 32u : 16u));
			event_from(RO_IMDS_EV_LIFECYCLE, 0, &e);
			(void)snprintf(e.state, sizeof(e.state), "%s", word);
			(void)snprintf(e.detail, sizeof(e.detail), "(first read)");
		} else {
			event_from(RO_IMDS_EV_UNREACHABLE, r, &e);
		}
		check_event(&e);
		break;
	case 'm': {
		struct ro_imds_maintenance *ev = NULL;
		size_t n = 0;

		r = ro_imds_parse_maintenance(m, s, len, &ev, &n);
		FUZZ_ASSERT(r == 0 || r == -EBADMSG || r == -EPROTO || r == -ENOMEM);
		FUZZ_ASSERT(!r || (!ev && !n));
		for (size_t i = 0; i < n; i++) { /* as the watcher reports them */
			event_from(i % 2 ? RO_IMDS_EV_MAINTENANCE_CANCELLED : RO_IMDS_EV_MAINTENANCE,
				   0, &e);
			(void)snprintf(e.id, sizeof(e.id), "%s", ev[i].id);
			(void)snprintf(e.state, sizeof(e.state), "%.31s", ev[i].code);
			e.deadline_ms = ev[i].not_before_ms;
			check_event(&e);
		}
		if (r) {
			event_from(RO_IMDS_EV_UNREACHABLE, r, &e);
			check_event(&e);
		}
		free(ev);
		break;
	}
	default: {
		int64_t t;

		if (!ro_imds_parse_time(s, &t)) {
			event_from(RO_IMDS_EV_INTERRUPTION, 0, &e);
			e.deadline_ms = t;
			check_event(&e);
		}
		break;
	}
	}
	free(s);
	return 0;
}
