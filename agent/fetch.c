/* The policy-weights fetcher: manifests (JSON, directory walks, S3 listings), in-place
 * verification of file:// policies, and the download engine for s3:// and https:// ones:
 * ranged GETs on one curl multi handle, each chunk written at its offset, a dropped
 * transfer resumed from the byte it reached, every file hashed in order as its chunks
 * complete, the version directory renamed into the cache only when all of it is right. */
#include "agent/fetch.h"
#include "agent/fetch_internal.h"

#include <ctype.h>
#include <curl/curl.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_PARALLEL 8
#define DEFAULT_CHUNK (8ull << 20)
#define DEFAULT_KEEP 2
#define MAX_RETRIES 6		  /* per request, after the first try */
#define BACKOFF_MS 100		  /* doubled per retry, jittered, at most 3.2 s */
#define MAX_META_BODY (64u << 20) /* manifest.json, one listing page */
#define UNKNOWN UINT64_MAX
#define EMPTY_SHA256 "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

/* ---- small things ------------------------------------------------------------------------ */

static int64_t mono_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int failf(char *err, size_t errlen, int r, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int failf(char *err, size_t errlen, int r, const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		(void)vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return r;
}

static bool cancelled(const struct ro_fetch_opts *o)
{
	return o->cancel && *o->cancel;
}

static void stat_store(volatile uint64_t *p, uint64_t v)
{
	if (p)
		__atomic_store_n(p, v, __ATOMIC_RELAXED);
}

static void stat_add(volatile uint64_t *p, uint64_t v)
{
	if (p)
		(void)__atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

static void hex(const unsigned char *d, size_t n, char *out)
{
	static const char x[] = "0123456789abcdef";

	for (size_t i = 0; i < n; i++) {
		out[2 * i] = x[d[i] >> 4];
		out[2 * i + 1] = x[d[i] & 15];
	}
	out[2 * n] = '\0';
}

static int sha_final(EVP_MD_CTX *md, char out[65])
{
	unsigned char d[EVP_MAX_MD_SIZE];
	unsigned n = 0;

	if (!EVP_DigestFinal_ex(md, d, &n) || n != 32)
		return -EIO;
	hex(d, 32, out);
	return 0;
}

static EVP_MD_CTX *sha_new(void)
{
	EVP_MD_CTX *md = EVP_MD_CTX_new();

	if (md && !EVP_DigestInit_ex(md, EVP_sha256(), NULL)) {
		EVP_MD_CTX_free(md);
		md = NULL;
	}
	return md;
}

/* AWS's URI encoding: unreserved characters kept, '/' kept when keep_slash, the rest %XX. */
static char *aws_encode(const char *s, bool keep_slash)
{
	char *out = malloc(strlen(s) * 3 + 1), *p = out;

	if (!out)
		return NULL;
	for (; *s; s++) {
		unsigned char c = (unsigned char)*s;

		if (isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
		    (c == '/' && keep_slash))
			*p++ = (char)c;
		else
			p += sprintf(p, "%%%02X", c);
	}
	*p = '\0';
	return out;
}

/* a/b into buf: false when it does not fit */
static bool join(char *buf, size_t len, const char *a, const char *b)
{
	size_t la = strlen(a), lb = strlen(b);

	if (la + 1 + lb >= len)
		return false;
	memcpy(buf, a, la);
	buf[la] = '/';
	memcpy(buf + la + 1, b, lb + 1);
	return true;
}

static void curl_init_once(void)
{
	(void)curl_global_init(CURL_GLOBAL_DEFAULT);
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;

/* ---- manifests --------------------------------------------------------------------------- */

void ro_policy_manifest_clear(struct ro_policy_manifest *m)
{
	if (!m)
		return;
	for (size_t i = 0; i < m->n; i++)
		free(m->files[i].name);
	free(m->files);
	m->files = NULL;
	m->n = 0;
}

static int cmp_file(const void *a, const void *b)
{
	return strcmp(((const struct ro_policy_file *)a)->name,
		      ((const struct ro_policy_file *)b)->name);
}

/* relative, '/'-separated, no empty, "." or ".." part, no control characters */
static bool name_ok(const char *n)
{
	const char *p = n;

	if (!*n || *n == '/' || strlen(n) > 1024)
		return false;
	for (const char *c = n; *c; c++)
		if ((unsigned char)*c < 0x20 || *c == '\\')
			return false;
	while (*p) {
		size_t len = strcspn(p, "/");

		if (!len || (len == 1 && p[0] == '.') || (len == 2 && p[0] == '.' && p[1] == '.'))
			return false;
		p += len;
		if (*p == '/')
			p++;
		if (!*p && p[-1] == '/')
			return false;
	}
	return true;
}

static bool hex64_ok(const char *s)
{
	size_t i;

	for (i = 0; s[i]; i++)
		if (!isxdigit((unsigned char)s[i]) || isupper((unsigned char)s[i]))
			return false;
	return i == 64;
}

static int add_file(struct ro_policy_manifest *m, size_t *cap, const char *name, uint64_t size,
		    const char *sha)
{
	struct ro_policy_file *f;

	if (m->n == *cap) {
		size_t nc = *cap ? *cap * 2 : 16;

		f = realloc(m->files, nc * sizeof(*f));
		if (!f)
			return -ENOMEM;
		m->files = f;
		*cap = nc;
	}
	f = &m->files[m->n];
	f->name = strdup(name);
	if (!f->name)
		return -ENOMEM;
	f->size = size;
	(void)snprintf(f->sha256, sizeof(f->sha256), "%s", sha ? sha : "");
	m->n++;
	return 0;
}

/* sorted, names unique */
static int manifest_finish(struct ro_policy_manifest *m, char *err, size_t errlen)
{
	if (m->n)
		qsort(m->files, m->n, sizeof(m->files[0]), cmp_file);
	for (size_t i = 1; i < m->n; i++)
		if (!strcmp(m->files[i - 1].name, m->files[i].name))
			return failf(err, errlen, -EBADMSG, "manifest: %s listed twice",
				     m->files[i].name);
	return 0;
}

char *ro_policy_manifest_json(const struct ro_policy_manifest *m)
{
	struct json_object *root = json_object_new_object(), *arr = json_object_new_array();
	char *out = NULL;

	if (!root || !arr)
		goto out;
	for (size_t i = 0; i < m->n; i++) {
		struct json_object *f = json_object_new_object();

		if (!f)
			goto out;
		(void)json_object_object_add(f, "name", json_object_new_string(m->files[i].name));
		(void)json_object_object_add(f, "size",
					     json_object_new_int64((int64_t)m->files[i].size));
		(void)json_object_object_add(f, "sha256",
					     json_object_new_string(m->files[i].sha256));
		(void)json_object_array_add(arr, f);
	}
	(void)json_object_object_add(root, "files", arr);
	arr = NULL;
	out = strdup(json_object_to_json_string_ext(root, JSON_C_TO_STRING_PLAIN));
out:
	json_object_put(arr);
	json_object_put(root);
	return out;
}

int ro_policy_manifest_parse(const char *json, struct ro_policy_manifest *m, char *err,
			     size_t errlen)
{
	struct json_tokener *tok = json_tokener_new();
	struct json_object *root = NULL, *files, *v;
	size_t cap = 0, n;
	int r = 0;

	memset(m, 0, sizeof(*m));
	if (!tok)
		return -ENOMEM;
	root = json_tokener_parse_ex(tok, json, (int)strlen(json));
	if (!root || json_tokener_get_error(tok) != json_tokener_success) {
		r = failf(err, errlen, -EBADMSG, "manifest: not JSON (%s)",
			  json_tokener_error_desc(json_tokener_get_error(tok)));
		goto out;
	}
	if (!json_object_is_type(root, json_type_object) ||
	    !json_object_object_get_ex(root, "files", &files) ||
	    !json_object_is_type(files, json_type_array)) {
		r = failf(err, errlen, -EBADMSG, "manifest: no \"files\" array");
		goto out;
	}
	n = json_object_array_length(files);
	for (size_t i = 0; i < n; i++) {
		struct json_object *f = json_object_array_get_idx(files, i);
		const char *name = NULL, *sha = NULL;
		int64_t size = -1;

		if (json_object_is_type(f, json_type_object)) {
			if (json_object_object_get_ex(f, "name", &v) &&
			    json_object_is_type(v, json_type_string))
				name = json_object_get_string(v);
			if (json_object_object_get_ex(f, "sha256", &v) &&
			    json_object_is_type(v, json_type_string))
				sha = json_object_get_string(v);
			if (json_object_object_get_ex(f, "size", &v) &&
			    json_object_is_type(v, json_type_int))
				size = json_object_get_int64(v);
		}
		if (!name || !name_ok(name)) {
			r = failf(err, errlen, -EBADMSG, "manifest: file %zu: bad or missing name",
				  i);
			goto out;
		}
		if (size < 0 || !sha || !hex64_ok(sha)) {
			r = failf(err, errlen, -EBADMSG,
				  "manifest: %s: size must be an integer >= 0, sha256 64 lowercase "
				  "hex digits",
				  name);
			goto out;
		}
		r = add_file(m, &cap, name, (uint64_t)size, sha);
		if (r)
			goto out;
	}
	r = manifest_finish(m, err, errlen);
out:
	if (r)
		ro_policy_manifest_clear(m);
	json_object_put(root);
	json_tokener_free(tok);
	return r;
}

bool ro_policy_manifest_equal(const struct ro_policy_manifest *a,
			      const struct ro_policy_manifest *b)
{
	if (a->n != b->n)
		return false;
	for (size_t i = 0; i < a->n; i++)
		if (strcmp(a->files[i].name, b->files[i].name) ||
		    a->files[i].size != b->files[i].size ||
		    strcmp(a->files[i].sha256, b->files[i].sha256))
			return false;
	return true;
}

/* ---- URIs -------------------------------------------------------------------------------- */

enum kind { K_FILE, K_S3, K_HTTP };

struct target {
	enum kind kind;
	char *dir;    /* file: the directory, no trailing '/' */
	char *bucket; /* s3 */
	char *prefix; /* s3: "" or ending in '/' */
	char *base;   /* http: no trailing '/' */
};

static void target_clear(struct target *t)
{
	free(t->dir);
	free(t->bucket);
	free(t->prefix);
	free(t->base);
	memset(t, 0, sizeof(*t));
}

static char *strip_slashes(const char *s, bool keep_root)
{
	size_t n = strlen(s);
	char *out;

	while (n > (keep_root ? 1u : 0u) && s[n - 1] == '/')
		n--;
	out = strndup(s, n);
	return out;
}

static int target_parse(const char *uri, struct target *t, char *err, size_t errlen)
{
	memset(t, 0, sizeof(*t));
	if (!uri || !*uri)
		return failf(err, errlen, -EINVAL, "no policy URI");
	if (!strncmp(uri, "s3://", 5)) {
		const char *b = uri + 5, *slash = strchr(b, '/');
		size_t bl = slash ? (size_t)(slash - b) : strlen(b);
		char *p;

		t->kind = K_S3;
		if (bl < 3 || bl > 63)
			return failf(err, errlen, -EINVAL, "%s: bad bucket name", uri);
		t->bucket = strndup(b, bl);
		p = strip_slashes(slash ? slash + 1 : "", false);
		if (!t->bucket || !p || asprintf(&t->prefix, "%s%s", p, *p ? "/" : "") < 0) {
			t->prefix = NULL;
			free(p);
			target_clear(t);
			return -ENOMEM;
		}
		free(p);
		for (const char *c = t->bucket; *c; c++)
			if (!islower((unsigned char)*c) && !isdigit((unsigned char)*c) &&
			    *c != '-' && *c != '.') {
				target_clear(t);
				return failf(err, errlen, -EINVAL, "%s: bad bucket name", uri);
			}
		return 0;
	}
	if (!strncmp(uri, "https://", 8) || !strncmp(uri, "http://", 7)) {
		t->kind = K_HTTP;
		if (strchr(uri + 8, '@'))
			return failf(err, errlen, -EINVAL, "policy URI: no credentials in URLs");
		t->base = strip_slashes(uri, false);
		return t->base ? 0 : -ENOMEM;
	}
	if (!strncmp(uri, "file://", 7))
		uri += 7;
	else if (strstr(uri, "://"))
		return failf(err, errlen, -EINVAL, "%s: only file://, s3://, https:// policies",
			     uri);
	t->kind = K_FILE;
	if (!*uri)
		return failf(err, errlen, -EINVAL, "file://: no path");
	t->dir = strip_slashes(uri, true);
	return t->dir ? 0 : -ENOMEM;
}

/* ---- file:// ------------------------------------------------------------------------------ */

/* sha256 of a whole file (its size in *ret_size), checking the cancel flag per block */
static int hash_file(const struct ro_fetch_opts *o, const char *path, uint64_t *ret_size,
		     char out[65], uint64_t *done, char *err, size_t errlen)
{
	static const size_t blk = 1u << 20;
	EVP_MD_CTX *md = NULL;
	unsigned char *buf = NULL;
	uint64_t size = 0;
	int fd, r = 0;

	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		r = -errno;
		return failf(err, errlen, r, "%s: %s", path, strerror(-r));
	}
	(void)posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
	buf = malloc(blk);
	md = sha_new();
	if (!buf || !md) {
		r = -ENOMEM;
		goto out;
	}
	for (;;) {
		ssize_t n = read(fd, buf, blk);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			r = failf(err, errlen, -errno, "%s: read: %s", path, strerror(errno));
			goto out;
		}
		if (!n)
			break;
		if (!EVP_DigestUpdate(md, buf, (size_t)n)) {
			r = -EIO;
			goto out;
		}
		size += (uint64_t)n;
		if (done) {
			*done += (uint64_t)n;
			stat_store(o->bytes_done, *done);
		}
		if (cancelled(o)) {
			r = failf(err, errlen, -ECANCELED, "cancelled");
			goto out;
		}
	}
	r = sha_final(md, out);
	*ret_size = size;
out:
	EVP_MD_CTX_free(md);
	free(buf);
	(void)close(fd);
	return r;
}

static char *read_small_file(const char *path, size_t max, int *ret)
{
	FILE *f = fopen(path, "re");
	char *buf;
	size_t n;

	*ret = 0;
	if (!f) {
		*ret = -errno;
		return NULL;
	}
	buf = malloc(max + 1);
	if (!buf) {
		(void)fclose(f);
		*ret = -ENOMEM;
		return NULL;
	}
	n = fread(buf, 1, max + 1, f);
	(void)fclose(f);
	if (n > max) {
		free(buf);
		*ret = -EFBIG;
		return NULL;
	}
	buf[n] = '\0';
	return buf;
}

/* the walk: nftw has no user pointer, so its state lives here (one walk per thread) */
static __thread struct walk {
	struct ro_policy_manifest *m;
	size_t cap, rootlen;
	uint64_t total;
	int err;
} * walk_state;

static int walk_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
	struct walk *w = walk_state;
	const char *rel = path + w->rootlen;

	if (ftw->level == 0)
		return 0;
	if (path[ftw->base] == '.')
		return 0; /* hidden (and what is below a hidden directory, see strstr) */
	if (flag != FTW_F || !S_ISREG(sb->st_mode))
		return 0;
	while (*rel == '/')
		rel++;
	if (!strcmp(rel, "manifest.json"))
		return 0;
	if (strstr(rel, "/."))
		return 0; /* inside a hidden directory */
	w->err = add_file(w->m, &w->cap, rel, (uint64_t)sb->st_size, NULL);
	w->total += (uint64_t)sb->st_size;
	return w->err ? 1 : 0;
}

static int file_compute(const struct ro_fetch_opts *o, const char *dir,
			struct ro_policy_manifest *m, char *err, size_t errlen)
{
	struct walk w = {.m = m, .rootlen = strlen(dir)};
	char path[4096];
	uint64_t done = 0;
	struct stat st;
	char *json;
	int r;

	if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode))
		return failf(err, errlen, -ENOENT, "%s: no such directory", dir);
	(void)join(path, sizeof(path), dir, "manifest.json");
	json = read_small_file(path, MAX_META_BODY, &r);
	if (json) {
		r = ro_policy_manifest_parse(json, m, err, errlen);
		free(json);
		return r;
	}
	if (r != -ENOENT)
		return failf(err, errlen, r, "%s: %s", path, strerror(-r));
	walk_state = &w;
	r = nftw(dir, walk_one, 16, 0);
	walk_state = NULL;
	if (r || w.err) {
		r = w.err ? w.err : -errno;
		ro_policy_manifest_clear(m);
		return failf(err, errlen, r, "%s: walk: %s", dir, strerror(-r));
	}
	r = manifest_finish(m, err, errlen);
	stat_store(o->bytes_total, w.total);
	for (size_t i = 0; !r && i < m->n; i++) {
		uint64_t size;

		(void)join(path, sizeof(path), dir, m->files[i].name);
		r = hash_file(o, path, &size, m->files[i].sha256, &done, err, errlen);
		if (!r && size != m->files[i].size)
			r = failf(err, errlen, -EIO, "%s: changed while it was hashed", path);
	}
	if (r)
		ro_policy_manifest_clear(m);
	return r;
}

static int file_verify(const struct ro_fetch_opts *o, const char *dir,
		       const struct ro_policy_manifest *m, char *err, size_t errlen)
{
	char path[4096], got[65];
	uint64_t total = 0, done = 0;
	int r;

	for (size_t i = 0; i < m->n; i++)
		total += m->files[i].size;
	stat_store(o->bytes_total, total);
	for (size_t i = 0; i < m->n; i++) {
		const struct ro_policy_file *f = &m->files[i];
		uint64_t size;
		struct stat st;

		(void)join(path, sizeof(path), dir, f->name);
		if (stat(path, &st) < 0) {
			r = -errno;
			return failf(err, errlen, r, "%s: %s", path, strerror(-r));
		}
		if ((uint64_t)st.st_size != f->size)
			return failf(err, errlen, -EBADMSG,
				     "%s: size %" PRIu64 ", manifest says %" PRIu64, path,
				     (uint64_t)st.st_size, f->size);
		r = hash_file(o, path, &size, got, &done, err, errlen);
		if (r)
			return r;
		if (strcmp(got, f->sha256))
			return failf(err, errlen, -EBADMSG, "%s: sha256 %s, manifest says %s", path,
				     got, f->sha256);
	}
	return 0;
}

/* ---- the HTTP engine ------------------------------------------------------------------------ */

enum mode {
	M_FILE, /* a chunk of a file: written at its offset */
	M_HASH, /* a whole object, hashed as it streams (manifest of an S3 prefix) */
	M_MEM,	/* a small body into memory (manifest.json, a listing page) */
};

struct membuf {
	char *p;
	size_t n, max;
};

struct fstate;

struct req {
	enum mode mode;
	char *url;
	const char *what;  /* for messages: s3://bucket/key or the URL */
	uint64_t off, len; /* the range this request owes; len UNKNOWN: the whole body */
	uint64_t size;	   /* the object's expected size, UNKNOWN when not known */
	uint64_t got;	   /* bytes of the range received so far, over all tries */
	uint64_t start;	   /* got when this try began */
	unsigned tries;
	int64_t not_before;
	bool done, active;
	CURL *h;
	struct curl_slist *hdrs;
	long status;
	int fatal; /* set by a callback: the error, message in the engine */
	struct membuf ebody;
	struct membuf mem;
	EVP_MD_CTX *md;
	struct fstate *fs;	      /* M_FILE: the file */
	struct ro_policy_file *entry; /* M_HASH: the manifest entry the hash goes to */
	struct engine *e;
};

/* one file being downloaded: its chunks are reqs[first .. first+n) */
struct fstate {
	const struct ro_policy_file *f;
	char *path;
	int fd;
	struct req *chunks;
	size_t n, hashed;
	EVP_MD_CTX *md;
};

struct engine {
	const struct ro_fetch_opts *o;
	const struct target *t;
	bool s3;
	char region[64];
	char sigv4[96];
	CURLM *multi;
	uint64_t done_bytes;
	char *err;
	size_t errlen;
	bool err_set;
};

static int efail(struct engine *e, int r, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int efail(struct engine *e, int r, const char *fmt, ...)
{
	va_list ap;

	if (!e->err_set && e->err && e->errlen) {
		va_start(ap, fmt);
		(void)vsnprintf(e->err, e->errlen, fmt, ap);
		va_end(ap);
		e->err_set = true;
	}
	return r;
}

static bool membuf_add(struct membuf *b, const char *d, size_t n)
{
	char *p;

	if (b->n + n > b->max)
		return false;
	p = realloc(b->p, b->n + n + 1);
	if (!p)
		return false;
	memcpy(p + b->n, d, n);
	b->n += n;
	p[b->n] = '\0';
	b->p = p;
	return true;
}

static void membuf_reset(struct membuf *b)
{
	b->n = 0;
	if (b->p)
		b->p[0] = '\0';
}

static size_t on_header(char *d, size_t s, size_t nm, void *arg)
{
	struct req *q = arg;
	size_t n = s * nm;
	char line[256];
	uint64_t a, b, total;

	if (n >= sizeof(line))
		return n;
	memcpy(line, d, n);
	line[n] = '\0';
	if (!strncmp(line, "HTTP/", 5)) {
		q->status = 0;
		(void)sscanf(line, "HTTP/%*s %ld", &q->status);
		return n;
	}
	if (strncasecmp(line, "content-range:", 14) || !q->status)
		return n;
	if (q->size == UNKNOWN)
		return n;
	if (sscanf(line + 14, " bytes %" SCNu64 "-%" SCNu64 "/%" SCNu64, &a, &b, &total) == 3) {
		if (total != q->size) {
			q->fatal =
			    efail(q->e, -EBADMSG, "%s: size %" PRIu64 ", manifest says %" PRIu64,
				  q->what, total, q->size);
			return 0;
		}
		if (a != q->off + q->got) {
			q->fatal = efail(q->e, -EIO,
					 "%s: asked for bytes from %" PRIu64 ", got from %" PRIu64,
					 q->what, q->off + q->got, a);
			return 0;
		}
	} else if (sscanf(line + 14, " bytes */%" SCNu64, &total) == 1 && total != q->size) {
		q->fatal = efail(q->e, -EBADMSG, "%s: size %" PRIu64 ", manifest says %" PRIu64,
				 q->what, total, q->size);
		return 0;
	}
	return n;
}

static int fs_advance(struct engine *e, struct fstate *fs);

static size_t on_write(char *d, size_t s, size_t nm, void *arg)
{
	struct req *q = arg;
	struct engine *e = q->e;
	size_t n = s * nm;

	if (q->status != 200 && q->status != 206) {
		(void)membuf_add(&q->ebody, d, n); /* the error document, bounded */
		return n;
	}
	if (cancelled(e->o))
		return 0;
	if (q->status == 200 &&
	    (q->off + q->start != 0 || (q->len != UNKNOWN && q->len != q->size))) {
		q->fatal = efail(e, -EIO, "%s: the server ignored Range (HTTP 200)", q->what);
		return 0;
	}
	if (q->len != UNKNOWN && q->got + n > q->len) {
		q->fatal = efail(e, -EBADMSG, "%s: more bytes than the manifest's %" PRIu64,
				 q->what, q->size);
		return 0;
	}
	switch (q->mode) {
	case M_FILE:
		for (size_t w = 0; w < n;) {
			ssize_t k = pwrite(q->fs->fd, d + w, n - w, (off_t)(q->off + q->got + w));

			if (k < 0 && errno == EINTR)
				continue;
			if (k < 0) {
				q->fatal =
				    efail(e, -errno, "%s: write: %s", q->fs->path, strerror(errno));
				return 0;
			}
			w += (size_t)k;
		}
		break;
	case M_HASH:
		if (!EVP_DigestUpdate(q->md, d, n)) {
			q->fatal = -EIO;
			return 0;
		}
		break;
	case M_MEM:
		if (!membuf_add(&q->mem, d, n)) {
			q->fatal = efail(e, -EFBIG, "%s: reply larger than %zu bytes", q->what,
					 q->mem.max);
			return 0;
		}
		break;
	}
	q->got += n;
	if (q->mode != M_MEM) {
		e->done_bytes += n;
		stat_store(e->o->bytes_done, e->done_bytes);
	}
	return n;
}

static int req_start(struct engine *e, struct req *q)
{
	char range[64], hdr[4200], cerr[256];
	struct ro_aws_creds c;
	CURL *h;
	int r;

	h = curl_easy_init();
	if (!h)
		return efail(e, -ENOMEM, "out of memory");
	q->status = 0;
	q->start = q->got;
	membuf_reset(&q->ebody);
	(void)curl_easy_setopt(h, CURLOPT_URL, q->url);
	(void)curl_easy_setopt(h, CURLOPT_PRIVATE, q);
	(void)curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
	(void)curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_write);
	(void)curl_easy_setopt(h, CURLOPT_WRITEDATA, q);
	(void)curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
	(void)curl_easy_setopt(h, CURLOPT_HEADERDATA, q);
	(void)curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
	(void)curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1024L); /* a stall: retried */
	(void)curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, 30L);
	(void)curl_easy_setopt(h, CURLOPT_BUFFERSIZE, 256L << 10);
	(void)curl_easy_setopt(h, CURLOPT_NOPROXY, "127.0.0.1,localhost,::1");
	if (q->len != UNKNOWN) {
		(void)snprintf(range, sizeof(range), "%" PRIu64 "-%" PRIu64, q->off + q->got,
			       q->off + q->len - 1);
		(void)curl_easy_setopt(h, CURLOPT_RANGE, range);
	}
	if (e->s3) {
		r = ro_aws_creds_get(e->o->imds_endpoint, e->region, &c, cerr, sizeof(cerr));
		if (r) {
			curl_easy_cleanup(h);
			return efail(e, r, "%s", cerr);
		}
		(void)curl_easy_setopt(h, CURLOPT_AWS_SIGV4, e->sigv4);
		(void)curl_easy_setopt(h, CURLOPT_USERNAME, c.access_key_id);
		(void)curl_easy_setopt(h, CURLOPT_PASSWORD, c.secret_access_key);
		/* the hash of the empty payload curl signs; S3 wants it as a header too */
		q->hdrs = curl_slist_append(NULL, "x-amz-content-sha256: " EMPTY_SHA256);
		if (c.session_token[0]) {
			(void)snprintf(hdr, sizeof(hdr), "x-amz-security-token: %s",
				       c.session_token);
			q->hdrs = curl_slist_append(q->hdrs, hdr);
			explicit_bzero(hdr, sizeof(hdr));
		}
		explicit_bzero(&c, sizeof(c));
		(void)curl_easy_setopt(h, CURLOPT_HTTPHEADER, q->hdrs);
	}
	q->h = h;
	q->active = true;
	stat_add(e->o->requests, 1);
	if (curl_multi_add_handle(e->multi, h) != CURLM_OK)
		return efail(e, -ENOMEM, "curl_multi_add_handle failed");
	return 0;
}

static void req_stop(struct engine *e, struct req *q)
{
	if (q->h) {
		(void)curl_multi_remove_handle(e->multi, q->h);
		curl_easy_cleanup(q->h);
		q->h = NULL;
	}
	curl_slist_free_all(q->hdrs); /* holds the session token: libcurl is done with it */
	q->hdrs = NULL;
	q->active = false;
}

static void req_clear(struct req *q)
{
	free(q->url);
	free(q->ebody.p);
	free(q->mem.p);
	EVP_MD_CTX_free(q->md);
	memset(q, 0, sizeof(*q));
}

static void s3_error(const struct req *q, char *code, size_t clen, char *msg, size_t mlen)
{
	code[0] = msg[0] = '\0';
	if (q->ebody.p) {
		if (ro_xml_field(q->ebody.p, NULL, "Code", code, clen))
			code[0] = '\0';
		if (ro_xml_field(q->ebody.p, NULL, "Message", msg, mlen))
			msg[0] = '\0';
	}
}

/* A finished try: 0 done, 1 to be tried again (scheduled), or -errno. */
static int req_finish(struct engine *e, struct req *q, CURLcode rc)
{
	long status = q->status;
	char code[64], msg[200];
	const char *why;
	int64_t delay;

	req_stop(e, q);
	if (cancelled(e->o))
		return efail(e, -ECANCELED, "cancelled");
	if (q->fatal)
		return q->fatal;
	if (rc == CURLE_OK && (status == 200 || status == 206)) {
		if (q->len == UNKNOWN || q->got == q->len) {
			q->done = true;
			return 0;
		}
		why = "short reply";
	} else if (rc == CURLE_OK) {
		s3_error(q, code, sizeof(code), msg, sizeof(msg));
		if (status == 404)
			return efail(e, -ENOENT, "%s: not found (HTTP 404%s%s)", q->what,
				     code[0] ? " " : "", code);
		if (status == 403 && e->s3 &&
		    (!strcmp(code, "ExpiredToken") || !strcmp(code, "TokenRefreshRequired")) &&
		    q->tries < 1) {
			ro_aws_creds_invalidate();
			why = "credentials expired";
		} else if (status == 401 || status == 403) {
			return efail(e, -EACCES, "%s: access denied (HTTP %ld %s: %s)", q->what,
				     status, code, msg);
		} else if (status == 416) {
			return efail(e, -EBADMSG,
				     "%s: shorter than the manifest's %" PRIu64 " bytes", q->what,
				     q->size);
		} else if (status == 429 || status >= 500) {
			why = "server busy";
		} else {
			return efail(e, -EIO, "%s: HTTP %ld %s %s", q->what, status, code, msg);
		}
	} else {
		why = curl_easy_strerror(rc);
	}
	if (q->tries >= MAX_RETRIES)
		return efail(e, -EIO, "%s: %s (HTTP %ld) after %u tries", q->what, why, status,
			     q->tries + 1);
	/* again, from the byte it reached; a body of unknown length starts over */
	if (q->len == UNKNOWN) {
		q->got = 0;
		membuf_reset(&q->mem);
	}
	delay = (int64_t)BACKOFF_MS << (q->tries < 5 ? q->tries : 5);
	delay = delay * 3 / 4 + rand() % (delay / 2 + 1);
	q->tries++;
	q->not_before = mono_ms() + delay;
	stat_add(e->o->retries, 1);
	return 1;
}

/* Runs reqs[0..n) (in order, at most o->parallel at a time; retries first when due) until
 * every one is done; on_done is called for each as it completes. The first error stops
 * everything. */
static int engine_run(struct engine *e, struct req *reqs, size_t n,
		      int (*on_done)(struct engine *, struct req *))
{
	unsigned par = e->o->parallel ? e->o->parallel : DEFAULT_PARALLEL;
	size_t next = 0, active = 0, nretry = 0, cap = 0;
	struct req **retry = NULL;
	int r = 0;

	for (;;) {
		int64_t now = mono_ms(), wait = 100;
		int running, left;
		CURLMsg *msg;

		if (cancelled(e->o)) {
			r = efail(e, -ECANCELED, "cancelled");
			break;
		}
		for (size_t i = 0; i < nretry && active < par;) {
			if (retry[i]->not_before > now) {
				if (retry[i]->not_before - now < wait)
					wait = retry[i]->not_before - now;
				i++;
				continue;
			}
			r = req_start(e, retry[i]);
			if (r)
				goto out;
			active++;
			retry[i] = retry[--nretry];
		}
		while (active < par && next < n) {
			if (reqs[next].done) {
				next++;
				continue;
			}
			r = req_start(e, &reqs[next++]);
			if (r)
				goto out;
			active++;
		}
		if (!active && !nretry && next == n)
			break;
		(void)curl_multi_perform(e->multi, &running);
		while ((msg = curl_multi_info_read(e->multi, &left))) {
			struct req *q = NULL;

			if (msg->msg != CURLMSG_DONE)
				continue;
			(void)curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&q);
			active--;
			r = req_finish(e, q, msg->data.result);
			if (r == 1) {
				if (nretry == cap) {
					struct req **p =
					    realloc(retry, (cap ? cap * 2 : 8) * sizeof(*p));

					if (!p) {
						r = efail(e, -ENOMEM, "out of memory");
						goto out;
					}
					retry = p;
					cap = cap ? cap * 2 : 8;
				}
				retry[nretry++] = q;
				r = 0;
				continue;
			}
			if (!r && on_done)
				r = on_done(e, q);
			if (r)
				goto out;
		}
		if (active)
			(void)curl_multi_poll(e->multi, NULL, 0, (int)(wait < 100 ? wait : 100),
					      NULL);
		else if (nretry)
			(void)curl_multi_poll(e->multi, NULL, 0, (int)(wait < 100 ? wait : 100),
					      NULL);
	}
out:
	for (size_t i = 0; i < n; i++)
		if (reqs[i].active)
			req_stop(e, &reqs[i]);
	free(retry);
	return r;
}

static int engine_init(struct engine *e, const struct ro_fetch_opts *o, const struct target *t,
		       char *err, size_t errlen)
{
	memset(e, 0, sizeof(*e));
	(void)pthread_once(&curl_once, curl_init_once);
	e->o = o;
	e->t = t;
	e->err = err;
	e->errlen = errlen;
	e->s3 = t->kind == K_S3;
	if (e->s3) {
		if (o->region && *o->region)
			(void)snprintf(e->region, sizeof(e->region), "%s", o->region);
		else
			ro_aws_region(o->imds_endpoint, e->region, sizeof(e->region));
		(void)snprintf(e->sigv4, sizeof(e->sigv4), "aws:amz:%s:s3", e->region);
	}
	e->multi = curl_multi_init();
	if (!e->multi)
		return -ENOMEM;
	(void)curl_multi_setopt(e->multi, CURLMOPT_MAX_HOST_CONNECTIONS,
				(long)(o->parallel ? o->parallel : DEFAULT_PARALLEL));
	return 0;
}

static void engine_clear(struct engine *e)
{
	if (e->multi)
		(void)curl_multi_cleanup(e->multi);
	e->multi = NULL;
}

/* the URL of a file of the policy, and its name for messages */
static int object_url(const struct engine *e, const char *name, char **ret_url, char **ret_what)
{
	const struct target *t = e->t;
	char *enc, *key = NULL;
	int r;

	*ret_url = *ret_what = NULL;
	if (t->kind == K_S3) {
		if (asprintf(&key, "%s%s", t->prefix, name) < 0)
			return -ENOMEM;
		enc = aws_encode(key, true);
		if (!enc) {
			free(key);
			return -ENOMEM;
		}
		if (e->o->s3_endpoint && *e->o->s3_endpoint) {
			size_t l = strlen(e->o->s3_endpoint);

			while (l && e->o->s3_endpoint[l - 1] == '/')
				l--;
			r = asprintf(ret_url, "%.*s/%s/%s", (int)l, e->o->s3_endpoint, t->bucket,
				     enc);
		} else {
			r = asprintf(ret_url, "https://%s.s3.%s.amazonaws.com/%s", t->bucket,
				     e->region, enc);
		}
		free(enc);
		if (r < 0 || asprintf(ret_what, "s3://%s/%s", t->bucket, key) < 0) {
			free(key);
			free(*ret_url);
			*ret_url = NULL;
			return -ENOMEM;
		}
		free(key);
		return 0;
	}
	enc = aws_encode(name, true);
	if (!enc)
		return -ENOMEM;
	r = asprintf(ret_url, "%s/%s", t->base, enc);
	free(enc);
	if (r < 0) {
		*ret_url = NULL;
		return -ENOMEM;
	}
	*ret_what = strdup(*ret_url);
	return *ret_what ? 0 : -ENOMEM;
}

/* GET a small object (manifest.json) into memory: 0 and the body, or -ENOENT / -errno */
static int get_small(struct engine *e, const char *name, char **ret_body)
{
	struct req q = {0};
	char *what = NULL;
	int r;

	*ret_body = NULL;
	r = object_url(e, name, &q.url, &what);
	if (r)
		return r;
	q.mode = M_MEM;
	q.what = what;
	q.len = q.size = UNKNOWN;
	q.mem.max = MAX_META_BODY;
	q.ebody.max = 8192;
	q.e = e;
	r = engine_run(e, &q, 1, NULL);
	if (!r) {
		*ret_body = q.mem.p ? q.mem.p : strdup("");
		q.mem.p = NULL;
		if (!*ret_body)
			r = -ENOMEM;
	}
	req_clear(&q);
	free(what);
	return r;
}

/* ---- s3:// listing and hashing --------------------------------------------------------------- */

static int s3_list(struct engine *e, struct ro_policy_manifest *m)
{
	const struct target *t = e->t;
	char *token = NULL, *eprefix = aws_encode(t->prefix, false), *etok = NULL;
	char key[2048], sizebuf[32], trunc[16];
	size_t cap = 0, plen = strlen(t->prefix);
	int r = 0;

	if (!eprefix)
		return -ENOMEM;
	for (;;) {
		struct req q = {0};
		const char *pos;
		char *ep = NULL;

		/* the query already in SigV4's canonical order and encoding */
		if (e->o->s3_endpoint && *e->o->s3_endpoint) {
			size_t l = strlen(e->o->s3_endpoint);

			while (l && e->o->s3_endpoint[l - 1] == '/')
				l--;
			r = asprintf(&ep, "%.*s/%s", (int)l, e->o->s3_endpoint, t->bucket);
		} else {
			r = asprintf(&ep, "https://%s.s3.%s.amazonaws.com", t->bucket, e->region);
		}
		if (r < 0 || asprintf(&q.url, "%s/?%s%s%slist-type=2&prefix=%s", ep,
				      etok ? "continuation-token=" : "", etok ? etok : "",
				      etok ? "&" : "", eprefix) < 0) {
			free(ep);
			r = -ENOMEM;
			break;
		}
		free(ep);
		q.mode = M_MEM;
		q.what = q.url;
		q.len = q.size = UNKNOWN;
		q.mem.max = MAX_META_BODY;
		q.ebody.max = 8192;
		q.e = e;
		r = engine_run(e, &q, 1, NULL);
		if (r == -ENOENT) {
			req_clear(&q);
			r = efail(e, -ENOENT, "s3://%s: no such bucket", t->bucket);
			break;
		}
		if (r) {
			req_clear(&q);
			break;
		}
		pos = q.mem.p ? q.mem.p : "";
		while ((pos = strstr(pos, "<Contents>"))) {
			const char *end = strstr(pos, "</Contents>"), *kp = pos, *sp = pos;
			char *x;
			uint64_t size;

			if (!end || ro_xml_field(pos, &kp, "Key", key, sizeof(key)) || kp > end ||
			    ro_xml_field(pos, &sp, "Size", sizebuf, sizeof(sizebuf)) || sp > end) {
				r = efail(e, -EBADMSG, "s3://%s: unreadable ListObjectsV2 reply",
					  t->bucket);
				break;
			}
			pos = end;
			errno = 0;
			size = strtoull(sizebuf, &x, 10);
			if (errno || *x) {
				r = efail(e, -EBADMSG, "s3://%s/%s: bad Size", t->bucket, key);
				break;
			}
			if (strncmp(key, t->prefix, plen))
				continue;
			{
				const char *name = key + plen;
				size_t nl = strlen(name);

				if (!nl || name[nl - 1] == '/' || !strcmp(name, "manifest.json") ||
				    name[0] == '.' || strstr(name, "/."))
					continue; /* folder markers, hidden files, the manifest */
				if (!name_ok(name)) {
					r = efail(e, -EBADMSG,
						  "s3://%s/%s: a key the fetcher cannot store",
						  t->bucket, key);
					break;
				}
				r = add_file(m, &cap, name, size, NULL);
				if (r)
					break;
			}
		}
		free(token);
		token = NULL;
		if (!r &&
		    !ro_xml_field(q.mem.p ? q.mem.p : "", NULL, "IsTruncated", trunc,
				  sizeof(trunc)) &&
		    !strcmp(trunc, "true")) {
			char tk[2048];

			if (ro_xml_field(q.mem.p, NULL, "NextContinuationToken", tk, sizeof(tk)))
				r = efail(e, -EBADMSG, "s3://%s: truncated listing without a token",
					  t->bucket);
			else
				token = strdup(tk);
		}
		req_clear(&q);
		if (r || !token)
			break;
		free(etok);
		etok = aws_encode(token, false);
		if (!etok) {
			r = -ENOMEM;
			break;
		}
	}
	free(token);
	free(etok);
	free(eprefix);
	return r;
}

static int hash_done(struct engine *e, struct req *q)
{
	if (sha_final(q->md, q->entry->sha256))
		return efail(e, -EIO, "sha256 failed");
	return 0;
}

static int s3_compute(struct engine *e, struct ro_policy_manifest *m)
{
	struct req *reqs;
	uint64_t total = 0;
	int r;

	r = s3_list(e, m);
	if (!r)
		r = manifest_finish(m, e->err, e->errlen);
	if (r)
		return r;
	reqs = calloc(m->n ? m->n : 1, sizeof(*reqs));
	if (!reqs)
		return -ENOMEM;
	for (size_t i = 0; i < m->n; i++) {
		struct req *q = &reqs[i];
		char *what = NULL;

		total += m->files[i].size;
		if (!m->files[i].size) {
			(void)snprintf(m->files[i].sha256, sizeof(m->files[i].sha256),
				       EMPTY_SHA256);
			q->done = true;
			continue;
		}
		r = object_url(e, m->files[i].name, &q->url, &what);
		q->what = what;
		q->md = sha_new();
		if (r || !q->md) {
			r = -ENOMEM;
			goto out;
		}
		q->mode = M_HASH;
		q->off = 0;
		q->len = q->size = m->files[i].size;
		q->ebody.max = 8192;
		q->entry = &m->files[i];
		q->e = e;
	}
	stat_store(e->o->bytes_total, total);
	r = engine_run(e, reqs, m->n, hash_done);
out:
	for (size_t i = 0; i < m->n; i++) {
		free((char *)reqs[i].what);
		req_clear(&reqs[i]);
	}
	free(reqs);
	return r;
}

int ro_policy_manifest_compute(const struct ro_fetch_opts *o, const char *uri,
			       struct ro_policy_manifest *ret, char *err, size_t errlen)
{
	struct target t;
	struct engine e;
	char *json = NULL;
	int r;

	memset(ret, 0, sizeof(*ret));
	r = target_parse(uri, &t, err, errlen);
	if (r)
		return r;
	if (t.kind == K_FILE) {
		r = file_compute(o, t.dir, ret, err, errlen);
		target_clear(&t);
		return r;
	}
	r = engine_init(&e, o, &t, err, errlen);
	if (r)
		goto out;
	r = get_small(&e, "manifest.json", &json);
	if (!r) {
		r = ro_policy_manifest_parse(json, ret, err, errlen);
	} else if (r == -ENOENT && t.kind == K_S3) {
		e.err_set = false; /* no manifest.json: list and hash */
		r = s3_compute(&e, ret);
	}
out:
	if (r)
		ro_policy_manifest_clear(ret);
	free(json);
	engine_clear(&e);
	target_clear(&t);
	return r;
}

/* ---- the download ------------------------------------------------------------------------ */

static int mkdirs_for(const char *path)
{
	char buf[4096];
	size_t n = strlen(path);

	if (n >= sizeof(buf))
		return -ENAMETOOLONG;
	memcpy(buf, path, n + 1);
	for (char *p = buf + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(buf, 0755) < 0 && errno != EEXIST)
			return -errno;
		*p = '/';
	}
	return 0;
}

/* Hashes the chunks of fs that are done and in order; the whole file checked at the end. */
static int fs_advance(struct engine *e, struct fstate *fs)
{
	static const size_t blk = 1u << 20;
	unsigned char *buf = NULL;
	char got[65];
	int r = 0;

	while (fs->hashed < fs->n && fs->chunks[fs->hashed].done) {
		struct req *c = &fs->chunks[fs->hashed];

		if (!buf && !(buf = malloc(blk)))
			return efail(e, -ENOMEM, "out of memory");
		for (uint64_t o = 0; o < c->len;) {
			size_t want = c->len - o < blk ? (size_t)(c->len - o) : blk;
			ssize_t k = pread(fs->fd, buf, want, (off_t)(c->off + o));

			if (k < 0 && errno == EINTR)
				continue;
			if (k <= 0) {
				r = efail(e, k < 0 ? -errno : -EIO, "%s: read back: %s", fs->path,
					  k < 0 ? strerror(errno) : "short");
				goto out;
			}
			if (!EVP_DigestUpdate(fs->md, buf, (size_t)k)) {
				r = -EIO;
				goto out;
			}
			o += (uint64_t)k;
		}
		/* start writing it back now, so the fsync at the end has little left to do */
		(void)sync_file_range(fs->fd, (off_t)c->off, (off_t)c->len, SYNC_FILE_RANGE_WRITE);
		fs->hashed++;
	}
	if (fs->hashed < fs->n || fs->fd < 0)
		goto out;
	if (sha_final(fs->md, got)) {
		r = efail(e, -EIO, "sha256 failed");
		goto out;
	}
	if (strcmp(got, fs->f->sha256)) {
		r = efail(e, -EBADMSG, "%s: sha256 %s, manifest says %s", fs->f->name, got,
			  fs->f->sha256);
		goto out;
	}
	if (fsync(fs->fd) < 0) {
		r = efail(e, -errno, "%s: fsync: %s", fs->path, strerror(errno));
		goto out;
	}
	(void)close(fs->fd);
	fs->fd = -1;
out:
	free(buf);
	return r;
}

static int chunk_done(struct engine *e, struct req *q)
{
	return fs_advance(e, q->fs);
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	(void)remove(p);
	return 0;
}

static void rm_tree(const char *path)
{
	(void)nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static int write_manifest(const char *dir, const struct ro_policy_manifest *m)
{
	char path[4096];
	char *json = ro_policy_manifest_json(m);
	int fd, r = 0;
	size_t n;

	if (!json)
		return -ENOMEM;
	(void)join(path, sizeof(path), dir, "manifest.json");
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0) {
		free(json);
		return -errno;
	}
	n = strlen(json);
	if (write(fd, json, n) != (ssize_t)n || fsync(fd) < 0)
		r = errno ? -errno : -EIO;
	(void)close(fd);
	free(json);
	return r;
}

/* <dir> holds m already: its manifest.json equal to m and every file of the right size */
static bool cached_ok(const char *dir, const struct ro_policy_manifest *m)
{
	struct ro_policy_manifest have;
	char path[4096], *json;
	bool ok;
	int r;

	(void)join(path, sizeof(path), dir, "manifest.json");
	json = read_small_file(path, MAX_META_BODY, &r);
	if (!json)
		return false;
	r = ro_policy_manifest_parse(json, &have, NULL, 0);
	free(json);
	if (r)
		return false;
	ok = ro_policy_manifest_equal(&have, m);
	ro_policy_manifest_clear(&have);
	for (size_t i = 0; ok && i < m->n; i++) {
		struct stat st;

		(void)join(path, sizeof(path), dir, m->files[i].name);
		ok = stat(path, &st) == 0 && S_ISREG(st.st_mode) &&
		     (uint64_t)st.st_size == m->files[i].size;
	}
	return ok;
}

struct cached {
	int64_t version;
	struct timespec mtime;
};

static int cmp_cached(const void *a, const void *b)
{
	const struct cached *x = a, *y = b;

	if (x->mtime.tv_sec != y->mtime.tv_sec)
		return x->mtime.tv_sec > y->mtime.tv_sec ? -1 : 1;
	if (x->mtime.tv_nsec != y->mtime.tv_nsec)
		return x->mtime.tv_nsec > y->mtime.tv_nsec ? -1 : 1;
	return x->version > y->version ? -1 : x->version < y->version;
}

/* Keeps the version just made and the keep-1 most recently made or reused others; removes
 * the partial directories of processes that are gone. Called with the cache locked. */
static void prune(const char *cache, int64_t current, unsigned keep)
{
	struct cached *v = NULL;
	size_t n = 0, cap = 0, kept = 1;
	struct dirent *d;
	char path[4096];
	DIR *dir = opendir(cache);

	if (!dir)
		return;
	while ((d = readdir(dir))) {
		long long ver;
		int pid, end = 0;
		struct stat st;

		if (sscanf(d->d_name, "v%lld.partial.%d%n", &ver, &pid, &end) == 2 &&
		    !d->d_name[end]) {
			if (pid > 0 && kill(pid, 0) < 0 && errno == ESRCH) {
				(void)join(path, sizeof(path), cache, d->d_name);
				rm_tree(path);
			}
			continue;
		}
		end = 0;
		if (sscanf(d->d_name, "v%lld%n", &ver, &end) != 1 || d->d_name[end] ||
		    ver == current)
			continue;
		(void)join(path, sizeof(path), cache, d->d_name);
		if (stat(path, &st) < 0 || !S_ISDIR(st.st_mode))
			continue;
		if (n == cap) {
			struct cached *p = realloc(v, (cap ? cap * 2 : 8) * sizeof(*p));

			if (!p)
				break;
			v = p;
			cap = cap ? cap * 2 : 8;
		}
		v[n].version = ver;
		v[n].mtime = st.st_mtim;
		n++;
	}
	(void)closedir(dir);
	if (n)
		qsort(v, n, sizeof(*v), cmp_cached);
	for (size_t i = 0; i < n; i++) {
		if (kept < keep) {
			kept++;
			continue;
		}
		(void)snprintf(path, sizeof(path), "%s/v%lld", cache, (long long)v[i].version);
		rm_tree(path);
	}
	free(v);
}

static int lock_cache(const char *cache)
{
	char path[4096];
	int fd;

	(void)join(path, sizeof(path), cache, ".lock");
	fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
	if (fd >= 0)
		(void)flock(fd, LOCK_EX);
	return fd;
}

static int download(struct engine *e, const struct ro_policy_manifest *m, const char *partial)
{
	uint64_t chunk = e->o->chunk_bytes ? e->o->chunk_bytes : DEFAULT_CHUNK, total = 0;
	struct fstate *fs = calloc(m->n ? m->n : 1, sizeof(*fs));
	size_t nreq = 0, k = 0;
	struct req *reqs = NULL;
	int r = 0;

	if (!fs)
		return -ENOMEM;
	for (size_t i = 0; i < m->n; i++) {
		nreq += (m->files[i].size + chunk - 1) / chunk;
		total += m->files[i].size;
		fs[i].fd = -1;
	}
	stat_store(e->o->bytes_total, total);
	reqs = calloc(nreq ? nreq : 1, sizeof(*reqs));
	if (!reqs) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < m->n; i++) {
		const struct ro_policy_file *f = &m->files[i];
		char *url = NULL, *what = NULL;

		fs[i].f = f;
		if (asprintf(&fs[i].path, "%s/%s", partial, f->name) < 0) {
			fs[i].path = NULL;
			r = -ENOMEM;
			goto out;
		}
		r = mkdirs_for(fs[i].path);
		if (r) {
			r = efail(e, r, "%s: mkdir: %s", fs[i].path, strerror(-r));
			goto out;
		}
		fs[i].fd = open(fs[i].path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
		if (fs[i].fd < 0 || ftruncate(fs[i].fd, (off_t)f->size) < 0) {
			r = efail(e, -errno, "%s: %s", fs[i].path, strerror(errno));
			goto out;
		}
		fs[i].md = sha_new();
		if (!fs[i].md) {
			r = -ENOMEM;
			goto out;
		}
		fs[i].chunks = &reqs[k];
		fs[i].n = (f->size + chunk - 1) / chunk;
		if (!fs[i].n) {
			r = fs_advance(e, &fs[i]); /* an empty file: checked now */
			if (r)
				goto out;
			continue;
		}
		r = object_url(e, f->name, &url, &what);
		if (r)
			goto out;
		for (size_t c = 0; c < fs[i].n; c++, k++) {
			struct req *q = &reqs[k];

			q->mode = M_FILE;
			q->url = c ? strdup(url) : url;
			q->what = what; /* freed with the file's first chunk */
			q->off = c * chunk;
			q->len = f->size - q->off < chunk ? f->size - q->off : chunk;
			q->size = f->size;
			q->ebody.max = 8192;
			q->fs = &fs[i];
			q->e = e;
			if (!q->url) {
				r = -ENOMEM;
				goto out;
			}
		}
	}
	r = engine_run(e, reqs, nreq, chunk_done);
out:
	for (size_t i = 0; i < m->n; i++) {
		if (fs[i].n && fs[i].chunks)
			free((char *)fs[i].chunks[0].what);
		if (fs[i].fd >= 0)
			(void)close(fs[i].fd);
		EVP_MD_CTX_free(fs[i].md);
		free(fs[i].path);
	}
	for (size_t i = 0; i < nreq; i++)
		req_clear(&reqs[i]);
	free(reqs);
	free(fs);
	return r;
}

int ro_policy_fetch(const struct ro_fetch_opts *o, const char *uri, int64_t version,
		    const struct ro_policy_manifest *m, char *ret_dir, size_t dirlen, char *err,
		    size_t errlen)
{
	char final[4096], partial[4096], trash[4200];
	unsigned keep = o->keep ? o->keep : DEFAULT_KEEP;
	struct target t;
	struct engine e;
	int r, lock = -1;

	r = target_parse(uri, &t, err, errlen);
	if (r)
		return r;
	stat_store(o->bytes_done, 0);
	if (t.kind == K_FILE) {
		r = file_verify(o, t.dir, m, err, errlen);
		if (!r && (size_t)snprintf(ret_dir, dirlen, "%s", t.dir) >= dirlen)
			r = failf(err, errlen, -ENAMETOOLONG, "%s: path too long", t.dir);
		target_clear(&t);
		return r;
	}
	if (!o->cache_dir || !*o->cache_dir || version < 0) {
		target_clear(&t);
		return failf(err, errlen, -EINVAL,
			     "a cache directory and a version >= 0 are needed");
	}
	if (mkdir(o->cache_dir, 0755) < 0 && errno != EEXIST) {
		r = -errno;
		target_clear(&t);
		return failf(err, errlen, r, "%s: %s", o->cache_dir, strerror(-r));
	}
	r = snprintf(final, sizeof(final), "%s/v%" PRId64, o->cache_dir, version);
	if (r < 0 || (size_t)r + 32 >= sizeof(final) ||
	    snprintf(partial, sizeof(partial), "%s.partial.%d", final, (int)getpid()) < 0 ||
	    (size_t)snprintf(ret_dir, dirlen, "%s", final) >= dirlen) {
		target_clear(&t);
		return failf(err, errlen, -ENAMETOOLONG, "%s: path too long", final);
	}

	lock = lock_cache(o->cache_dir);
	if (cached_ok(final, m)) {
		uint64_t total = 0;

		for (size_t i = 0; i < m->n; i++)
			total += m->files[i].size;
		stat_store(o->bytes_total, total);
		stat_store(o->bytes_done, total);
		(void)utimensat(AT_FDCWD, final, NULL, 0); /* recently used: pruned last */
		prune(o->cache_dir, version, keep);
		r = 0;
		goto out;
	}
	if (lock >= 0) {
		(void)close(lock); /* not held over the download */
		lock = -1;
	}

	r = engine_init(&e, o, &t, err, errlen);
	if (r)
		goto out;
	rm_tree(partial);
	if (mkdir(partial, 0755) < 0) {
		r = failf(err, errlen, -errno, "%s: %s", partial, strerror(errno));
		goto out_engine;
	}
	r = download(&e, m, partial);
	if (!r) {
		r = write_manifest(partial, m);
		if (r)
			(void)failf(err, errlen, r, "%s/manifest.json: %s", partial, strerror(-r));
	}
	if (r) {
		rm_tree(partial);
		goto out_engine;
	}

	lock = lock_cache(o->cache_dir);
	/* a directory already there (another process, or a version published twice with
	 * different files) is swapped out, then removed */
	if (snprintf(trash, sizeof(trash), "%s.old.%d", final, (int)getpid()) < 0 ||
	    rename(final, trash) < 0)
		trash[0] = '\0';
	if (rename(partial, final) < 0) {
		r = failf(err, errlen, -errno, "rename %s: %s", partial, strerror(errno));
		rm_tree(partial);
	} else {
		int dfd = open(o->cache_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);

		if (dfd >= 0) {
			(void)fsync(dfd);
			(void)close(dfd);
		}
		prune(o->cache_dir, version, keep);
	}
	if (trash[0])
		rm_tree(trash);
out_engine:
	engine_clear(&e);
out:
	if (lock >= 0)
		(void)close(lock);
	target_clear(&t);
	return r;
}
