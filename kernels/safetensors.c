/* The safetensors reader: an 8-byte little-endian header length, a JSON header (json-c)
 * naming each tensor's dtype, shape and [begin, end) offsets, then the data, mapped
 * read-only. Nothing in a file is trusted: the header length, every offset and every shape
 * is checked against the file before a pointer into it is handed out. Sharded models are
 * read through model.safetensors.index.json. */
#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/internal.h"

#define MAX_HEADER (100u << 20) /* the format's own limit */
#define MAX_FILES 256

struct st_file {
	void *map;
	size_t size;
	int fd;	    /* kept open: ro_st_read reads the very file that is mapped */
	char *name; /* the file's name in the directory */
};

struct ro_st_set {
	struct st_file files[MAX_FILES];
	size_t n_files;
	struct ro_tensor *t;
	size_t n, cap;
};

int ro_errf(char *err, size_t errlen, int r, const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		(void)vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return r;
}

/* A small file (config.json, an index) read whole: never a FIFO or a device (the open does
 * not block), never more than max bytes. */
int ro_read_small(const char *path, size_t max, char **ret, size_t *ret_len, char *err,
		  size_t errlen)
{
	struct stat st;
	char *buf;
	size_t got = 0;
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);

	if (fd < 0)
		return ro_errf(err, errlen, -errno, "%s: %s", path, strerror(errno));
	if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
		(void)close(fd);
		return ro_errf(err, errlen, -EINVAL, "%s: not a regular file", path);
	}
	if ((uint64_t)st.st_size > max) {
		(void)close(fd);
		return ro_errf(err, errlen, -EFBIG, "%s: %lld bytes, at most %zu", path,
			       (long long)st.st_size, max);
	}
	buf = malloc((size_t)st.st_size + 1);
	if (!buf) {
		(void)close(fd);
		return ro_errf(err, errlen, -ENOMEM, "%s: out of memory", path);
	}
	while (got < (size_t)st.st_size) {
		ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	(void)close(fd);
	if (got != (size_t)st.st_size) {
		free(buf);
		return ro_errf(err, errlen, -EIO, "%s: short read (%zu of %lld bytes)", path, got,
			       (long long)st.st_size);
	}
	buf[got] = 0;
	*ret = buf;
	*ret_len = got;
	return 0;
}

/* JSON text as one object: a clear message for a parse error, a truncated text, trailing
 * bytes after the value, or a value that is not an object. */
int ro_parse_json_object(const char *what, const char *text, size_t len, struct json_object **ret,
			 char *err, size_t errlen)
{
	struct json_tokener *tok;
	struct json_object *o;
	enum json_tokener_error e;
	size_t end;

	if (len > INT32_MAX)
		return ro_errf(err, errlen, -EFBIG, "%s: too large", what);
	tok = json_tokener_new_ex(64);
	if (!tok)
		return ro_errf(err, errlen, -ENOMEM, "%s: out of memory", what);
	o = json_tokener_parse_ex(tok, text, (int)len);
	e = json_tokener_get_error(tok);
	end = json_tokener_get_parse_end(tok);
	json_tokener_free(tok);
	if (e == json_tokener_continue || (!o && e == json_tokener_success)) {
		json_object_put(o);
		return ro_errf(err, errlen, -EBADMSG, "%s: the JSON text ends early (truncated)",
			       what);
	}
	if (e != json_tokener_success) {
		json_object_put(o);
		return ro_errf(err, errlen, -EBADMSG, "%s: not JSON: %s at byte %zu", what,
			       json_tokener_error_desc(e), end);
	}
	for (size_t i = end; i < len; i++)
		if (text[i] != ' ' && text[i] != '\t' && text[i] != '\n' && text[i] != '\r') {
			json_object_put(o);
			return ro_errf(err, errlen, -EBADMSG,
				       "%s: bytes after the JSON value (at byte %zu)", what, i);
		}
	if (!json_object_is_type(o, json_type_object)) {
		const char *type = json_type_to_name(json_object_get_type(o));

		json_object_put(o);
		return ro_errf(err, errlen, -EBADMSG, "%s: a JSON %s, not an object", what, type);
	}
	*ret = o;
	return 0;
}

size_t ro_dtype_size(enum ro_dtype t)
{
	return t == RO_F32 ? 4 : t == RO_F8E4M3 ? 1 : 2;
}

float ro_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
	union {
		uint32_t u;
		float f;
	} v;

	if (exp == 0) {
		float f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */

		return sign ? -f : f;
	}
	if (exp == 31)
		v.u = sign | 0x7f800000 | (man << 13);
	else
		v.u = sign | ((exp + 112) << 23) | (man << 13);
	return v.f;
}

uint16_t ro_f32_to_f16(float f)
{
	union {
		float f;
		uint32_t u;
	} v = {.f = f};
	uint32_t sign = (v.u >> 16) & 0x8000, x = v.u & 0x7fffffff;

	if (x > 0x7f800000)
		return (uint16_t)(sign | 0x7e00);
	if (x >= 0x477ff000) /* rounds to >= 65520: infinity */
		return (uint16_t)(sign | 0x7c00);
	if (x < 0x38800000) { /* subnormal or zero in f16 */
		float a = (v.u & 0x7fffffff) == x ? (sign ? -f : f) : f;
		uint32_t m = (uint32_t)(a * 16777216.0f + 0.5f);

		return (uint16_t)(sign | m);
	}
	x += 0xfff + ((x >> 13) & 1) - (112u << 23);
	return (uint16_t)(sign | (x >> 13));
}

static int parse_dtype(const char *s, enum ro_dtype *ret)
{
	if (!strcmp(s, "F32"))
		*ret = RO_F32;
	else if (!strcmp(s, "BF16"))
		*ret = RO_BF16;
	else if (!strcmp(s, "F16"))
		*ret = RO_F16;
	else if (!strcmp(s, "F8_E4M3"))
		*ret = RO_F8E4M3;
	else
		return -ENOTSUP;
	return 0;
}

static int add_tensor(struct ro_st_set *s, const char *file, const char *name,
		      struct json_object *desc, const uint8_t *data, uint64_t data_len,
		      uint64_t data_at, char *err, size_t errlen)
{
	struct json_object *dt, *shape, *offs;
	struct ro_tensor t = {0};
	uint64_t elems = 1, b, e, es;

	if (!json_object_is_type(desc, json_type_object) ||
	    !json_object_object_get_ex(desc, "dtype", &dt) ||
	    !json_object_is_type(dt, json_type_string) ||
	    !json_object_object_get_ex(desc, "shape", &shape) ||
	    !json_object_is_type(shape, json_type_array) ||
	    !json_object_object_get_ex(desc, "data_offsets", &offs) ||
	    !json_object_is_type(offs, json_type_array) || json_object_array_length(offs) != 2)
		return ro_errf(err, errlen, -EBADMSG,
			       "%s: tensor %s: want dtype, shape and data_offsets [begin, end]",
			       file, name);
	if (parse_dtype(json_object_get_string(dt), &t.dtype))
		return ro_errf(
		    err, errlen, -ENOTSUP,
		    "%s: tensor %s: dtype %.32s is not supported (F32, BF16, F16, F8_E4M3)", file,
		    name, json_object_get_string(dt));
	if (json_object_array_length(shape) > 4)
		return ro_errf(err, errlen, -EBADMSG, "%s: tensor %s: %zu dimensions, at most 4",
			       file, name, json_object_array_length(shape));
	t.ndim = (uint32_t)json_object_array_length(shape);
	for (uint32_t i = 0; i < t.ndim; i++) {
		struct json_object *d = json_object_array_get_idx(shape, i);
		int64_t v;

		if (!json_object_is_type(d, json_type_int) || (v = json_object_get_int64(d)) < 0 ||
		    v > (1LL << 40))
			return ro_errf(err, errlen, -EBADMSG,
				       "%s: tensor %s: shape[%u] is not a size", file, name, i);
		t.shape[i] = (uint64_t)v;
		if (v && elems > (1ULL << 48) / (uint64_t)v)
			return ro_errf(err, errlen, -EBADMSG, "%s: tensor %s: shape too large", file,
				       name);
		elems *= (uint64_t)v;
	}
	for (int i = 0; i < 2; i++) {
		struct json_object *o = json_object_array_get_idx(offs, i);

		if (!json_object_is_type(o, json_type_int) || json_object_get_int64(o) < 0)
			return ro_errf(err, errlen, -EBADMSG,
				       "%s: tensor %s: data_offsets[%d] is not a byte offset", file,
				       name, i);
	}
	b = (uint64_t)json_object_get_int64(json_object_array_get_idx(offs, 0));
	e = (uint64_t)json_object_get_int64(json_object_array_get_idx(offs, 1));
	if (b > e || e > data_len)
		return ro_errf(err, errlen, -EBADMSG,
			       "%s: tensor %s: data_offsets [%llu, %llu) outside the %llu data bytes "
			       "(truncated file or lying header)",
			       file, name, (unsigned long long)b, (unsigned long long)e,
			       (unsigned long long)data_len);
	es = ro_dtype_size(t.dtype);
	if (e - b != elems * es)
		return ro_errf(err, errlen, -EBADMSG,
			       "%s: tensor %s: %llu bytes for %llu elements of %s", file, name,
			       (unsigned long long)(e - b), (unsigned long long)elems,
			       json_object_get_string(dt));
	/* the mapping is page aligned: the element must be aligned in the file */
	if ((data_at + b) % es)
		return ro_errf(err, errlen, -EBADMSG,
			       "%s: tensor %s: %s data at file offset %llu is not %llu-byte aligned "
			       "(header length and data_offsets must keep elements aligned)",
			       file, name, json_object_get_string(dt),
			       (unsigned long long)(data_at + b), (unsigned long long)es);
	t.data = data + b;
	t.begin = b;
	t.bytes = e - b;
	t.file = (uint32_t)s->n_files - 1;
	t.name = strdup(name);
	if (!t.name)
		return -ENOMEM;
	if (s->n == s->cap) {
		size_t cap = s->cap ? s->cap * 2 : 256;
		struct ro_tensor *nt = realloc(s->t, cap * sizeof(*nt));

		if (!nt) {
			free(t.name);
			return -ENOMEM;
		}
		s->t = nt;
		s->cap = cap;
	}
	s->t[s->n++] = t;
	return 0;
}

static int by_begin(const void *a, const void *b)
{
	const struct ro_tensor *x = *(const struct ro_tensor *const *)a,
			       *y = *(const struct ro_tensor *const *)b;

	if (x->begin != y->begin)
		return x->begin < y->begin ? -1 : 1;
	return x->bytes < y->bytes ? -1 : x->bytes > y->bytes;
}

/* As the format requires: the tensors of a file tile its data bytes exactly, no overlap,
 * no hole, nothing after the last one. */
static int check_tiling(struct ro_st_set *s, size_t first, const char *path, uint64_t data_len,
			char *err, size_t errlen)
{
	const size_t n = s->n - first;
	struct ro_tensor **v;
	uint64_t at = 0;
	int r = 0;

	if (!n)
		return data_len ? ro_errf(err, errlen, -EBADMSG,
					  "%s: %llu data bytes but no tensor", path,
					  (unsigned long long)data_len)
				: 0;
	v = malloc(n * sizeof(*v));
	if (!v)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++)
		v[i] = &s->t[first + i];
	qsort(v, n, sizeof(*v), by_begin);
	for (size_t i = 0; i < n && !r; i++) {
		if (v[i]->begin < at)
			r = ro_errf(err, errlen, -EBADMSG,
				    "%s: tensor %s: data_offsets [%llu, %llu) overlap tensor %s", path,
				    v[i]->name, (unsigned long long)v[i]->begin,
				    (unsigned long long)(v[i]->begin + v[i]->bytes), v[i - 1]->name);
		else if (v[i]->begin > at)
			r = ro_errf(err, errlen, -EBADMSG,
				    "%s: tensor %s: data_offsets begin at %llu, leaving a hole after "
				    "byte %llu",
				    path, v[i]->name, (unsigned long long)v[i]->begin,
				    (unsigned long long)at);
		at = v[i]->begin + v[i]->bytes;
	}
	if (!r && at != data_len)
		r = ro_errf(err, errlen, -EBADMSG,
			    "%s: the tensors end at data byte %llu of %llu (trailing bytes)", path,
			    (unsigned long long)at, (unsigned long long)data_len);
	free(v);
	return r;
}

static int open_file(struct ro_st_set *s, const char *path, char *err, size_t errlen)
{
	struct json_object *hdr = NULL;
	struct st_file *f;
	struct stat st;
	uint64_t hlen = 0;
	size_t first = s->n;
	int fd, r = 0;

	if (s->n_files == MAX_FILES)
		return ro_errf(err, errlen, -EINVAL, "%s: more than %d shards", path, MAX_FILES);
	/* O_NONBLOCK: a FIFO or a device in the model directory must not hang the loader */
	fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	if (fd < 0)
		return ro_errf(err, errlen, -errno, "%s: %s", path, strerror(errno));
	if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
		(void)close(fd);
		return ro_errf(err, errlen, -EBADMSG, "%s: not a regular file", path);
	}
	if (st.st_size < 8) {
		(void)close(fd);
		return ro_errf(err, errlen, -EBADMSG, "%s: %lld bytes: truncated (no header)",
			       path, (long long)st.st_size);
	}
	f = &s->files[s->n_files];
	f->size = (size_t)st.st_size;
	f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
	if (f->map == MAP_FAILED) {
		const int e = errno;

		(void)close(fd);
		f->map = NULL;
		return ro_errf(err, errlen, -e, "%s: mmap: %s", path, strerror(e));
	}
	f->fd = fd;
	f->name = strdup(strrchr(path, '/') ? strrchr(path, '/') + 1 : path);
	s->n_files++;
	if (!f->name)
		return -ENOMEM;
	for (int i = 7; i >= 0; i--)
		hlen = hlen << 8 | ((const uint8_t *)f->map)[i];
	if (hlen > MAX_HEADER || hlen > f->size - 8)
		return ro_errf(err, errlen, -EBADMSG,
			       "%s: header of %llu bytes in a %zu-byte file: truncated or not "
			       "safetensors",
			       path, (unsigned long long)hlen, f->size);
	{
		char what[4200];

		(void)snprintf(what, sizeof(what), "%s: header", path);
		r = ro_parse_json_object(what, (const char *)f->map + 8, (size_t)hlen, &hdr, err,
					 errlen);
		if (r)
			return r;
	}
	json_object_object_foreach(hdr, name, desc)
	{
		if (!strcmp(name, "__metadata__"))
			continue;
		r = add_tensor(s, path, name, desc, (const uint8_t *)f->map + 8 + hlen,
			       f->size - 8 - hlen, 8 + hlen, err, errlen);
		if (r)
			goto out;
	}
	r = check_tiling(s, first, path, f->size - 8 - hlen, err, errlen);
out:
	json_object_put(hdr);
	return r;
}

static int by_name(const void *a, const void *b)
{
	return strcmp(((const struct ro_tensor *)a)->name, ((const struct ro_tensor *)b)->name);
}

/* Sorted by name for lookups; a name twice (in one header or two shards) is an error. */
static int sort_unique(struct ro_st_set *s, const char *dir, char *err, size_t errlen)
{
	if (s->n < 2)
		return 0; /* (and no qsort of a NULL array) */
	qsort(s->t, s->n, sizeof(*s->t), by_name);
	for (size_t i = 1; i < s->n; i++)
		if (!strcmp(s->t[i - 1].name, s->t[i].name))
			return ro_errf(err, errlen, -EBADMSG, "%s: tensor %s appears twice (%s, %s)",
				       dir, s->t[i].name, s->files[s->t[i - 1].file].name,
				       s->files[s->t[i].file].name);
	return 0;
}

/* A shard name from an index: a plain file name in the directory. */
static bool shard_name_ok(const char *fn)
{
	return *fn && !strchr(fn, '/') && strcmp(fn, ".") && strcmp(fn, "..") && strlen(fn) < 256;
}

static int open_index(struct ro_st_set *s, const char *dir, const char *ipath, char *err,
		      size_t errlen)
{
	struct json_object *idx = NULL, *map;
	char path[4096], *text = NULL;
	size_t len;
	int r = ro_read_small(ipath, MAX_HEADER, &text, &len, err, errlen);

	if (r)
		return r;
	r = ro_parse_json_object(ipath, text, len, &idx, err, errlen);
	free(text);
	if (r)
		return r;
	if (!json_object_object_get_ex(idx, "weight_map", &map) ||
	    !json_object_is_type(map, json_type_object)) {
		r = ro_errf(err, errlen, -EBADMSG, "%s: want a \"weight_map\" object", ipath);
		goto out;
	}
	json_object_object_foreach(map, tname, fname)
	{
		const char *fn = json_object_get_string(fname);
		bool seen = false;

		if (!json_object_is_type(fname, json_type_string) || !shard_name_ok(fn)) {
			r = ro_errf(err, errlen, -EBADMSG,
				    "%s: weight_map: tensor %.200s: bad shard name \"%.200s\" (want a "
				    "file name in %s)",
				    ipath, tname, json_object_is_type(fname, json_type_string) ? fn : "",
				    dir);
			goto out;
		}
		for (size_t i = 0; i < s->n_files && !seen; i++)
			seen = !strcmp(s->files[i].name, fn);
		if (seen)
			continue;
		(void)snprintf(path, sizeof(path), "%s/%s", dir, fn);
		r = open_file(s, path, err, errlen);
		if (r)
			goto out;
	}
	r = sort_unique(s, dir, err, errlen);
	if (r)
		goto out;
	/* every tensor the index names must be in the shard it names */
	json_object_object_foreach(map, tn, fv)
	{
		const struct ro_tensor *t = ro_st_find(s, tn);

		if (!t) {
			r = ro_errf(err, errlen, -ENOENT, "%s names %.200s, which no shard holds",
				    ipath, tn);
			goto out;
		}
		if (strcmp(s->files[t->file].name, json_object_get_string(fv))) {
			r = ro_errf(err, errlen, -EBADMSG,
				    "%s: weight_map puts %.200s in %s, but it is in %s", ipath, tn,
				    json_object_get_string(fv), s->files[t->file].name);
			goto out;
		}
	}
out:
	json_object_put(idx);
	return r;
}

int ro_st_open_dir(const char *dir, struct ro_st_set **ret, char *err, size_t errlen)
{
	struct ro_st_set *s = calloc(1, sizeof(*s));
	char path[4096];
	struct stat st;
	int r;

	if (!s)
		return -ENOMEM;
	/* as Hugging Face's from_pretrained: model.safetensors first, the index only without
	 * it (an index left beside a re-saved single file is stale) */
	(void)snprintf(path, sizeof(path), "%s/model.safetensors", dir);
	if (lstat(path, &st) == 0 || errno != ENOENT) {
		r = open_file(s, path, err, errlen);
		if (!r)
			r = sort_unique(s, dir, err, errlen);
	} else {
		(void)snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
		if (lstat(path, &st) && errno == ENOENT)
			r = ro_errf(err, errlen, -ENOENT,
				    "%s: no model.safetensors or model.safetensors.index.json",
				    dir);
		else
			r = open_index(s, dir, path, err, errlen);
	}
	if (r) {
		ro_st_free(s);
		return r;
	}
	*ret = s;
	return 0;
}

struct ro_st_set *ro_st_free(struct ro_st_set *s)
{
	if (!s)
		return NULL;
	for (size_t i = 0; i < s->n_files; i++) {
		if (s->files[i].map)
			(void)munmap(s->files[i].map, s->files[i].size);
		(void)close(s->files[i].fd);
	}
	for (size_t i = 0; i < s->n_files; i++)
		free(s->files[i].name);
	for (size_t i = 0; i < s->n; i++)
		free(s->t[i].name);
	free(s->t);
	free(s);
	return NULL;
}

const struct ro_tensor *ro_st_find(const struct ro_st_set *s, const char *name)
{
	size_t lo = 0, hi = s->n;

	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		int c = strcmp(s->t[mid].name, name);

		if (!c)
			return &s->t[mid];
		if (c < 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	return NULL;
}

size_t ro_st_count(const struct ro_st_set *s)
{
	return s->n;
}

size_t ro_st_index(const struct ro_st_set *s, const struct ro_tensor *t)
{
	return (size_t)(t - s->t);
}

const struct ro_tensor *ro_st_at(const struct ro_st_set *s, size_t i)
{
	return i < s->n ? &s->t[i] : NULL;
}

int ro_st_read(const struct ro_st_set *s, const struct ro_tensor *t, void *dst)
{
	const struct st_file *f = &s->files[t->file];
	const off_t off = (off_t)((const uint8_t *)t->data - (const uint8_t *)f->map);
	uint64_t got = 0;

	while (got < t->bytes) {
		const size_t want = t->bytes - got > (1u << 30) ? 1u << 30 : (size_t)(t->bytes - got);
		const ssize_t r = pread(f->fd, (uint8_t *)dst + got, want, off + (off_t)got);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -errno;
		if (r == 0)
			return -EBADMSG; /* shorter than when it was mapped */
		got += (uint64_t)r;
	}
	return 0;
}

const char *ro_st_file(const struct ro_st_set *s, const struct ro_tensor *t)
{
	return s->files[t->file].name;
}
