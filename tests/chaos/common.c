/* What the chaos driver and checker share: the redis-server they run on loopback with an
 * append-only file (fsync always or everysec), kept in a directory of the run so that a
 * SIGKILLed server restarts from it; the record format; a seeded generator. */
#include "tests/chaos/chaos.h"

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
#include "kernels/model.h"
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

void ch_model_opts(struct ro_make_model_opts *o)
{
	/* tests/test_agent.c's model: a few hundred tokens a second per agent thread */
	ro_make_model_defaults(o);
	o->layers = 4;
	o->hidden = 256;
	o->heads = 4;
	o->kv_heads = 2;
	o->head_dim = 64;
	o->experts = 8;
	o->top_k = 2;
	o->expert_ffn = 256;
	o->vocab = 1024;
}

/* ---- redis-server ------------------------------------------------------------------------ */

static int free_port(void)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t len = sizeof(a);
	int fd = socket(AF_INET, SOCK_STREAM, 0), port = -1;

	if (fd < 0)
		return -1;
	if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
	    getsockname(fd, (struct sockaddr *)&a, &len) == 0)
		port = ntohs(a.sin_port);
	(void)close(fd);
	return port;
}

int ch_redis_spawn(struct ch_redis *r)
{
	char port[16];
	pid_t parent = getpid();
	pid_t pid;

	(void)snprintf(port, sizeof(port), "%d", r->port);
	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0) {
		const char *server = getenv("RO_REDIS_SERVER");

		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(1);
		if (!server || !*server)
			server = RO_REDIS_SERVER[0] ? RO_REDIS_SERVER : "redis-server";
		/* no RDB snapshots and no AOF rewrites: the append-only file only grows, so a
		 * simulated power loss can cut it back to an earlier length */
		execlp(server, server, "--port", port, "--bind", "127.0.0.1", "--dir", r->dir,
		       "--save", "", "--appendonly", "yes", "--appendfsync",
		       r->everysec ? "everysec" : "always", "--auto-aof-rewrite-percentage", "0",
		       "--aof-load-truncated", "yes", "--daemonize", "no", "--logfile", r->log,
		       "--protected-mode", "yes", (char *)NULL);
		_exit(127);
	}
	r->pid = pid;
	/* up when it answers PING (not LOADING); a taken port shows as an early exit */
	for (int i = 0; i < 1500; i++) {
		redisContext *c;
		int st;

		if (waitpid(pid, &st, WNOHANG) == pid) {
			r->pid = 0;
			return -EADDRINUSE;
		}
		c = redisConnectWithTimeout("127.0.0.1", r->port, (struct timeval){0, 200000});
		if (c && !c->err) {
			redisReply *rep;

			(void)redisSetTimeout(c, (struct timeval){0, 500000});
			rep = redisCommand(c, "PING");
			bool ok =
			    rep && rep->type == REDIS_REPLY_STATUS && !strcmp(rep->str, "PONG");

			if (rep)
				freeReplyObject(rep);
			redisFree(c);
			if (ok)
				return 0;
		} else if (c) {
			redisFree(c);
		}
		ro_test_msleep(10);
	}
	return -ETIMEDOUT;
}

int ch_redis_start(struct ch_redis *r, const char *dir, bool everysec)
{
	int ret = -EADDRINUSE;

	memset(r, 0, sizeof(*r));
	r->everysec = everysec;
	(void)snprintf(r->dir, sizeof(r->dir), "%s", dir);
	(void)snprintf(r->log, sizeof(r->log), "%s/redis.log", dir);
	if (mkdir(dir, 0700) && errno != EEXIST)
		return -errno;
	for (int tries = 0; tries < 8 && ret == -EADDRINUSE; tries++) {
		r->port = free_port();
		if (r->port < 0)
			return -EADDRNOTAVAIL;
		ret = ch_redis_spawn(r);
	}
	if (!ret)
		(void)snprintf(r->url, sizeof(r->url), "redis://127.0.0.1:%d/0", r->port);
	return ret;
}

static void reap(struct ch_redis *r, int sig)
{
	if (r->pid <= 0)
		return;
	(void)kill(r->pid, SIGCONT);
	(void)kill(r->pid, sig);
	for (int i = 0; i < 500; i++) {
		if (waitpid(r->pid, NULL, WNOHANG) == r->pid) {
			r->pid = 0;
			return;
		}
		ro_test_msleep(10);
	}
	(void)kill(r->pid, SIGKILL);
	(void)waitpid(r->pid, NULL, 0);
	r->pid = 0;
}

void ch_redis_kill(struct ch_redis *r)
{
	reap(r, SIGKILL);
}

void ch_redis_stop(struct ch_redis *r)
{
	reap(r, SIGTERM);
}

int ch_aof_incr_path(const struct ch_redis *r, char *buf, size_t len)
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
