/* What the chaos driver and checker share: where the redis-server's append-only file is
 * (the server itself is tests/redis_fixture.c's, started with a growing AOF in a directory
 * of the run so that a SIGKILLed server restarts from it); the record format; a seeded
 * generator. */
#include "tests/chaos/chaos.h"
#include "tests/redis_fixture.h"

#include <arpa/inet.h>
#include <errno.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "config.h"
#include "tests/testutil.h"

const char *const ch_kind_name[CH_NKINDS] = {
    "kill",	 "stop",	  "spot",	 "rebalance", "lifecycle",
    "sigterm",	 "ctl",		  "redis_restart", "redis_pause", "redis_down",
    "imds",	 "poison",	  "poison_ckpt", "flood",     "short_lease",
};

int ch_kind_of(const char *name)
{
	for (int k = 0; k < CH_NKINDS; k++)
		if (!strcmp(name, ch_kind_name[k]))
			return k;
	return -1;
}

const char *const ch_poison_name[CH_NPOISON] = {
    "badjson", "n_up", "n_down", "stray_body", "stray_hash", "ckpt_garbage", "ckpt_vocab",
    "ckpt_neg",
};

const char *ch_poison_expect(int v)
{
	/* a body the agent cannot trust must go to dead; a unit with a good body and a bad
	 * checkpoint (or harmless stray fields) may also be run, from scratch */
	return v <= CH_PV_STRAY_BODY ? "dead" : "either";
}


/* ---- redis-server ------------------------------------------------------------------------ */

int ch_aof_incr_path(const struct ro_test_redis *r, char *buf, size_t len)
{
	char path[300], line[512], last[256] = "";
	FILE *f;

	/* Redis 7: appendonlydir/appendonly.aof.manifest lists "file NAME seq N type b|h|i" */
	(void)snprintf(path, sizeof(path), "%s/appendonlydir/appendonly.aof.manifest", r->dir);
	f = fopen(path, "r");
	if (!f)
		return -errno;
	while (fgets(line, sizeof(line), f)) {
		char name[256];

		if (sscanf(line, "file %255s", name) == 1 && strstr(line, " type i"))
			(void)snprintf(last, sizeof(last), "%s", name);
	}
	(void)fclose(f);
	if (!last[0])
		return -ENOENT;
	(void)snprintf(buf, len, "%s/appendonlydir/%s", r->dir, last);
	return 0;
}

long long ch_file_size(const char *path)
{
	struct stat st;

	return stat(path, &st) ? -1 : (long long)st.st_size;
}

/* ---- generator ------------------------------------------------------------------------------ */

uint64_t ch_rng_next(struct ch_rng *g)
{
	uint64_t z = (g->s += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

uint32_t ch_rng_range(struct ch_rng *g, uint32_t lo, uint32_t hi)
{
	if (hi <= lo)
		return lo;
	return lo + (uint32_t)(ch_rng_next(g) % ((uint64_t)hi - lo + 1));
}

double ch_rng_unit(struct ch_rng *g)
{
	return (double)(ch_rng_next(g) >> 11) / 9007199254740992.0;
}

/* ---- record lines ------------------------------------------------------------------------------ */

bool ch_is(const char *line, const char *type)
{
	size_t n = strlen(type);

	return !strncmp(line, type, n) && (line[n] == ' ' || line[n] == '\n' || !line[n]);
}

bool ch_kv(const char *line, const char *key, char *out, size_t len)
{
	size_t k = strlen(key);

	for (const char *p = strchr(line, ' '); p; p = strchr(p + 1, ' ')) {
		if (!strncmp(p + 1, key, k) && p[1 + k] == '=') {
			const char *v = p + 2 + k;
			size_t n = strcspn(v, " \n");

			if (n >= len)
				n = len - 1;
			memcpy(out, v, n);
			out[n] = '\0';
			return true;
		}
	}
	return false;
}

long long ch_kv_ll(const char *line, const char *key, long long dflt)
{
	char v[64];

	return ch_kv(line, key, v, sizeof(v)) ? strtoll(v, NULL, 10) : dflt;
}
