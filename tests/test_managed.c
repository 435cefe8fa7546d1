/* Managed Redis, as a user meets it: the URL forms, TLS (a server and certificates the
 * test makes), ACL users, a Redis Cluster (3 primaries + 3 replicas: routing from any
 * node, a primary killed, a slot migrated) and a Sentinel group (a failover), all real
 * servers on loopback; the figures of what a failover loses with redis-wait-replicas 0
 * and 1. */
#include <criterion/criterion.h>
#include <errno.h>
#include <json-c/json.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/model.h"
#include "queue/conn.h"
#include "tests/agent_fixture.h"
#include "tests/agent_model.h"
#include "tests/redis_fixture.h"
#include "tests/testutil.h"

/* ---- URLs --------------------------------------------------------------------------- */

Test(url, forms)
{
	struct ro_redis_url u;
	char err[512];

	cr_assert_eq(ro_redis_url_parse("redis://alice:p%40ss%2Fw@10.0.0.5:6380/3", &u, err,
					sizeof(err)),
		     0, "%s", err);
	cr_assert_str_eq(u.user, "alice");
	cr_assert_str_eq(u.password, "p@ss/w");
	cr_assert_str_eq(u.hosts[0].host, "10.0.0.5");
	cr_assert_eq(u.hosts[0].port, 6380);
	cr_assert_eq(u.db, 3);
	cr_assert(!u.tls && !u.sentinel);
	ro_redis_url_clear(&u);

	cr_assert_eq(ro_redis_url_parse("rediss://:secret@cache.example:6379", &u, err, sizeof(err)),
		     0, "%s", err);
	cr_assert(u.tls);
	cr_assert_null(u.user);
	cr_assert_str_eq(u.password, "secret");
	cr_assert_str_eq(u.hosts[0].host, "cache.example");
	ro_redis_url_clear(&u);

	cr_assert_eq(ro_redis_url_parse("redis://[::1]:7000", &u, err, sizeof(err)), 0, "%s", err);
	cr_assert_str_eq(u.hosts[0].host, "::1");
	cr_assert_eq(u.hosts[0].port, 7000);
	ro_redis_url_clear(&u);

	cr_assert_eq(ro_redis_url_parse("rediss+sentinel://bob:pw@s1,s2:26380,10.1.1.1/my%20primary/2",
					&u, err, sizeof(err)),
		     0, "%s", err);
	cr_assert(u.tls && u.sentinel);
	cr_assert_eq(u.n_hosts, 3);
	cr_assert_eq(u.hosts[0].port, 26379);
	cr_assert_eq(u.hosts[1].port, 26380);
	cr_assert_str_eq(u.hosts[2].host, "10.1.1.1");
	cr_assert_str_eq(u.master, "my primary");
	cr_assert_eq(u.db, 2);
	cr_assert_str_eq(u.user, "bob");
	ro_redis_url_clear(&u);

	cr_assert_eq(ro_redis_url_parse("unix:///run/redis/redis.sock?db=4&user=w&password=a%26b",
					&u, err, sizeof(err)),
		     0, "%s", err);
	cr_assert_str_eq(u.path, "/run/redis/redis.sock");
	cr_assert_eq(u.db, 4);
	cr_assert_str_eq(u.user, "w");
	cr_assert_str_eq(u.password, "a&b");
	ro_redis_url_clear(&u);

	/* an @ in a socket path is part of the path */
	cr_assert_eq(ro_redis_url_parse("unix:///run/redis@main/redis.sock", &u, err, sizeof(err)),
		     0, "%s", err);
	cr_assert_str_eq(u.path, "/run/redis@main/redis.sock");
	cr_assert_null(u.user);
	ro_redis_url_clear(&u);
}

Test(url, refused_with_the_reason_and_no_password)
{
	static const struct {
		const char *url, *why;
	} bad[] = {
	    {"http://h:1", "want redis://"},
	    {"redis://u:hunter2@h:99999", "bad port"},
	    {"redis://u:hunter2@h:6379/x", "bad db"},
	    {"redis://u:hunter2@h1,h2", "only redis+sentinel"},
	    {"redis+sentinel://u:hunter2@h1,h2", "no primary name"},
	    {"redis://u:hun%zzter2@h", "%-escape"},
	    {"rediss://", "no host"},
	};

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct ro_redis_url u;
		char err[512] = "";

		cr_assert_eq(ro_redis_url_parse(bad[i].url, &u, err, sizeof(err)), -EINVAL, "%s",
			     bad[i].url);
		cr_assert(strstr(err, bad[i].why), "%s: %s", bad[i].url, err);
		cr_assert(!strstr(err, "hunter2") && !strstr(err, "hun%zz"), "%s", err);
	}
}

Test(url, redacted)
{
	char out[256];

	ro_redis_url_redact("redis://alice:s3cr%40t@h:1/0", out, sizeof(out));
	cr_assert_str_eq(out, "redis://alice:***@h:1/0");
	ro_redis_url_redact("rediss://:pw@h", out, sizeof(out));
	cr_assert_str_eq(out, "rediss://:***@h");
	ro_redis_url_redact("unix:///s.sock?db=1&password=pw&user=u", out, sizeof(out));
	cr_assert_str_eq(out, "unix:///s.sock?db=1&password=***&user=u");
	ro_redis_url_redact("redis://h:6379", out, sizeof(out));
	cr_assert_str_eq(out, "redis://h:6379");
	/* what a refused URL may hold is hidden too */
	ro_redis_url_redact("redis//:secret@host", out, sizeof(out));
	cr_assert(!strstr(out, "secret"), "%s", out);
	ro_redis_url_redact("redis://h/0?password=secret", out, sizeof(out));
	cr_assert(!strstr(out, "secret"), "%s", out);
	ro_redis_url_redact("unix:///s?password=a&password=secret", out, sizeof(out));
	cr_assert(!strstr(out, "secret"), "%s", out);
	ro_redis_url_redact("unix://u:pw@/tmp/s?password=secret", out, sizeof(out));
	cr_assert(!strstr(out, "secret") && !strstr(out, "pw@"), "%s", out);
}

Test(url, slots_match_redis)
{
	/* CLUSTER KEYSLOT of these, as Redis 7 answers */
	cr_assert_eq(ro_key_slot("a", 1), 15495);
	cr_assert_eq(ro_key_slot("ro:{b}:pending", 14), 3300);
	cr_assert_eq(ro_key_slot("ro:{c}:", 7), 7365);
	cr_assert_eq(ro_key_slot("x{}y", 4), 16116); /* an empty tag: the whole key */
	cr_assert_neq(ro_key_slot("x{}y", 4), ro_key_slot("", 0));
}

/* ---- real servers -------------------------------------------------------------------- */

static char dir[64];
static char model[128];


static void setup(void)
{
	struct ro_make_model_opts o;
	char err[256];

	(void)snprintf(dir, sizeof(dir), "/tmp/ro-managed-XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
	(void)snprintf(model, sizeof(model), "%s/model", dir);
	ro_test_agent_model(&o);
	cr_assert_eq(ro_make_model(&o, model, err, sizeof(err)), 0, "%s", err);
}

static void teardown(void)
{
	char cmd[128];

	(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	(void)system(cmd);
}

TestSuite(managed, .init = setup, .fini = teardown, .timeout = 240);

/* How the test's own client reaches a server (TLS, credentials). */
struct conn_opts {
	const char *ca, *cert, *key, *password;
	uint32_t wait_replicas;
};

static struct ro_queue *open_q(const char *url, const char *queue, const char *worker,
			       const struct conn_opts *co)
{
	struct ro_queue_opts o = {
	    .url = url,
	    .queue = queue,
	    .worker = worker,
	    .timeout_ms = 2000,
	    .retry_ms = 30000,
	    .max_attempts = 10,
	};
	struct ro_queue *q = NULL;

	if (co) {
		o.tls_ca = co->ca;
		o.tls_cert = co->cert;
		o.tls_key = co->key;
		o.password = co->password;
		o.wait_replicas = co->wait_replicas;
		o.wait_timeout_ms = 300;
	}
	cr_assert_eq(ro_queue_new(&o, &q), 0, "%s", ro_queue_errmsg(NULL));
	return q;
}

static void enqueue(struct ro_queue *q, const char *prefix, int count, unsigned n, unsigned max_new)
{
	for (int i = 0; i < count; i++) {
		char js[512], why[256];
		struct ro_unit u = {0};
		int st;

		(void)snprintf(js, sizeof(js),
			       "{\"id\":\"%s-%d\",\"prompt\":[%d,%d,5],\"n\":%u,\"max_new_tokens\":%u,"
			       "\"sampling\":{\"temperature\":1.0,\"seed\":%d}}",
			       prefix, i, i % 1000, (i * 7) % 1000, n, max_new, i);
		cr_assert_eq(ro_unit_parse(js, strlen(js),
					   &(struct ro_unit_bounds){1000, 64, 100000, 1 << 20}, &u,
					   why, sizeof(why)),
			     0, "%s", why);
		cr_assert_eq(ro_queue_enqueue(q, &u, 1, &st), 0, "%s", ro_queue_errmsg(q));
		ro_unit_clear(&u);
	}
}

static long done_count(struct ro_queue *q)
{
	struct ro_queue_stats s = {0};
	long d = -1;

	if (ro_queue_stats(q, &s) == 0)
		d = (long)s.done;
	ro_queue_stats_clear(&s);
	return d;
}

static bool wait_done(struct ro_queue *q, long want, long ms)
{
	for (int64_t end = ro_test_mono_ms() + ms; ro_test_mono_ms() < end;) {
		if (done_count(q) >= want)
			return true;
		ro_test_msleep(50);
	}
	return false;
}

/* Every (unit, idx) in the samples stream once, units * n in all (through the queue's own
 * client: over TLS, to a cluster's owner, to the sentinels' primary). */
struct seen {
	char key[4096][48];
	char id[4096][24];
	size_t n, dups;
};

static void on_sample(void *arg, const char *js)
{
	struct seen *s = arg;
	struct json_object *o = json_tokener_parse(js), *u, *i, *id;
	char k[48];

	cr_assert(o && json_object_object_get_ex(o, "unit", &u) &&
		  json_object_object_get_ex(o, "idx", &i) && json_object_object_get_ex(o, "id", &id),
		  "%s", js);
	(void)snprintf(k, sizeof(k), "%s|%d", json_object_get_string(u), json_object_get_int(i));
	for (size_t j = 0; j < s->n; j++)
		if (!strcmp(s->key[j], k))
			s->dups++;
	cr_assert_lt(s->n, 4096);
	(void)snprintf(s->key[s->n], sizeof(s->key[0]), "%s", k);
	(void)snprintf(s->id[s->n], sizeof(s->id[0]), "%s", json_object_get_string(id));
	s->n++;
	json_object_put(o);
}

static struct seen *read_stream(struct ro_queue *q)
{
	struct seen *s = calloc(1, sizeof(*s));
	char cursor[48] = "0";
	int r;

	cr_assert_not_null(s);
	do {
		r = ro_queue_read_samples(q, cursor, 500, 0, on_sample, s);
		cr_assert_geq(r, 0, "%s", ro_queue_errmsg(q));
	} while (r > 0);
	return s;
}

static void verify_once(struct ro_queue *q, long units, unsigned n)
{
	struct seen *s = read_stream(q);

	cr_expect_eq(s->dups, 0, "%zu samples published twice", s->dups);
	cr_expect_eq(s->n, (size_t)units * n, "%zu samples, want %ld", s->n, units * n);
	free(s);
}


/* Until the agent's readiness is want (bounded): the probe's answer, as kubelet sees it. */
static bool wait_ready(const struct ro_test_agent *ag, bool want, long ms)
{
	for (int64_t end = ro_test_mono_ms() + ms; ro_test_mono_ms() < end;) {
		if (ro_test_agent_field(ag, "ready") == (want ? 1 : 0))
			return true;
		ro_test_msleep(20);
	}
	return false;
}

/* Lines of the agent's log that hold what. */
static int log_count(const struct ro_test_agent *ag, const char *what)
{
	FILE *f = fopen(ag->log, "r");
	char line[4096];
	int n = 0;

	while (f && fgets(line, sizeof(line), f))
		n += strstr(line, what) != NULL;
	if (f)
		(void)fclose(f);
	return n;
}

/* Waits (bounded) until Redis has refused n AUTHs of the user "worker" since its ACL LOG
 * was last reset (ACL LOG folds repeats of one refusal into an entry's count). */
static bool wait_auth_refused(const struct ro_test_redis *r, long n, long ms)
{
	char out[16384];

	for (int64_t end = ro_test_mono_ms() + ms; ro_test_mono_ms() < end;) {
		long seen = 0;

		if (ro_test_redis_cli(r, out, sizeof(out), "ACL", "LOG", NULL) == 0)
			/* entries one after another, each from its "count" line to the next */
			for (char *p = strstr(out, "count\n"); p;) {
				char *next = strstr(p + 1, "count\n");

				if (next)
					*next = '\0';
				if (strstr(p, "\nreason\nauth\n") && strstr(p, "\nusername\nworker\n"))
					seen += strtol(p + 6, NULL, 10);
				if (next)
					*next = 'c';
				p = next;
			}
		if (seen >= n)
			return true;
		ro_test_msleep(100);
	}
	return false;
}

static void stop_agent(struct ro_test_agent *ag)
{
	ro_test_agent_term(ag);
	cr_expect_eq(ro_test_agent_wait_exit(ag, 30000), 0);
}

/* A worker over TLS with a client certificate (the server wants one), a CA that is not
 * the server's and a missing client certificate refused at once with exit 2. */
Test(managed, tls_and_mtls)
{
	struct ro_test_redis r;
	struct ro_test_redis_opts ro = {.tls = true, .tls_auth_clients = true};
	char out[4096], other[300], q[64];
	struct conn_opts co;
	struct ro_test_agent a;
	struct ro_queue *qq;
	const char *extra[10];

	cr_assert_eq(ro_test_redis_start_opts(&r, &ro), 0);
	co = (struct conn_opts){.ca = r.ca, .cert = r.cert, .key = r.key};
	(void)snprintf(other, sizeof(other), "%s/other-ca.crt", r.certdir);
	ro_test_name("tls", q, sizeof(q));

	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", r.url, "--redis-tls-ca", other, "status",
			 NULL),
		     2, "%s", out);
	cr_expect(strstr(out, "not trusted"), "%s", out);
	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", r.url, "--redis-tls-ca", r.ca, "status",
			 NULL),
		     2, "%s", out);
	cr_expect(strstr(out, "client certificate"), "%s", out);
	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", r.url, "--redis-tls-ca", r.ca,
			 "--redis-tls-cert", r.cert, "--redis-tls-key", r.key, "--queue", q, "status",
			 NULL),
		     0, "%s", out);
	{
		/* by name (/etc/hosts: looked up without blocking, its addresses tried in turn,
		 * the certificate checked for the name, SNI sent), the settings from the
		 * environment */
		char byname[96];

		(void)snprintf(byname, sizeof(byname), "rediss://localhost:%d", r.port);
		cr_assert_eq(setenv("ROLLOUTD_REDIS_TLS_CA", r.ca, 1), 0);
		cr_assert_eq(setenv("ROLLOUTD_REDIS_TLS_CERT", r.cert, 1), 0);
		cr_assert_eq(setenv("ROLLOUTD_REDIS_TLS_KEY", r.key, 1), 0);
		cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", byname, "--queue", q, "status", NULL),
			     0, "%s", out);
		cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", byname, "--redis-tls-server-name",
				 "not-this-server", "--queue", q, "status", NULL),
			     2, "%s", out);
		cr_expect(strstr(out, "not trusted"), "%s", out);
		(void)unsetenv("ROLLOUTD_REDIS_TLS_CA");
		(void)unsetenv("ROLLOUTD_REDIS_TLS_CERT");
		(void)unsetenv("ROLLOUTD_REDIS_TLS_KEY");
	}

	/* rolloutd with the wrong CA stops at start, naming the cause */
	extra[0] = "--redis-tls-ca";
	extra[1] = other;
	extra[2] = NULL;
	ro_test_agent_start(&a, dir, model, r.url, "tls-bad", q, extra, NULL);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 2);
	cr_expect(ro_test_agent_log_has(&a, "not trusted"));

	qq = open_q(r.url, q, "enq", &co);
	enqueue(qq, "t", 6, 2, 24);
	extra[1] = r.ca;
	extra[2] = "--redis-tls-cert";
	extra[3] = r.cert;
	extra[4] = "--redis-tls-key";
	extra[5] = r.key;
	extra[6] = NULL;
	ro_test_agent_start(&a, dir, model, r.url, "tls-w", q, extra, NULL);
	if (!wait_done(qq, 6, 60000))
		ro_test_agent_dump_log(&a);
	cr_expect_eq(done_count(qq), 6);
	verify_once(qq, 6, 2);
	stop_agent(&a);
	(void)ro_queue_free(qq);
	ro_test_redis_stop(&r);
}

/* The worker's least-privilege ACL, as the README gives it (its queue's keys, FCALL and
 * the commands the functions and the client run; no FUNCTION, no CONFIG, no FLUSH*). */
#define WORKER_ACL                                                                          \
	"on >w0rker%pw resetkeys ~ro:{*}:* resetchannels -@all +ping +time +client|setname "   \
	"+cluster|slots +role +wait +fcall +fcall_ro +blpop +xlen +xinfo|groups +xread "      \
	"+xrange +hget +hgetall +hset +hdel +hexists +hincrby +hmget +del +lpop +lpush +rpush " \
	"+lrange +lrem +ltrim +llen +pexpire +xadd +zadd +zrange +zrangebyscore +zrem "        \
	"+zremrangebyscore +zcard +type +hstrlen +hlen +hkeys"

/* A least-privilege worker completes units once an admin loaded the library; before, and
 * with a wrong password, the start stops with exit 2 naming the user and the cause. */
Test(managed, acl_users)
{
	struct ro_test_redis r;
	struct ro_test_redis_opts ro = {
	    .acl_file_text = "user default off\n"
			     "user admin on >adm1n ~* &* +@all\n"
			     "user worker " WORKER_ACL "\n",
	    .user = "admin",
	    .password = "adm1n",
	};
	char out[4096], url[200], admin[200], bad[200], q[64];
	struct ro_test_agent a;
	struct ro_queue *qq;

	cr_assert_eq(ro_test_redis_start_opts(&r, &ro), 0);
	ro_test_name("acl", q, sizeof(q));
	/* the password's % and / escaped in the URL */
	(void)snprintf(url, sizeof(url), "redis://worker:w0rker%%25pw@127.0.0.1:%d", r.port);
	(void)snprintf(admin, sizeof(admin), "redis://admin:adm1n@127.0.0.1:%d", r.port);
	(void)snprintf(bad, sizeof(bad), "redis://worker:nope@127.0.0.1:%d", r.port);

	ro_test_agent_start(&a, dir, model, url, "acl-early", q, NULL, NULL);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 2);
	cr_expect(ro_test_agent_log_has(&a, "rolloutctl init"), "names the way out");
	cr_expect(!ro_test_agent_log_has(&a, "w0rker"), "no password in the log");

	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", admin, "--queue", q, "init", NULL), 0, "%s",
		     out);
	ro_test_agent_start(&a, dir, model, bad, "acl-bad", q, NULL, NULL);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 2);
	cr_expect(ro_test_agent_log_has(&a, "user worker.*WRONGPASS"));
	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", bad, "--queue", q, "status", NULL), 2, "%s",
		     out);
	cr_expect(strstr(out, "WRONGPASS") && strstr(out, "worker"), "%s", out);

	qq = open_q(admin, q, "enq", NULL);
	enqueue(qq, "a", 6, 2, 24);
	ro_test_agent_start(&a, dir, model, url, "acl-w", q, NULL, NULL);
	if (!wait_done(qq, 6, 60000))
		ro_test_agent_dump_log(&a);
	cr_expect_eq(done_count(qq), 6);
	cr_expect_eq(ro_test_agent_field(&a, "failed"), 0);
	verify_once(qq, 6, 2);
	/* and rolloutctl as the worker, with the password from the environment's file */
	{
		char pwf[200], u2[200];
		FILE *f;

		(void)snprintf(pwf, sizeof(pwf), "%s/pw", dir);
		f = fopen(pwf, "w");
		cr_assert_not_null(f);
		(void)fputs("w0rker%pw\n", f);
		(void)fclose(f);
		(void)snprintf(u2, sizeof(u2), "redis://worker@127.0.0.1:%d", r.port);
		cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", u2, "--redis-password-file", pwf,
				 "--queue", q, "status", NULL),
			     0, "%s", out);
	}
	/* the credentials change under a running worker: said once, not ready, retried; back
	 * once the password is right again. The retries are counted where Redis refuses
	 * them (ACL LOG, emptied first: the refusals above are in it). */
	cr_expect_eq(ro_test_redis_cli(&r, out, sizeof(out), "ACL", "LOG", "RESET", NULL), 0, "%s",
		     out);
	cr_expect_eq(ro_test_redis_cli(&r, out, sizeof(out), "ACL", "SETUSER", "worker", "resetpass",
				       ">rotated", NULL),
		     0, "%s", out);
	cr_expect_eq(ro_test_redis_cli(&r, out, sizeof(out), "CLIENT", "KILL", "USER", "worker", NULL),
		     0, "%s", out);
	cr_expect(wait_ready(&a, false, 20000), "not ready with the wrong password");
	cr_expect(wait_auth_refused(&r, 3, 30000), "the worker's AUTH refused three times");
	if (log_count(&a, "WRONGPASS") != 1)
		ro_test_agent_dump_log(&a);
	cr_expect_eq(log_count(&a, "WRONGPASS"), 1, "said once, not %d times",
		     log_count(&a, "WRONGPASS"));
	cr_expect_eq(ro_test_redis_cli(&r, out, sizeof(out), "ACL", "SETUSER", "worker", "resetpass",
				       ">w0rker%pw", NULL),
		     0, "%s", out);
	cr_expect(wait_ready(&a, true, 20000), "ready again");
	stop_agent(&a);
	cr_expect(!ro_test_agent_log_has(&a, "w0rker"), "no password in the log");
	(void)ro_queue_free(qq);
	ro_test_redis_stop(&r);
}

/* ---- Redis Cluster ---------------------------------------------------------------------- */

/* count queue names whose slots are on count different primaries */
static void names_on_primaries(struct ro_test_cluster *c, char (*names)[64], int count)
{
	int owners[8], found = 0;
	char name[64];

	for (int i = 0; found < count && i < 1000; i++) {
		int o;
		bool dup = false;

		(void)snprintf(name, sizeof(name), "mq%d-%d", (int)getpid() % 1000, i);
		o = ro_test_cluster_owner(c, name);
		cr_assert_geq(o, 0);
		for (int j = 0; j < found; j++)
			dup |= owners[j] == o;
		if (dup)
			continue;
		owners[found] = o;
		(void)snprintf(names[found++], 64, "%s", name);
	}
	cr_assert_eq(found, count);
}

/* Three queues on three primaries; agents and rolloutctl pointed at a replica (a node that
 * owns no slot) work; a db in the URL is refused as a cluster has only db 0. */
Test(managed, cluster_routing)
{
	static struct ro_test_cluster c;
	char names[3][64], out[4096], bad[200];
	struct ro_test_agent a[3];
	struct ro_queue *qq[3];
	const char *seed;
	int rep;

	cr_assert_eq(ro_test_cluster_start(&c, 3, 1), 0);
	names_on_primaries(&c, names, 3);
	rep = ro_test_cluster_replica_of(&c, ro_test_cluster_owner(&c, names[0]));
	cr_assert_geq(rep, 0);
	seed = c.node[rep].url;
	for (int i = 0; i < 3; i++) {
		qq[i] = open_q(seed, names[i], "enq", NULL);
		enqueue(qq[i], "c", 8, 2, 24);
		ro_test_agent_start(&a[i], dir, model, seed, names[i], names[i], NULL, NULL);
	}
	for (int i = 0; i < 3; i++) {
		if (!wait_done(qq[i], 8, 60000))
			ro_test_agent_dump_log(&a[i]);
		cr_expect_eq(done_count(qq[i]), 8, "queue %s", names[i]);
		verify_once(qq[i], 8, 2);
		cr_expect(strstr(ro_test_agent_status(&a[i], "status\n"), "\"redis_mode\":\"cluster\""));
		cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", seed, "--queue", names[i], "status",
				 NULL),
			     0, "%s", out);
		cr_expect(strstr(out, "done     8"), "%s", out);
	}
	/* rolloutctl queues sees the queues of every primary from the replica seed */
	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", seed, "queues", NULL), 0, "%s", out);
	for (int i = 0; i < 3; i++) {
		char line[200];

		(void)snprintf(line, sizeof(line), "%.64s\n", names[i]);
		cr_expect(strstr(out, line), "queue %s listed: %s", names[i], out);
	}
	(void)snprintf(bad, sizeof(bad), "%s/1", seed);
	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", bad, "--queue", names[0], "status", NULL), 2,
		     "%s", out);
	cr_expect(strstr(out, "only db 0"), "%s", out);
	for (int i = 0; i < 3; i++) {
		stop_agent(&a[i]);
		(void)ro_queue_free(qq[i]);
	}
	ro_test_cluster_stop(&c);
}

/* SIGKILL primary idx of a cluster (hung, or refusing the fixture's own connections) and
 * wait (bounded) until another node owns the queue's slot: its index. */
static int kill_and_promote(struct ro_test_cluster *c, int idx, const char *q)
{
	ro_test_redis_kill(&c->node[idx]);
	for (int i = 0; i < 1500; i++) {
		int o = ro_test_cluster_owner(c, q);

		if (o >= 0 && o != idx)
			return o;
		ro_test_msleep(20);
	}
	cr_assert_fail("no replica of node %d promoted in 30 s", idx);
	return -1;
}

/* The primary of a running agent's queue killed and its replica promoted: the agent is not
 * ready while it cannot write, drops and counts the leases it could not renew, and goes
 * on with the new primary without a restart; every unit completes once. */
static void failover_run(bool sentinel)
{
	static struct ro_test_cluster c;
	static struct ro_test_sentinel s;
	char q[64];
	struct ro_test_agent a;
	struct ro_queue *qq;
	const char *url;
	const char *extra[] = {"--lease-ms", "1000", "--redis-unready-ms", "500",
			       "--redis-timeout-ms", "500", "--max-inflight", "4",
			       "--claim-batch", "1", NULL};
	pid_t old;
	int promoted_port, units = 12;
	unsigned max_new = ro_test_scaled(600);

	ro_test_name(sentinel ? "snt" : "clu", q, sizeof(q));
	if (sentinel) {
		cr_assert_eq(ro_test_sentinel_start(&s, NULL), 0);
		url = s.url;
		old = s.primary.pid;
	} else {
		int owner;

		cr_assert_eq(ro_test_cluster_start(&c, 3, 1), 0);
		owner = ro_test_cluster_owner(&c, q);
		cr_assert_geq(owner, 0);
		url = c.node[(owner + 1) % 3].url; /* another primary as the seed */
		old = c.node[owner].pid;
	}
	qq = open_q(url, q, "enq", NULL);
	enqueue(qq, "f", units, 2, max_new);
	ro_test_agent_start(&a, dir, model, url, "fo", q, extra, NULL);
	cr_assert(wait_ready(&a, true, 30000));
	for (int i = 0; i < 600 && ro_test_agent_field(&a, "units") < 1; i++)
		ro_test_msleep(20);
	cr_assert_geq(ro_test_agent_field(&a, "units"), 1, "the agent holds units when its primary dies");

	/* hung first (it cannot write: not ready), then dead and replaced */
	cr_assert_eq(kill(old, SIGSTOP), 0);
	cr_expect(wait_ready(&a, false, 20000), "not ready while it cannot write");
	if (sentinel) {
		cr_assert_eq(ro_test_sentinel_kill_primary(&s, &promoted_port), 0);
	} else {
		for (int i = 0; i < c.n; i++)
			if (c.node[i].pid == old)
				promoted_port = c.node[kill_and_promote(&c, i, q)].port;
	}
	cr_expect(wait_ready(&a, true, 30000), "ready again on the new primary");
	{
		char want[32];

		(void)snprintf(want, sizeof(want), "127.0.0.1:%d", promoted_port);
		cr_expect(strstr(ro_test_agent_status(&a, "status\n"), want), "on %s: %s", want,
			  ro_test_agent_status(&a, "status\n"));
	}
	cr_expect_geq(ro_test_agent_field(&a, "lease_losses"), 1, "the leases it could not renew");
	if (!wait_done(qq, units, 120000)) {
		ro_test_agent_dump_log(&a);
		(void)fprintf(stderr, "agent status: %s\n", ro_test_agent_status(&a, "status\n"));
		if (!sentinel)
			for (int i = 0; i < c.n; i++) {
				char cmd[512];

				(void)snprintf(cmd, sizeof(cmd),
					       "(timeout 5 redis-cli -p %d role | head -1; timeout 5 redis-cli -p %d llen "
					       "'ro:{%s}:pending'; timeout 5 redis-cli -p %d zcard 'ro:{%s}:leases') "
					       "| tr '\\n' ' ' >&2; echo >&2",
					       c.node[i].port, c.node[i].port, q, c.node[i].port, q);
				(void)fprintf(stderr, "node %d (port %d): ", i, c.node[i].port);
				(void)system(cmd);
			}
	}
	cr_expect_eq(done_count(qq), units);
	verify_once(qq, units, 2);
	cr_expect_eq(ro_test_agent_field(&a, "ready"), 1);
	stop_agent(&a);
	(void)ro_queue_free(qq);
	if (sentinel)
		ro_test_sentinel_stop(&s);
	else
		ro_test_cluster_stop(&c);
}

Test(managed, cluster_primary_killed)
{
	failover_run(false);
}

Test(managed, sentinel_failover)
{
	failover_run(true);
}

/* A running agent's slot migrated to another primary in steps (ASK while half of its keys
 * are on each side, then MOVED): no error surfaces, nothing is charged or lost. */
Test(managed, cluster_slot_migration)
{
	static struct ro_test_cluster c;
	char q[64];
	struct ro_test_agent a;
	struct ro_queue *qq;
	int from, to, slot, moved = 0, units = 16;
	char key[96];

	cr_assert_eq(ro_test_cluster_start(&c, 3, 1), 0);
	ro_test_name("mig", q, sizeof(q));
	from = ro_test_cluster_owner(&c, q);
	to = (from + 1) % 3;
	while (to == from || ro_test_cluster_replica_of(&c, to) < 0) /* another primary */
		to = (to + 1) % c.n;
	(void)snprintf(key, sizeof(key), "{%s}", q);
	slot = ro_test_slot(key);
	qq = open_q(c.node[from].url, q, "enq", NULL);
	enqueue(qq, "m", units, 2, ro_test_scaled(300));
	ro_test_agent_start(&a, dir, model, c.node[from].url, "mig", q,
			    (const char *const[]){"--max-inflight", "4", "--claim-batch", "1", NULL},
			    NULL);
	for (int i = 0; i < 600 && ro_test_agent_field(&a, "completed") < 2; i++)
		ro_test_msleep(20);
	cr_assert_eq(ro_test_cluster_migrate_begin(&c, slot, from, to), 0);
	for (int r; (r = ro_test_cluster_migrate_some(&c, slot, from, to, 3)) > 0;) {
		moved += r;
		ro_test_msleep(20); /* traffic meets the half-migrated slot */
	}
	cr_assert_eq(ro_test_cluster_migrate_end(&c, slot, from, to), 0);
	cr_expect_gt(moved, 0);
	if (!wait_done(qq, units, 120000))
		ro_test_agent_dump_log(&a);
	cr_expect_eq(done_count(qq), units);
	verify_once(qq, units, 2);
	cr_expect_eq(ro_test_agent_field(&a, "failed"), 0, "nothing charged");
	cr_expect_eq(ro_test_agent_field(&a, "lease_losses"), 0);
	{
		char want[32];

		(void)snprintf(want, sizeof(want), "127.0.0.1:%d", c.node[to].port);
		cr_expect(strstr(ro_test_agent_status(&a, "status\n"), want), "follows the slot");
		cr_expect_geq(ro_test_agent_field(&a, "redis_redirects"), 1, "by its MOVED");
	}
	stop_agent(&a);
	(void)ro_queue_free(qq);
	ro_test_cluster_stop(&c);
}

/* ---- what a failover loses ---------------------------------------------------------------- */

/* Replication is asynchronous: a write the primary acknowledged and had not sent to its
 * replica is gone once that replica is promoted. The schedule makes that window certain:
 * units claimed and half their samples published and replicated; the replica's link cut
 * (the primary now wants a password the replica does not have); the other half published;
 * the primary killed and the replica promoted; the old primary back as a replica; then
 * the worker finishes every unit as rolloutd does (publish is idempotent, complete refuses
 * a unit with a sample missing). lost: samples whose publish was confirmed to the worker
 * and that are not in the final stream; dups: (unit, idx) twice in it. */
struct figures {
	long confirmed, unconfirmed, lost, dups, total;
};

static int publish_one(struct ro_queue *q, const struct ro_claim *c, uint32_t idx, char id[24])
{
	int32_t tok[2] = {(int32_t)idx, (int32_t)c->attempt};
	float lp[2] = {-0.5f, -0.25f};
	struct ro_sample s = {.idx = idx, .tokens = tok, .logprobs = lp, .len = 2, .finish = "stop"};
	char ids[1][24];
	bool completed;
	int r = ro_queue_publish(q, c, &s, 1, false, ids, &completed);

	if (!r)
		memcpy(id, ids[0], 24);
	return r;
}

static void wait_info(const struct ro_test_redis *r, const char *field, const char *want)
{
	char v[64] = "";

	for (int i = 0; i < 500; i++) {
		if (ro_test_redis_info(r, "replication", field, v, sizeof(v)) == 0 && !strcmp(v, want))
			return;
		ro_test_msleep(20);
	}
	cr_assert_fail("%s:%d: %s is %s, want %s", "127.0.0.1", r->port, field, v, want);
}

static void wait_synced(const struct ro_test_redis *p, const struct ro_test_redis *r)
{
	char a[32] = "", b[32] = "";

	for (int i = 0; i < 500; i++) {
		if (!ro_test_redis_info(p, "replication", "master_repl_offset", a, sizeof(a)) &&
		    !ro_test_redis_info(r, "replication", "master_repl_offset", b, sizeof(b)) &&
		    !strcmp(a, b))
			return;
		ro_test_msleep(20);
	}
	cr_assert_fail("replica at %s, primary at %s", b, a);
}

static void failover_figures(bool sentinel, uint32_t wait, struct figures *f)
{
	static struct ro_test_cluster c;
	static struct ro_test_sentinel s;
	struct ro_test_redis *p, *rep, cut;
	char q[64], out[512], (*acked)[24];
	struct ro_claim *cl = NULL;
	size_t ncl = 0;
	struct ro_queue *qq;
	const char *url;
	const unsigned units = 6, n = 4;
	int pi = -1, promoted = -1, port;

	memset(f, 0, sizeof(*f));
	ro_test_name("fig", q, sizeof(q));
	if (sentinel) {
		cr_assert_eq(ro_test_sentinel_start(&s, NULL), 0);
		url = s.url;
		p = &s.primary;
		rep = &s.replica;
	} else {
		cr_assert_eq(ro_test_cluster_start(&c, 3, 1), 0);
		pi = ro_test_cluster_owner(&c, q);
		cr_assert_geq(pi, 0);
		p = &c.node[pi];
		rep = &c.node[ro_test_cluster_replica_of(&c, pi)];
		url = p->url;
		/* promote it whatever the age of its data (the point of the test) */
		cr_assert_eq(ro_test_redis_cli(rep, out, sizeof(out), "CONFIG", "SET",
					       "cluster-replica-validity-factor", "0", NULL),
			     0, "%s", out);
	}
	qq = open_q(url, q, "drv", &(struct conn_opts){.wait_replicas = wait});
	enqueue(qq, "g", (int)units, n, 8);
	while (ncl < units) {
		struct ro_claim *more = NULL;
		size_t k = 0;

		cr_assert_geq(ro_queue_claim(qq, units, 600000, &more, &k), 0, "%s",
			      ro_queue_errmsg(qq));
		cr_assert_gt(k, 0);
		cl = realloc(cl, (ncl + k) * sizeof(*cl));
		memcpy(cl + ncl, more, k * sizeof(*cl));
		free(more);
		ncl += k;
	}
	acked = calloc(units * n, sizeof(*acked));
	for (unsigned u = 0; u < units; u++)
		for (unsigned i = 0; i < n / 2; i++) {
			cr_assert_eq(publish_one(qq, &cl[u], i, acked[u * n + i]), 0, "%s",
				     ro_queue_errmsg(qq));
			f->confirmed++;
		}
	wait_synced(p, rep);

	/* cut the link: the replica cannot come back without the new password */
	cut = *p;
	cr_assert_eq(ro_test_redis_cli(p, out, sizeof(out), "CONFIG", "SET", "requirepass",
				       "cut-link", NULL),
		     0, "%s", out);
	(void)snprintf(cut.password, sizeof(cut.password), "cut-link");
	cr_assert_eq(ro_test_redis_cli(&cut, out, sizeof(out), "CLIENT", "KILL", "TYPE", "replica",
				       NULL),
		     0, "%s", out);
	wait_info(rep, "master_link_status", "down");
	for (unsigned u = 0; u < units; u++)
		for (unsigned i = n / 2; i < n; i++) {
			int r = publish_one(qq, &cl[u], i, acked[u * n + i]);

			if (r == 0) {
				f->confirmed++;
			} else {
				cr_assert_eq(r, -ETIMEDOUT, "%s", ro_queue_errmsg(qq));
				acked[u * n + i][0] = '\0';
				f->unconfirmed++;
			}
		}

	/* the primary dies, its replica is promoted, the old one comes back as a replica */
	if (sentinel) {
		char pstr[16];

		cr_assert_eq(ro_test_sentinel_kill_primary(&s, &port), 0);
		cr_assert_eq(ro_test_redis_restart(&s.replica), 0);
		/* what the sentinels would do, in their own time (often 10 s and more) */
		(void)snprintf(pstr, sizeof(pstr), "%d", port);
		cr_assert_eq(ro_test_redis_cli(&s.replica, out, sizeof(out), "REPLICAOF", "127.0.0.1",
					       pstr, NULL),
			     0, "%s", out);
		cr_assert_eq(ro_test_redis_wait_link(&s.replica, 30000), 0);
	} else {
		promoted = kill_and_promote(&c, pi, q);
		(void)promoted;
		cr_assert_eq(ro_test_redis_restart(&c.node[pi]), 0);
		cr_assert_eq(ro_test_redis_wait_link(&c.node[pi], 30000), 0);
	}

	/* the worker finishes, as rolloutd does: what is not confirmed (a WAIT short of its
	 * replica while the old primary resyncs) is sent again */
	for (unsigned u = 0; u < units; u++) {
		int r = -EBUSY;

		for (int tries = 0; tries < 100 && r && r != -ESTALE; tries++) {
			r = 0;
			for (unsigned i = 0; i < n && !r; i++) {
				char id[24];

				r = publish_one(qq, &cl[u], i, id);
			}
			if (!r)
				r = ro_queue_complete(qq, &cl[u], NULL);
			if (r)
				ro_test_msleep(50);
		}
		cr_assert_eq(r, 0, "%s", ro_queue_errmsg(qq));
	}
	{
		struct seen *st = read_stream(qq);

		for (unsigned k = 0; k < units * n; k++) {
			bool found = !acked[k][0];

			for (size_t j = 0; j < st->n && !found; j++)
				found = !strcmp(st->id[j], acked[k]);
			f->lost += !found;
		}
		f->dups = (long)st->dups;
		f->total = (long)st->n;
		free(st);
	}
	ro_claims_free(cl, ncl);
	free(acked);
	(void)ro_queue_free(qq);
	if (sentinel)
		ro_test_sentinel_stop(&s);
	else
		ro_test_cluster_stop(&c);
}

static void figures_for(bool sentinel)
{
	for (uint32_t wait = 0; wait <= 1; wait++) {
		struct figures f;

		failover_figures(sentinel, wait, &f);
		(void)fprintf(stderr,
			      "failover figures (%s, redis-wait-replicas %u): %ld samples confirmed, "
			      "%ld not confirmed, %ld confirmed and lost, %ld duplicated, %ld in the "
			      "stream\n",
			      sentinel ? "sentinel" : "cluster", wait, f.confirmed, f.unconfirmed,
			      f.lost, f.dups, f.total);
		cr_expect_eq(f.dups, 0, "never a duplicate");
		cr_expect_eq(f.total, 24, "every sample in the stream in the end");
		if (wait)
			cr_expect_eq(f.lost, 0, "with WAIT, nothing confirmed is lost");
		else
			cr_expect_gt(f.lost, 0, "without WAIT the window is real (the schedule opens it)");
	}
}

Test(managed, failover_figures_cluster)
{
	figures_for(false);
}

Test(managed, failover_figures_sentinel)
{
	figures_for(true);
}

/* CLUSTER FAILOVER on the replica of a running agent's primary: the old primary, now a
 * replica, answers MOVED and the agent follows at once; nothing charged, every unit once. */
Test(managed, cluster_manual_failover)
{
	static struct ro_test_cluster c;
	char q[64], want[32];
	struct ro_test_agent a;
	struct ro_queue *qq;
	int owner, rep, units = 12;

	cr_assert_eq(ro_test_cluster_start(&c, 3, 1), 0);
	ro_test_name("mfo", q, sizeof(q));
	owner = ro_test_cluster_owner(&c, q);
	rep = ro_test_cluster_replica_of(&c, owner);
	cr_assert_geq(rep, 0);
	qq = open_q(c.node[owner].url, q, "enq", NULL);
	enqueue(qq, "o", units, 2, ro_test_scaled(300));
	ro_test_agent_start(&a, dir, model, c.node[owner].url, "mfo", q,
			    (const char *const[]){"--max-inflight", "4", "--claim-batch", "1", NULL},
			    NULL);
	for (int i = 0; i < 600 && ro_test_agent_field(&a, "completed") < 2; i++)
		ro_test_msleep(20);
	cr_assert_eq(ro_test_cluster_manual_failover(&c, rep), 0);
	if (!wait_done(qq, units, 120000))
		ro_test_agent_dump_log(&a);
	cr_expect_eq(done_count(qq), units);
	verify_once(qq, units, 2);
	cr_expect_eq(ro_test_agent_field(&a, "failed"), 0, "nothing charged");
	(void)snprintf(want, sizeof(want), "127.0.0.1:%d", c.node[rep].port);
	cr_expect(strstr(ro_test_agent_status(&a, "status\n"), want), "on the new primary: %s",
		  ro_test_agent_status(&a, "status\n"));
	cr_expect_geq(ro_test_agent_field(&a, "redis_redirects"), 1, "by its MOVED");
	cr_expect_eq(ro_test_agent_field(&a, "ready"), 1);
	stop_agent(&a);
	(void)ro_queue_free(qq);
	ro_test_cluster_stop(&c);
}

/* A server at its client limit refuses a connection with an ERR reply to the first command
 * (AUTH here): an overload, not wrong credentials. rolloutctl fails with 1 (try again), not
 * 2, and works once a client leaves. */
Test(managed, maxclients_is_not_a_credentials_error)
{
	struct ro_test_redis r;
	const char *extra[] = {"--maxclients", "1", NULL};
	struct ro_test_redis_opts ro = {.password = "pw", .extra_args = extra};
	char out[4096], url[128];
	redisContext *hold;

	cr_assert_eq(ro_test_redis_start_opts(&r, &ro), 0);
	(void)snprintf(url, sizeof(url), "redis://:pw@127.0.0.1:%d", r.port);
	hold = redisConnect("127.0.0.1", r.port); /* the one client it takes */
	cr_assert(hold && !hold->err);
	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", url, "--redis-timeout-ms", "500", "status",
			 NULL),
		     1, "%s", out);
	cr_expect(strstr(out, "max number of clients"), "%s", out);
	redisFree(hold);
	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", url, "status", NULL), 0, "%s", out);
	ro_test_redis_stop(&r);
}
