/* Fuzz target: the config file parser (agent/config.c) through ro_config_load(), as
 * rolloutd reads /etc/rolloutd/rolloutd.conf, then --print-config, which walks every
 * setting (and redacts the Redis URL). A file with a NUL byte must be refused. The command line empties redis-password-file, so a
 * file naming one never makes the target read some other file. */
#include "tests/fuzz/fuzz.h"

#include <errno.h>

#include "agent/settings.h"

static FILE *devnull;
static char path[512];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	extern char **environ;

	(void)argc;
	(void)argv;
	/* the environment beats the file: none of ours may mask what the input sets */
	for (char **e = environ; *e;) {
		if (!strncmp(*e, "ROLLOUTD_", 9)) {
			char name[256];
			size_t n = strcspn(*e, "=");

			(void)snprintf(name, sizeof(name), "%.*s", (int)n, *e);
			(void)unsetenv(name);
			e = environ;
		} else {
			e++;
		}
	}
	devnull = fopen("/dev/null", "w");
	if (!devnull)
		abort();
	(void)snprintf(path, sizeof(path), "%s/rolloutd.conf", fuzz_tmpdir());
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *argv[] = {"rolloutd", "--config", path, "--redis-password-file=", "--print-config",
			NULL};
	struct ro_config c;
	int r;

	fuzz_write("rolloutd.conf", data, size);
	r = ro_config_load(&c, 5, argv, devnull, devnull);
	FUZZ_ASSERT(r == 1 || r == -EINVAL || r == -ENOMEM);
	FUZZ_ASSERT(r != 1 || !memchr(data, '\0', size)); /* a NUL byte is refused */
	if (r == 1) { /* printed: the values it took are within the table's bounds */
		FUZZ_ASSERT(c.redis && c.queue && c.prefix);
		FUZZ_ASSERT(c.lease_ms >= 1000 && c.ep_size >= 1 && c.ep_size <= 64);
	}
	ro_config_clear(&c);
	return 0;
}
