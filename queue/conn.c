/* One Redis connection the project owns (see conn.h): the URL, a non-blocking socket
 * (TCP, unix or TLS), the handshake pipelined on the wire, a FIFO of commands with
 * deadlines, reconnection with jittered backoff that sends unanswered commands again, and
 * the routing of a Cluster (the owner of the queue's slot) or a Sentinel group (the
 * primary). hiredis is only the RESP codec here. */
#include "queue/conn.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ---- URLs ---------------------------------------------------------------------------- */

static int hexval(int ch)
{
	return ch >= '0' && ch <= '9'	? ch - '0'
	       : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
	       : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10
					: -1;
}

/* s[0..n) percent-decoded into a new string; NULL on a bad escape or a NUL. */
static char *decode(const char *s, size_t n, bool *bad)
{
	char *o = malloc(n + 1), *p = o;

	if (!o)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		if (s[i] == '%') {
			int hi = i + 1 < n ? hexval((unsigned char)s[i + 1]) : -1;
			int lo = i + 2 < n ? hexval((unsigned char)s[i + 2]) : -1;

			if (hi < 0 || lo < 0 || (hi == 0 && lo == 0)) {
				free(o);
				*bad = true;
				return NULL;
			}
			*p++ = (char)(hi * 16 + lo);
			i += 2;
		} else {
			*p++ = s[i];
		}
	}
	*p = '\0';
	return o;
}

__attribute__((format(printf, 4, 5))) static int url_fail(const char *url, char *err,
							   size_t errlen, const char *fmt, ...)
{
	char red[512], why[256];
	va_list ap;

	va_start(ap, fmt);
	(void)vsnprintf(why, sizeof(why), fmt, ap);
	va_end(ap);
	ro_redis_url_redact(url, red, sizeof(red));
	(void)snprintf(err, errlen, "bad redis url %s: %s", red, why);
	return -EINVAL;
}

/* "host[:port]" or "[v6]:port" into hp; default port def. */
static int parse_hostport(const char *s, size_t n, int def, struct ro_hostport *hp,
			  const char **why)
{
	const char *colon = NULL, *hs = s;
	size_t hl;

	if (n && s[0] == '[') {
		const char *rb = memchr(s, ']', n);

		if (!rb) {
			*why = "unclosed [ in the host";
			return -EINVAL;
		}
		hs = s + 1;
		hl = (size_t)(rb - s - 1);
		if ((size_t)(rb + 1 - s) < n) {
			if (rb[1] != ':') {
				*why = "junk after ]";
				return -EINVAL;
			}
			colon = rb + 1;
		}
	} else {
		colon = memchr(s, ':', n);
		hl = colon ? (size_t)(colon - s) : n;
	}
	if (!hl) {
		*why = "no host";
		return -EINVAL;
	}
	if (hl >= sizeof(hp->host)) {
		*why = "host name too long";
		return -EINVAL;
	}
	memcpy(hp->host, hs, hl);
	hp->host[hl] = '\0';
	hp->port = def;
	if (colon) {
		long port = 0;
		size_t pl = (size_t)(s + n - colon - 1);

		if (!pl || pl > 5) {
			*why = "bad port";
			return -EINVAL;
		}
		for (size_t i = 0; i < pl; i++) {
			if (!isdigit((unsigned char)colon[1 + i])) {
				*why = "bad port";
				return -EINVAL;
			}
			port = port * 10 + (colon[1 + i] - '0');
		}
		if (port <= 0 || port > 65535) {
			*why = "bad port";
			return -EINVAL;
		}
		hp->port = (int)port;
	}
	return 0;
}

static int parse_db(const char *s, size_t n, int *db)
{
	long v = 0;

	if (!n || n > 6)
		return -EINVAL;
	for (size_t i = 0; i < n; i++) {
		if (!isdigit((unsigned char)s[i]))
			return -EINVAL;
		v = v * 10 + (s[i] - '0');
	}
	*db = (int)v;
	return 0;
}

void ro_redis_url_clear(struct ro_redis_url *u)
{
	free(u->path);
	free(u->user);
	free(u->password);
	free(u->master);
	memset(u, 0, sizeof(*u));
}

/* unix:///path[?db=N&user=U&password=P] */
static int parse_unix(const char *url, const char *p, struct ro_redis_url *u, char *err,
		      size_t errlen)
{
	const char *qm = strchr(p, '?');
	size_t n = qm ? (size_t)(qm - p) : strlen(p);
	bool bad = false;

	/* unix://[user[:pw]@]/path */
	const char *at = n && *p != '/' ? memchr(p, '@', n) : NULL;

	if (at) {
		const char *colon = memchr(p, ':', (size_t)(at - p));

		u->user = decode(p, colon ? (size_t)(colon - p) : (size_t)(at - p), &bad);
		if (colon)
			u->password = decode(colon + 1, (size_t)(at - colon - 1), &bad);
		n -= (size_t)(at + 1 - p);
		p = at + 1;
	}
	if (!n || *p != '/')
		return url_fail(url, err, errlen, "want unix:///path/to/socket");
	u->path = decode(p, n, &bad);
	if (bad || !u->path)
		return url_fail(url, err, errlen, "bad %%-escape");
	for (const char *kv = qm ? qm + 1 : NULL; kv && *kv;) {
		size_t l = strcspn(kv, "&");

		if (!strncmp(kv, "db=", 3)) {
			if (parse_db(kv + 3, l - 3, &u->db))
				return url_fail(url, err, errlen, "bad db");
		} else if (!strncmp(kv, "password=", 9)) {
			free(u->password);
			u->password = decode(kv + 9, l - 9, &bad);
		} else if (!strncmp(kv, "user=", 5)) {
			free(u->user);
			u->user = decode(kv + 5, l - 5, &bad);
		} else {
			return url_fail(url, err, errlen, "unknown parameter %.*s", (int)l, kv);
		}
		if (bad)
			return url_fail(url, err, errlen, "bad %%-escape");
		kv += l;
		if (*kv == '&')
			kv++;
	}
	return 0;
}

static int url_parse(const char *url, struct ro_redis_url *u, char *err, size_t errlen);

int ro_redis_url_parse(const char *url, struct ro_redis_url *u, char *err, size_t errlen)
{
	int r = url_parse(url, u, err, errlen);

	if (r)
		ro_redis_url_clear(u); /* every early return, not only some */
	return r;
}

static int url_parse(const char *url, struct ro_redis_url *u, char *err, size_t errlen)
{
	static const struct {
		const char *scheme;
		bool tls, sentinel;
	} schemes[] = {
	    {"redis://", false, false},
	    {"rediss://", true, false},
	    {"redis+sentinel://", false, true},
	    {"rediss+sentinel://", true, true},
	    {"valkey://", false, false},
	    {"valkeys://", true, false},
	};
	const char *p = NULL, *end, *auth_end, *at, *path;
	bool bad = false;
	int r;

	memset(u, 0, sizeof(*u));
	if (!strncmp(url, "unix://", 7)) {
		r = parse_unix(url, url + 7, u, err, errlen);
		if (r)
			ro_redis_url_clear(u);
		return r;
	}
	for (size_t i = 0; i < sizeof(schemes) / sizeof(schemes[0]); i++)
		if (!strncasecmp(url, schemes[i].scheme, strlen(schemes[i].scheme))) {
			p = url + strlen(schemes[i].scheme);
			u->tls = schemes[i].tls;
			u->sentinel = schemes[i].sentinel;
			break;
		}
	if (!p)
		return url_fail(url, err, errlen,
				"want redis://[user[:password]@]host[:port][/db], rediss://..., "
				"unix:///path or redis+sentinel://h1:26379,h2/MASTER[/db]");
	end = p + strlen(p);
	/* the user part ends at the last @ (a password may hold / or @ when not escaped) */
	at = NULL;
	for (const char *s = p; s < end; s++)
		if (*s == '@')
			at = s;
	if (at) {
		const char *colon = memchr(p, ':', (size_t)(at - p));

		if (colon) {
			if (colon > p)
				u->user = decode(p, (size_t)(colon - p), &bad);
			u->password = decode(colon + 1, (size_t)(at - colon - 1), &bad);
		} else if (at > p) {
			u->user = decode(p, (size_t)(at - p), &bad);
		}
		if (bad)
			goto bad_escape;
		p = at + 1;
	}
	path = strchr(p, '/');
	auth_end = path ? path : end;
	{
		const char *q = memchr(p, '?', (size_t)(auth_end - p));

		if (q)
			return url_fail(url, err, errlen, "query parameters are not supported here");
	}
	/* hosts: one, or (sentinel) a comma-separated list */
	for (const char *h = p; h < auth_end;) {
		const char *comma = memchr(h, ',', (size_t)(auth_end - h));
		size_t hl = comma ? (size_t)(comma - h) : (size_t)(auth_end - h);
		const char *why = NULL;

		if (u->n_hosts == RO_URL_MAX_HOSTS)
			return url_fail(url, err, errlen, "more than %d hosts", RO_URL_MAX_HOSTS);
		if (u->n_hosts && !u->sentinel)
			return url_fail(url, err, errlen,
					"several hosts: only redis+sentinel:// takes a list (a "
					"cluster needs one seed node)");
		if (parse_hostport(h, hl, u->sentinel ? 26379 : 6379, &u->hosts[u->n_hosts],
				   &why)) {
			ro_redis_url_clear(u);
			return url_fail(url, err, errlen, "%s", why);
		}
		{
			char *d = decode(u->hosts[u->n_hosts].host, strlen(u->hosts[u->n_hosts].host),
					 &bad);

			if (!d)
				goto bad_escape;
			(void)snprintf(u->hosts[u->n_hosts].host, sizeof(u->hosts[0].host), "%s", d);
			free(d);
		}
		u->n_hosts++;
		h += hl + (comma ? 1 : 0);
	}
	if (!u->n_hosts) {
		if (u->sentinel || u->tls) {
			ro_redis_url_clear(u);
			return url_fail(url, err, errlen, "no host");
		}
		(void)snprintf(u->hosts[0].host, sizeof(u->hosts[0].host), "127.0.0.1");
		u->hosts[0].port = 6379;
		u->n_hosts = 1;
	}
	/* /db, or (sentinel) /MASTER[/db] */
	if (path && path[1]) {
		const char *s = path + 1;

		if (u->sentinel) {
			const char *sl = strchr(s, '/');
			size_t ml = sl ? (size_t)(sl - s) : strlen(s);

			u->master = decode(s, ml, &bad);
			if (bad)
				goto bad_escape;
			s = sl ? sl + 1 : s + ml;
		}
		if (*s && strcmp(s, "/") && parse_db(s, strlen(s) - (s[strlen(s) - 1] == '/'),
						     &u->db)) {
			ro_redis_url_clear(u);
			return url_fail(url, err, errlen, "bad db \"%s\" (a number)", s);
		}
	}
	if (u->sentinel && (!u->master || !*u->master)) {
		ro_redis_url_clear(u);
		return url_fail(url, err, errlen,
				"no primary name: redis+sentinel://h1:26379,h2:26379/MASTER[/db]");
	}
	return 0;
bad_escape:
	ro_redis_url_clear(u);
	return url_fail(url, err, errlen, "bad %%-escape");
}

void ro_redis_url_redact(const char *url, char *out, size_t len)
{
	const char *p = strstr(url, "://"), *at = NULL, *colon;

	if (!p) {
		/* not a URL we know: hide whatever could be credentials */
		const char *a = strrchr(url, '@');

		(void)snprintf(out, len, "%s%s", a ? "***" : "", a ? a : url);
		return;
	}
	p += 3;
	for (const char *s = p; *s; s++)
		if (*s == '@')
			at = s;
	if (at && (colon = memchr(p, ':', (size_t)(at - p))) != NULL) {
		(void)snprintf(out, len, "%.*s:***%s", (int)(colon - url), url, at);
	} else {
		(void)snprintf(out, len, "%s", url);
	}
	/* and every password= parameter, whatever the scheme (a refused URL is shown too) */
	for (char *pw = strstr(out, "password="); pw; pw = strstr(pw, "password=")) {
		char *v = pw + 9, *e = v + strcspn(v, "&");

		if (e - v > 3 || strncmp(v, "***", 3)) {
			/* a value shorter than *** grows the text: only within out */
			if (e - v < 3 && strlen(out) + (size_t)(3 - (e - v)) + 1 > len) {
				if ((size_t)(v - out) + 4 <= len)
					memcpy(v, "***", 4);
				else
					*v = '\0';
				break;
			}
			memmove(v + 3, e, strlen(e) + 1);
			memcpy(v, "***", 3);
		}
		pw = v + 3;
	}
}

/* ---- the connection ------------------------------------------------------------------ */

enum kind { K_USER, K_AUTH, K_ROLE, K_SLOTS, K_SENTINEL, K_SELECT, K_NAME, K_VERSION, K_LOAD };
enum state { S_IDLE, S_RESOLVING, S_CONNECTING, S_TLS, S_HANDSHAKE, S_READY };
enum mode { M_UNKNOWN, M_STANDALONE, M_CLUSTER, M_SENTINEL };
enum { F_AT_ONCE = 1, F_REROUTE = 2 };

#define MAX_NODES 64

struct cmd {
	struct cmd *next;
	char *buf;
	size_t len;
	char name[40]; /* the FCALL function or the command, for after_send */
	enum kind kind;
	int64_t deadline, sent_at;
	/* when it was last written whole on any connection (sent_at: on this one): one that
	 * times out after that may have run, even if the reconnect never sent it again */
	int64_t written_at;
	uint32_t block_ms, wait_n, wait_ms;
	bool got_first;	  /* WAIT follows: its own reply came (held) */
	redisReply *held; /* that reply, until WAIT's */
	ro_conn_reply_fn fn; /* NULL: its caller was already answered (deadline) */
	void *arg;
	bool reloaded; /* sent again once after "Function not found" */
};

struct ro_conn {
	struct ro_conn_opts o;
	struct ro_redis_url url;
	char *password, *sentinel_password, *name, *library, *library_version, *server_name;
	unsigned slot;
	SSL_CTX *tls;
	SSL *ssl;
	short tls_want;	 /* the TLS handshake waits for POLLIN or POLLOUT */
	bool rd_want_wr; /* SSL_read wants to write (a renegotiation) */
	enum state st;
	enum mode mode;
	bool asking_sentinel; /* this socket is to a sentinel */
	bool discover;	      /* this socket first asks CLUSTER SLOTS */
	int fd;
	redisReader *rd;
	struct cmd *head, *tail; /* every unanswered command, in the order sent */
	struct cmd *unsent;	 /* the first not completely written */
	size_t woff;		 /* bytes of unsent already written */
	bool wpend;		 /* TLS: SSL_write of unsent wants a retry (a record is committed) */
	int64_t wstart;		 /* when the write of unsent began */
	int64_t next_try, backoff, connect_at;
	bool need_load;
	int last_err, fatal;
	char err[300];
	uint64_t connects, rng, sockets, redirects;
	size_t n_user;
	struct ro_hostport target; /* the node of this socket */
	/* Cluster: known nodes (the seed first), the slot's owner among them (-1: unknown) */
	struct ro_hostport nodes[MAX_NODES];
	size_t n_nodes, next_seed;
	int owner;
	/* Sentinel: the primary they named */
	struct ro_hostport primary;
	bool have_primary;
	unsigned hops; /* redirections since the last answered command */
	char node_str[300];
	/* a host name being looked up without blocking (getaddrinfo_a) */
	struct lookup *lookup;
	int64_t lookup_poll;
	/* the addresses of the name, the next to try when a connect fails */
	struct addrinfo *addrs, *next_addr;
};

/* One name lookup in glibc's resolver thread. Owned by the connection until it ends; one
 * that cannot be cancelled when the connection gives up on it is left to finish on its own
 * (a few hundred bytes), so the resolver never writes into freed memory. */
struct lookup {
	struct gaicb cb;
	struct addrinfo hints;
	char host[256], port[8];
};

static int64_t mono_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t rng_next(struct ro_conn *c)
{
	c->rng ^= c->rng >> 12;
	c->rng ^= c->rng << 25;
	c->rng ^= c->rng >> 27;
	return c->rng * 2685821657736338717ull;
}

static char *dup_or_null(const char *s)
{
	return s && *s ? strdup(s) : NULL;
}

/* CRC16-XMODEM of the key, or of its {tag} when it has a non-empty one (Redis Cluster). */
unsigned ro_key_slot(const char *key, size_t len)
{
	const char *open = memchr(key, '{', len);
	unsigned crc = 0;

	if (open) {
		const char *close = memchr(open + 1, '}', len - (size_t)(open + 1 - key));

		if (close && close > open + 1) {
			len = (size_t)(close - open - 1);
			key = open + 1;
		}
	}
	for (size_t i = 0; i < len; i++) {
		crc ^= (unsigned)(unsigned char)key[i] << 8;
		for (int b = 0; b < 8; b++)
			crc = crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1;
		crc &= 0xffff;
	}
	return crc & 16383;
}

static int tls_setup(struct ro_conn *c, char *err, size_t errlen)
{
	const struct ro_conn_opts *o = &c->o;
	unsigned long e;
	char why[256];

	c->tls = SSL_CTX_new(TLS_client_method());
	if (!c->tls)
		return -ENOMEM;
	(void)SSL_CTX_set_min_proto_version(c->tls, TLS1_2_VERSION);
	SSL_CTX_set_verify(c->tls, SSL_VERIFY_PEER, NULL);
	SSL_CTX_set_mode(c->tls, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
	/* one read() takes what the socket has, not a record header and then its body:
	 * what is buffered is then seen by SSL_has_pending, not by poll() */
	SSL_CTX_set_read_ahead(c->tls, 1);
	ERR_clear_error();
	if (o->tls_ca && *o->tls_ca) {
		struct stat st;
		bool dir = !stat(o->tls_ca, &st) && S_ISDIR(st.st_mode);

		if (SSL_CTX_load_verify_locations(c->tls, dir ? NULL : o->tls_ca,
						  dir ? o->tls_ca : NULL) != 1)
			goto bad_ca;
	} else if (SSL_CTX_set_default_verify_paths(c->tls) != 1) {
		goto bad_ca;
	}
	if ((o->tls_cert && *o->tls_cert) != (o->tls_key && *o->tls_key)) {
		(void)snprintf(err, errlen, "redis TLS: a client certificate needs its key (%s)",
			       o->tls_cert && *o->tls_cert ? "redis-tls-key" : "redis-tls-cert");
		return -EINVAL;
	}
	if (o->tls_cert && *o->tls_cert) {
		if (SSL_CTX_use_certificate_chain_file(c->tls, o->tls_cert) != 1) {
			e = ERR_get_error();
			ERR_error_string_n(e, why, sizeof(why));
			(void)snprintf(err, errlen, "redis TLS: client certificate %s: %s",
				       o->tls_cert, why);
			return -EINVAL;
		}
		if (SSL_CTX_use_PrivateKey_file(c->tls, o->tls_key, SSL_FILETYPE_PEM) != 1 ||
		    SSL_CTX_check_private_key(c->tls) != 1) {
			e = ERR_get_error();
			ERR_error_string_n(e, why, sizeof(why));
			(void)snprintf(err, errlen, "redis TLS: client key %s: %s", o->tls_key, why);
			return -EINVAL;
		}
	}
	return 0;
bad_ca:
	e = ERR_get_error();
	ERR_error_string_n(e, why, sizeof(why));
	(void)snprintf(err, errlen, "redis TLS: CA %s: %s",
		       o->tls_ca && *o->tls_ca ? o->tls_ca : "(system store)", why);
	return -EINVAL;
}

static size_t add_node(struct ro_conn *c, const char *host, int port)
{
	for (size_t i = 0; i < c->n_nodes; i++)
		if (c->nodes[i].port == port && !strcmp(c->nodes[i].host, host))
			return i;
	if (c->n_nodes == MAX_NODES) {
		/* forget the oldest learned node (never the seeds) */
		size_t keep = c->url.n_hosts;

		memmove(&c->nodes[keep], &c->nodes[keep + 1],
			(MAX_NODES - keep - 1) * sizeof(c->nodes[0]));
		c->n_nodes--;
		if (c->owner > (int)keep)
			c->owner--;
		else if (c->owner == (int)keep)
			c->owner = -1;
	}
	(void)snprintf(c->nodes[c->n_nodes].host, sizeof(c->nodes[0].host), "%s", host);
	c->nodes[c->n_nodes].port = port;
	return c->n_nodes++;
}

int ro_conn_new(const struct ro_conn_opts *o, struct ro_conn **ret, char *err, size_t errlen)
{
	struct ro_conn *c = calloc(1, sizeof(*c));
	const struct ro_redis_url *u = o->url;
	int r = -ENOMEM;

	if (!c)
		return -ENOMEM;
	c->o = *o;
	c->o.url = NULL;
	c->fd = -1;
	c->owner = -1;
	c->url = *u;
	c->url.path = dup_or_null(u->path);
	c->url.user = dup_or_null(u->user);
	c->url.password = NULL;
	c->url.master = dup_or_null(u->master);
	c->password = dup_or_null(o->password && *o->password ? o->password : u->password);
	c->sentinel_password = dup_or_null(o->sentinel_password);
	c->name = dup_or_null(o->client_name);
	c->library = dup_or_null(o->library);
	c->library_version = dup_or_null(o->library_version);
	c->server_name = dup_or_null(o->tls_server_name);
	c->o.password = c->o.sentinel_password = c->o.client_name = NULL;
	c->o.library = c->o.library_version = c->o.tls_server_name = NULL;
	c->slot = o->slot_key ? ro_key_slot(o->slot_key, strlen(o->slot_key)) : 0;
	c->o.slot_key = NULL;
	if (!c->o.timeout_ms)
		c->o.timeout_ms = 5000;
	c->backoff = 25;
	c->last_err = -EIO;
	c->mode = u->sentinel ? M_SENTINEL : u->path || o->cluster == RO_REDIS_CLUSTER_NO
						 ? M_STANDALONE
						 : M_UNKNOWN;
	if (!u->sentinel)
		for (size_t i = 0; i < u->n_hosts; i++)
			(void)add_node(c, u->hosts[i].host, u->hosts[i].port);
	c->rng = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)mono_ms() ^ (uintptr_t)c;
	if (!c->rng)
		c->rng = 1;
	if ((u->path && !c->url.path) || (u->master && !c->url.master))
		goto fail;
	if (u->tls) {
		r = tls_setup(c, err, errlen);
		if (r)
			goto fail;
	}
	c->o.tls_ca = c->o.tls_cert = c->o.tls_key = NULL;
	*ret = c;
	return 0;
fail:
	(void)ro_conn_free(c);
	return r;
}

static void lookup_drop(struct ro_conn *c);

static void cmd_free(struct cmd *m)
{
	if (m->held)
		freeReplyObject(m->held);
	free(m->buf);
	free(m);
}

static void close_socket(struct ro_conn *c)
{
	if (c->ssl)
		SSL_free(c->ssl);
	c->ssl = NULL;
	if (c->fd >= 0)
		(void)close(c->fd);
	c->fd = -1;
	if (c->rd)
		redisReaderFree(c->rd);
	c->rd = NULL;
	c->rd_want_wr = false;
	c->wpend = false;
}

static void free_str(char *s)
{
	if (s) {
		explicit_bzero(s, strlen(s));
		free(s);
	}
}

struct ro_conn *ro_conn_free(struct ro_conn *c)
{
	if (!c)
		return NULL;
	lookup_drop(c);
	if (c->addrs)
		freeaddrinfo(c->addrs);
	close_socket(c);
	while (c->head) {
		struct cmd *m = c->head;

		c->head = m->next;
		if (m->fn)
			m->fn(m->arg, -ECANCELED, NULL, "connection closed", m->sent_at);
		cmd_free(m);
	}
	if (c->tls)
		SSL_CTX_free(c->tls);
	ro_redis_url_clear(&c->url);
	free_str(c->password);
	free_str(c->sentinel_password);
	free(c->name);
	free(c->library);
	free(c->library_version);
	free(c->server_name);
	free(c);
	return NULL;
}

/* ---- the command list --------------------------------------------------------------- */

static struct cmd *cmd_new(int argc, const char **argv, const size_t *lens, enum kind k)
{
	struct cmd *m = calloc(1, sizeof(*m));
	long long n;

	if (!m)
		return NULL;
	n = redisFormatCommandArgv(&m->buf, argc, argv, lens);
	if (n < 0) {
		free(m);
		return NULL;
	}
	m->len = (size_t)n;
	m->kind = k;
	{
		/* FCALL's function name, else the command's */
		int i = argc > 1 && lens[0] == 5 && !strncasecmp(argv[0], "FCALL", 5) ? 1 : 0;
		size_t l = lens[i] < sizeof(m->name) - 1 ? lens[i] : sizeof(m->name) - 1;

		memcpy(m->name, argv[i], l);
		m->name[l] = '\0';
	}
	return m;
}

static void append(struct ro_conn *c, struct cmd *m)
{
	if (c->tail)
		c->tail->next = m;
	else
		c->head = m;
	c->tail = m;
	if (!c->unsent)
		c->unsent = m;
}

int ro_conn_send(struct ro_conn *c, int argc, const char **argv, const size_t *lens,
		 int64_t deadline_ms, uint32_t block_ms, uint32_t wait_n, uint32_t wait_ms,
		 ro_conn_reply_fn fn, void *arg)
{
	struct cmd *m = cmd_new(argc, argv, lens, K_USER);

	if (!m)
		return -ENOMEM;
	if (wait_n) {
		/* WAIT goes in the same buffer: both are always written (and sent again)
		 * together, so WAIT counts this command's write on this connection */
		char n[16], ms[16], *w = NULL, *both;
		long long wl;

		(void)snprintf(n, sizeof(n), "%u", wait_n);
		(void)snprintf(ms, sizeof(ms), "%u", wait_ms);
		wl = redisFormatCommandArgv(&w, 3, (const char *[]){"WAIT", n, ms},
					    (size_t[]){4, strlen(n), strlen(ms)});
		both = wl > 0 ? realloc(m->buf, m->len + (size_t)wl) : NULL;
		if (!both) {
			free(w);
			cmd_free(m);
			return -ENOMEM;
		}
		memcpy(both + m->len, w, (size_t)wl);
		free(w);
		m->buf = both;
		m->len += (size_t)wl;
		m->wait_n = wait_n;
		m->wait_ms = wait_ms;
	}
	m->deadline = deadline_ms;
	m->block_ms = block_ms;
	m->fn = fn;
	m->arg = arg;
	append(c, m);
	c->n_user++;
	return 0;
}

/* Unlink m (which must be the head, or unsent and never written). */
static void unlink_cmd(struct ro_conn *c, struct cmd *m)
{
	struct cmd **p = &c->head, *prev = NULL;

	while (*p && *p != m) {
		prev = *p;
		p = &(*p)->next;
	}
	if (!*p)
		return;
	*p = m->next;
	if (c->tail == m)
		c->tail = prev;
	if (c->unsent == m)
		c->unsent = m->next;
	if (m->kind == K_USER)
		c->n_user--;
}

/* ---- failure and reconnection --------------------------------------------------------- */

/* The socket goes: internal and abandoned commands go, the rest wait (in order) to be sent
 * again on the next one. */
static void drop_socket(struct ro_conn *c)
{
	lookup_drop(c);
	if (c->addrs)
		freeaddrinfo(c->addrs);
	c->addrs = c->next_addr = NULL;
	close_socket(c);
	c->st = S_IDLE;
	for (struct cmd **p = &c->head; *p;) {
		struct cmd *m = *p;

		if (m->kind != K_USER || !m->fn) {
			*p = m->next;
			if (m->kind == K_USER)
				c->n_user--;
			cmd_free(m);
			continue;
		}
		m->sent_at = 0;
		m->got_first = false;
		if (m->held)
			freeReplyObject(m->held);
		m->held = NULL;
		p = &m->next;
	}
	c->tail = NULL;
	for (struct cmd *m = c->head; m; m = m->next)
		c->tail = m;
	c->unsent = c->head;
	c->woff = 0;
}

/* The connection failed (r, the message): reconnect after a jittered backoff, or at once;
 * F_REROUTE: the node may be gone, find the route again (the slot's owner from another
 * node, the primary from the sentinels). */
__attribute__((format(printf, 4, 5))) static void conn_fail(struct ro_conn *c, int r, int flags,
							    const char *fmt, ...)
{
	int64_t now = mono_ms();
	va_list ap;

	va_start(ap, fmt);
	(void)vsnprintf(c->err, sizeof(c->err), fmt, ap);
	va_end(ap);
	c->last_err = r;
	c->fatal = 0;
	drop_socket(c);
	if (flags & F_REROUTE) {
		c->owner = -1;
		c->have_primary = false;
	}
	if (flags & F_AT_ONCE) {
		c->next_try = now;
	} else {
		/* full jitter in [backoff/2, backoff*3/2) keeps a fleet from reconnecting in step
		 */
		c->next_try = now + c->backoff / 2 + (int64_t)(rng_next(c) % (uint64_t)c->backoff);
		if (c->backoff < 1000)
			c->backoff *= 2;
	}
}

/* A permanent cause: no retry fixes it without a change (still retried, slowly). */
__attribute__((format(printf, 3, 4))) static void conn_fatal(struct ro_conn *c, int r,
							     const char *fmt, ...)
{
	char msg[300];
	va_list ap;

	va_start(ap, fmt);
	(void)vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	c->backoff = 1000;
	conn_fail(c, r, 0, "%s", msg);
	c->fatal = r;
}

/* Follow a redirection: a new socket at once to the new route (a loop backs off). */
static void reroute_now(struct ro_conn *c, const char *why)
{
	c->redirects++;
	if (++c->hops > 8) {
		conn_fail(c, -EAGAIN, 0, "redis: %s (redirected %u times without an answer)", why,
			  c->hops);
		return;
	}
	drop_socket(c);
	c->next_try = mono_ms();
}

static void push_internal(struct ro_conn *c, struct cmd **tail, enum kind k, int argc,
			  const char **argv)
{
	size_t lens[8];
	struct cmd *m;

	for (int i = 0; i < argc; i++)
		lens[i] = strlen(argv[i]);
	m = cmd_new(argc, argv, lens, k);
	if (!m)
		return; /* the handshake then fails on the missing reply's timeout */
	/* internal commands go before every user command, in the order pushed */
	if (!*tail) {
		m->next = c->head;
		c->head = m;
	} else {
		m->next = (*tail)->next;
		(*tail)->next = m;
	}
	if (c->tail == *tail)
		c->tail = m;
	*tail = m;
	c->unsent = c->head;
}

static void handshake_done(struct ro_conn *c)
{
	if (c->head && c->head->kind != K_USER)
		return;
	c->st = S_READY;
	c->connects++;
	c->backoff = 25;
	c->err[0] = '\0';
	c->fatal = 0;
}

/* What follows the route checks: SELECT, CLIENT SETNAME, the library. */
static void push_rest(struct ro_conn *c, struct cmd **t)
{
	char db[16];

	if (c->url.db && c->mode != M_CLUSTER) {
		(void)snprintf(db, sizeof(db), "%d", c->url.db);
		push_internal(c, t, K_SELECT, 2, (const char *[]){"SELECT", db});
	}
	if (c->name)
		push_internal(c, t, K_NAME, 3, (const char *[]){"CLIENT", "SETNAME", c->name});
	if (c->library) {
		if (c->need_load)
			push_internal(c, t, K_LOAD, 4,
				      (const char *[]){"FUNCTION", "LOAD", "REPLACE", c->library});
		else
			push_internal(c, t, K_VERSION, 3,
				      (const char *[]){"FCALL", "ro_version", "0"});
	}
}

static void start_handshake(struct ro_conn *c)
{
	struct cmd *t = NULL;

	c->st = S_HANDSHAKE;
	c->rd = redisReaderCreate();
	if (!c->rd) {
		conn_fail(c, -ENOMEM, 0, "redis: %s", "out of memory");
		return;
	}
	if (c->asking_sentinel) {
		if (c->sentinel_password)
			push_internal(c, &t, K_AUTH, 2,
				      (const char *[]){"AUTH", c->sentinel_password});
		push_internal(c, &t, K_SENTINEL, 3,
			      (const char *[]){"SENTINEL", "get-master-addr-by-name", c->url.master});
		return;
	}
	if (c->password || c->url.user) {
		const char *pw = c->password ? c->password : "";

		if (c->url.user)
			push_internal(c, &t, K_AUTH, 3, (const char *[]){"AUTH", c->url.user, pw});
		else
			push_internal(c, &t, K_AUTH, 2, (const char *[]){"AUTH", pw});
	}
	if (c->mode == M_SENTINEL)
		push_internal(c, &t, K_ROLE, 1, (const char *[]){"ROLE"});
	if (c->discover) {
		push_internal(c, &t, K_SLOTS, 2, (const char *[]){"CLUSTER", "SLOTS"});
		return; /* the rest once the route is known */
	}
	push_rest(c, &t);
	if (!t)
		handshake_done(c);
}

/* ---- TLS ------------------------------------------------------------------------------ */

static bool is_ip(const char *h)
{
	unsigned char b[16];

	return inet_pton(AF_INET, h, b) == 1 || inet_pton(AF_INET6, h, b) == 1;
}

static void tls_fail(struct ro_conn *c, int ret)
{
	int e = SSL_get_error(c->ssl, ret);
	long v = SSL_get_verify_result(c->ssl);
	unsigned long ee = ERR_peek_last_error();
	char why[256] = "";

	if (v != X509_V_OK) {
		conn_fatal(c, -EINVAL,
			   "redis TLS to %s:%d: server certificate not trusted: %s (check "
			   "redis-tls-ca and redis-tls-server-name)",
			   c->target.host, c->target.port, X509_verify_cert_error_string(v));
		return;
	}
	if (ee)
		ERR_error_string_n(ee, why, sizeof(why));
	else if (e == SSL_ERROR_SYSCALL)
		(void)snprintf(why, sizeof(why), "%s",
			       errno ? strerror(errno) : "connection closed by the server");
	else
		(void)snprintf(why, sizeof(why), "SSL error %d", e);
	if (ee && ERR_GET_LIB(ee) == ERR_LIB_SSL &&
	    (ERR_GET_REASON(ee) == SSL_R_WRONG_VERSION_NUMBER ||
	     ERR_GET_REASON(ee) == SSL_R_UNSUPPORTED_PROTOCOL))
		conn_fatal(c, -EINVAL, "redis TLS to %s:%d: %s (is this a TLS port?)",
			   c->target.host, c->target.port, why);
	else
		conn_fail(c, -EIO, F_REROUTE, "redis TLS to %s:%d: %s", c->target.host,
			  c->target.port, why);
}

static void tls_step(struct ro_conn *c)
{
	int ret;

	ERR_clear_error();
	errno = 0;
	ret = SSL_connect(c->ssl);
	if (ret == 1) {
		start_handshake(c);
		return;
	}
	switch (SSL_get_error(c->ssl, ret)) {
	case SSL_ERROR_WANT_READ:
		c->tls_want = POLLIN;
		return;
	case SSL_ERROR_WANT_WRITE:
		c->tls_want = POLLOUT;
		return;
	default:
		tls_fail(c, ret);
	}
}

static void tls_start(struct ro_conn *c)
{
	const char *name = c->server_name ? c->server_name : c->target.host;
	X509_VERIFY_PARAM *vp;

	c->ssl = SSL_new(c->tls);
	if (!c->ssl || SSL_set_fd(c->ssl, c->fd) != 1) {
		conn_fail(c, -ENOMEM, 0, "redis TLS: %s", "out of memory");
		return;
	}
	SSL_set_connect_state(c->ssl);
	vp = SSL_get0_param(c->ssl);
	if (is_ip(name)) {
		(void)X509_VERIFY_PARAM_set1_ip_asc(vp, name);
	} else {
		(void)SSL_set_tlsext_host_name(c->ssl, name);
		(void)X509_VERIFY_PARAM_set1_host(vp, name, 0);
	}
	c->st = S_TLS;
	tls_step(c);
}

static void connected(struct ro_conn *c)
{
	if (c->tls)
		tls_start(c);
	else
		start_handshake(c);
}

/* ---- choosing the node and connecting ------------------------------------------------- */

static void choose_target(struct ro_conn *c)
{
	c->asking_sentinel = c->discover = false;
	if (c->mode == M_SENTINEL) {
		if (c->have_primary) {
			c->target = c->primary;
		} else {
			c->target = c->url.hosts[c->next_seed++ % c->url.n_hosts];
			c->asking_sentinel = true;
		}
	} else if (c->mode == M_CLUSTER || c->mode == M_UNKNOWN) {
		if (c->owner >= 0) {
			c->target = c->nodes[c->owner];
		} else {
			c->target = c->nodes[c->next_seed++ % c->n_nodes];
			c->discover = true;
		}
		if (c->mode == M_UNKNOWN)
			c->discover = true;
	} else {
		c->target = c->url.hosts[0];
	}
}

static void free_addrs(struct ro_conn *c)
{
	if (c->addrs)
		freeaddrinfo(c->addrs);
	c->addrs = c->next_addr = NULL;
}

/* A socket to the next address and its non-blocking connect (a name's addresses are
 * tried in turn: localhost may be ::1 first while the server listens on 127.0.0.1). */
static void connect_next(struct ro_conn *c)
{
	for (;;) {
		const struct addrinfo *ai = c->next_addr;
		int one = 1, r;

		if (!ai) {
			free_addrs(c);
			conn_fail(c, -EIO, F_REROUTE, "redis connect %s: %s", ro_conn_node(c),
				  "no address");
			return;
		}
		c->next_addr = ai->ai_next;
		c->sockets++;
		c->fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (c->fd < 0) {
			free_addrs(c);
			conn_fail(c, -EIO, 0, "redis connect: %s", strerror(errno));
			return;
		}
		(void)setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		(void)setsockopt(c->fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
		r = connect(c->fd, ai->ai_addr, ai->ai_addrlen);
		if (r == 0) {
			free_addrs(c);
			connected(c);
			return;
		}
		if (errno == EINPROGRESS || errno == EAGAIN) {
			c->st = S_CONNECTING;
			return;
		}
		if (!c->next_addr) {
			int e = errno;

			free_addrs(c);
			conn_fail(c, e == ETIMEDOUT ? -ETIMEDOUT : -EIO, F_REROUTE,
				  "redis connect %s: %s", ro_conn_node(c), strerror(e));
			return;
		}
		(void)close(c->fd);
		c->fd = -1;
	}
}

static void connect_addrs(struct ro_conn *c, struct addrinfo *ai)
{
	free_addrs(c);
	c->addrs = c->next_addr = ai;
	connect_next(c);
}

/* Give up a lookup: cancelled, or (still running in the resolver) left to finish. */
static void lookup_drop(struct ro_conn *c)
{
	struct lookup *l = c->lookup;

	c->lookup = NULL;
	if (!l)
		return;
	if (gai_error(&l->cb) == EAI_INPROGRESS && gai_cancel(&l->cb) != EAI_CANCELED)
		return; /* the resolver still writes into it: not ours to free */
	if (l->cb.ar_result)
		freeaddrinfo(l->cb.ar_result);
	free(l);
}

/* The lookup's end (or not yet): connect to its first address. */
static void lookup_step(struct ro_conn *c, int64_t now)
{
	struct lookup *l = c->lookup;
	int r = gai_error(&l->cb);

	if (r == EAI_INPROGRESS) {
		if (now >= c->connect_at + c->o.timeout_ms) {
			lookup_drop(c);
			conn_fail(c, -ETIMEDOUT, F_REROUTE, "redis connect %s: %s", ro_conn_node(c),
				  "name lookup timed out");
		} else if (c->lookup_poll < 50) {
			c->lookup_poll *= 2;
		}
		return;
	}
	if (r) {
		lookup_drop(c);
		conn_fail(c, -EIO, F_REROUTE, "redis connect %s: %s", ro_conn_node(c),
			  gai_strerror(r));
		return;
	}
	{
		struct addrinfo *ai = l->cb.ar_result;

		l->cb.ar_result = NULL;
		lookup_drop(c);
		connect_addrs(c, ai);
	}
}

static void start_connect(struct ro_conn *c)
{
	c->connect_at = mono_ms();
	if (c->url.path) {
		struct sockaddr_un sa = {.sun_family = AF_UNIX};
		int r;

		if (strlen(c->url.path) >= sizeof(sa.sun_path)) {
			conn_fatal(c, -EINVAL, "redis connect: %s", "socket path too long");
			return;
		}
		(void)strcpy(sa.sun_path, c->url.path);
		c->sockets++;
		c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (c->fd < 0) {
			conn_fail(c, -EIO, 0, "redis connect: %s", strerror(errno));
			return;
		}
		r = connect(c->fd, (struct sockaddr *)&sa, sizeof(sa));
		if (r == 0)
			connected(c);
		else if (errno == EINPROGRESS || errno == EAGAIN)
			c->st = S_CONNECTING;
		else
			conn_fail(c, -EIO, 0, "redis connect %s: %s", c->url.path, strerror(errno));
	} else {
		struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST};
		struct addrinfo *ai = NULL;
		struct lookup *l;
		char port[8];
		int r;

		choose_target(c);
		(void)snprintf(port, sizeof(port), "%d", c->target.port);
		/* an address: at once */
		r = getaddrinfo(c->target.host, port, &hints, &ai);
		if (r == 0) {
			connect_addrs(c, ai);
			return;
		}
		if (r != EAI_NONAME) {
			conn_fail(c, -EIO, F_REROUTE, "redis connect %s: %s", ro_conn_node(c),
				  gai_strerror(r));
			return;
		}
		/* a name: looked up in glibc's resolver thread, bounded by the connect timeout */
		l = calloc(1, sizeof(*l));
		if (!l) {
			conn_fail(c, -ENOMEM, 0, "redis connect: %s", "out of memory");
			return;
		}
		(void)snprintf(l->host, sizeof(l->host), "%s", c->target.host);
		(void)snprintf(l->port, sizeof(l->port), "%s", port);
		l->hints.ai_socktype = SOCK_STREAM;
		l->cb.ar_name = l->host;
		l->cb.ar_service = l->port;
		l->cb.ar_request = &l->hints;
		{
			struct gaicb *list[1] = {&l->cb};

			r = getaddrinfo_a(GAI_NOWAIT, list, 1, NULL);
		}
		if (r) {
			free(l);
			conn_fail(c, -EIO, F_REROUTE, "redis connect %s: %s", ro_conn_node(c),
				  gai_strerror(r));
			return;
		}
		c->lookup = l;
		c->lookup_poll = 1;
		c->st = S_RESOLVING;
		lookup_step(c, mono_ms());
	}
}

/* ---- replies ------------------------------------------------------------------------ */

static bool starts(const char *s, const char *p)
{
	return !strncmp(s, p, strlen(p));
}

/* Worth another try later, on this route: a server loading, busy, out of memory, a slot
 * being migrated (ASK: the queue's functions touch keys of the whole slot, which must not
 * run while half of them are elsewhere: they wait for the migration's MOVED), a cluster
 * still electing. */
static bool transient(const char *s)
{
	return starts(s, "LOADING") || starts(s, "BUSY") || starts(s, "MASTERDOWN") ||
	       starts(s, "TRYAGAIN") || starts(s, "ASK ") || starts(s, "CLUSTERDOWN") ||
	       starts(s, "OOM") || strstr(s, "non local key") || strstr(s, "UNBLOCKED") ||
	       starts(s, "ERR max number of clients reached");
}

static bool auth_error(const char *s)
{
	return starts(s, "WRONGPASS") || starts(s, "NOAUTH") || starts(s, "NOPERM") ||
	       (starts(s, "ERR") && strstr(s, "AUTH") && strstr(s, "password"));
}

static bool no_functions(const char *s)
{
	return starts(s, "ERR unknown command") &&
	       (strcasestr(s, "'fcall'") || strcasestr(s, "'function'"));
}

/* MOVED <slot> <host>:<port>: the slot's owner is elsewhere now. */
static bool follow_moved(struct ro_conn *c, const char *s)
{
	const char *sp = strchr(s + 6, ' '), *colon;
	char host[256];
	long port;

	if (!sp)
		return false;
	sp++;
	colon = strrchr(sp, ':');
	if (!colon || (size_t)(colon - sp) >= sizeof(host))
		return false;
	port = strtol(colon + 1, NULL, 10);
	if (port <= 0 || port > 65535)
		return false;
	if (colon == sp) /* an unknown endpoint: the same host */
		(void)snprintf(host, sizeof(host), "%s", c->target.host);
	else
		(void)snprintf(host, sizeof(host), "%.*s", (int)(colon - sp), sp);
	c->mode = M_CLUSTER;
	c->owner = (int)add_node(c, host, (int)port);
	reroute_now(c, s);
	return true;
}

/* An error that the connection handles itself (true: handled, the socket may be gone). */
static bool route_error(struct ro_conn *c, const char *s)
{
	if (starts(s, "MOVED ") && follow_moved(c, s))
		return true;
	if (starts(s, "READONLY")) {
		/* a replica now: a failover happened */
		c->redirects++;
		conn_fail(c, -EAGAIN, F_REROUTE, "redis %s: %s", ro_conn_node(c), s);
		return true;
	}
	if (transient(s)) {
		conn_fail(c, -EAGAIN, 0, "redis %s: %s", ro_conn_node(c), s);
		return true;
	}
	if (auth_error(s)) {
		conn_fatal(c, -EACCES, "redis %s%s%s: %s", ro_conn_node(c),
			   c->url.user ? " as user " : "", c->url.user ? c->url.user : "", s);
		return true;
	}
	if (no_functions(s)) {
		conn_fatal(c, -ENOTSUP, "redis %s: %s: the queue needs Redis 7 functions",
			   ro_conn_node(c), s);
		return true;
	}
	return false;
}

/* CLUSTER SLOTS: the owner of our slot, and every node as a seed for later. */
static void slots_reply(struct ro_conn *c, redisReply *rep)
{
	struct cmd *t = NULL;
	int owner = -1;
	struct ro_hostport own = {.port = 0};

	if (rep->type == REDIS_REPLY_ERROR) {
		if (strstr(rep->str, "cluster support disabled") ||
		    starts(rep->str, "ERR unknown command")) {
			if (c->o.cluster == RO_REDIS_CLUSTER_YES) {
				conn_fatal(c, -EINVAL,
					   "redis %s: redis-cluster = yes, but it is not a cluster "
					   "node (%s)",
					   ro_conn_node(c), rep->str);
				return;
			}
			c->mode = M_STANDALONE;
			push_rest(c, &t);
			handshake_done(c);
			return;
		}
		if (starts(rep->str, "NOPERM") && c->o.cluster == RO_REDIS_CLUSTER_AUTO) {
			/* a user without CLUSTER: take it as one server (a MOVED would still
			 * switch to cluster routing) */
			c->mode = M_STANDALONE;
			push_rest(c, &t);
			handshake_done(c);
			return;
		}
		if (starts(rep->str, "NOPERM")) {
			conn_fatal(c, -EACCES,
				   "redis %s: CLUSTER SLOTS: %s (grant the worker +cluster|slots, or "
				   "set redis-cluster = no)",
				   ro_conn_node(c), rep->str);
			return;
		}
		if (!route_error(c, rep->str))
			conn_fail(c, -EIO, F_REROUTE, "redis %s: CLUSTER SLOTS: %s", ro_conn_node(c),
				  rep->str);
		return;
	}
	if (rep->type != REDIS_REPLY_ARRAY) {
		conn_fail(c, -EPROTO, F_REROUTE, "redis %s: %s", ro_conn_node(c),
			  "unexpected reply to CLUSTER SLOTS");
		return;
	}
	if (c->url.db) {
		conn_fatal(c, -EINVAL,
			   "redis %s: db %d in the URL, but a Redis Cluster has only db 0 (drop "
			   "/%d)",
			   ro_conn_node(c), c->url.db, c->url.db);
		return;
	}
	c->mode = M_CLUSTER;
	for (size_t i = 0; i < rep->elements; i++) {
		const redisReply *e = rep->element[i];

		if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
		    e->element[0]->type != REDIS_REPLY_INTEGER ||
		    e->element[1]->type != REDIS_REPLY_INTEGER)
			continue;
		for (size_t j = 2; j < e->elements; j++) {
			const redisReply *n = e->element[j];
			const char *host;
			size_t idx;

			if (n->type != REDIS_REPLY_ARRAY || n->elements < 2 ||
			    n->element[0]->type != REDIS_REPLY_STRING ||
			    n->element[1]->type != REDIS_REPLY_INTEGER)
				continue;
			host = n->element[0]->len && strcmp(n->element[0]->str, "?")
				   ? n->element[0]->str
				   : c->target.host;
			idx = add_node(c, host, (int)n->element[1]->integer);
			if (j == 2 && (long long)c->slot >= e->element[0]->integer &&
			    (long long)c->slot <= e->element[1]->integer) {
				/* by address: a later add_node may shift or evict indices */
				(void)snprintf(own.host, sizeof(own.host), "%s", host);
				own.port = (int)n->element[1]->integer;
				owner = (int)idx;
			}
		}
	}
	if (owner >= 0)
		owner = (int)add_node(c, own.host, own.port);
	if (owner < 0) {
		conn_fail(c, -EAGAIN, F_REROUTE,
			  "redis cluster (asked %s): no node serves slot %u (is the cluster down?)",
			  ro_conn_node(c), c->slot);
		return;
	}
	c->owner = owner;
	if (c->nodes[owner].port != c->target.port || strcmp(c->nodes[owner].host, c->target.host)) {
		reroute_now(c, "the queue's slot is on another node");
		return;
	}
	push_rest(c, &t);
	handshake_done(c);
}

/* SENTINEL get-master-addr-by-name: the primary, then a socket to it. */
static void sentinel_reply(struct ro_conn *c, redisReply *rep)
{
	if (rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
	    rep->element[0]->type == REDIS_REPLY_STRING && rep->element[1]->type == REDIS_REPLY_STRING) {
		long port = strtol(rep->element[1]->str, NULL, 10);

		if (port > 0 && port < 65536) {
			bool same = c->have_primary || !c->primary.port ||
				    (c->primary.port == port &&
				     !strcmp(c->primary.host, rep->element[0]->str));

			(void)snprintf(c->primary.host, sizeof(c->primary.host), "%s",
				       rep->element[0]->str);
			c->primary.port = (int)port;
			c->have_primary = true;
			if (!same)
				c->redirects++;
			drop_socket(c);
			c->next_try = mono_ms();
			return;
		}
	}
	if (rep->type == REDIS_REPLY_ERROR && auth_error(rep->str)) {
		conn_fatal(c, -EACCES, "redis sentinel %s: %s (redis-sentinel-password)",
			   ro_conn_node(c), rep->str);
		return;
	}
	conn_fail(c, -EAGAIN, 0, "redis sentinel %s: %s \"%s\"", ro_conn_node(c),
		  rep->type == REDIS_REPLY_ERROR ? rep->str : "does not know the primary",
		  c->url.master);
}

static void handshake_reply(struct ro_conn *c, struct cmd *m, redisReply *rep)
{
	bool is_err = rep->type == REDIS_REPLY_ERROR;
	struct cmd *t = NULL;

	switch (m->kind) {
	case K_SLOTS:
		slots_reply(c, rep);
		return;
	case K_SENTINEL:
		sentinel_reply(c, rep);
		return;
	case K_AUTH:
		if (!is_err)
			break;
		if (transient(rep->str))
			conn_fail(c, -EAGAIN, 0, "redis %s: AUTH: %s", ro_conn_node(c), rep->str);
		else if (auth_error(rep->str) || starts(rep->str, "ERR"))
			conn_fatal(c, -EACCES, "redis %s: AUTH%s%s refused: %s", ro_conn_node(c),
				   c->asking_sentinel || !c->url.user ? "" : " as user ",
				   c->asking_sentinel || !c->url.user ? "" : c->url.user, rep->str);
		else if (!route_error(c, rep->str))
			conn_fail(c, -EIO, 0, "redis %s: AUTH: %s", ro_conn_node(c), rep->str);
		return;
	case K_ROLE:
		if (!is_err && rep->type == REDIS_REPLY_ARRAY && rep->elements &&
		    rep->element[0]->type == REDIS_REPLY_STRING &&
		    !strcmp(rep->element[0]->str, "master"))
			break;
		if (is_err && auth_error(rep->str)) {
			conn_fatal(c, -EACCES, "redis %s: ROLE: %s (grant the worker +role)",
				   ro_conn_node(c), rep->str);
			return;
		}
		c->redirects++;
		conn_fail(c, -EAGAIN, F_REROUTE,
			  "redis %s is not the primary of \"%s\" (now %s): asking the sentinels again",
			  ro_conn_node(c), c->url.master,
			  !is_err && rep->type == REDIS_REPLY_ARRAY && rep->elements &&
				  rep->element[0]->type == REDIS_REPLY_STRING
			      ? rep->element[0]->str
			      : "unknown");
		return;
	case K_SELECT:
		if (!is_err)
			break;
		if (strstr(rep->str, "cluster"))
			conn_fatal(c, -EINVAL,
				   "redis %s: db %d in the URL, but a Redis Cluster has only db 0",
				   ro_conn_node(c), c->url.db);
		else if (!route_error(c, rep->str))
			conn_fatal(c, -EINVAL, "redis %s: SELECT %d: %s", ro_conn_node(c),
				   c->url.db, rep->str);
		return;
	case K_NAME:
		break; /* a name is a convenience: a user without CLIENT SETNAME works */
	case K_VERSION:
		if (!is_err && rep->type == REDIS_REPLY_STRING && c->library_version &&
		    !strcmp(rep->str, c->library_version))
			break;
		if (is_err && (route_error(c, rep->str) || c->fd < 0))
			return;
		/* the server lacks this exact library: load it before anything else */
		push_internal(c, &t, K_LOAD, 4,
			      (const char *[]){"FUNCTION", "LOAD", "REPLACE", c->library});
		return;
	case K_LOAD:
		if (!is_err) {
			c->need_load = false;
			break;
		}
		if (starts(rep->str, "NOPERM")) {
			conn_fatal(c, -EACCES,
				   "redis %s: the queue's function library (version %s) is not "
				   "loaded and this user may not load it (%s): load it once as an "
				   "admin with `rolloutctl init`",
				   ro_conn_node(c), c->library_version ? c->library_version : "?",
				   rep->str);
			return;
		}
		if (!route_error(c, rep->str))
			conn_fail(c, -EIO, 0, "redis %s: FUNCTION LOAD: %s", ro_conn_node(c),
				  rep->str);
		return;
	case K_USER:
		break;
	}
	handshake_done(c);
}

/* A user command's reply (its own, then WAIT's when one follows it). */
static void user_reply(struct ro_conn *c, struct cmd *m, redisReply *rep)
{
	ro_conn_reply_fn fn = m->fn;
	int64_t sent = m->sent_at;
	void *arg = m->arg;

	if (!m->got_first && fn && rep->type == REDIS_REPLY_ERROR) {
		if (route_error(c, rep->str)) {
			freeReplyObject(rep);
			return;
		}
		if (!m->reloaded && strstr(rep->str, "Function not found")) {
			/* the server lost our library (flushed, or a new primary) */
			m->reloaded = true;
			c->need_load = true;
			conn_fail(c, -EAGAIN, F_AT_ONCE, "redis: %s", rep->str);
			freeReplyObject(rep);
			return;
		}
	}
	if (m->wait_n && !m->got_first) {
		m->got_first = true;
		m->held = rep;
		return;
	}
	c->hops = 0;
	unlink_cmd(c, m);
	if (m->wait_n) {
		/* rep is WAIT's: how many replicas have the write */
		long long got = rep->type == REDIS_REPLY_INTEGER ? rep->integer : -1;
		bool refused = rep->type == REDIS_REPLY_ERROR;
		redisReply *own = m->held;
		char why[200];

		(void)snprintf(why, sizeof(why), "WAIT refused: %s", refused ? rep->str : "");
		freeReplyObject(rep);
		m->held = NULL;
		if (own && own->type != REDIS_REPLY_ERROR && refused) {
			/* WAIT itself refused (NOPERM, a replica): not a shortfall to retry */
			freeReplyObject(own);
			if (fn)
				fn(arg, auth_error(why + 14) ? -EACCES : -EIO, NULL, why, sent);
			cmd_free(m);
			return;
		}
		if (own && own->type != REDIS_REPLY_ERROR && got < (long long)m->wait_n) {
			freeReplyObject(own);
			(void)snprintf(why, sizeof(why),
				       "not confirmed: WAIT %u %u: %lld replicas acknowledged",
				       m->wait_n, m->wait_ms, got);
			if (fn)
				fn(arg, -ETIMEDOUT, NULL, why, sent);
			cmd_free(m);
			return;
		}
		rep = own;
	}
	if (fn && rep)
		fn(arg, 0, rep, NULL, sent);
	else if (rep)
		freeReplyObject(rep);
	cmd_free(m);
}

/* One reply for the head of the list. */
static void dispatch(struct ro_conn *c, redisReply *rep)
{
	struct cmd *m = c->head;

	if (!m) {
		freeReplyObject(rep);
		conn_fail(c, -EPROTO, 0, "redis: %s", "a reply nobody asked for");
		return;
	}
	if (m->kind != K_USER) {
		unlink_cmd(c, m);
		handshake_reply(c, m, rep);
		freeReplyObject(rep);
		cmd_free(m);
		return;
	}
	user_reply(c, m, rep);
}

/* ---- the socket ------------------------------------------------------------------------ */

/* A TLS record layer failure after the handshake: the server's alert (a client
 * certificate it wants or refuses) is a configuration error; the connection is gone. */
static void tls_io_error(struct ro_conn *c)
{
	unsigned long ee = ERR_peek_last_error();
	char why[256] = "TLS error";

	if (ee)
		ERR_error_string_n(ee, why, sizeof(why));
	if (ee && ERR_GET_LIB(ee) == ERR_LIB_SSL &&
	    (strstr(why, "certificate required") || strstr(why, "bad certificate") ||
	     strstr(why, "unknown ca") || strstr(why, "certificate unknown")))
		conn_fatal(c, -EINVAL,
			   "redis TLS to %s:%d: the server refused the client certificate (%s): "
			   "check redis-tls-cert and redis-tls-key",
			   c->target.host, c->target.port, why);
	else
		conn_fail(c, -EIO, F_REROUTE, "redis TLS to %s:%d: %s", c->target.host,
			  c->target.port, why);
}

/* >0 bytes, 0 closed, -EAGAIN nothing now, -EPROTO (TLS: the connection already failed),
 * else -errno */
static ssize_t io_read(struct ro_conn *c, char *buf, size_t len)
{
	ssize_t n;

	if (c->ssl) {
		int ret, e;

		ERR_clear_error();
		errno = 0;
		ret = SSL_read(c->ssl, buf, (int)len);
		if (ret > 0)
			return ret;
		e = SSL_get_error(c->ssl, ret);
		if (e == SSL_ERROR_WANT_READ)
			return -EAGAIN;
		if (e == SSL_ERROR_WANT_WRITE) {
			c->rd_want_wr = true;
			return -EAGAIN;
		}
		if (e == SSL_ERROR_ZERO_RETURN || (e == SSL_ERROR_SYSCALL && !errno))
			return 0;
		tls_io_error(c);
		return -EPROTO;
	}
	n = read(c->fd, buf, len);
	if (n < 0)
		return errno == EINTR ? -EAGAIN : -errno;
	return n;
}

static ssize_t io_write(struct ro_conn *c, const char *buf, size_t len)
{
	ssize_t n;

	if (c->ssl) {
		int ret, e;

		ERR_clear_error();
		ret = SSL_write(c->ssl, buf, (int)len);
		if (ret > 0) {
			c->wpend = false;
			return ret;
		}
		e = SSL_get_error(c->ssl, ret);
		if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
			/* OpenSSL holds (part of) this buffer: the retry must be the same */
			c->wpend = true;
			return -EAGAIN;
		}
		tls_io_error(c);
		return -EPROTO;
	}
	n = send(c->fd, buf, len, MSG_NOSIGNAL);
	if (n < 0)
		return errno == EINTR ? -EAGAIN : -errno;
	return n;
}

/* The reply being read holds more than max_reply bytes in the reader (hiredis 0.14 has no
 * bound of its own; maxbuf only trims an idle buffer): it is someone's oversized value, and
 * the command that asked would get it again, so that command is answered -EMSGSIZE and not
 * sent again. The socket goes, the rest of the reply unread; every other command is sent
 * again on the next one. */
static void refuse_reply(struct ro_conn *c)
{
	struct cmd *m = c->head;
	char why[200];

	(void)snprintf(why, sizeof(why), "redis %s: the reply to %s is longer than %zu bytes: refused",
		       ro_conn_node(c), m ? m->name : "?", c->o.max_reply);
	if (!m || m->kind != K_USER) {
		conn_fail(c, -EMSGSIZE, 0, "%s", why);
		return;
	}
	{
		ro_conn_reply_fn fn = m->fn;
		void *arg = m->arg;
		int64_t sent = m->sent_at;

		unlink_cmd(c, m);
		conn_fail(c, -EMSGSIZE, F_AT_ONCE, "%s", why);
		cmd_free(m);
		if (fn)
			fn(arg, -EMSGSIZE, NULL, why, sent);
	}
}

static void do_read(struct ro_conn *c)
{
	char buf[16384];

	c->rd_want_wr = false;
	for (int rounds = 0; rounds < 64 && c->fd >= 0; rounds++) {
		ssize_t n = io_read(c, buf, sizeof(buf));

		if (n == 0) {
			conn_fail(c, -EIO, F_REROUTE, "redis %s: %s", ro_conn_node(c),
				  "connection closed by the server");
			return;
		}
		if (n == -EAGAIN || n == -EPROTO)
			return;
		if (n < 0) {
			conn_fail(c, -EIO, F_REROUTE, "redis %s: %s", ro_conn_node(c),
				  strerror((int)-n));
			return;
		}
		if (redisReaderFeed(c->rd, buf, (size_t)n) != REDIS_OK) {
			conn_fail(c, -EPROTO, 0, "redis: %s", "bad reply");
			return;
		}
		for (;;) {
			void *rep = NULL;

			if (redisReaderGetReply(c->rd, &rep) != REDIS_OK) {
				conn_fail(c, -EPROTO, 0, "redis: protocol error: %s",
					  c->rd ? c->rd->errstr : "");
				return;
			}
			if (!rep)
				break;
			dispatch(c, rep);
			if (c->fd < 0)
				return;
		}
		if (c->o.max_reply && c->rd->len - c->rd->pos > c->o.max_reply) {
			refuse_reply(c);
			return;
		}
		if ((size_t)n < sizeof(buf) && (!c->ssl || !SSL_has_pending(c->ssl)))
			return;
	}
}

static void do_read(struct ro_conn *c);

static bool can_write(const struct ro_conn *c)
{
	return c->unsent && (c->st == S_READY || c->unsent->kind != K_USER);
}

static void do_write(struct ro_conn *c)
{
	while (c->fd >= 0 && can_write(c)) {
		struct cmd *m = c->unsent;
		ssize_t n;

		if (!c->woff && !c->wpend)
			c->wstart = mono_ms();
		n = io_write(c, m->buf + c->woff, m->len - c->woff);

		if (n == -EAGAIN || n == -EPROTO)
			return;
		if (n < 0) {
			/* a server that refuses a client (max clients, a protocol error) says why
			 * and closes: what it said is read first, so the error names the cause,
			 * not the reset our write ran into */
			if (!c->ssl) {
				do_read(c);
				if (c->fd < 0)
					return;
			}
			conn_fail(c, -EIO, F_REROUTE, "redis %s: send: %s", ro_conn_node(c),
				  strerror((int)-n));
			return;
		}
		c->woff += (size_t)n;
		if (c->woff < m->len && !c->ssl)
			return; /* the socket is full (TLS: one record went, try the next) */
		if (c->woff < m->len)
			continue;
		c->woff = 0;
		c->unsent = m->next;
		m->sent_at = m->written_at = mono_ms();
		if (c->o.after_send && m->kind == K_USER)
			c->o.after_send(c->o.after_send_arg, m->name, c->fd);
	}
}

/* Answer every command past its deadline with the connection's last error. One already
 * written stays in the list without a caller, so the next reply still finds its owner. */
static void expire(struct ro_conn *c, int64_t now)
{
	for (struct cmd *m = c->head, *next; m; m = next) {
		bool down = c->st != S_READY && c->err[0];
		ro_conn_reply_fn fn = m->fn;
		void *arg = m->arg;
		char why[320];
		int64_t sent;
		bool partial;
		int r;

		next = m->next;
		if (m->kind != K_USER || !fn || m->deadline > now)
			continue;
		r = !down					       ? -ETIMEDOUT
		    : c->last_err == -EAGAIN || c->last_err == -EPROTO ? -EIO
								       : c->last_err;
		(void)snprintf(why, sizeof(why), "%s", down ? c->err : "redis: no reply in time");
		m->fn = NULL;
		partial = m == c->unsent && (c->woff || c->wpend);
		sent = m->sent_at ? m->sent_at : m->written_at;
		if (!sent && partial)
			sent = now; /* partly written: it is finished, and may run */
		if (!m->sent_at && !partial) {
			unlink_cmd(c, m);
			cmd_free(m);
		}
		fn(arg, r, NULL, why, sent);
	}
}

static bool has_user_work(const struct ro_conn *c)
{
	for (const struct cmd *m = c->head; m; m = m->next)
		if (m->kind == K_USER && m->fn)
			return true;
	return false;
}

/* The oldest written command still waiting for its reply: its wait is bounded. */
static int64_t reply_due(const struct ro_conn *c)
{
	for (const struct cmd *m = c->head; m && m != c->unsent; m = m->next)
		if (m->sent_at)
			return m->sent_at + c->o.timeout_ms + m->block_ms + m->wait_ms;
	/* a write the server stopped taking is bounded too */
	if (c->unsent && (c->woff || c->wpend))
		return c->wstart + c->o.timeout_ms;
	return -1;
}

int ro_conn_fd(const struct ro_conn *c)
{
	return c->fd;
}

short ro_conn_events(const struct ro_conn *c)
{
	if (c->fd < 0)
		return 0;
	if (c->st == S_CONNECTING)
		return POLLOUT;
	if (c->st == S_TLS)
		return c->tls_want;
	return (short)(POLLIN | (can_write(c) || c->rd_want_wr ? POLLOUT : 0));
}

static int64_t min_t(int64_t a, int64_t b)
{
	return a < 0 ? b : b < 0 ? a : a < b ? a : b;
}

int64_t ro_conn_next_ms(const struct ro_conn *c)
{
	int64_t t = -1;

	if (c->ssl && c->st >= S_HANDSHAKE && SSL_has_pending(c->ssl))
		return mono_ms(); /* bytes wait inside OpenSSL, not on the socket */
	for (const struct cmd *m = c->head; m; m = m->next)
		if (m->kind == K_USER && m->fn)
			t = min_t(t, m->deadline);
	if (c->st == S_IDLE && has_user_work(c))
		t = min_t(t, c->next_try);
	if (c->st == S_CONNECTING || c->st == S_TLS || c->st == S_HANDSHAKE)
		t = min_t(t, c->connect_at + c->o.timeout_ms);
	if (c->st == S_RESOLVING) /* glibc's lookup ends without a descriptor to watch */
		t = min_t(t, mono_ms() + c->lookup_poll);
	return min_t(t, reply_due(c));
}

void ro_conn_process(struct ro_conn *c, short revents)
{
	int64_t now, due;

	if (c->st == S_RESOLVING)
		lookup_step(c, mono_ms());
	if (c->st == S_CONNECTING && (revents & (POLLOUT | POLLERR | POLLHUP))) {
		int err = 0;
		socklen_t l = sizeof(err);

		bool bad = getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &l) || err;

		if (bad && c->next_addr) {
			(void)close(c->fd); /* the name's next address */
			c->fd = -1;
			connect_next(c);
		} else if (bad) {
			free_addrs(c);
			conn_fail(c, err == ETIMEDOUT ? -ETIMEDOUT : -EIO, F_REROUTE,
				  "redis connect %s: %s", ro_conn_node(c), strerror(err ? err : errno));
		} else {
			free_addrs(c);
			connected(c);
		}
	} else if (c->st == S_TLS && revents) {
		tls_step(c);
	}
	if (c->fd >= 0 && c->st >= S_HANDSHAKE &&
	    ((revents & (POLLIN | POLLHUP | POLLERR)) || (c->ssl && SSL_has_pending(c->ssl)) ||
	     (c->rd_want_wr && (revents & POLLOUT))))
		do_read(c);
	if (c->fd >= 0 && c->st >= S_HANDSHAKE)
		do_write(c);
	now = mono_ms();
	if ((c->st == S_CONNECTING || c->st == S_TLS || c->st == S_HANDSHAKE) &&
	    now >= c->connect_at + c->o.timeout_ms)
		conn_fail(c, -ETIMEDOUT, F_REROUTE, "redis connect %s: %s", ro_conn_node(c),
			  "timed out");
	due = reply_due(c);
	if (c->fd >= 0 && due >= 0 && now >= due)
		conn_fail(c, -ETIMEDOUT, F_REROUTE, "redis %s: %s", ro_conn_node(c),
			  "no reply in time");
	expire(c, now);
	for (int i = 0; i < 4 && c->st == S_IDLE && has_user_work(c) && now >= c->next_try; i++) {
		/* a redirection connects again at once (a few hops at most here) */
		start_connect(c);
		if (c->fd >= 0 && c->st >= S_HANDSHAKE)
			do_write(c);
		now = mono_ms();
	}
}

size_t ro_conn_pending(const struct ro_conn *c)
{
	size_t n = 0;

	for (const struct cmd *m = c->head; m; m = m->next)
		if (m->kind == K_USER && m->fn)
			n++;
	return n;
}

uint64_t ro_conn_connects(const struct ro_conn *c)
{
	return c->connects;
}

bool ro_conn_ready(const struct ro_conn *c)
{
	return c->st == S_READY;
}

const char *ro_conn_errmsg(const struct ro_conn *c)
{
	return c->err;
}

uint64_t ro_conn_sockets(const struct ro_conn *c)
{
	return c->sockets;
}

int ro_conn_fatal(const struct ro_conn *c)
{
	return c->fatal;
}

const char *ro_conn_mode(const struct ro_conn *c)
{
	static const char *const names[] = {"unknown", "standalone", "cluster", "sentinel"};

	return names[c->mode];
}

const char *ro_conn_node(const struct ro_conn *c)
{
	struct ro_conn *w = (struct ro_conn *)c; /* a cache of the text only */

	if (c->url.path)
		(void)snprintf(w->node_str, sizeof(w->node_str), "%s", c->url.path);
	else if (strchr(c->target.host, ':'))
		(void)snprintf(w->node_str, sizeof(w->node_str), "[%s]:%d", c->target.host,
			       c->target.port);
	else if (c->target.port)
		(void)snprintf(w->node_str, sizeof(w->node_str), "%s:%d", c->target.host,
			       c->target.port);
	else
		(void)snprintf(w->node_str, sizeof(w->node_str), "%s:%d", c->url.hosts[0].host,
			       c->url.hosts[0].port);
	return c->node_str;
}

uint64_t ro_conn_redirects(const struct ro_conn *c)
{
	return c->redirects;
}
