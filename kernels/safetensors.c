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

size_t ro_dtype_size(enum ro_dtype t)
{
	return t == RO_F32 ? 4 : 2;
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
	else
		return -ENOTSUP;
	return 0;
}

static int add_tensor(struct ro_st_set *s, const char *file, const char *name,
		      struct json_object *desc, const uint8_t *data, uint64_t data_len, char *err,
		      size_t errlen)
{
	struct json_object *dt, *shape, *offs;
	struct ro_tensor t = {0};
	uint64_t elems = 1, b, e;

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
		return ro_errf(err, errlen, -ENOTSUP,
			       "%s: tensor %s: dtype %s is not supported (F32, BF16, F16)", file,
			       name, json_object_get_string(dt));
	t.ndim = (uint32_t)json_object_array_length(shape);
	if (t.ndim > 4)
		return ro_errf(err, errlen, -EBADMSG, "%s: tensor %s: %u dimensions", file, name,
			       t.ndim);
	for (uint32_t i = 0; i < t.ndim; i++) {
		struct json_object *d = json_object_array_get_idx(shape, i);
		int64_t v;

		if (!json_object_is_type(d, json_type_int) || (v = json_object_get_int64(d)) < 0 ||
		    v > (1LL << 40))
			return ro_errf(err, errlen, -EBADMSG, "%s: tensor %s: bad shape", file, name);
		t.shape[i] = (uint64_t)v;
		if (v && elems > (1ULL << 48) / (uint64_t)v)
			return ro_errf(err, errlen, -EBADMSG, "%s: tensor %s: shape too large", file,
				       name);
		elems *= (uint64_t)v;
	}
	for (int i = 0; i < 2; i++) {
		struct json_object *o = json_object_array_get_idx(offs, i);

		if (!json_object_is_type(o, json_type_int) || json_object_get_int64(o) < 0)
			return ro_errf(err, errlen, -EBADMSG, "%s: tensor %s: bad data_offsets", file,
				       name);
	}
	b = (uint64_t)json_object_get_int64(json_object_array_get_idx(offs, 0));
	e = (uint64_t)json_object_get_int64(json_object_array_get_idx(offs, 1));
	if (b > e || e > data_len)
		return ro_errf(err, errlen, -EBADMSG,
			       "%s: tensor %s: data_offsets [%llu, %llu) outside the %llu data bytes "
			       "(truncated file or lying header)",
			       file, name, (unsigned long long)b, (unsigned long long)e,
			       (unsigned long long)data_len);
	if (e - b != elems * ro_dtype_size(t.dtype))
		return ro_errf(err, errlen, -EBADMSG,
			       "%s: tensor %s: %llu bytes for %llu elements of %s", file, name,
			       (unsigned long long)(e - b), (unsigned long long)elems,
			       json_object_get_string(dt));
	t.data = data + b;
	t.bytes = e - b;
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

static int open_file(struct ro_st_set *s, const char *path, char *err, size_t errlen)
{
	struct json_tokener *tok = NULL;
	struct json_object *hdr = NULL;
	struct st_file *f;
	struct stat st;
	uint64_t hlen = 0;
	int fd, r = 0;

	if (s->n_files == MAX_FILES)
		return ro_errf(err, errlen, -EINVAL, "%s: more than %d shards", path, MAX_FILES);
	fd = open(path, O_RDONLY | O_CLOEXEC);
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
	(void)close(fd);
	if (f->map == MAP_FAILED) {
		f->map = NULL;
		return ro_errf(err, errlen, -errno, "%s: mmap: %s", path, strerror(errno));
	}
	s->n_files++;
	for (int i = 7; i >= 0; i--)
		hlen = hlen << 8 | ((const uint8_t *)f->map)[i];
	if (hlen > MAX_HEADER || hlen > f->size - 8)
		return ro_errf(err, errlen, -EBADMSG,
			       "%s: header of %llu bytes in a %zu-byte file: truncated or not "
			       "safetensors",
			       path, (unsigned long long)hlen, f->size);
	tok = json_tokener_new_ex(16);
	if (!tok)
		return -ENOMEM;
	hdr = json_tokener_parse_ex(tok, (const char *)f->map + 8, (int)hlen);
	if (!hdr || json_tokener_get_error(tok) != json_tokener_success ||
	    !json_object_is_type(hdr, json_type_object)) {
		r = ro_errf(err, errlen, -EBADMSG, "%s: header is not a JSON object (%s)", path,
			    json_tokener_error_desc(json_tokener_get_error(tok)));
		goto out;
	}
	json_object_object_foreach(hdr, name, desc)
	{
		if (!strcmp(name, "__metadata__"))
			continue;
		r = add_tensor(s, path, name, desc, (const uint8_t *)f->map + 8 + hlen,
			       f->size - 8 - hlen, err, errlen);
		if (r)
			goto out;
	}
out:
	json_object_put(hdr);
	json_tokener_free(tok);
	return r;
}

static int by_name(const void *a, const void *b)
{
	return strcmp(((const struct ro_tensor *)a)->name, ((const struct ro_tensor *)b)->name);
}

/* Sorted by name for lookups; a name twice (in one header or two shards) is an error. */
static int sort_unique(struct ro_st_set *s, const char *dir, char *err, size_t errlen)
{
	qsort(s->t, s->n, sizeof(*s->t), by_name);
	for (size_t i = 1; i < s->n; i++)
		if (!strcmp(s->t[i - 1].name, s->t[i].name))
			return ro_errf(err, errlen, -EBADMSG, "%s: tensor %s appears twice", dir,
				       s->t[i].name);
	return 0;
}

int ro_st_open_dir(const char *dir, struct ro_st_set **ret, char *err, size_t errlen)
{
	struct ro_st_set *s = calloc(1, sizeof(*s));
	char path[4096];
	struct json_object *idx = NULL, *map;
	int r = 0;

	if (!s)
		return -ENOMEM;
	(void)snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
	if (access(path, F_OK) == 0) {
		char *seen[MAX_FILES];
		size_t n_seen = 0;

		idx = json_object_from_file(path);
		if (!idx || !json_object_object_get_ex(idx, "weight_map", &map) ||
		    !json_object_is_type(map, json_type_object)) {
			r = ro_errf(err, errlen, -EBADMSG, "%s: want a JSON object with weight_map",
				    path);
			goto out;
		}
		json_object_object_foreach(map, tname, fname)
		{
			const char *fn = json_object_get_string(fname);
			bool dup = false;

			(void)tname;
			if (!json_object_is_type(fname, json_type_string) || strchr(fn, '/') ||
			    !strcmp(fn, "..")) {
				r = ro_errf(err, errlen, -EBADMSG, "%s: bad shard name", path);
				break;
			}
			for (size_t i = 0; i < n_seen && !dup; i++)
				dup = !strcmp(seen[i], fn);
			if (dup)
				continue;
			if (n_seen == MAX_FILES) {
				r = ro_errf(err, errlen, -EINVAL, "%s: too many shards", path);
				break;
			}
			seen[n_seen++] = (char *)fn;
			(void)snprintf(path, sizeof(path), "%s/%s", dir, fn);
			r = open_file(s, path, err, errlen);
			if (r)
				break;
		}
		if (r)
			goto out;
		r = sort_unique(s, dir, err, errlen);
		if (r)
			goto out;
		/* every tensor the index names must be in some shard */
		json_object_object_foreach(map, tn, fv)
		{
			(void)fv;
			if (!ro_st_find(s, tn)) {
				r = ro_errf(err, errlen, -ENOENT,
					    "%s/model.safetensors.index.json names %s, which no "
					    "shard holds",
					    dir, tn);
				goto out;
			}
		}
	} else {
		(void)snprintf(path, sizeof(path), "%s/model.safetensors", dir);
		r = open_file(s, path, err, errlen);
		if (!r)
			r = sort_unique(s, dir, err, errlen);
	}
out:
	json_object_put(idx);
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
	for (size_t i = 0; i < s->n_files; i++)
		if (s->files[i].map)
			(void)munmap(s->files[i].map, s->files[i].size);
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
