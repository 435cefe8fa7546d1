/* What agent/fetch.c and agent/awscreds.c share and nobody else sees: a one-shot HTTP
 * request into memory and the XML field reader for S3 and STS replies. */
#pragma once

#include <stddef.h>

#include <curl/curl.h>

struct ro_http_reply {
	long status; /* 0: no HTTP reply (see curl) */
	CURLcode curl;
	char *body; /* NUL-terminated, the caller frees */
	size_t len;
};

/* GET (post == NULL) or POST post, with the extra headers (may be NULL); replies larger than
 * max_body fail with CURLE_WRITE_ERROR. Proxies are never used for loopback. */
int ro_http_request(const char *url, const char *post, struct curl_slist *headers, long timeout_ms,
		    size_t max_body, struct ro_http_reply *ret);
void ro_http_reply_clear(struct ro_http_reply *r);

/* The text of the first <tag>...</tag> at or after *pos (entities &amp; &lt; &gt; &quot;
 * &apos; decoded) into buf; *pos moves past it. 0, -ENOENT (none), -ENOBUFS (too long). */
int ro_xml_field(const char *xml, const char **pos, const char *tag, char *buf, size_t len);
