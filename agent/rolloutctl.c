/* rolloutctl: the operator's tool for a rolloutd queue. Enqueue units from JSON lines,
 * show the queue's state, reap expired leases, inspect and retry dead letters, read the
 * samples stream. Exit codes: 0 ok, 1 failure, 2 usage. */
#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <json-c/json.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent/ctl.h"
#include "agent/version.h"
#include "agent/fetch.h"
#include "queue/queue.h"

struct ctl {
	const char *redis, *queue, *prefix;
	const char *password, *password_file, *sentinel_password;
	const char *tls_ca, *tls_cert, *tls_key, *tls_server_name, *cluster;
	uint32_t timeout_ms, wait_replicas;
	/* policy publish */
	long long policy_version;
	const char *uri, *s3_endpoint, *s3_region, *imds_endpoint;
	bool json, follow, plain;
	long count, interval_ms, iterations;
	const char *from;
	struct ro_unit_bounds bounds;
};

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
	(void)sig;
	stop_requested = 1;
}

static void usage(FILE *f)
{
	(void)fputs(
	    "usage: rolloutctl [--redis URL] [--queue NAME] [--json] COMMAND ...\n"
	    "       rolloutctl --version\n"
	    "\n"
	    "commands:\n"
	    "  enqueue FILE|-          add units from JSON lines; every bad line is reported by\n"
	    "                          number and nothing is written unless all lines are good\n"
	    "  status                  pending, leased, done, dead, samples, trainer lag, workers\n"
	    "  init                    load the queue's function library (an admin's right), so\n"
	    "                          that workers need none\n"
	    "  policy publish --version N --uri URI [--s3-endpoint URL] [--s3-region R]\n"
	    "                          new weights for the queue's workers (file://, s3://,\n"
	    "                          https://): every file's size and sha256 recorded\n"
	    "  policy show             the published policy and how many workers run it\n"
	    "  unit ID                 one unit: state, owner, attempt, lease, history, which\n"
	    "                          samples are published, their checkpoints\n"
	    "  queues                  the queues under the prefix (every node of a Cluster)\n"
	    "  top [--interval MS] [--iterations N] [--plain]\n"
	    "                          live view of the queue and its workers (q quits); plain\n"
	    "                          lines when stdout is not a terminal\n"
	    "  reap                    expired leases back to pending (or dead past the limit)\n"
	    "  dead list               dead-lettered units with their reason and history\n"
	    "  dead retry ID           a dead unit back to pending with a fresh attempt count\n"
	    "  dead purge              delete every dead unit\n"
	    "  samples [--follow] [--count N] [--from ID]\n"
	    "                          the samples stream as JSON lines\n"
	    "  drain [--deadline S] [--wait] [--socket PATH]\n"
	    "                          drain the rolloutd on this node (control socket)\n"
	    "  status --local [--ready|--live]\n"
	    "                          the local daemon's state; exit 1 when not ready/live\n"
	    "  make-model [--arch qwen3_moe|mixtral ...] DIR\n"
	    "                          write a random model in Hugging Face layout\n"
	    "  generate --model DIR --prompt 1,2,3 [--n N] [--max-new-tokens T] ...\n"
	    "                          run the model without the queue (samples as JSON)\n"
	    "  imds watch|get|mock     EC2 metadata: print interruption events as JSON lines,\n"
	    "                          read a path, or start the mock IMDS (imds --help)\n"
	    "\n"
	    "options (anywhere on the line):\n"
	    "  --redis URL             redis://[user[:password]@]host[:port][/db], rediss://...\n"
	    "                          (TLS), unix:///path, redis+sentinel://h1:26379,h2/MASTER\n"
	    "                          (env ROLLOUTD_REDIS; default redis://127.0.0.1:6379/0)\n"
	    "  --redis-password-file F, --redis-password PW (env ROLLOUTD_REDIS_PASSWORD[_FILE])\n"
	    "  --redis-tls-ca F --redis-tls-cert F --redis-tls-key F --redis-tls-server-name N\n"
	    "  --redis-cluster auto|yes|no --redis-sentinel-password PW --redis-timeout-ms MS\n"
	    "  --redis-wait-replicas N  the same settings as rolloutd's (env ROLLOUTD_REDIS_*)\n"
	    "  --queue NAME            queue name (env ROLLOUTD_QUEUE; default \"default\")\n"
	    "  --prefix P              key prefix (env ROLLOUTD_PREFIX; default \"ro\")\n"
	    "  --json                  machine-readable output\n"
	    "  --max-prompt N --max-n N --max-new-tokens N --max-body BYTES\n"
	    "                          bounds a unit must respect to be enqueued\n",
	    f);
}

static int failed(struct ro_queue *q, int r, const char *what);

/* The password: --redis-password-file (or ROLLOUTD_REDIS_PASSWORD_FILE), else
 * --redis-password (or ROLLOUTD_REDIS_PASSWORD), else the URL's. */
static int read_password(const struct ctl *c, char *buf, size_t len)
{
	FILE *f;
	size_t n;

	buf[0] = '\0';
	if (!c->password_file || !*c->password_file) {
		(void)snprintf(buf, len, "%s", c->password ? c->password : "");
		return 0;
	}
	f = fopen(c->password_file, "r");
	if (!f) {
		(void)fprintf(stderr, "rolloutctl: redis-password-file %s: %s\n", c->password_file,
			      strerror(errno));
		return -EINVAL;
	}
	if (!fgets(buf, (int)len, f))
		buf[0] = '\0';
	(void)fclose(f);
	n = strcspn(buf, "\r\n");
	buf[n] = '\0';
	return 0;
}

/* The queue options of the command line; the password (file, env or flag) read into pw. */
static void ctl_opts(const struct ctl *c, struct ro_queue_opts *o, char *pw, size_t pwlen)
{
	*o = (struct ro_queue_opts){
	    .url = c->redis,
	    .queue = c->queue,
	    .prefix = c->prefix,
	    .worker = "rolloutctl",
	    .timeout_ms = c->timeout_ms ? c->timeout_ms : 2000,
	    .retry_ms = 3000,
	    .bounds = c->bounds,
	    .password = pw,
	    .sentinel_password = c->sentinel_password,
	    .tls_ca = c->tls_ca,
	    .tls_cert = c->tls_cert,
	    .tls_key = c->tls_key,
	    .tls_server_name = c->tls_server_name,
	    .cluster = !c->cluster || !strcmp(c->cluster, "auto") ? RO_REDIS_CLUSTER_AUTO
		       : !strcmp(c->cluster, "yes")		  ? RO_REDIS_CLUSTER_YES
								  : RO_REDIS_CLUSTER_NO,
	    .wait_replicas = c->wait_replicas,
	};
	if (c->cluster && strcmp(c->cluster, "auto") && strcmp(c->cluster, "yes") &&
	    strcmp(c->cluster, "no")) {
		(void)fprintf(stderr, "rolloutctl: --redis-cluster wants auto, yes or no\n");
		exit(EXIT_USAGE);
	}
	if (read_password(c, pw, pwlen))
		exit(EXIT_USAGE);
}

static int open_queue(const struct ctl *c, struct ro_queue **ret)
{
	char pw[4096];
	struct ro_queue_opts o;
	int r;

	ctl_opts(c, &o, pw, sizeof(pw));
	r = ro_queue_new(&o, ret);
	explicit_bzero(pw, sizeof(pw));
	if (r) {
		/* a bad URL, queue name or TLS file */
		(void)fprintf(stderr, "rolloutctl: %s\n", ro_queue_errmsg(NULL));
		exit(EXIT_USAGE);
	}
	r = ro_queue_check(*ret, o.retry_ms);
	if (r && ro_queue_fatal(*ret)) {
		/* credentials, permissions, TLS trust: no retry fixes these */
		(void)fprintf(stderr, "rolloutctl: %s\n", ro_queue_errmsg(*ret));
		*ret = ro_queue_free(*ret);
		exit(EXIT_USAGE);
	}
	return 0;
}

static void numbers_as_numbers(struct json_object *o);

/* unit ID: one unit's record (ro_unit_info), its history parsed */
static int cmd_unit(const struct ctl *c, const char *id)
{
	struct ro_queue *q = NULL;
	struct json_object *o, *v, *h = NULL;
	char *js = NULL;
	int r;

	if (!ro_unit_id_valid(id)) {
		(void)fprintf(stderr, "rolloutctl: unit: \"%.64s\" is not a unit id\n", id);
		return EXIT_USAGE;
	}
	if (open_queue(c, &q))
		return EXIT_FAILURE;
	r = ro_queue_unit_info(q, id, &js);
	if (r) {
		r = failed(q, r, "unit");
		(void)ro_queue_free(q);
		return r;
	}
	(void)ro_queue_free(q);
	o = json_tokener_parse(js);
	free(js);
	if (!o || !json_object_is_type(o, json_type_object)) {
		json_object_put(o);
		(void)fprintf(stderr, "rolloutctl: unit: the server's answer is not JSON\n");
		return EXIT_FAILURE;
	}
	/* the history as stored is its entries without brackets */
	if (json_object_object_get_ex(o, "hist", &v)) {
		char *t = NULL;

		if (asprintf(&t, "[%s]", json_object_get_string(v)) >= 0)
			h = json_tokener_parse(t);
		free(t);
		json_object_object_del(o, "hist");
	}
	json_object_object_add(o, "history", h && json_object_is_type(h, json_type_array)
						 ? h
						 : (json_object_put(h), json_object_new_array()));
	if (!json_object_object_get_ex(o, "samples", &v) || !json_object_is_type(v, json_type_array))
		json_object_object_add(o, "samples", json_object_new_array());
	numbers_as_numbers(o);
	if (c->json) {
		(void)printf("%s\n", json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN));
	} else {
		static const char *const keys[] = {"state", "owner", "attempt", "n", "npub",
						   "reason", "lease_until_ms", "claimed_ms",
						   "done_ms", "dead_ms", "group", "body_bytes"};
		struct json_object *smp, *hist;

		(void)printf("unit     %s\n", id);
		for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
			if (json_object_object_get_ex(o, keys[i], &v))
				(void)printf("%-8s %s\n", !strcmp(keys[i], "npub") ? "published" : keys[i],
					     json_object_get_string(v));
		(void)json_object_object_get_ex(o, "samples", &smp);
		for (size_t i = 0; i < json_object_array_length(smp); i++) {
			struct json_object *e = json_object_array_get_idx(smp, i), *x;

			(void)printf("sample %-3zu", i);
			if (json_object_object_get_ex(e, "published", &x))
				(void)printf(" published %s", json_object_get_string(x));
			else
				(void)printf(" not published");
			if (json_object_object_get_ex(e, "checkpoint_tokens", &x))
				(void)printf(", checkpoint at %s tokens", json_object_get_string(x));
			else if (json_object_object_get_ex(e, "checkpoint_bytes", &x))
				(void)printf(", checkpoint of %s bytes", json_object_get_string(x));
			(void)printf("\n");
		}
		(void)json_object_object_get_ex(o, "history", &hist);
		for (size_t i = 0; i < json_object_array_length(hist); i++)
			(void)printf("history  %s\n",
				     json_object_to_json_string_ext(json_object_array_get_idx(hist, i),
								    JSON_C_TO_STRING_PLAIN));
	}
	json_object_put(o);
	return EXIT_SUCCESS;
}

/* queues: the queue names under the prefix */
static int cmd_queues(const struct ctl *c)
{
	char pw[4096], err[256] = "", **v = NULL;
	struct ro_queue_opts o;
	size_t n = 0;
	int r;

	ctl_opts(c, &o, pw, sizeof(pw));
	r = ro_queue_list_queues(&o, &v, &n, err, sizeof(err));
	explicit_bzero(pw, sizeof(pw));
	if (r) {
		(void)fprintf(stderr, "rolloutctl: queues: %s\n", err);
		return EXIT_FAILURE;
	}
	if (c->json) {
		struct json_object *a = json_object_new_array();

		for (size_t i = 0; i < n; i++)
			json_object_array_add(a, json_object_new_string(v[i]));
		(void)printf("%s\n", json_object_to_json_string_ext(a, JSON_C_TO_STRING_PLAIN));
		json_object_put(a);
	} else {
		for (size_t i = 0; i < n; i++)
			(void)printf("%s\n", v[i]);
	}
	for (size_t i = 0; i < n; i++)
		free(v[i]);
	free(v);
	return EXIT_SUCCESS;
}

static int cmd_top(const struct ctl *c)
{
	struct ro_queue *q = NULL;
	int rc;

	if (open_queue(c, &q))
		return EXIT_FAILURE;
	rc = ro_ctl_top(q, c->queue ? c->queue : "default", c->interval_ms ? c->interval_ms : 1000,
			c->iterations ? c->iterations : -1, c->plain, &stop_requested);
	(void)ro_queue_free(q);
	return rc;
}

/* policy publish --version N --uri URI [--s3-endpoint URL] [--s3-region R]
 * policy show */
static int cmd_policy(const struct ctl *c, int argc, char **argv)
{
	struct ro_fetch_opts fo = {
	    .s3_endpoint = c->s3_endpoint ? c->s3_endpoint : getenv("ROLLOUTD_S3_ENDPOINT"),
	    .region = c->s3_region ? c->s3_region : getenv("ROLLOUTD_S3_REGION"),
	    .imds_endpoint = c->imds_endpoint ? c->imds_endpoint : getenv("ROLLOUTD_IMDS_ENDPOINT"),
	};
	const char *uri = c->uri;
	long long version = c->policy_version;
	struct ro_queue *q = NULL;
	int r, rc = EXIT_FAILURE;

	if (argc != 1 || (strcmp(argv[0], "publish") && strcmp(argv[0], "show"))) {
		(void)fprintf(stderr, "rolloutctl: policy publish --version N --uri URI | policy "
				      "show\n");
		return EXIT_USAGE;
	}
	if (fo.s3_endpoint && !*fo.s3_endpoint)
		fo.s3_endpoint = NULL;
	if (fo.region && !*fo.region)
		fo.region = NULL;
	if (!strcmp(argv[0], "publish")) {
		struct ro_policy_manifest m = {0};
		char err[1024] = "", host[128] = "rolloutctl";
		char *js;
		uint64_t bytes = 0;

		if (version < 1 || !uri) {
			(void)fprintf(stderr, "rolloutctl: policy publish wants --version N --uri URI\n");
			return EXIT_USAGE;
		}
		r = ro_policy_manifest_compute(&fo, uri, &m, err, sizeof(err));
		if (r) {
			(void)fprintf(stderr, "rolloutctl: policy %s: %s\n", uri, err);
			return EXIT_FAILURE;
		}
		if (!m.n) {
			(void)fprintf(stderr, "rolloutctl: policy %s: no files\n", uri);
			ro_policy_manifest_clear(&m);
			return EXIT_FAILURE;
		}
		for (size_t i = 0; i < m.n; i++)
			bytes += m.files[i].size;
		js = ro_policy_manifest_json(&m);
		(void)gethostname(host, sizeof(host) - 1);
		if (open_queue(c, &q) || !js) {
			free(js);
			ro_policy_manifest_clear(&m);
			return EXIT_FAILURE;
		}
		r = ro_queue_policy_publish(q, version, uri, js, host);
		if (r < 0) {
			rc = failed(q, r, "policy publish");
			if (r == -EINVAL)
				rc = EXIT_USAGE;
		} else {
			(void)printf("policy version %lld published: %s, %zu files, %.1f MiB\n",
				     version, uri, m.n, (double)bytes / 1048576.0);
			rc = EXIT_SUCCESS;
		}
		free(js);
		ro_policy_manifest_clear(&m);
	} else {
		struct ro_policy_info p = {0};
		struct ro_queue_stats st = {0};
		uint32_t on = 0;

		if (open_queue(c, &q))
			return EXIT_FAILURE;
		r = ro_queue_policy_get(q, &p);
		if (!r)
			r = ro_queue_stats(q, &st);
		if (r) {
			rc = failed(q, r, "policy show");
		} else {
			char pat[48];

			(void)snprintf(pat, sizeof(pat), "\"policy_version\":\"%lld\"",
				       (long long)p.version);
			for (uint32_t i = 0; i < st.n_workers; i++)
				on += st.workers[i].fields && strstr(st.workers[i].fields, pat);
			if (c->json)
				(void)printf("{\"version\":%lld,\"uri\":\"%s\",\"published_ms\":%lld,"
					     "\"by\":\"%s\",\"workers\":%u,\"workers_on_it\":%u,"
					     "\"manifest\":%s}\n",
					     (long long)p.version, p.uri ? p.uri : "",
					     (long long)p.published_ms, p.by ? p.by : "", st.n_workers,
					     on, p.manifest ? p.manifest : "null");
			else
				(void)printf("version  %lld\nuri      %s\npublished %lld ms since "
					     "the epoch by %s\nworkers  %u of %u on it\n",
					     (long long)p.version, p.uri ? p.uri : "(none)",
					     (long long)p.published_ms, p.by ? p.by : "", on,
					     st.n_workers);
			rc = EXIT_SUCCESS;
		}
		ro_policy_info_clear(&p);
		ro_queue_stats_clear(&st);
	}
	(void)ro_queue_free(q);
	return rc;
}

static int cmd_init(const struct ctl *c)
{
	struct ro_queue *q = NULL;
	int r = open_queue(c, &q);

	if (r)
		return EXIT_FAILURE;
	r = ro_queue_init_library(q);
	if (r < 0) {
		r = failed(q, r, "init");
	} else {
		(void)printf("function library loaded on %s (%s): workers need no FUNCTION right\n",
			     ro_queue_node(q), ro_queue_mode(q));
		r = EXIT_SUCCESS;
	}
	(void)ro_queue_free(q);
	return r;
}

static int failed(struct ro_queue *q, int r, const char *what)
{
	(void)fprintf(stderr, "rolloutctl: %s: %s\n", what,
		      q && ro_queue_errmsg(q)[0] ? ro_queue_errmsg(q) : strerror(-r));
	return EXIT_FAILURE;
}

static int cmd_enqueue(const struct ctl *c, int argc, char **argv)
{
	struct ro_unit *units = NULL;
	size_t n = 0, cap = 0, lineno = 0, bad = 0;
	size_t *lines = NULL;
	char *line = NULL;
	size_t linecap = 0;
	ssize_t len;
	FILE *f;
	const char *name;
	struct ro_queue *q = NULL;
	int *status = NULL;
	int r, rc = EXIT_FAILURE;
	size_t queued = 0, dup = 0, conflict = 0;

	if (argc != 1) {
		usage(stderr);
		return EXIT_USAGE;
	}
	name = argv[0];
	f = strcmp(name, "-") ? fopen(name, "r") : stdin;
	if (!f) {
		(void)fprintf(stderr, "rolloutctl: %s: %s\n", name, strerror(errno));
		return EXIT_FAILURE;
	}
	while ((len = getline(&line, &linecap, f)) >= 0) {
		char why[256];
		struct ro_unit u;

		lineno++;
		while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
			line[--len] = '\0';
		if (len == 0)
			continue;
		r = ro_unit_parse(line, (size_t)len, &c->bounds, &u, why, sizeof(why));
		if (r) {
			(void)fprintf(stderr, "%s:%zu: %s\n", name, lineno,
				      r == -EINVAL ? why : strerror(-r));
			bad++;
			continue;
		}
		if (n == cap) {
			size_t nc = cap ? cap * 2 : 64;
			struct ro_unit *nu = realloc(units, nc * sizeof(*nu));
			size_t *nl = nu ? realloc(lines, nc * sizeof(*nl)) : NULL;

			if (nu)
				units = nu;
			if (!nl) {
				ro_unit_clear(&u);
				(void)fprintf(stderr, "rolloutctl: out of memory\n");
				goto out;
			}
			lines = nl;
			cap = nc;
		}
		lines[n] = lineno;
		units[n++] = u;
	}
	if (ferror(f)) {
		(void)fprintf(stderr, "rolloutctl: %s: read error\n", name);
		goto out;
	}
	if (bad) {
		(void)fprintf(stderr, "rolloutctl: %zu bad line%s in %s: nothing enqueued\n", bad,
			      bad == 1 ? "" : "s", name);
		goto out;
	}
	r = open_queue(c, &q);
	if (r)
		goto out;
	status = calloc(n + 1, sizeof(*status));
	if (!status)
		goto out;
	r = ro_queue_enqueue(q, units, n, status);
	if (r) {
		rc = failed(q, r, "enqueue");
		goto out;
	}
	for (size_t i = 0; i < n; i++) {
		if (status[i] == 1) {
			queued++;
		} else if (status[i] == 0) {
			dup++;
		} else {
			conflict++;
			(void)fprintf(stderr, "%s:%zu: id %s exists with a different body\n", name,
				      lines[i], units[i].id);
		}
	}
	if (c->json)
		(void)printf("{\"queued\":%zu,\"already_queued\":%zu,\"conflicts\":%zu}\n", queued,
			     dup, conflict);
	else
		(void)printf("queued %zu, already queued %zu, conflicts %zu\n", queued, dup,
			     conflict);
	rc = conflict ? EXIT_FAILURE : EXIT_SUCCESS;
out:
	for (size_t i = 0; i < n; i++)
		ro_unit_clear(&units[i]);
	free(units);
	free(lines);
	free(line);
	free(status);
	if (f != stdin)
		(void)fclose(f);
	(void)ro_queue_free(q);
	return rc;
}

/* A worker's hash holds every field as a string: those that are plain decimal numbers
 * ("3", "-1", "12.5", not "007" or "1e3") become JSON numbers. */
static void numbers_as_numbers(struct json_object *o)
{
	json_object_object_foreach(o, key, val)
	{
		const char *v = json_object_is_type(val, json_type_string)
					? json_object_get_string(val)
					: NULL;
		const char *p = v;
		bool dot = false, ok;

		if (!v)
			continue;
		if (*p == '-')
			p++;
		ok = *p >= '0' && *p <= '9' && !(p[0] == '0' && p[1] >= '0' && p[1] <= '9');
		for (; ok && *p; p++) {
			if (*p == '.' && !dot && p[1] >= '0' && p[1] <= '9')
				dot = true;
			else if (*p < '0' || *p > '9')
				ok = false;
		}
		if (!ok || strlen(v) > 18)
			continue;
		json_object_object_add(o, key,
				       dot ? json_object_new_double(strtod(v, NULL))
					   : json_object_new_int64(strtoll(v, NULL, 10)));
	}
}

static int cmd_status(const struct ctl *c)
{
	struct ro_queue *q = NULL;
	struct ro_queue_stats s;
	int r = open_queue(c, &q);

	if (r)
		return EXIT_FAILURE;
	r = ro_queue_stats(q, &s);
	if (r) {
		r = failed(q, r, "status");
		(void)ro_queue_free(q);
		return r;
	}
	if (c->json) {
		struct json_object *o = json_object_new_object(), *w = json_object_new_array();

		json_object_object_add(o, "queue", json_object_new_string(c->queue));
		json_object_object_add(o, "redis_mode", json_object_new_string(ro_queue_mode(q)));
		json_object_object_add(o, "redis_node", json_object_new_string(ro_queue_node(q)));
		json_object_object_add(o, "pending", json_object_new_int64(s.pending));
		json_object_object_add(o, "leased", json_object_new_int64(s.leased));
		json_object_object_add(o, "done", json_object_new_int64(s.done));
		json_object_object_add(o, "dead", json_object_new_int64(s.dead));
		json_object_object_add(o, "samples", json_object_new_int64(s.samples));
		json_object_object_add(o, "groups", json_object_new_int64(s.groups));
		json_object_object_add(o, "trainer_groups", json_object_new_int64(s.n_groups));
		json_object_object_add(o, "trainer_lag", json_object_new_int64(s.lag));
		for (uint32_t i = 0; i < s.n_workers; i++) {
			struct json_object *e = json_tokener_parse(s.workers[i].fields);

			if (!e || !json_object_is_type(e, json_type_object)) {
				json_object_put(e);
				e = json_object_new_object();
			}
			numbers_as_numbers(e);
			json_object_object_add(e, "id", json_object_new_string(s.workers[i].id));
			json_object_object_add(e, "age_ms",
					       json_object_new_int64(s.workers[i].age_ms));
			json_object_array_add(w, e);
		}
		json_object_object_add(o, "workers", w);
		if (s.n_warnings) {
			struct json_object *wa = json_object_new_array();

			for (uint32_t i = 0; i < s.n_warnings; i++)
				json_object_array_add(wa, json_object_new_string(s.warnings[i]));
			json_object_object_add(o, "warnings", wa);
		}
		(void)printf("%s\n", json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN));
		json_object_put(o);
	} else {
		(void)printf("queue    %s\n", c->queue);
		(void)printf("redis    %s %s\n", ro_queue_mode(q), ro_queue_node(q));
		(void)printf("pending  %lld\nleased   %lld\ndone     %lld\ndead     %lld\n",
			     (long long)s.pending, (long long)s.leased, (long long)s.done,
			     (long long)s.dead);
		(void)printf("samples  %lld (trainer lag %lld, %u consumer group%s)\n",
			     (long long)s.samples, (long long)s.lag, s.n_groups,
			     s.n_groups == 1 ? "" : "s");
		(void)printf("groups   %lld\nworkers  %u\n", (long long)s.groups, s.n_workers);
		for (uint32_t i = 0; i < s.n_workers; i++)
			(void)printf("  %-32s seen %.1fs ago  %s\n", s.workers[i].id,
				     (double)s.workers[i].age_ms / 1000.0, s.workers[i].fields);
	}
	/* keys of another type than the schema's: said, the rest still shown, exit 0 */
	(void)fflush(stdout);
	for (uint32_t i = 0; i < s.n_warnings; i++)
		(void)fprintf(stderr, "rolloutctl: status: %s\n", s.warnings[i]);
	ro_queue_stats_clear(&s);
	(void)ro_queue_free(q);
	return EXIT_SUCCESS;
}

static int cmd_reap(const struct ctl *c)
{
	struct ro_queue *q = NULL;
	uint32_t req = 0, dead = 0;
	int r = open_queue(c, &q), rc = EXIT_SUCCESS;

	if (r)
		return EXIT_FAILURE;
	r = ro_queue_reap(q, &req, &dead);
	if (r)
		rc = failed(q, r, "reap");
	else if (c->json)
		(void)printf("{\"requeued\":%u,\"dead\":%u}\n", req, dead);
	else
		(void)printf("requeued %u, dead %u\n", req, dead);
	(void)ro_queue_free(q);
	return rc;
}

static int cmd_dead(const struct ctl *c, int argc, char **argv)
{
	struct ro_queue *q = NULL;
	int r, rc = EXIT_SUCCESS;

	if (argc < 1 || (!strcmp(argv[0], "retry") ? argc != 2 : argc != 1) ||
	    (strcmp(argv[0], "list") && strcmp(argv[0], "retry") && strcmp(argv[0], "purge"))) {
		usage(stderr);
		return EXIT_USAGE;
	}
	r = open_queue(c, &q);
	if (r)
		return EXIT_FAILURE;
	if (!strcmp(argv[0], "list")) {
		/* --json: one array (an empty list is []), written once the whole list is read */
		struct json_object *all = c->json ? json_object_new_array() : NULL;

		for (uint32_t start = 0;; start += 256) {
			struct ro_dead *d = NULL;
			size_t n = 0;

			r = ro_queue_dead_list(q, start, 256, &d, &n);
			if (r < 0) {
				rc = failed(q, r, "dead list");
				break;
			}
			for (size_t i = 0; i < n; i++) {
				if (c->json) {
					struct json_object *o = json_object_new_object(),
							   *h = json_tokener_parse(d[i].history);

					json_object_object_add(o, "id",
							       json_object_new_string(d[i].id));
					json_object_object_add(o, "attempt",
							       json_object_new_int(d[i].attempt));
					json_object_object_add(o, "reason",
							       json_object_new_string(d[i].reason));
					json_object_object_add(o, "history",
							       h ? h : json_object_new_array());
					json_object_array_add(all, o);
				} else {
					(void)printf("%-40s attempt %u  %s\n", d[i].id,
						     d[i].attempt, d[i].reason);
				}
			}
			ro_dead_free(d, n);
			if (n < 256)
				break;
		}
		if (all && rc == EXIT_SUCCESS)
			(void)printf("%s\n", json_object_to_json_string_ext(all, JSON_C_TO_STRING_PLAIN));
		json_object_put(all);
	} else if (!strcmp(argv[0], "retry")) {
		r = ro_queue_dead_retry(q, argv[1]);
		if (r)
			rc = failed(q, r, "dead retry");
		else
			(void)printf("%s back to pending\n", argv[1]);
	} else {
		r = ro_queue_dead_purge(q);
		if (r < 0)
			rc = failed(q, r, "dead purge");
		else
			(void)printf("purged %d\n", r);
	}
	(void)ro_queue_free(q);
	return rc;
}

static void print_line(void *arg, const char *json)
{
	(void)arg;
	(void)printf("%s\n", json);
}

static int cmd_samples(const struct ctl *c)
{
	struct ro_queue *q = NULL;
	char cursor[48];
	long left = c->count > 0 ? c->count : (c->follow ? -1 : 100);
	int r = open_queue(c, &q), rc = EXIT_SUCCESS;

	if (r)
		return EXIT_FAILURE;
	(void)snprintf(cursor, sizeof(cursor), "%s", c->from ? c->from : "0");
	while (!stop_requested && left != 0) {
		uint32_t want = left < 0 || left > 500 ? 500 : (uint32_t)left;

		r = ro_queue_read_samples(q, cursor, want, c->follow ? 1000 : 0, print_line, NULL);
		if (r < 0) {
			rc = failed(q, r, "samples");
			break;
		}
		(void)fflush(stdout);
		if (left > 0)
			left -= r;
		if (!c->follow && (uint32_t)r < want)
			break;
	}
	(void)ro_queue_free(q);
	return rc;
}

static bool parse_u32(const char *s, uint32_t *ret)
{
	char *end;
	unsigned long v;

	errno = 0;
	v = strtoul(s, &end, 10);
	if (errno || *end || end == s || v > UINT32_MAX || s[0] == '-')
		return false;
	*ret = (uint32_t)v;
	return true;
}

static int ctl_main(int argc, char **argv);

/* --json: what would go to stderr as text goes there as JSON, one object per line,
 * {"error": "...", "code": N} with N the exit status ({"warning": ...} when it is 0). The
 * lines are held until the command ends, since the code is known only then; a usage error
 * that exits early is code 2, and the usage text is cut to its first line. */
static FILE *json_err_real;
static char *json_err_buf;
static size_t json_err_len;
static int json_err_code = EXIT_USAGE;

static void json_err_flush(void)
{
	char *line, *save = NULL;
	unsigned emitted = 0;

	(void)fflush(stderr);
	if (!json_err_real)
		return;
	for (line = json_err_buf ? strtok_r(json_err_buf, "\n", &save) : NULL; line;
	     line = strtok_r(NULL, "\n", &save)) {
		struct json_object *o;
		const char *msg = !strncmp(line, "rolloutctl: ", 12) ? line + 12 : line;
		bool usage_text = !strncmp(msg, "usage:", 6);

		/* the usage text after an error is for people: its first line stands for it */
		if (usage_text && emitted)
			break;
		emitted++;
		o = json_object_new_object();
		json_object_object_add(o, json_err_code ? "error" : "warning",
				       json_object_new_string(msg));
		if (json_err_code)
			json_object_object_add(o, "code", json_object_new_int(json_err_code));
		(void)fprintf(json_err_real, "%s\n",
			      json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN));
		json_object_put(o);
		if (usage_text)
			break;
	}
	(void)fflush(json_err_real);
}

int main(int argc, char **argv)
{
	FILE *m;
	int rc, fd;

	if (argc == 2 && (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version"))) {
		ro_version_print(stdout, "rolloutctl");
		return 0;
	}
	for (int i = 1; i < argc && !json_err_real; i++) {
		if (strcmp(argv[i], "--json"))
			continue;
		fd = dup(STDERR_FILENO);
		json_err_real = fd >= 0 ? fdopen(fd, "w") : NULL;
		m = json_err_real ? open_memstream(&json_err_buf, &json_err_len) : NULL;
		if (m) {
			stderr = m;
			(void)atexit(json_err_flush);
		} else if (json_err_real) {
			(void)fclose(json_err_real);
			json_err_real = NULL;
			break;
		}
	}
	rc = ctl_main(argc, argv);
	json_err_code = rc;
	return rc;
}

static int ctl_main(int argc, char **argv)
{
	enum {
		O_REDIS = 256,
		O_QUEUE,
		O_PREFIX,
		O_JSON,
		O_FOLLOW,
		O_COUNT,
		O_FROM,
		O_MAXP,
		O_MAXN,
		O_MAXT,
		O_MAXB,
		O_PW,
		O_PWFILE,
		O_SPW,
		O_CA,
		O_CERT,
		O_KEY,
		O_SNI,
		O_CLUSTER,
		O_TIMEOUT,
		O_WAIT,
		O_PVERSION,
		O_URI,
		O_S3EP,
		O_S3REG,
		O_IMDSEP,
		O_INTERVAL,
		O_ITERATIONS,
		O_PLAIN
	};
	static const struct option opts[] = {
	    {"redis", required_argument, NULL, O_REDIS},
	    {"queue", required_argument, NULL, O_QUEUE},
	    {"prefix", required_argument, NULL, O_PREFIX},
	    {"json", no_argument, NULL, O_JSON},
	    {"follow", no_argument, NULL, O_FOLLOW},
	    {"count", required_argument, NULL, O_COUNT},
	    {"from", required_argument, NULL, O_FROM},
	    {"max-prompt", required_argument, NULL, O_MAXP},
	    {"max-n", required_argument, NULL, O_MAXN},
	    {"max-new-tokens", required_argument, NULL, O_MAXT},
	    {"max-body", required_argument, NULL, O_MAXB},
	    {"redis-password", required_argument, NULL, O_PW},
	    {"redis-password-file", required_argument, NULL, O_PWFILE},
	    {"redis-sentinel-password", required_argument, NULL, O_SPW},
	    {"redis-tls-ca", required_argument, NULL, O_CA},
	    {"redis-tls-cert", required_argument, NULL, O_CERT},
	    {"redis-tls-key", required_argument, NULL, O_KEY},
	    {"redis-tls-server-name", required_argument, NULL, O_SNI},
	    {"redis-cluster", required_argument, NULL, O_CLUSTER},
	    {"redis-timeout-ms", required_argument, NULL, O_TIMEOUT},
	    {"redis-wait-replicas", required_argument, NULL, O_WAIT},
	    {"version", required_argument, NULL, O_PVERSION},
	    {"uri", required_argument, NULL, O_URI},
	    {"s3-endpoint", required_argument, NULL, O_S3EP},
	    {"s3-region", required_argument, NULL, O_S3REG},
	    {"imds-endpoint", required_argument, NULL, O_IMDSEP},
	    {"interval", required_argument, NULL, O_INTERVAL},
	    {"iterations", required_argument, NULL, O_ITERATIONS},
	    {"plain", no_argument, NULL, O_PLAIN},
	    {"help", no_argument, NULL, 'h'},
	    {0},
	};
	struct ctl c = {
	    .redis = getenv("ROLLOUTD_REDIS"),
	    .queue = getenv("ROLLOUTD_QUEUE"),
	    .prefix = getenv("ROLLOUTD_PREFIX"),
	    .password = getenv("ROLLOUTD_REDIS_PASSWORD"),
	    .password_file = getenv("ROLLOUTD_REDIS_PASSWORD_FILE"),
	    .sentinel_password = getenv("ROLLOUTD_REDIS_SENTINEL_PASSWORD"),
	    .tls_ca = getenv("ROLLOUTD_REDIS_TLS_CA"),
	    .tls_cert = getenv("ROLLOUTD_REDIS_TLS_CERT"),
	    .tls_key = getenv("ROLLOUTD_REDIS_TLS_KEY"),
	    .tls_server_name = getenv("ROLLOUTD_REDIS_TLS_SERVER_NAME"),
	    .cluster = getenv("ROLLOUTD_REDIS_CLUSTER"),
	};
	struct sigaction sa = {.sa_handler = on_signal};
	int ch;

	/* imds has options of its own (the mock's are amazon-ec2-metadata-mock's) */
	if (argc > 1 && !strcmp(argv[1], "imds"))
		return ro_ctl_imds(argc - 2, argv + 2);
	/* the daemon's control socket */
	if (argc > 1 && !strcmp(argv[1], "drain"))
		return ro_ctl_drain(argc - 1, argv + 1);
	for (int i = 2; argc > 1 && !strcmp(argv[1], "status") && i < argc; i++)
		if (!strcmp(argv[i], "--local"))
			return ro_ctl_status_local(argc - 1, argv + 1);
	/* the model commands need no queue and take options of their own */
	if (argc > 1 && !strcmp(argv[1], "make-model"))
		return ro_ctl_make_model(argc - 1, argv + 1);
	if (argc > 1 && !strcmp(argv[1], "generate"))
		return ro_ctl_generate(argc - 1, argv + 1);
	ro_unit_bounds_default(&c.bounds);
	if (!c.queue || !*c.queue)
		c.queue = "default";
	while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		uint32_t v = 0;

		switch (ch) {
		case O_REDIS:
			c.redis = optarg;
			break;
		case O_QUEUE:
			c.queue = optarg;
			break;
		case O_PREFIX:
			c.prefix = optarg;
			break;
		case O_JSON:
			c.json = true;
			break;
		case O_FOLLOW:
			c.follow = true;
			break;
		case O_FROM:
			c.from = optarg;
			break;
		case O_PW: c.password = optarg; break;
		case O_PWFILE: c.password_file = optarg; break;
		case O_SPW: c.sentinel_password = optarg; break;
		case O_CA: c.tls_ca = optarg; break;
		case O_CERT: c.tls_cert = optarg; break;
		case O_KEY: c.tls_key = optarg; break;
		case O_SNI: c.tls_server_name = optarg; break;
		case O_CLUSTER: c.cluster = optarg; break;
		case O_URI: c.uri = optarg; break;
		case O_S3EP: c.s3_endpoint = optarg; break;
		case O_S3REG: c.s3_region = optarg; break;
		case O_IMDSEP: c.imds_endpoint = optarg; break;
		case O_PVERSION: {
			char *end;

			c.policy_version = strtoll(optarg, &end, 10);
			if (*end || c.policy_version < 1) {
				(void)fprintf(stderr, "rolloutctl: --version wants a positive integer\n");
				return EXIT_USAGE;
			}
			break;
		}
		case O_TIMEOUT:
		case O_WAIT:
		case O_PLAIN: c.plain = true; break;
		case O_INTERVAL:
		case O_ITERATIONS:
		case O_COUNT:
		case O_MAXP:
		case O_MAXN:
		case O_MAXT:
		case O_MAXB:
			if (!parse_u32(optarg, &v)) {
				(void)fprintf(
				    stderr,
				    "rolloutctl: --%s wants a non-negative integer, got \"%s\"\n",
				    opts[ch - O_REDIS].name, optarg);
				return EXIT_USAGE;
			}
			if (ch == O_TIMEOUT)
				c.timeout_ms = v;
			else if (ch == O_WAIT)
				c.wait_replicas = v;
			else if (ch == O_COUNT)
				c.count = v;
			else if (ch == O_INTERVAL)
				c.interval_ms = v;
			else if (ch == O_ITERATIONS)
				c.iterations = v;
			else if (ch == O_MAXP)
				c.bounds.max_prompt = v;
			else if (ch == O_MAXN)
				c.bounds.max_n = v;
			else if (ch == O_MAXT)
				c.bounds.max_new_tokens = v;
			else
				c.bounds.max_body = v;
			break;
		case 'h':
			usage(stdout);
			return EXIT_SUCCESS;
		default:
			usage(stderr);
			return EXIT_USAGE;
		}
	}
	argc -= optind;
	argv += optind;
	if (argc < 1) {
		usage(stderr);
		return EXIT_USAGE;
	}
	(void)sigaction(SIGINT, &sa, NULL);
	(void)sigaction(SIGTERM, &sa, NULL);
	(void)signal(SIGPIPE, SIG_IGN);
	if (!strcmp(argv[0], "enqueue"))
		return cmd_enqueue(&c, argc - 1, argv + 1);
	if (!strcmp(argv[0], "status") && argc == 1)
		return cmd_status(&c);
	if (!strcmp(argv[0], "init") && argc == 1)
		return cmd_init(&c);
	if (!strcmp(argv[0], "policy"))
		return cmd_policy(&c, argc - 1, argv + 1);
	if (!strcmp(argv[0], "reap") && argc == 1)
		return cmd_reap(&c);
	if (!strcmp(argv[0], "dead"))
		return cmd_dead(&c, argc - 1, argv + 1);
	if (!strcmp(argv[0], "samples") && argc == 1)
		return cmd_samples(&c);
	if (!strcmp(argv[0], "unit") && argc == 2)
		return cmd_unit(&c, argv[1]);
	if (!strcmp(argv[0], "queues") && argc == 1)
		return cmd_queues(&c);
	if (!strcmp(argv[0], "top") && argc == 1)
		return cmd_top(&c);
	(void)fprintf(stderr, "rolloutctl: unknown command \"%s\"\n", argv[0]);
	usage(stderr);
	return EXIT_USAGE;
}
