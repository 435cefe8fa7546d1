/* The IMDS client: one reused libcurl handle (keep-alive), IMDSv2 session tokens cached and
 * refreshed before they expire (and again on a 401), short timeouts, bounded retries with
 * jittered backoff, a capped reply body, and a typed -errno for every way the metadata
 * service can fail or lie. Libraries do not log: the message of the last failure is kept. */
#include "imds/imds.h"

#include <ctype.h>
#include <curl/curl.h>
#include <errno.h>
#include <json-c/json.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "imds/internal.h"

struct ro_imds {
	struct ro_imds_opts o;
	char *endpoint;
	CURL *curl;
	char token[256];
	int64_t token_refresh_at; /* monotonic ms after which the token is renewed */
	uint64_t token_fetches;
	bool v1;
	uint64_t rng;
	/* the reply being read */
	char *body;
	size_t len, cap;
	bool too_big;
	uint32_t reply_ttl;
	char errmsg[256];
};

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;

static void curl_init_once(void)
{
	(void)curl_global_init(CURL_GLOBAL_DEFAULT);
}

int64_t ro_imds_mono_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t ro_imds_wall_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int fail(struct ro_imds *m, int r, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	(void)vsnprintf(m->errmsg, sizeof(m->errmsg), fmt, ap);
	va_end(ap);
	return r;
}

void ro_imds_opts_default(struct ro_imds_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->endpoint = "http://169.254.169.254";
	o->connect_timeout_ms = 300;
	o->timeout_ms = 1000;
	o->token_ttl_s = 21600;
	o->retries = 2;
	o->backoff_ms = 100;
	o->max_body = 65536;
}

const char *ro_imds_errmsg(const struct ro_imds *m)
{
	return m ? m->errmsg : "no client";
}

uint64_t ro_imds_token_fetches(const struct ro_imds *m)
{
	return m->token_fetches;
}

bool ro_imds_using_v1(const struct ro_imds *m)
{
	return m->v1;
}

static size_t on_body(char *p, size_t size, size_t nmemb, void *arg)
{
	struct ro_imds *m = arg;
	size_t n = size * nmemb;

	if (m->len + n > m->o.max_body) {
		m->too_big = true;
		return 0; /* aborts the transfer: CURLE_WRITE_ERROR */
	}
	if (m->len + n + 1 > m->cap) {
		size_t cap = m->cap ? m->cap : 1024;
		char *b;

		while (cap < m->len + n + 1)
			cap *= 2;
		b = realloc(m->body, cap);
		if (!b)
			return 0;
		m->body = b;
		m->cap = cap;
	}
	memcpy(m->body + m->len, p, n);
	m->len += n;
	m->body[m->len] = '\0';
	return n;
}

/* A reply header line as libcurl hands it (not NUL-terminated, CRLF kept): the token
 * PUT's TTL is all we read. */
void ro_imds_parse_header(struct ro_imds *m, const char *p, size_t n)
{
	static const char name[] = "x-aws-ec2-metadata-token-ttl-seconds:";

	if (n > sizeof(name) && !strncasecmp(p, name, sizeof(name) - 1)) {
		char v[16] = "";
		size_t vl = n - (sizeof(name) - 1);

		if (vl >= sizeof(v))
			vl = sizeof(v) - 1;
		memcpy(v, p + sizeof(name) - 1, vl);
		m->reply_ttl = (uint32_t)strtoul(v, NULL, 10);
	}
}

static size_t on_header(char *p, size_t size, size_t nmemb, void *arg)
{
	size_t n = size * nmemb;

	ro_imds_parse_header(arg, p, n);
	return n;
}

int ro_imds_new(const struct ro_imds_opts *o, struct ro_imds **ret)
{
	struct ro_imds *m;
	size_t el;

	(void)pthread_once(&curl_once, curl_init_once);
	m = calloc(1, sizeof(*m));
	if (!m)
		return -ENOMEM;
	ro_imds_opts_default(&m->o);
	if (o) {
		m->o = *o;
		if (!m->o.endpoint)
			m->o.endpoint = "http://169.254.169.254";
		if (!m->o.timeout_ms)
			m->o.timeout_ms = 1000;
		if (!m->o.connect_timeout_ms)
			m->o.connect_timeout_ms = 300;
		if (!m->o.token_ttl_s || m->o.token_ttl_s > 21600)
			m->o.token_ttl_s = 21600;
		if (!m->o.max_body)
			m->o.max_body = 65536;
		if (!m->o.backoff_ms)
			m->o.backoff_ms = 100;
	}
	m->endpoint = strdup(m->o.endpoint);
	if (!m->endpoint)
		goto out_nomem;
	el = strlen(m->endpoint);
	while (el && m->endpoint[el - 1] == '/')
		m->endpoint[--el] = '\0';
	m->o.endpoint = m->endpoint;
	if (strncmp(m->endpoint, "http://", 7) && strncmp(m->endpoint, "https://", 8)) {
		ro_imds_free(m);
		return -EINVAL;
	}
	m->rng = (uint64_t)ro_imds_wall_ms() * 0x9E3779B97F4A7C15ULL ^ (uint64_t)getpid();
	m->curl = curl_easy_init();
	if (!m->curl)
		goto out_nomem;
	(void)curl_easy_setopt(m->curl, CURLOPT_NOSIGNAL, 1L);
	/* IMDS is link-local: a configured proxy must never see it (nor its token) */
	(void)curl_easy_setopt(m->curl, CURLOPT_PROXY, "");
	(void)curl_easy_setopt(m->curl, CURLOPT_NOPROXY, "*");
	(void)curl_easy_setopt(m->curl, CURLOPT_FOLLOWLOCATION, 0L);
	(void)curl_easy_setopt(m->curl, CURLOPT_PROTOCOLS_STR, "http,https");
	(void)curl_easy_setopt(m->curl, CURLOPT_CONNECTTIMEOUT_MS, (long)m->o.connect_timeout_ms);
	(void)curl_easy_setopt(m->curl, CURLOPT_TIMEOUT_MS, (long)m->o.timeout_ms);
	(void)curl_easy_setopt(m->curl, CURLOPT_WRITEFUNCTION, on_body);
	(void)curl_easy_setopt(m->curl, CURLOPT_WRITEDATA, m);
	(void)curl_easy_setopt(m->curl, CURLOPT_HEADERFUNCTION, on_header);
	(void)curl_easy_setopt(m->curl, CURLOPT_HEADERDATA, m);
	(void)curl_easy_setopt(m->curl, CURLOPT_USERAGENT, "rolloutd/" "0.1");
	*ret = m;
	return 0;
out_nomem:
	ro_imds_free(m);
	return -ENOMEM;
}

struct ro_imds *ro_imds_free(struct ro_imds *m)
{
	if (!m)
		return NULL;
	if (m->curl)
		curl_easy_cleanup(m->curl);
	free(m->endpoint);
	free(m->body);
	free(m);
	return NULL;
}

static uint64_t rng_next(struct ro_imds *m)
{
	m->rng ^= m->rng << 13;
	m->rng ^= m->rng >> 7;
	m->rng ^= m->rng << 17;
	return m->rng;
}

void ro_imds_sleep_ms(int64_t ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};

	while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
		;
}

/* One HTTP exchange; CURLcode and status become -errno here, once. */
static int exchange(struct ro_imds *m, bool put, const char *url, struct curl_slist *hdr,
		    long *ret_status)
{
	CURLcode c;
	long status = 0;

	m->len = 0;
	m->too_big = false;
	m->reply_ttl = 0;
	if (m->body)
		m->body[0] = '\0';
	(void)curl_easy_setopt(m->curl, CURLOPT_URL, url);
	(void)curl_easy_setopt(m->curl, CURLOPT_HTTPHEADER, hdr);
	if (put) {
		(void)curl_easy_setopt(m->curl, CURLOPT_CUSTOMREQUEST, "PUT");
	} else {
		(void)curl_easy_setopt(m->curl, CURLOPT_CUSTOMREQUEST, NULL);
		(void)curl_easy_setopt(m->curl, CURLOPT_HTTPGET, 1L);
	}
	c = curl_easy_perform(m->curl);
	(void)curl_easy_getinfo(m->curl, CURLINFO_RESPONSE_CODE, &status);
	*ret_status = status;
	if (m->too_big)
		return fail(m, -EFBIG, "%s: reply larger than %u bytes", url, m->o.max_body);
	switch (c) {
	case CURLE_OK:
		return 0;
	case CURLE_OPERATION_TIMEDOUT:
		return fail(m, -ETIMEDOUT, "%s: no reply within %u ms", url, m->o.timeout_ms);
	case CURLE_COULDNT_CONNECT:
		return fail(m, -ECONNREFUSED, "%s: %s", url, curl_easy_strerror(c));
	case CURLE_GOT_NOTHING:
	case CURLE_RECV_ERROR:
	case CURLE_SEND_ERROR:
	case CURLE_PARTIAL_FILE:
		return fail(m, -ECONNRESET, "%s: %s", url, curl_easy_strerror(c));
	case CURLE_OUT_OF_MEMORY:
		return fail(m, -ENOMEM, "%s: out of memory", url);
	default:
		return fail(m, -EIO, "%s: %s", url, curl_easy_strerror(c));
	}
}

static bool retryable(int r)
{
	/* timeouts are not retried: the wait already spent the poll's budget */
	return r == -EAGAIN || r == -EIO || r == -ECONNRESET || r == -ECONNREFUSED;
}

static int status_errno(struct ro_imds *m, const char *url, long status)
{
	if (status == 200)
		return 0;
	if (status == 404)
		return fail(m, -ENOENT, "%s: 404 not found", url);
	if (status == 401 || status == 403 || status == 400 || status == 405)
		return fail(m, -EACCES, "%s: HTTP %ld", url, status);
	if (status == 429)
		return fail(m, -EAGAIN, "%s: HTTP 429 (throttled)", url);
	return fail(m, -EIO, "%s: HTTP %ld", url, status);
}

/* Exchange with bounded, jittered retries of what may pass. */
static int request(struct ro_imds *m, bool put, const char *url, struct curl_slist *hdr,
		   long *ret_status)
{
	int64_t backoff = m->o.backoff_ms;
	int r = 0;

	for (uint32_t i = 0;; i++) {
		r = exchange(m, put, url, hdr, ret_status);
		if (!r)
			r = status_errno(m, url, *ret_status);
		if (!r || !retryable(r) || i >= m->o.retries)
			return r;
		/* jitter in [backoff/2, backoff*3/2): many nodes must not retry in step */
		ro_imds_sleep_ms(backoff / 2 + (int64_t)(rng_next(m) % (uint64_t)backoff));
		backoff *= 2;
	}
}

static int fetch_token(struct ro_imds *m)
{
	char url[512], ttl[80];
	struct curl_slist *hdr;
	long status = 0;
	int r;

	(void)snprintf(url, sizeof(url), "%s/latest/api/token", m->endpoint);
	(void)snprintf(ttl, sizeof(ttl), "X-aws-ec2-metadata-token-ttl-seconds: %u",
		       m->o.token_ttl_s);
	hdr = curl_slist_append(NULL, ttl);
	if (!hdr)
		return -ENOMEM;
	m->token_fetches++;
	r = request(m, true, url, hdr, &status);
	curl_slist_free_all(hdr);
	if (r == -ENOENT)
		r = fail(m, -EACCES, "%s: 404: this endpoint has no IMDSv2 token service", url);
	if (r)
		return r;
	return ro_imds_take_token(m, url, m->body, m->len);
}

/* The token PUT's reply: printable text that fits, renewed before the TTL the reply
 * header granted (or the one asked for, when shorter or absent) runs out. */
int ro_imds_take_token(struct ro_imds *m, const char *what, const char *body, size_t len)
{
	uint32_t ttl_s;
	int64_t margin;

	if (len == 0 || len >= sizeof(m->token))
		return fail(m, -EBADMSG, "%s: token of %zu bytes", what, len);
	for (size_t i = 0; i < len; i++)
		if (!isgraph((unsigned char)body[i]))
			return fail(m, -EBADMSG, "%s: token is not printable text", what);
	memcpy(m->token, body, len);
	m->token[len] = '\0';
	ttl_s = m->reply_ttl && m->reply_ttl < m->o.token_ttl_s ? m->reply_ttl : m->o.token_ttl_s;
	/* renew a quarter of the lifetime (at most a minute) early: a token that expires
	 * between our check and EC2's costs a 401 and a second round trip */
	margin = (int64_t)ttl_s * 1000 / 4;
	if (margin > 60000)
		margin = 60000;
	m->token_refresh_at = ro_imds_mono_ms() + (int64_t)ttl_s * 1000 - margin;
	return 0;
}

static int ensure_token(struct ro_imds *m)
{
	int r;

	if (m->v1)
		return 0;
	if (m->token[0] && ro_imds_mono_ms() < m->token_refresh_at)
		return 0;
	m->token[0] = '\0';
	r = fetch_token(m);
	if (r && m->o.v1_fallback && (r == -EACCES || r == -ETIMEDOUT)) {
		/* hop limit 1 in a pod drops the PUT reply; 403 is IMDSv2 refused */
		m->v1 = true;
		return 0;
	}
	return r;
}

int ro_imds_get(struct ro_imds *m, const char *path, char **ret_body, size_t *ret_len)
{
	char url[512], th[320];
	long status = 0;
	int r;

	(void)snprintf(url, sizeof(url), "%s/latest/%s", m->endpoint, path);
	for (int tries = 0;; tries++) {
		struct curl_slist *hdr = NULL;

		r = ensure_token(m);
		if (r)
			return r;
		if (!m->v1) {
			(void)snprintf(th, sizeof(th), "X-aws-ec2-metadata-token: %s", m->token);
			hdr = curl_slist_append(NULL, th);
			if (!hdr)
				return -ENOMEM;
		}
		r = request(m, false, url, hdr, &status);
		curl_slist_free_all(hdr);
		if (status != 401 || tries > 0)
			break;
		/* expired or revoked token: get a new one once */
		m->token[0] = '\0';
		m->v1 = false;
	}
	if (r)
		return r;
	if (memchr(m->body ? m->body : "", '\0', m->len))
		return fail(m, -EBADMSG, "%s: binary reply", url);
	*ret_body = strndup(m->body ? m->body : "", m->len);
	if (!*ret_body)
		return -ENOMEM;
	if (ret_len)
		*ret_len = m->len;
	return 0;
}

int ro_imds_parse_time(const char *s, int64_t *ret_ms)
{
	struct tm tm = {0};
	int y, mo, d, h, mi, sec, n = 0, frac_ms = 0, off = 0;
	const char *p;

	if (sscanf(s, "%4d-%2d-%2d%*1[Tt ]%2d:%2d:%2d%n", &y, &mo, &d, &h, &mi, &sec, &n) != 6 ||
	    n != 19)
		return -EINVAL;
	if (y < 1970 || y > 9999 || mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 ||
	    sec > 60 || h < 0 || mi < 0 || sec < 0)
		return -EINVAL;
	p = s + n;
	if (*p == '.') {
		int digits = 0;

		for (p++; isdigit((unsigned char)*p); p++, digits++)
			if (digits < 3)
				frac_ms = frac_ms * 10 + (*p - '0');
		if (!digits)
			return -EINVAL;
		for (; digits < 3; digits++)
			frac_ms *= 10;
	}
	if (*p == 'Z' || *p == 'z') {
		p++;
	} else if (*p == '+' || *p == '-') {
		int oh, om, k = 0;

		if (sscanf(p + 1, "%2d:%2d%n", &oh, &om, &k) != 2 || k != 5 || oh > 23 || om > 59)
			return -EINVAL;
		off = (oh * 60 + om) * (*p == '-' ? -1 : 1);
		p += 6;
	} else {
		return -EINVAL;
	}
	if (*p)
		return -EINVAL;
	tm.tm_year = y - 1900;
	tm.tm_mon = mo - 1;
	tm.tm_mday = d;
	tm.tm_hour = h;
	tm.tm_min = mi;
	tm.tm_sec = sec;
	*ret_ms = ((int64_t)timegm(&tm) - (int64_t)off * 60) * 1000 + frac_ms;
	return 0;
}

/* Parse a JSON object reply; -EBADMSG when it is not one. */
static int parse_object(struct ro_imds *m, const char *what, const char *body, size_t len,
			struct json_object **ret)
{
	struct json_tokener *tok = json_tokener_new_ex(8);
	struct json_object *o;
	enum json_tokener_error e;

	if (!tok)
		return -ENOMEM;
	o = json_tokener_parse_ex(tok, body, (int)len);
	e = json_tokener_get_error(tok);
	if (o && e == json_tokener_success) {
		size_t used = json_tokener_get_parse_end(tok);

		while (used < len && isspace((unsigned char)body[used]))
			used++;
		if (used != len)
			e = json_tokener_error_parse_unexpected;
	}
	json_tokener_free(tok);
	if (!o || e != json_tokener_success) {
		json_object_put(o);
		return fail(m, -EBADMSG, "%s: reply is not JSON (%s)", what,
			    e == json_tokener_continue ? "truncated" : json_tokener_error_desc(e));
	}
	if (!json_object_is_type(o, json_type_object) && !json_object_is_type(o, json_type_array)) {
		json_object_put(o);
		return fail(m, -EPROTO, "%s: reply is JSON but not an object", what);
	}
	*ret = o;
	return 0;
}

static const char *get_str(struct json_object *o, const char *key)
{
	struct json_object *v;

	if (!json_object_is_type(o, json_type_object) || !json_object_object_get_ex(o, key, &v) ||
	    !json_object_is_type(v, json_type_string))
		return NULL;
	return json_object_get_string(v);
}

const char *ro_imds_action_name(enum ro_imds_action a)
{
	switch (a) {
	case RO_IMDS_STOP:
		return "stop";
	case RO_IMDS_HIBERNATE:
		return "hibernate";
	default:
		return "terminate";
	}
}

int ro_imds_parse_spot(struct ro_imds *m, const char *body, size_t len,
		       struct ro_imds_notice *ret)
{
	static const char what[] = "spot/instance-action";
	struct json_object *o = NULL;
	const char *action, *t;
	int r;

	r = parse_object(m, what, body, len, &o);
	if (r)
		return r;
	action = get_str(o, "action");
	t = get_str(o, "time");
	if (!action || !t) {
		r = fail(m, -EPROTO, "%s: want string fields action and time", what);
		goto out;
	}
	if (!strcmp(action, "terminate")) {
		ret->action = RO_IMDS_TERMINATE;
	} else if (!strcmp(action, "stop")) {
		ret->action = RO_IMDS_STOP;
	} else if (!strcmp(action, "hibernate")) {
		ret->action = RO_IMDS_HIBERNATE;
	} else {
		r = fail(m, -EPROTO, "%s: unknown action \"%.32s\"", what, action);
		goto out;
	}
	if (ro_imds_parse_time(t, &ret->time_ms)) {
		r = fail(m, -EPROTO, "%s: time \"%.40s\" is not RFC 3339", what, t);
		goto out;
	}
out:
	json_object_put(o);
	return r;
}

int ro_imds_spot_action(struct ro_imds *m, struct ro_imds_notice *ret)
{
	char *body = NULL;
	size_t len = 0;
	int r;

	r = ro_imds_get(m, "meta-data/spot/instance-action", &body, &len);
	if (r)
		return r;
	r = ro_imds_parse_spot(m, body, len, ret);
	free(body);
	return r;
}

int ro_imds_parse_rebalance(struct ro_imds *m, const char *body, size_t len,
			    int64_t *ret_notice_ms)
{
	static const char what[] = "events/recommendations/rebalance";
	struct json_object *o = NULL;
	const char *t;
	int r;

	r = parse_object(m, what, body, len, &o);
	if (r)
		return r;
	t = get_str(o, "noticeTime");
	if (!t)
		r = fail(m, -EPROTO, "%s: want a string field noticeTime", what);
	else if (ro_imds_parse_time(t, ret_notice_ms))
		r = fail(m, -EPROTO, "%s: noticeTime \"%.40s\" is not RFC 3339", what, t);
	json_object_put(o);
	return r;
}

int ro_imds_rebalance(struct ro_imds *m, int64_t *ret_notice_ms)
{
	char *body = NULL;
	size_t len = 0;
	int r;

	r = ro_imds_get(m, "meta-data/events/recommendations/rebalance", &body, &len);
	if (r)
		return r;
	r = ro_imds_parse_rebalance(m, body, len, ret_notice_ms);
	free(body);
	return r;
}

/* A short token of text (a state name, an id): trimmed, [A-Za-z0-9:._-] only. */
int ro_imds_parse_word(struct ro_imds *m, const char *what, const char *body, char *buf,
		       size_t len)
{
	size_t n;

	while (*body && isspace((unsigned char)*body))
		body++;
	n = strlen(body);
	while (n && isspace((unsigned char)body[n - 1]))
		n--;
	if (!n || n >= len)
		return fail(m, -EBADMSG, "%s: %zu bytes is not a plain value", what, n);
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)body[i];

		if (!isalnum(c) && !strchr(":._-", c))
			return fail(m, -EBADMSG, "%s: unexpected character 0x%02x", what, c);
	}
	memcpy(buf, body, n);
	buf[n] = '\0';
	return 0;
}

int ro_imds_lifecycle(struct ro_imds *m, char *buf, size_t len)
{
	char *body = NULL;
	int r;

	r = ro_imds_get(m, "meta-data/autoscaling/target-lifecycle-state", &body, NULL);
	if (r)
		return r;
	r = ro_imds_parse_word(m, "autoscaling/target-lifecycle-state", body, buf, len);
	free(body);
	return r;
}

static int64_t parse_maint_time(const char *s)
{
	struct tm tm = {0};
	const char *end = strptime(s, "%d %b %Y %H:%M:%S GMT", &tm);

	if (!end || *end)
		return -1;
	return (int64_t)timegm(&tm) * 1000;
}

int ro_imds_parse_maintenance(struct ro_imds *m, const char *body, size_t len,
			      struct ro_imds_maintenance **ret, size_t *ret_count)
{
	static const char what[] = "events/maintenance/scheduled";
	struct ro_imds_maintenance *ev = NULL;
	struct json_object *o = NULL;
	size_t n;
	int r;

	*ret = NULL;
	*ret_count = 0;
	r = parse_object(m, what, body, len, &o);
	if (r)
		return r;
	if (!json_object_is_type(o, json_type_array)) {
		r = fail(m, -EPROTO, "%s: want an array", what);
		goto out;
	}
	n = json_object_array_length(o);
	if (n > 64)
		n = 64;
	ev = calloc(n + 1, sizeof(*ev));
	if (!ev) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < n; i++) {
		struct json_object *e = json_object_array_get_idx(o, i);
		const char *id = get_str(e, "EventId"), *code = get_str(e, "Code");
		const char *state = get_str(e, "State"), *nb = get_str(e, "NotBefore");

		if (!id || !code || !state || strlen(id) >= sizeof(ev->id) ||
		    strlen(code) >= sizeof(ev->code) || strlen(state) >= sizeof(ev->state)) {
			r = fail(m, -EPROTO, "%s: event %zu lacks EventId, Code or State", what, i);
			goto out;
		}
		strcpy(ev[i].id, id);
		strcpy(ev[i].code, code);
		strcpy(ev[i].state, state);
		ev[i].not_before_ms = nb ? parse_maint_time(nb) : -1;
	}
	*ret = ev;
	*ret_count = n;
	ev = NULL;
out:
	free(ev);
	json_object_put(o);
	return r;
}

int ro_imds_maintenance(struct ro_imds *m, struct ro_imds_maintenance **ret, size_t *ret_count)
{
	char *body = NULL;
	size_t len = 0;
	int r;

	*ret = NULL;
	*ret_count = 0;
	r = ro_imds_get(m, "meta-data/events/maintenance/scheduled", &body, &len);
	if (r)
		return r;
	r = ro_imds_parse_maintenance(m, body, len, ret, ret_count);
	free(body);
	return r;
}

int ro_imds_identity(struct ro_imds *m, struct ro_imds_identity *ret)
{
	static const struct {
		const char *path;
		size_t off, len;
	} f[] = {
	    {"meta-data/instance-id", offsetof(struct ro_imds_identity, instance_id),
	     sizeof(ret->instance_id)},
	    {"meta-data/instance-type", offsetof(struct ro_imds_identity, instance_type),
	     sizeof(ret->instance_type)},
	    {"meta-data/placement/availability-zone", offsetof(struct ro_imds_identity, az),
	     sizeof(ret->az)},
	    {"meta-data/instance-life-cycle", offsetof(struct ro_imds_identity, life_cycle),
	     sizeof(ret->life_cycle)},
	};

	memset(ret, 0, sizeof(*ret));
	for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++) {
		char *body = NULL;
		int r = ro_imds_get(m, f[i].path, &body, NULL);

		if (r == -ENOENT && i == 3) { /* older instances: no life-cycle key */
			strcpy(ret->life_cycle, "unknown");
			continue;
		}
		if (r)
			return r;
		r = ro_imds_parse_word(m, f[i].path, body, (char *)ret + f[i].off, f[i].len);
		free(body);
		if (r)
			return r;
	}
	return 0;
}
