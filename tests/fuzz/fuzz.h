/* Shared by the fuzz targets (tests/fuzz/fuzz_<name>.c): the libFuzzer entry points, a
 * private temporary directory made once and removed at exit, and a file writer. Built both
 * by clang with libFuzzer (make fuzz) and by the project's compiler with driver.c, which
 * replays the corpora in make check. */
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* An invariant the target checks broke: abort, so libFuzzer and the replay driver both
 * report the input. */
#define FUZZ_ASSERT(cond)                                                                   \
	do {                                                                                \
		if (!(cond)) {                                                              \
			(void)fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__,     \
				      __LINE__, #cond);                                             \
			abort();                                                            \
		}                                                                           \
	} while (0)

static char fuzz_dir[256] __attribute__((unused));

static inline void fuzz_rmdir(void)
{
	DIR *d = opendir(fuzz_dir);
	struct dirent *e;
	char p[512];

	if (!d)
		return;
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
			(void)snprintf(p, sizeof(p), "%s/%s", fuzz_dir, e->d_name);
			(void)unlink(p);
		}
	(void)closedir(d);
	(void)rmdir(fuzz_dir);
}

/* The target's directory (files only, flat), made on the first call. */
static inline const char *fuzz_tmpdir(void)
{
	const char *t = getenv("TMPDIR");

	if (fuzz_dir[0])
		return fuzz_dir;
	(void)snprintf(fuzz_dir, sizeof(fuzz_dir), "%s/ro-fuzz-XXXXXX", t && *t ? t : "/tmp");
	if (!mkdtemp(fuzz_dir)) {
		perror("fuzz: mkdtemp");
		abort();
	}
	(void)atexit(fuzz_rmdir);
	return fuzz_dir;
}

/* dir/name := data[0..size) */
static inline void fuzz_write(const char *name, const void *data, size_t size)
{
	char p[512];
	int fd;

	(void)snprintf(p, sizeof(p), "%s/%s", fuzz_tmpdir(), name);
	fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0 || (size && write(fd, data, size) != (ssize_t)size) || close(fd)) {
		perror("fuzz: write");
		abort();
	}
}

/* data as a NUL-terminated string (caller frees) */
static inline char *fuzz_cstr(const uint8_t *data, size_t size)
{
	char *s = malloc(size + 1);

	if (!s)
		abort();
	memcpy(s, data, size);
	s[size] = '\0';
	return s;
}
