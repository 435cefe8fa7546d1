/* AWS credentials for the policy fetcher, in the SDKs' order: environment, container
 * (EKS Pod Identity, ECS), web identity (IRSA, through STS), the instance profile (IMDSv2).
 * Credentials that expire are cached per process and fetched again 5 minutes before their
 * Expiration. No secret ever reaches a message. */
#include "agent/fetch.h"
#include "agent/fetch_internal.h"
#include "imds/imds.h"

#include <errno.h>
#include <json-c/json.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define REFRESH_AHEAD_MS (5 * 60 * 1000)
#define CRED_TIMEOUT_MS 5000L

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static struct ro_aws_creds cache;
static char cache_key[512]; /* which configuration the cached credentials came from */

static int64_t wall_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static const char *env(const char *name)
{
	const char *v = getenv(name);

	return v && *v ? v : NULL;
}

static void seterr(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void seterr(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (!err || !errlen)
		return;
	va_start(ap, fmt);
	(void)vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
}

static void wipe(struct ro_aws_creds *c)
{
	explicit_bzero(c, sizeof(*c));
}

/* ---- small HTTP and XML helpers (shared with fetch.c) ---------------------------------- */

struct membuf {
	char *p;
	size_t n, max;
};

static size_t on_body(char *d, size_t s, size_t nm, void *arg)
{
	struct membuf *b = arg;
	size_t add = s * nm;
	char *p;

	if (b->n + add > b->max)
		return 0;
	p = realloc(b->p, b->n + add + 1);
	if (!p)
		return 0;
	memcpy(p + b->n, d, add);
	b->n += add;
	p[b->n] = '\0';
	b->p = p;
	return add;
}

int ro_http_request(const char *url, const char *post, struct curl_slist *headers, long timeout_ms,
		    size_t max_body, struct ro_http_reply *ret)
{
	struct membuf b = {.max = max_body};
	CURL *c = curl_easy_init();

	memset(ret, 0, sizeof(*ret));
	if (!c)
		return -ENOMEM;
	(void)curl_easy_setopt(c, CURLOPT_URL, url);
	(void)curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
	(void)curl_easy_setopt(
	    c, CURLOPT_NOPROXY,
	    "127.0.0.1,localhost,::1,169.254.169.254,169.254.170.2,169.254.170.23");
	(void)curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
	(void)curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS,
			       timeout_ms < 2000 ? timeout_ms : 2000L);
	(void)curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
	(void)curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
	if (headers)
		(void)curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
	if (post)
		(void)curl_easy_setopt(c, CURLOPT_POSTFIELDS, post);
	ret->curl = curl_easy_perform(c);
	(void)curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &ret->status);
	curl_easy_cleanup(c);
	if (!b.p)
		b.p = calloc(1, 1);
	if (!b.p)
		return -ENOMEM;
	ret->body = b.p;
	ret->len = b.n;
	return 0;
}

void ro_http_reply_clear(struct ro_http_reply *r)
{
	if (r->body) {
		explicit_bzero(r->body, r->len);
		free(r->body);
	}
	memset(r, 0, sizeof(*r));
}

int ro_xml_field(const char *xml, const char **pos, const char *tag, char *buf, size_t len)
{
	char open[80], close[82];
	const char *a, *b, *from = pos && *pos ? *pos : xml;
	size_t o = 0;

	(void)snprintf(open, sizeof(open), "<%s>", tag);
	(void)snprintf(close, sizeof(close), "</%s>", tag);
	a = strstr(from, open);
	if (!a)
		return -ENOENT;
	a += strlen(open);
	b = strstr(a, close);
	if (!b)
		return -ENOENT;
	if (pos)
		*pos = b + strlen(close);
	for (const char *p = a; p < b; p++) {
		static const struct {
			const char *e;
			char c;
		} ent[] = {{"&amp;", '&'},
			   {"&lt;", '<'},
			   {"&gt;", '>'},
			   {"&quot;", '"'},
			   {"&apos;", '\''}};
		char c = *p;

		if (c == '&')
			for (size_t i = 0; i < sizeof(ent) / sizeof(ent[0]); i++)
				if (!strncmp(p, ent[i].e, strlen(ent[i].e))) {
					c = ent[i].c;
					p += strlen(ent[i].e) - 1;
					break;
				}
		if (o + 1 >= len)
			return -ENOBUFS;
		buf[o++] = c;
	}
	buf[o] = '\0';
	return 0;
}

/* ---- the sources ------------------------------------------------------------------------ */

static int copy_field(char *dst, size_t len, const char *src)
{
	if (!src || strlen(src) >= len)
		return -EPROTO;
	memcpy(dst, src, strlen(src) + 1);
	return 0;
}

/* The JSON the container endpoint and IMDS serve: AccessKeyId, SecretAccessKey, Token,
 * Expiration (and, from IMDS, Code). */
static int from_json(const char *body, const char *what, struct ro_aws_creds *c, char *err,
		     size_t errlen)
{
	struct json_object *root = json_tokener_parse(body), *v;
	const char *s;
	int r = 0;

	if (!root || !json_object_is_type(root, json_type_object)) {
		seterr(err, errlen, "%s: credentials reply is not JSON", what);
		r = -EBADMSG;
		goto out;
	}
	if (json_object_object_get_ex(root, "Code", &v) &&
	    strcmp(json_object_get_string(v), "Success")) {
		seterr(err, errlen, "%s: credentials Code %.60s", what, json_object_get_string(v));
		r = -EACCES;
		goto out;
	}
	s = json_object_object_get_ex(root, "AccessKeyId", &v) ? json_object_get_string(v) : NULL;
	r = copy_field(c->access_key_id, sizeof(c->access_key_id), s);
	s = json_object_object_get_ex(root, "SecretAccessKey", &v) ? json_object_get_string(v)
								   : NULL;
	r = r ?: copy_field(c->secret_access_key, sizeof(c->secret_access_key), s);
	s = json_object_object_get_ex(root, "Token", &v) ? json_object_get_string(v) : "";
	r = r ?: copy_field(c->session_token, sizeof(c->session_token), s);
	if (r) {
		seterr(err, errlen, "%s: credentials reply lacks AccessKeyId/SecretAccessKey",
		       what);
		goto out;
	}
	if (json_object_object_get_ex(root, "Expiration", &v) &&
	    ro_imds_parse_time(json_object_get_string(v), &c->expire_ms)) {
		seterr(err, errlen, "%s: unparsable Expiration", what);
		r = -EPROTO;
	}
out:
	json_object_put(root);
	return r;
}

static int read_token_file(const char *path, char *buf, size_t len, char *err, size_t errlen)
{
	FILE *f = fopen(path, "r");
	size_t n;

	if (!f) {
		int r = -errno;

		seterr(err, errlen, "%s: %s", path, strerror(-r));
		return r == -ENOENT ? -EACCES : r;
	}
	n = fread(buf, 1, len - 1, f);
	(void)fclose(f);
	while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' '))
		n--;
	buf[n] = '\0';
	if (!n) {
		seterr(err, errlen, "%s: empty token file", path);
		return -EACCES;
	}
	return 0;
}

static int http_status_errno(const struct ro_http_reply *h)
{
	if (h->curl != CURLE_OK)
		return -EIO;
	if (h->status == 401 || h->status == 403 || h->status == 400)
		return -EACCES;
	if (h->status == 404)
		return -ENOENT;
	return -EIO;
}

static int from_container(struct ro_aws_creds *c, char *err, size_t errlen)
{
	const char *full = env("AWS_CONTAINER_CREDENTIALS_FULL_URI");
	const char *rel = env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI");
	const char *tokfile = env("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
	const char *tok = env("AWS_CONTAINER_AUTHORIZATION_TOKEN");
	char url[1024], auth[4200];
	struct curl_slist *h = NULL;
	struct ro_http_reply rep;
	int r;

	if (full)
		(void)snprintf(url, sizeof(url), "%s", full);
	else
		(void)snprintf(url, sizeof(url), "http://169.254.170.2%s", rel);
	auth[0] = '\0';
	if (tokfile) {
		char t[4096];

		r = read_token_file(tokfile, t, sizeof(t), err, errlen);
		if (r)
			return r;
		(void)snprintf(auth, sizeof(auth), "Authorization: %s", t);
		explicit_bzero(t, sizeof(t));
	} else if (tok) {
		(void)snprintf(auth, sizeof(auth), "Authorization: %s", tok);
	}
	if (auth[0])
		h = curl_slist_append(NULL, auth);
	explicit_bzero(auth, sizeof(auth));
	r = ro_http_request(url, NULL, h, CRED_TIMEOUT_MS, 1 << 16, &rep);
	curl_slist_free_all(h); /* the token is in there: libcurl copied it, free it */
	if (r)
		return r;
	if (rep.curl != CURLE_OK || rep.status != 200) {
		seterr(err, errlen, "container credentials %s: %s, HTTP %ld", url,
		       curl_easy_strerror(rep.curl), rep.status);
		r = http_status_errno(&rep);
	} else {
		r = from_json(rep.body, "container credentials", c, err, errlen);
	}
	ro_http_reply_clear(&rep);
	return r;
}

static int from_web_identity(const char *region, struct ro_aws_creds *c, char *err, size_t errlen)
{
	const char *tokfile = env("AWS_WEB_IDENTITY_TOKEN_FILE");
	const char *role = env("AWS_ROLE_ARN");
	const char *sess = env("AWS_ROLE_SESSION_NAME");
	const char *ep = env("AWS_ENDPOINT_URL_STS");
	char url[512], tok[8192], exp[64], code[96], msg[256];
	char *etok = NULL, *erole = NULL, *esess = NULL, *post = NULL;
	struct ro_http_reply rep = {0};
	const char *pos = NULL, *p[4];
	int r;

	r = read_token_file(tokfile, tok, sizeof(tok), err, errlen);
	if (r)
		return r;
	if (ep)
		(void)snprintf(url, sizeof(url), "%s", ep);
	else
		(void)snprintf(url, sizeof(url), "https://sts.%s.amazonaws.com/", region);
	etok = curl_easy_escape(NULL, tok, 0);
	erole = curl_easy_escape(NULL, role, 0);
	esess = curl_easy_escape(NULL, sess ? sess : "rolloutd", 0);
	explicit_bzero(tok, sizeof(tok));
	if (!etok || !erole || !esess ||
	    asprintf(&post,
		     "Action=AssumeRoleWithWebIdentity&Version=2011-06-15&RoleArn=%s"
		     "&RoleSessionName=%s&WebIdentityToken=%s",
		     erole, esess, etok) < 0) {
		post = NULL;
		r = -ENOMEM;
		goto out;
	}
	r = ro_http_request(url, post, NULL, CRED_TIMEOUT_MS, 1 << 16, &rep);
	if (r)
		goto out;
	if (rep.curl != CURLE_OK || rep.status != 200) {
		if (ro_xml_field(rep.body, NULL, "Code", code, sizeof(code)))
			code[0] = '\0';
		if (ro_xml_field(rep.body, NULL, "Message", msg, sizeof(msg)))
			msg[0] = '\0';
		seterr(err, errlen, "STS AssumeRoleWithWebIdentity (%s): %s, HTTP %ld %s %s", role,
		       curl_easy_strerror(rep.curl), rep.status, code, msg);
		r = http_status_errno(&rep);
		goto out;
	}
	pos = strstr(rep.body, "<Credentials>");
	p[0] = p[1] = p[2] = p[3] = pos;
	if (!pos ||
	    ro_xml_field(rep.body, &p[0], "AccessKeyId", c->access_key_id,
			 sizeof(c->access_key_id)) ||
	    ro_xml_field(rep.body, &p[1], "SecretAccessKey", c->secret_access_key,
			 sizeof(c->secret_access_key)) ||
	    ro_xml_field(rep.body, &p[2], "SessionToken", c->session_token,
			 sizeof(c->session_token)) ||
	    ro_xml_field(rep.body, &p[3], "Expiration", exp, sizeof(exp)) ||
	    ro_imds_parse_time(exp, &c->expire_ms)) {
		seterr(err, errlen, "STS AssumeRoleWithWebIdentity: reply lacks credentials");
		r = -EPROTO;
	}
out:
	if (etok) {
		explicit_bzero(etok, strlen(etok));
		curl_free(etok);
	}
	curl_free(erole);
	curl_free(esess);
	if (post) {
		explicit_bzero(post, strlen(post));
		free(post);
	}
	ro_http_reply_clear(&rep);
	return r;
}

static struct ro_imds *imds_open(const char *endpoint)
{
	struct ro_imds_opts io;
	struct ro_imds *m = NULL;

	ro_imds_opts_default(&io);
	if (endpoint)
		io.endpoint = endpoint;
	io.retries = 1;
	return ro_imds_new(&io, &m) ? NULL : m;
}

static int from_imds(const char *endpoint, struct ro_aws_creds *c, char *err, size_t errlen)
{
	struct ro_imds *m = imds_open(endpoint);
	char *body = NULL, path[256], role[128];
	size_t len = 0, n;
	int r;

	if (!m)
		return -ENOMEM;
	r = ro_imds_get(m, "meta-data/iam/security-credentials/", &body, &len);
	if (r) {
		seterr(err, errlen, "IMDS iam/security-credentials: %s",
		       r == -ENOENT ? "no instance profile" : ro_imds_errmsg(m));
		goto out;
	}
	n = strcspn(body, "\r\n");
	if (!n || n >= sizeof(role)) {
		seterr(err, errlen, "IMDS iam/security-credentials: no role name");
		r = -ENOENT;
		goto out;
	}
	memcpy(role, body, n);
	role[n] = '\0';
	free(body);
	body = NULL;
	(void)snprintf(path, sizeof(path), "meta-data/iam/security-credentials/%s", role);
	r = ro_imds_get(m, path, &body, &len);
	if (r) {
		seterr(err, errlen, "IMDS %s: %s", path, ro_imds_errmsg(m));
		goto out;
	}
	r = from_json(body, "IMDS", c, err, errlen);
out:
	if (body) {
		explicit_bzero(body, len);
		free(body);
	}
	(void)ro_imds_free(m);
	return r;
}

void ro_aws_region(const char *imds_endpoint, char *buf, size_t len)
{
	const char *e = env("AWS_REGION");
	struct ro_imds *m;
	char *body = NULL;
	size_t n = 0;

	if (!e)
		e = env("AWS_DEFAULT_REGION");
	if (e) {
		(void)snprintf(buf, len, "%s", e);
		return;
	}
	(void)snprintf(buf, len, "us-east-1");
	m = imds_open(imds_endpoint);
	if (m && ro_imds_get(m, "meta-data/placement/region", &body, &n) == 0 && n && n < len &&
	    !strpbrk(body, " \r\n/"))
		(void)snprintf(buf, len, "%s", body);
	free(body);
	(void)ro_imds_free(m);
}

/* ---- the chain -------------------------------------------------------------------------- */

int ro_aws_creds_get(const char *imds_endpoint, const char *region, struct ro_aws_creds *ret,
		     char *err, size_t errlen)
{
	const char *akid = env("AWS_ACCESS_KEY_ID"), *secret = env("AWS_SECRET_ACCESS_KEY");
	char key[512], e1[256] = "";
	struct ro_aws_creds c;
	int r;

	memset(ret, 0, sizeof(*ret));
	if (akid && secret) {
		const char *tok = env("AWS_SESSION_TOKEN");

		if (copy_field(ret->access_key_id, sizeof(ret->access_key_id), akid) ||
		    copy_field(ret->secret_access_key, sizeof(ret->secret_access_key), secret) ||
		    copy_field(ret->session_token, sizeof(ret->session_token), tok ? tok : "")) {
			wipe(ret);
			seterr(err, errlen, "AWS credentials in the environment are too long");
			return -EACCES;
		}
		(void)snprintf(ret->source, sizeof(ret->source), "env");
		return 0;
	}

	/* which source applies, and the key its cached credentials are filed under */
	memset(&c, 0, sizeof(c));
	if (env("AWS_CONTAINER_CREDENTIALS_FULL_URI") ||
	    env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")) {
		(void)snprintf(key, sizeof(key), "container %s%s",
			       env("AWS_CONTAINER_CREDENTIALS_FULL_URI") ?: "",
			       env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") ?: "");
		(void)snprintf(c.source, sizeof(c.source), "container");
	} else if (env("AWS_WEB_IDENTITY_TOKEN_FILE") && env("AWS_ROLE_ARN")) {
		(void)snprintf(key, sizeof(key), "web-identity %s %s", env("AWS_ROLE_ARN"),
			       env("AWS_ENDPOINT_URL_STS") ?: "");
		(void)snprintf(c.source, sizeof(c.source), "web-identity");
	} else {
		(void)snprintf(key, sizeof(key), "imds %s", imds_endpoint ? imds_endpoint : "");
		(void)snprintf(c.source, sizeof(c.source), "imds");
	}

	(void)pthread_mutex_lock(&cache_lock);
	if (!strcmp(cache_key, key) && cache.access_key_id[0] &&
	    (!cache.expire_ms || wall_ms() < cache.expire_ms - REFRESH_AHEAD_MS)) {
		*ret = cache;
		(void)pthread_mutex_unlock(&cache_lock);
		return 0;
	}
	if (!strcmp(c.source, "container"))
		r = from_container(&c, e1, sizeof(e1));
	else if (!strcmp(c.source, "web-identity"))
		r = from_web_identity(region ? region : "us-east-1", &c, e1, sizeof(e1));
	else
		r = from_imds(imds_endpoint, &c, e1, sizeof(e1));
	if (r == 0) {
		wipe(&cache);
		cache = c;
		(void)snprintf(cache_key, sizeof(cache_key), "%s", key);
		*ret = c;
	}
	(void)pthread_mutex_unlock(&cache_lock);
	wipe(&c);
	if (r) {
		if (!strcmp(ret->source, "") && r != -ENOMEM) {
			if (!strncmp(key, "imds", 4))
				seterr(err, errlen,
				       "no AWS credentials: none in the environment, no "
				       "container or web identity, %s",
				       e1);
			else
				seterr(err, errlen, "%s", e1);
		}
		wipe(ret);
		return r == -ENOMEM ? r : -EACCES;
	}
	return 0;
}

void ro_aws_creds_invalidate(void)
{
	(void)pthread_mutex_lock(&cache_lock);
	wipe(&cache);
	cache_key[0] = '\0';
	(void)pthread_mutex_unlock(&cache_lock);
}
