/* The settings table (Redis's src/config.c pattern): name, type, default, check and help
 * per row. The same parser takes a value from a flag (--lease-ms 30000 or
 * --lease-ms=30000), an environment variable (ROLLOUTD_LEASE_MS) or a line of the config
 * file (lease-ms = 30000; lease_ms works too). An unknown key or a bad value stops the
 * start, naming the setting and where it came from. */
#include "agent/settings.h"
#include "queue/queue.h"

#include <ctype.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>
#include <unistd.h>

enum type { T_STR, T_U32, T_BOOL, T_I64, T_ENUM };

struct setting {
	const char *name;
	enum type type;
	size_t off;
	const char *def;
	uint64_t min, max;	    /* numbers */
	const char *const *choices; /* enums: index = value */
	const char *help;
};

static const char *const rebalance_names[] = {"drain", "stop-claiming", "ignore", NULL};
static const char *const ep_mode_names[] = {"auto", "low-latency", "throughput", NULL};
static const char *const dtype_names[] = {"f32", "bf16", NULL};
static const char *const combine_names[] = {"exact", "sum", NULL};
static const char *const swap_names[] = {"recompute", "finish", NULL};
static const char *const cluster_names[] = {"auto", "yes", "no", NULL};
static const char *const level_names[] = {"emerg", "alert", "crit",  "err",
					  "warning", "notice", "info", "debug", NULL};

/* the configured sysconfdir's (./configure --sysconfdir=/etc, as packages do) */
#ifndef RO_SYSCONFDIR
#define RO_SYSCONFDIR "/etc"
#endif
#define RO_CONFIG_FILE RO_SYSCONFDIR "/rolloutd/rolloutd.conf"

#define F(x) offsetof(struct ro_config, x)
static const struct setting table[] = {
    {"redis", T_STR, F(redis), "redis://127.0.0.1:6379/0", 0, 0, NULL,
     "Redis URL: redis://[user[:password]@]host[:port][/db], rediss://... (TLS), "
     "unix:///path, redis+sentinel://[user:pw@]h1:26379,h2/MASTER[/db]"},
    {"redis-password", T_STR, F(redis_password), "", 0, 0, NULL,
     "Redis password (beats the URL's; prefer ROLLOUTD_REDIS_PASSWORD or the file)"},
    {"redis-password-file", T_STR, F(redis_password_file), "", 0, 0, NULL,
     "file whose first line is the Redis password (beats redis-password)"},
    {"redis-sentinel-password", T_STR, F(redis_sentinel_password), "", 0, 0, NULL,
     "the sentinels' own password, when they have one"},
    {"redis-tls-ca", T_STR, F(redis_tls_ca), "", 0, 0, NULL,
     "CA file or directory that signs the server's certificate; empty: the system store"},
    {"redis-tls-cert", T_STR, F(redis_tls_cert), "", 0, 0, NULL,
     "client certificate (PEM) for mutual TLS"},
    {"redis-tls-key", T_STR, F(redis_tls_key), "", 0, 0, NULL, "its private key (PEM)"},
    {"redis-tls-server-name", T_STR, F(redis_tls_server_name), "", 0, 0, NULL,
     "name sent (SNI) and verified in the server's certificate; empty: the URL's host"},
    {"redis-cluster", T_ENUM, F(redis_cluster), "auto", 0, 0, cluster_names,
     "Redis Cluster routing: auto (detected) | yes | no"},
    {"redis-wait-replicas", T_U32, F(redis_wait_replicas), "0", 0, 64, NULL,
     "confirm enqueue, publish, complete and requeue only once this many replicas have "
     "them (WAIT)"},
    {"redis-wait-timeout-ms", T_U32, F(redis_wait_timeout_ms), "1000", 1, 600000, NULL,
     "how long one WAIT waits for the replicas (then the write is sent again)"},
    {"queue", T_STR, F(queue), "default", 0, 0, NULL, "queue name (the {q} of the keys)"},
    {"prefix", T_STR, F(prefix), "ro", 0, 0, NULL, "Redis key prefix"},
    {"worker-id", T_STR, F(worker_id), "", 0, 0, NULL,
     "worker id; empty: the IMDS instance-id, else the hostname"},
    {"model", T_STR, F(model), "", 0, 0, NULL,
     "model directory (Hugging Face layout: config.json + safetensors)"},
    {"max-inflight", T_U32, F(max_inflight), "64", 1, 65536, NULL,
     "sequences decoded at once (continuous batching)"},
    {"claim-batch", T_U32, F(claim_batch), "4", 1, 256, NULL, "units claimed per claim"},
    {"prefill-chunk", T_U32, F(prefill_chunk), "256", 1, 1 << 20, NULL,
     "prompt tokens prefilled per engine step, beside the decode of running sequences"},
    {"max-attempts", T_U32, F(max_attempts), "3", 1, 1000, NULL,
     "attempts (expired leases, failed runs) before a unit is dead-lettered"},
    {"redis-timeout-ms", T_U32, F(redis_timeout_ms), "2000", 100, 600000, NULL,
     "connect and reply timeout of one Redis attempt (operations retry within their own time)"},
    {"redis-unready-ms", T_U32, F(redis_unready_ms), "3000", 100, 3600000, NULL,
     "not ready (status --ready, the probe) once Redis has not answered for this long"},
    {"lease-ms", T_U32, F(lease_ms), "30000", 1000, 3600000, NULL,
     "lease on a claimed unit; renewed every third of it"},
    {"checkpoint-tokens", T_U32, F(checkpoint_tokens), "32", 1, 1000000, NULL,
     "checkpoint an unfinished sample every N generated tokens"},
    {"checkpoint-ms", T_U32, F(checkpoint_ms), "2000", 10, 3600000, NULL,
     "... or every T ms, whichever comes first"},
    {"imds", T_BOOL, F(imds), "true", 0, 0, NULL, "watch EC2 instance metadata"},
    {"imds-endpoint", T_STR, F(imds_endpoint), "http://169.254.169.254", 0, 0, NULL,
     "IMDS endpoint (http://[fd00:ec2::254] for IPv6, or the mock's URL)"},
    {"imds-poll-ms", T_U32, F(imds_poll_ms), "1000", 50, 60000, NULL,
     "spot instance-action poll interval"},
    {"imds-slow-poll-ms", T_U32, F(imds_slow_poll_ms), "5000", 50, 600000, NULL,
     "rebalance and ASG lifecycle poll interval (AWS suggests 5 s)"},
    {"imds-v1-fallback", T_BOOL, F(imds_v1_fallback), "false", 0, 0, NULL,
     "fall back to IMDSv1 when the token PUT fails"},
    {"drain-margin-ms", T_U32, F(drain_margin_ms), "15000", 0, 600000, NULL,
     "drain deadline = notice time minus this"},
    {"notice-s", T_U32, F(notice_s), "120", 1, 86400, NULL,
     "lead time assumed for drains that carry no time (rebalance, ASG lifecycle)"},
    {"rebalance", T_ENUM, F(rebalance), "stop-claiming", 0, 0, rebalance_names,
     "on a rebalance recommendation: drain | stop-claiming | ignore"},
    {"sigterm-grace-s", T_U32, F(sigterm_grace_s), "90", 0, 86400, NULL,
     "drain deadline after SIGTERM (keep below TimeoutStopSec)"},
    {"max-prompt", T_U32, F(max_prompt), "32768", 1, 1 << 24, NULL, "unit bound: prompt tokens"},
    {"max-n", T_U32, F(max_n), "64", 1, 4096, NULL, "unit bound: samples per unit"},
    {"max-new-tokens", T_U32, F(max_new_tokens), "32768", 1, 1 << 24, NULL,
     "unit bound: generated tokens per sample"},
    {"max-body", T_U32, F(max_body), "1048576", 64, 1 << 30, NULL, "unit bound: JSON bytes"},
    {"high-water", T_U32, F(high_water), "100000", 1, UINT32_MAX, NULL,
     "stop claiming while the trainer's lag on the samples stream is above this"},
    {"trainer-group", T_STR, F(trainer_group), "", 0, 0, NULL,
     "the trainer's consumer group on the samples stream (empty: the most behind)"},
    {"metrics-file", T_STR, F(metrics_file), "", 0, 0, NULL,
     "Prometheus textfile (node_exporter textfile collector); empty: none"},
    {"metrics-interval-ms", T_U32, F(metrics_interval_ms), "5000", 100, 600000, NULL,
     "how often the textfile is rewritten"},
    {"status-interval-ms", T_U32, F(status_interval_ms), "5000", 100, 600000, NULL,
     "how often STATUS= and the heartbeat are sent"},
    {"control-socket", T_STR, F(control_socket), "/run/rolloutd/control.sock", 0, 0, NULL,
     "unix socket for rolloutctl drain / status --local (mode 0600); empty: none"},
    {"threads", T_U32, F(threads), "0", 0, 1024, NULL, "model threads; 0: one per CPU"},
    {"weights-hugepages", T_BOOL, F(weights_hugepages), "true", 0, 0, NULL,
     "copy the linear weights (of the experts this rank owns) into transparent huge pages: "
     "faster decoding, a copy at load; false: read them in place from the mapped files"},
    {"policy-version", T_I64, F(policy_version), "0", 0, INT64_MAX, NULL,
     "policy version of the weights in `model` (samples carry it); newer ones published with "
     "`rolloutctl policy publish` are loaded while running"},
    {"policy-swap", T_ENUM, F(policy_swap), "recompute", 0, 0, swap_names,
     "recompute: running sequences go on with the new weights (their caches rebuilt) | "
     "finish: they finish on the old ones"},
    {"policy-rebuild-chunk", T_U32, F(policy_rebuild_chunk), "0", 0, 1 << 20, NULL,
     "recompute: tokens of the caches rebuilt per step after a swap (smaller: flatter steps, "
     "a later first token); 0: as many as there are sequences in flight"},
    {"max-policy-lag", T_U32, F(max_policy_lag), "0", 0, UINT32_MAX, NULL,
     "stop claiming while more than this many versions behind the published one (0: no bound)"},
    {"weights-cache", T_STR, F(weights_cache), "/var/cache/rolloutd", 0, 0, NULL,
     "where s3:// and https:// policies are downloaded (the loaded and the next version)"},
    {"s3-region", T_STR, F(s3_region), "", 0, 0, NULL,
     "S3 region of s3:// policies; empty: AWS_REGION, AWS_DEFAULT_REGION, else IMDS"},
    {"s3-endpoint", T_STR, F(s3_endpoint), "", 0, 0, NULL,
     "S3 endpoint (path-style: http://127.0.0.1:9000 for MinIO or a test); empty: AWS"},
    {"log-level", T_ENUM, F(log_level), "info", 0, 0, level_names,
     "err | warning | notice | info | debug"},
    {"ep-group", T_STR, F(ep_group), "", 0, 0, NULL,
     "expert-parallel group id (ranks meet under ro:{q}:ep:<group>); empty: no EP"},
    {"ep-size", T_U32, F(ep_size), "1", 1, 64, NULL, "ranks in the EP group"},
    {"ep-rank", T_U32, F(ep_rank), "0", 0, 63, NULL, "this process's rank in the group"},
    {"ep-local-ranks", T_U32, F(ep_local_ranks), "0", 0, 64, NULL,
     "run this many ranks of one group on this host (children of this process)"},
    {"fabric-provider", T_STR, F(fabric_provider), "auto", 0, 0, NULL,
     "libfabric provider: efa | tcp | shm | ...; auto: shm for local ranks, else efa, else the first"},
    {"ep-timeout-ms", T_U32, F(ep_timeout_ms), "30000", 100, 3600000, NULL,
     "a rank silent this long fails the group (keep above the longest prefill)"},
    {"ep-max-tokens", T_U32, F(ep_max_tokens), "2048", 1, 65536, NULL,
     "tokens per rank and exchange; longer prefills go in several passes"},
    {"ep-mode", T_ENUM, F(ep_mode), "auto", 0, 0, ep_mode_names,
     "auto (low-latency for decode batches) | low-latency | throughput"},
    {"ep-dtype", T_ENUM, F(ep_dtype), "f32", 0, 0, dtype_names,
     "dispatch payload: f32 (bitwise the single-rank result) | bf16 (half the bytes)"},
    {"ep-combine-dtype", T_ENUM, F(ep_combine_dtype), "f32", 0, 0, dtype_names,
     "combine payload: f32 | bf16"},
    {"ep-combine", T_ENUM, F(ep_combine), "exact", 0, 0, combine_names,
     "exact: every expert output home, bitwise the single-rank result | sum: one weighted "
     "sum per token and rank (fewer bytes, not bitwise)"},
    {"ep-direct", T_BOOL, F(ep_direct), "true", 0, 0, NULL,
     "shm: ranks of one host store into each other's memory, libfabric only signals"},
    {"ep-secret", T_STR, F(ep_secret), "", 0, 0, NULL,
     "EP group secret: every rank's card in Redis is signed with it (HMAC-SHA256); prefer "
     "ROLLOUTD_EP_SECRET or the file"},
    {"ep-secret-file", T_STR, F(ep_secret_file), "", 0, 0, NULL,
     "file whose first line is the EP group secret (beats ep-secret; same on every rank)"},
};
#undef F

#define N_SETTINGS (sizeof(table) / sizeof(table[0]))

const char *ro_rebalance_name(uint32_t r)
{
	return r < 3 ? rebalance_names[r] : "?";
}

/* "lease_ms", "lease-ms", "LEASE_MS" all name lease-ms */
static const struct setting *find(const char *key, size_t len)
{
	for (size_t i = 0; i < N_SETTINGS; i++) {
		const char *n = table[i].name;
		size_t j = 0;

		for (; j < len && n[j]; j++) {
			char a = (char)tolower((unsigned char)key[j]), b = n[j];

			if (a == '_')
				a = '-';
			if (a != b)
				break;
		}
		if (j == len && !n[j])
			return &table[i];
	}
	return NULL;
}

static int set(struct ro_config *c, const struct setting *s, const char *v, const char *from,
	       FILE *err)
{
	void *p = (char *)c + s->off;
	char *end;

	switch (s->type) {
	case T_STR: {
		char *d = strdup(v);

		if (!d)
			return -ENOMEM;
		free(*(char **)p);
		*(char **)p = d;
		return 0;
	}
	case T_U32:
	case T_I64: {
		unsigned long long x;

		errno = 0;
		x = strtoull(v, &end, 10);
		if (!*v || *end || errno || v[0] == '-' || x < s->min || x > s->max) {
			(void)fprintf(err,
				      "rolloutd: %s: %s = \"%s\": want an integer in [%llu, %llu]\n",
				      from, s->name, v, (unsigned long long)s->min,
				      (unsigned long long)s->max);
			return -EINVAL;
		}
		if (s->type == T_U32)
			*(uint32_t *)p = (uint32_t)x;
		else
			*(int64_t *)p = (int64_t)x;
		return 0;
	}
	case T_BOOL:
		if (!strcmp(v, "true") || !strcmp(v, "1") || !strcmp(v, "yes") || !strcmp(v, "on")) {
			*(bool *)p = true;
		} else if (!strcmp(v, "false") || !strcmp(v, "0") || !strcmp(v, "no") ||
			   !strcmp(v, "off")) {
			*(bool *)p = false;
		} else {
			(void)fprintf(err, "rolloutd: %s: %s = \"%s\": want true or false\n", from,
				      s->name, v);
			return -EINVAL;
		}
		return 0;
	case T_ENUM:
		for (uint32_t i = 0; s->choices[i]; i++)
			if (!strcmp(v, s->choices[i]) && (s->choices != level_names || i >= 3)) {
				*(uint32_t *)p = i;
				return 0;
			}
		(void)fprintf(err, "rolloutd: %s: %s = \"%s\": want one of", from, s->name, v);
		for (uint32_t i = s->choices == level_names ? 3 : 0; s->choices[i]; i++)
			(void)fprintf(err, " %s", s->choices[i]);
		(void)fputc('\n', err);
		return -EINVAL;
	}
	return -EINVAL;
}

static char *trim(char *s)
{
	char *e;

	while (isspace((unsigned char)*s))
		s++;
	e = s + strlen(s);
	while (e > s && isspace((unsigned char)e[-1]))
		*--e = '\0';
	return s;
}

/* One "key = value" per line, any length; '#' starts a comment line. A line is read whole
 * (a fixed buffer would cut a long value and read its tail as a line of its own), and a
 * NUL byte, which would silently cut it, is refused. */
static int load_file(struct ro_config *c, const char *path, bool must, FILE *err)
{
	FILE *f = fopen(path, "r");
	char *line = NULL, from[4200];
	size_t cap = 0;
	ssize_t n;
	int lineno = 0, r = 0;

	if (!f) {
		if (!must && errno == ENOENT)
			return 0;
		(void)fprintf(err, "rolloutd: config file %s: %s\n", path, strerror(errno));
		return -EINVAL;
	}
	while (!r && (n = getline(&line, &cap, f)) >= 0) {
		char *s, *eq, *k, *v;
		const struct setting *st;

		lineno++;
		(void)snprintf(from, sizeof(from), "%s:%d", path, lineno);
		if (memchr(line, '\0', (size_t)n)) {
			(void)fprintf(err, "rolloutd: %s: a NUL byte in the line\n", from);
			r = -EINVAL;
			break;
		}
		s = trim(line);
		if (!*s || *s == '#')
			continue;
		eq = strchr(s, '=');
		if (!eq) {
			(void)fprintf(err, "rolloutd: %s: want key = value\n", from);
			r = -EINVAL;
			break;
		}
		*eq = '\0';
		k = trim(s);
		v = trim(eq + 1);
		if (strlen(v) >= 2 && (v[0] == '"' || v[0] == '\'') && v[strlen(v) - 1] == v[0]) {
			v[strlen(v) - 1] = '\0';
			v++;
		}
		st = find(k, strlen(k));
		if (!st) {
			(void)fprintf(err, "rolloutd: %s: unknown setting \"%s\"\n", from, k);
			r = -EINVAL;
			break;
		}
		r = set(c, st, v, from, err);
	}
	free(line);
	(void)fclose(f);
	return r;
}

static void usage(FILE *f)
{
	(void)fprintf(f, "usage: rolloutd [--config FILE] [--print-config] [--SETTING VALUE ...]\n"
			 "       rolloutd --version\n\n"
			 "Every setting is also ROLLOUTD_<NAME> in the environment and a\n"
			 "\"name = value\" line of the config file (default "
			 RO_CONFIG_FILE ").\nFlags beat environment beat file.\n\n");
	for (size_t i = 0; i < N_SETTINGS; i++)
		(void)fprintf(f, "  --%-20s %s\n  %-22s (default \"%s\")\n", table[i].name,
			      table[i].help, "", table[i].def);
}

void ro_config_print(const struct ro_config *c, FILE *f)
{
	(void)fprintf(f, "# effective rolloutd settings (a valid config file)\n");
	for (size_t i = 0; i < N_SETTINGS; i++) {
		const void *p = (const char *)c + table[i].off;

		switch (table[i].type) {
		case T_STR: {
			const char *v = *(char *const *)p ? *(char *const *)p : "";
			char red[1024];

			/* secrets never leave the process */
			if (p == (const void *)&c->redis)
				ro_redis_url_redact(v, red, sizeof(red));
			else
				(void)snprintf(red, sizeof(red), "%s",
					       *v && (p == (const void *)&c->redis_password ||
						      p == (const void *)&c->redis_sentinel_password ||
						      p == (const void *)&c->ep_secret)
						   ? "***"
						   : v);
			(void)fprintf(f, "%s = %s\n", table[i].name, red);
			break;
		}
		case T_U32:
			(void)fprintf(f, "%s = %u\n", table[i].name, *(const uint32_t *)p);
			break;
		case T_I64:
			(void)fprintf(f, "%s = %lld\n", table[i].name, (long long)*(const int64_t *)p);
			break;
		case T_BOOL:
			(void)fprintf(f, "%s = %s\n", table[i].name, *(const bool *)p ? "true" : "false");
			break;
		case T_ENUM:
			(void)fprintf(f, "%s = %s\n", table[i].name,
				      table[i].choices[*(const uint32_t *)p]);
			break;
		}
	}
}

/* roff text with its special characters escaped: backslash, a leading dot or quote, '-' */
static void roff(FILE *f, const char *s)
{
	for (const char *p = s; *p; p++) {
		if (*p == '\\')
			(void)fputs("\\e", f);
		else if (*p == '-')
			(void)fputs("\\-", f);
		else if ((*p == '.' || *p == '\'') && (p == s || p[-1] == '\n'))
			(void)fprintf(f, "\\&%c", *p);
		else
			(void)fputc(*p, f);
	}
}

void ro_config_man(FILE *f, bool conf)
{
	for (size_t i = 0; i < N_SETTINGS; i++) {
		char env[64];
		size_t k = 0;

		for (const char *p = table[i].name; *p && k + 1 < sizeof(env); p++)
			env[k++] = *p == '-' ? '_' : (char)(*p >= 'a' && *p <= 'z' ? *p - 32 : *p);
		env[k] = '\0';
		(void)fputs(".TP\n.B ", f);
		if (!conf)
			(void)fputs("\\-\\-", f);
		roff(f, table[i].name);
		(void)fputs(conf ? " = \\fIvalue\\fR\n" : " \\fIvalue\\fR\n", f);
		roff(f, table[i].help);
		(void)fputs(".\n.br\n", f);
		if (table[i].choices) {
			(void)fputs("One of: ", f);
			for (size_t j = 0; table[i].choices[j]; j++) {
				(void)fputs(j ? ", " : "", f);
				roff(f, table[i].choices[j]);
			}
			(void)fputs(".\n.br\n", f);
		}
		(void)fputs("Default: \\(lq", f);
		roff(f, table[i].def);
		(void)fprintf(f, "\\(rq; environment: \\fBROLLOUTD_%s\\fR%s.\n", env,
			      conf ? "" : "; config file: the same name");
	}
}

void ro_config_clear(struct ro_config *c)
{
	for (size_t i = 0; i < N_SETTINGS; i++)
		if (table[i].type == T_STR) {
			char **p = (char **)((char *)c + table[i].off);

			free(*p);
			*p = NULL;
		}
	free(c->config_file);
	c->config_file = NULL;
}

/* The first line of a secret's file (redis-password-file, ep-secret-file) becomes the
 * secret (redis-password, ep-secret). */
static int read_secret(const char *setting, const char *path, char **ret, FILE *err)
{
	FILE *f = fopen(path, "r");
	char line[4096] = "";
	size_t n;

	if (!f) {
		(void)fprintf(err, "rolloutd: %s %s: %s\n", setting, path, strerror(errno));
		return -EINVAL;
	}
	if (!fgets(line, sizeof(line), f))
		line[0] = '\0';
	(void)fclose(f);
	n = strcspn(line, "\r\n");
	line[n] = '\0';
	if (!n) {
		(void)fprintf(err, "rolloutd: %s %s: empty\n", setting, path);
		return -EINVAL;
	}
	free(*ret);
	*ret = strdup(line);
	explicit_bzero(line, sizeof(line));
	return *ret ? 0 : -ENOMEM;
}

int ro_config_load(struct ro_config *c, int argc, char **argv, FILE *out, FILE *err)
{
	const char *file = getenv("ROLLOUTD_CONFIG");
	bool must = file && *file, print = false;
	extern char **environ;
	int r = 0;

	memset(c, 0, sizeof(*c));
	for (size_t i = 0; i < N_SETTINGS && !r; i++)
		r = set(c, &table[i], table[i].def, "default", err);
	/* the file first: it is named by --config (or ROLLOUTD_CONFIG) */
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--config") && i + 1 < argc) {
			file = argv[++i];
			must = true;
		} else if (!strncmp(argv[i], "--config=", 9)) {
			file = argv[i] + 9;
			must = true;
		}
	}
	if (!file || !*file)
		file = RO_CONFIG_FILE;
	c->config_file = strdup(file);
	if (!r)
		r = load_file(c, file, must, err);
	for (char **e = environ; !r && *e; e++) {
		const char *eq = strchr(*e, '=');
		const struct setting *st;

		if (strncmp(*e, "ROLLOUTD_", 9) || !eq || !strncmp(*e, "ROLLOUTD_CONFIG=", 16))
			continue;
		st = find(*e + 9, (size_t)(eq - *e - 9));
		if (!st) {
			(void)fprintf(err, "rolloutd: environment: unknown setting %.*s\n",
				      (int)(eq - *e), *e);
			r = -EINVAL;
			break;
		}
		r = set(c, st, eq + 1, "environment", err);
	}
	for (int i = 1; !r && i < argc; i++) {
		const char *a = argv[i], *v, *eq;
		const struct setting *st;

		if (!strcmp(a, "--config")) {
			i++;
			continue;
		}
		if (!strncmp(a, "--config=", 9))
			continue;
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(out);
			return 1;
		}
		if (!strcmp(a, "--print-config")) {
			print = true;
			continue;
		}
		if (strncmp(a, "--", 2)) {
			(void)fprintf(err, "rolloutd: unexpected argument \"%s\" (see --help)\n", a);
			return -EINVAL;
		}
		a += 2;
		eq = strchr(a, '=');
		st = find(a, eq ? (size_t)(eq - a) : strlen(a));
		if (!st) {
			(void)fprintf(err, "rolloutd: unknown option --%.*s (see --help)\n",
				      (int)(eq ? eq - a : (long)strlen(a)), a);
			return -EINVAL;
		}
		if (eq) {
			v = eq + 1;
		} else if (st->type == T_BOOL && (i + 1 >= argc || !strncmp(argv[i + 1], "--", 2))) {
			v = "true";
		} else if (i + 1 < argc) {
			v = argv[++i];
		} else {
			(void)fprintf(err, "rolloutd: --%s wants a value\n", st->name);
			return -EINVAL;
		}
		r = set(c, st, v, "command line", err);
	}
	if (!r && c->redis_password_file && *c->redis_password_file)
		r = read_secret("redis-password-file", c->redis_password_file, &c->redis_password,
				err);
	if (!r && c->ep_secret_file && *c->ep_secret_file)
		r = read_secret("ep-secret-file", c->ep_secret_file, &c->ep_secret, err);
	if (r)
		return r;
	if (print) {
		ro_config_print(c, out);
		return 1;
	}
	if (!c->model || !*c->model) {
		(void)fprintf(err, "rolloutd: model is not set (--model DIR, ROLLOUTD_MODEL or "
				   "model = DIR in the config file)\n");
		return -EINVAL;
	}
	if (c->max_new_tokens == 0 || c->claim_batch > c->max_inflight)
		c->claim_batch = c->max_inflight;
	return 0;
}
