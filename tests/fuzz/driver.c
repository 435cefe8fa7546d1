/* Replays fuzz inputs without libFuzzer: runs LLVMFuzzerTestOneInput over every file of
 * the directories (or files) given, in name order, so make check keeps every corpus and
 * regression input passing (under ASan + UBSan with --enable-sanitizers). A crash aborts
 * the run; the file it was on is printed first, so the log names it. */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int run_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	uint8_t *buf = NULL;
	long n;

	if (!f || fseek(f, 0, SEEK_END) || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET)) {
		(void)fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
		if (f)
			(void)fclose(f);
		return -1;
	}
	/* exactly n bytes on the heap: a read past the input is ASan's to see */
	buf = malloc(n ? (size_t)n : 1);
	if (!buf || (n && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
		(void)fprintf(stderr, "replay: %s: short read\n", path);
		free(buf);
		(void)fclose(f);
		return -1;
	}
	(void)fclose(f);
	(void)fprintf(stderr, "replay: %s (%ld bytes)\n", path, n);
	(void)LLVMFuzzerTestOneInput(buf, (size_t)n);
	free(buf);
	return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b)
{
	return strcmp((*a)->d_name, (*b)->d_name);
}

int main(int argc, char **argv)
{
	size_t files = 0;
	int bad = 0;

	if (argc < 2) {
		(void)fprintf(stderr, "usage: %s DIR|FILE...\n", argv[0]);
		return 2;
	}
	if (LLVMFuzzerInitialize)
		(void)LLVMFuzzerInitialize(&argc, &argv);
	for (int i = 1; i < argc; i++) {
		struct dirent **ents;
		struct stat st;
		int n;

		if (stat(argv[i], &st)) {
			if (errno == ENOENT)
				continue; /* no regression inputs yet for this target */
			(void)fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
			bad = 1;
			continue;
		}
		if (!S_ISDIR(st.st_mode)) {
			bad |= run_file(argv[i]) != 0;
			files++;
			continue;
		}
		n = scandir(argv[i], &ents, NULL, by_name);
		if (n < 0) {
			(void)fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
			bad = 1;
			continue;
		}
		for (int k = 0; k < n; k++) {
			char p[4096];

			(void)snprintf(p, sizeof(p), "%s/%s", argv[i], ents[k]->d_name);
			if (ents[k]->d_name[0] != '.' && !stat(p, &st) && S_ISREG(st.st_mode)) {
				bad |= run_file(p) != 0;
				files++;
			}
			free(ents[k]);
		}
		free(ents);
	}
	(void)fprintf(stderr, "replay: %zu inputs, %s\n", files, bad ? "FAILED" : "all passed");
	return bad;
}
