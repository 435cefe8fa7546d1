/* rolloutctl as a user runs it: the real binary against the binary's redis-server, its
 * output, its exit codes (0 ok, 1 failure, 2 usage), and that a refused file writes
 * nothing. */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/redis_hooks.h"

static redisContext *R;
static char Q[96];
static char dir[64];

static void setup(void)
{
	R = ro_test_redis_connect(ro_test_redis_url());
	cr_assert(R && !R->err);
	ro_test_name("ctl", Q, sizeof(Q));
	(void)snprintf(dir, sizeof(dir), "/tmp/ro-ctl-XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void)
{
	char cmd[128];

	redisFree(R);
	(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	(void)system(cmd);
}

TestSuite(ctl, .init = setup, .fini = teardown, .timeout = 60);

struct run {
	int status;
	char out[65536];
	char err[65536];
};

static void slurp(int fd, char *buf, size_t cap)
{
	size_t off = 0;
	ssize_t n;

	while (off + 1 < cap && (n = read(fd, buf + off, cap - 1 - off)) > 0)
		off += (size_t)n;
	buf[off] = '\0';
}

/* the commands that take no queue options (make-model, generate, imds) go alone */
static bool bare;

/* rolloutctl ARGS... with --redis and --queue from the fixture, stdin from file (or none) */
static struct run *ctl(const char *stdin_file, ...)
{
	static struct run r;
	const char *argv[32] = {getenv("RO_ROLLOUTCTL"), "--redis", ro_test_redis_url(), "--queue",
				Q};
	int argc = bare ? 1 : 5, out[2], err[2];
	va_list ap;
	pid_t pid;
	char of[128], ef[128];

	cr_assert_not_null(argv[0], "RO_ROLLOUTCTL not set");
	va_start(ap, stdin_file);
	for (const char *a; (a = va_arg(ap, const char *));)
		argv[argc++] = a;
	va_end(ap);
	argv[argc] = NULL;
	(void)snprintf(of, sizeof(of), "%s/out", dir);
	(void)snprintf(ef, sizeof(ef), "%s/err", dir);
	pid = fork();
	if (pid == 0) {
		int in = open(stdin_file ? stdin_file : "/dev/null", O_RDONLY);
		int o = open(of, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		int e = open(ef, O_WRONLY | O_CREAT | O_TRUNC, 0600);

		(void)dup2(in, 0);
		(void)dup2(o, 1);
		(void)dup2(e, 2);
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	cr_assert_eq(waitpid(pid, &r.status, 0), pid);
	r.status = WIFEXITED(r.status) ? WEXITSTATUS(r.status) : 128 + WTERMSIG(r.status);
	out[0] = open(of, O_RDONLY);
	err[0] = open(ef, O_RDONLY);
	slurp(out[0], r.out, sizeof(r.out));
	slurp(err[0], r.err, sizeof(r.err));
	(void)close(out[0]);
	(void)close(err[0]);
	(void)err;
	(void)out;
	return &r;
}

static const char *write_file(const char *name, const char *text)
{
	static char paths[4][128];
	static int turn;
	char *path = paths[turn++ % 4];
	FILE *f;

	(void)snprintf(path, 128, "%s/%s", dir, name);
	f = fopen(path, "w");
	cr_assert_not_null(f);
	(void)fputs(text, f);
	(void)fclose(f);
	return path;
}

#define UNIT(id) "{\"id\":\"" id "\",\"prompt\":[1,2],\"n\":2,\"max_new_tokens\":4}\n"

Test(ctl, enqueue_and_status)
{
	const char *f = write_file("units.jsonl", UNIT("a") "\n" UNIT("b") UNIT("c"));
	struct run *r = ctl(NULL, "enqueue", f, NULL);

	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_assert(strstr(r->out, "queued 3, already queued 0"), "%s", r->out);
	r = ctl(NULL, "enqueue", f, NULL);
	cr_assert_eq(r->status, 0);
	cr_assert(strstr(r->out, "queued 0, already queued 3"), "%s", r->out);
	r = ctl(NULL, "status", "--json", NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_assert(strstr(r->out, "\"pending\":3,"), "%s", r->out);
	cr_assert(strstr(r->out, "\"dead\":0,"), "%s", r->out);
	/* a worker's hash holds strings; status --json gives numbers as numbers */
	{
		redisReply *t = redisCommand(R, "TIME");
		long long now = t ? atoll(t->element[0]->str) * 1000 : 0;

		freeReplyObject(t);
		freeReplyObject(redisCommand(R,
					     "HSET ro:{%s}:worker:w9 last_seen_ms %lld units 0 "
					     "tokens_per_s 12.5 state running version 007",
					     Q, now));
		freeReplyObject(redisCommand(R, "ZADD ro:{%s}:workers %lld w9", Q, now));
	}
	r = ctl(NULL, "status", "--json", NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_assert(strstr(r->out, "\"units\":0"), "%s", r->out);
	cr_assert(strstr(r->out, "\"tokens_per_s\":12.5"), "%s", r->out);
	cr_assert(strstr(r->out, "\"state\":\"running\""), "%s", r->out);
	cr_assert(strstr(r->out, "\"version\":\"007\""), "not a decimal number: %s", r->out);
	r = ctl(NULL, "status", NULL);
	cr_assert_eq(r->status, 0);
	cr_assert(strstr(r->out, "pending  3\n"), "%s", r->out);
}

Test(ctl, enqueue_from_stdin)
{
	const char *f = write_file("in.jsonl", UNIT("s1") UNIT("s2"));
	struct run *r = ctl(f, "enqueue", "-", NULL);

	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s}:pending", Q), 2);
}

Test(ctl, bad_lines_are_reported_by_number_and_nothing_is_written)
{
	const char *f = write_file(
	    "bad.jsonl",
	    UNIT("ok1") "{\"id\":\"x y\",\"prompt\":[1],\"n\":1,\"max_new_tokens\":1}\n" UNIT(
		"ok2") "{\"id\":\"z\",\"prompt\":[1],\"n\":0,\"max_new_tokens\":1}\n"
		       "{broken\n");
	struct run *r = ctl(NULL, "enqueue", f, NULL);

	cr_assert_eq(r->status, 1);
	cr_assert(strstr(r->err, "bad.jsonl:2: id \"x y\" must be 1-128 characters"), "%s", r->err);
	cr_assert(strstr(r->err, "bad.jsonl:4: n must be at least 1"), "%s", r->err);
	cr_assert(strstr(r->err, "bad.jsonl:5: not valid JSON"), "%s", r->err);
	cr_assert(strstr(r->err, "3 bad lines"), "%s", r->err);
	cr_assert_eq(ro_test_int(R, "EXISTS ro:{%s}:pending", Q), 0);
	cr_assert_eq(ro_test_int(R, "EXISTS ro:{%s}:unit:ok1", Q), 0);
}

Test(ctl, ten_megabyte_line_is_refused)
{
	char path[128];
	FILE *f;
	struct run *r;

	(void)snprintf(path, sizeof(path), "%s/huge.jsonl", dir);
	f = fopen(path, "w");
	(void)fputs("{\"id\":\"big\",\"n\":1,\"max_new_tokens\":1,\"prompt\":[1", f);
	for (int i = 0; i < (10 << 20) / 2; i++)
		(void)fputs(",1", f);
	(void)fputs("]}\n", f);
	(void)fclose(f);
	r = ctl(NULL, "enqueue", path, NULL);
	cr_assert_eq(r->status, 1);
	cr_assert(strstr(r->err, "huge.jsonl:1: unit is 10485") &&
		      strstr(r->err, "above the bound 1048576"),
		  "%s", r->err);
	cr_assert_eq(ro_test_int(R, "EXISTS ro:{%s}:unit:big", Q), 0);
}

Test(ctl, conflicting_body_fails)
{
	const char *a = write_file("a.jsonl", UNIT("dup"));
	const char *b =
	    write_file("b.jsonl", "{\"id\":\"dup\",\"prompt\":[9],\"n\":1,\"max_new_tokens\":1}\n");
	struct run *r = ctl(NULL, "enqueue", a, NULL);

	cr_assert_eq(r->status, 0);
	r = ctl(NULL, "enqueue", b, NULL);
	cr_assert_eq(r->status, 1);
	cr_assert(strstr(r->err, "b.jsonl:1: id dup exists with a different body"), "%s", r->err);
}

Test(ctl, usage_errors_exit_2)
{
	cr_assert_eq(ctl(NULL, NULL)->status, 2);
	cr_assert_eq(ctl(NULL, "frobnicate", NULL)->status, 2);
	cr_assert_eq(ctl(NULL, "enqueue", NULL)->status, 2);
	cr_assert_eq(ctl(NULL, "dead", "explode", NULL)->status, 2);
	cr_assert_eq(ctl(NULL, "dead", "retry", NULL)->status, 2);
	cr_assert_eq(ctl(NULL, "samples", "--count", "-3", NULL)->status, 2);
	cr_assert_eq(ctl(NULL, "--bogus", "status", NULL)->status, 2);
	cr_assert_eq(ctl(NULL, "--help", NULL)->status, 0);
}

Test(ctl, failures_exit_1)
{
	const char *argv0 = getenv("RO_ROLLOUTCTL");
	char cmd[512];
	int st;

	cr_assert_eq(ctl(NULL, "enqueue", "/nonexistent/file", NULL)->status, 1);
	cr_assert_eq(ctl(NULL, "dead", "retry", "nosuch", NULL)->status, 1);
	/* a Redis that is not there: a clear message and 1, quickly */
	(void)snprintf(cmd, sizeof(cmd), "%s --redis redis://127.0.0.1:1/0 status 2>/dev/null",
		       argv0);
	st = system(cmd);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d", st);
	/* a bad URL is a usage error: no retry fixes it */
	(void)snprintf(cmd, sizeof(cmd), "%s --redis ftp://x status 2>/dev/null", argv0);
	st = system(cmd);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "status %d", st);
}

Test(ctl, env_selects_redis_and_queue)
{
	char cmd[1024];
	const char *f = write_file("e.jsonl", UNIT("e1"));
	int st;

	(void)snprintf(cmd, sizeof(cmd),
		       "ROLLOUTD_REDIS=unix://%s ROLLOUTD_QUEUE=%s-env %s enqueue %s >/dev/null",
		       getenv("RO_TEST_REDIS_SOCK"), Q, getenv("RO_ROLLOUTCTL"), f);
	st = system(cmd);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s-env}:pending", Q), 1);
}

Test(ctl, reap_dead_list_retry_purge_samples)
{
	struct ro_queue *q = ro_test_queue(ro_test_redis_url(), Q, "w1", 1);
	struct ro_claim *c;
	size_t n;
	struct run *r;
	char dead_id[32];

	ro_test_enqueue(q, "d", 0, 2, 1, false);
	cr_assert_eq(ro_queue_claim(q, 2, 50, &c, &n), 2);
	ro_claims_free(c, n);
	usleep(150000);
	/* max attempts 1 in this client; rolloutctl's default is 3, so reap requeues */
	r = ctl(NULL, "reap", "--json", NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_assert_str_eq(r->out, "{\"requeued\":2,\"dead\":0}\n");
	cr_assert_eq(ro_queue_claim(q, 1, 10000, &c, &n), 1);
	(void)snprintf(dead_id, sizeof(dead_id), "%s", c[0].id);
	cr_assert_eq(ro_queue_dead_letter(q, c, "too long for the model"), 0);
	ro_claims_free(c, n);
	r = ctl(NULL, "dead", "list", NULL);
	cr_assert_eq(r->status, 0);
	cr_assert(strstr(r->out, "attempt 2  too long for the model"), "%s", r->out);
	r = ctl(NULL, "dead", "list", "--json", NULL);
	cr_assert(!strncmp(r->out, "[{\"id\":", 7), "one JSON array: %s", r->out);
	cr_assert(strstr(r->out, "\"history\":[{"), "%s", r->out);
	r = ctl(NULL, "dead", "retry", dead_id, NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_assert_eq(ro_test_int(R, "LLEN ro:{%s}:dead", Q), 0);
	r = ctl(NULL, "dead", "list", "--json", NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_assert_str_eq(r->out, "[]\n", "an empty list is []");
	/* complete both, then read them back */
	cr_assert_eq(ro_test_worker_run(ro_test_redis_url(), Q, "w2", 2, 20, 10000, false), 2);
	r = ctl(NULL, "samples", "--count", "1", NULL);
	cr_assert_eq(r->status, 0);
	cr_assert(strstr(r->out, "\"unit\":\"d-"), "%s", r->out);
	cr_assert(strstr(r->out, "\"tokens\":[0,"), "%s", r->out);
	cr_assert_eq(strchr(r->out, '\n') - r->out + 1, (long)strlen(r->out), "more than one line");
	r = ctl(NULL, "samples", NULL);
	cr_assert_eq(r->status, 0);
	{
		int lines = 0;

		for (const char *p = r->out; *p; p++)
			lines += *p == '\n';
		cr_assert_eq(lines, 2);
	}
	r = ctl(NULL, "samples", "--follow", "--count", "2", NULL);
	cr_assert_eq(r->status, 0);
	r = ctl(NULL, "dead", "purge", NULL);
	cr_assert_eq(r->status, 0);
	cr_assert(strstr(r->out, "purged 0"), "%s", r->out);
	ro_queue_free(q);
}

/* generate with values no model can serve, and a checkpoint with a NaN weight: a clear
 * refusal, never a crash, a wrapped buffer size or "logprobs":[nan] */
Test(ctl, generate_refuses_hostile_flags_and_models)
{
	char model[128], cmd[1024];
	struct run *r;

	bare = true;
	(void)snprintf(model, sizeof(model), "%s/m", dir);
	r = ctl(NULL, "make-model", model, NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	r = ctl(NULL, "generate", "--model", model, "--prompt", "1,2,3", "--max-new-tokens",
		"4294967295", NULL);
	cr_expect_eq(r->status, 2, "%s", r->err);
	cr_expect(strstr(r->err, "--max-new-tokens 4294967295") &&
		      strstr(r->err, "max_position_embeddings (32768)"),
		  "%s", r->err);
	r = ctl(NULL, "generate", "--model", model, "--prompt", "1,2,3", "--max-new-tokens",
		"4294967294", NULL);
	cr_expect_eq(r->status, 2, "%s", r->err);
	cr_expect(strstr(r->err, "max_position_embeddings"), "%s", r->err);
	r = ctl(NULL, "generate", "--model", model, "--prompt", "1,2,3", "--threads", "4294967295",
		NULL);
	cr_expect_eq(r->status, 1, "%s", r->err);
	cr_expect(strstr(r->err, "threads 4294967295: at most"), "%s", r->err);
	/* the model still serves sane values */
	r = ctl(NULL, "generate", "--model", model, "--prompt", "1,2,3", "--max-new-tokens", "4",
		NULL);
	cr_expect_eq(r->status, 0, "%s", r->err);
	cr_expect(strstr(r->out, "\"logprobs\":[") && !strstr(r->out, "nan"), "%s", r->out);
	/* a NaN in one expert's weights: exit 1 naming the file, the tensor and the element */
	(void)snprintf(cmd, sizeof(cmd),
		       "python3 -c 'import json,struct,sys; f=open(sys.argv[1],\"r+b\"); "
		       "n=struct.unpack(\"<Q\",f.read(8))[0]; h=json.loads(f.read(n)); "
		       "b=h[sys.argv[2]][\"data_offsets\"][0]; f.seek(8+n+b+6); "
		       "f.write(bytes([0xc0,0x7f]))' %s/model.safetensors "
		       "model.layers.0.mlp.experts.1.up_proj.weight",
		       model);
	cr_assert_eq(system(cmd), 0, "%s", cmd);
	r = ctl(NULL, "generate", "--model", model, "--prompt", "1,2,3", "--temperature", "1",
		NULL);
	cr_expect_eq(r->status, 1, "%s", r->err);
	cr_expect(strstr(r->err, "model.safetensors: tensor "
				 "model.layers.0.mlp.experts.1.up_proj.weight: element 3 is NaN"),
		  "%s", r->err);
	cr_expect(!strstr(r->out, "nan"), "%s", r->out);
}

/* --version on both binaries: the release, the commit when built from git, the backends */
Test(ctl, version_names_release_cuda_and_providers)
{
	char cmd[1024], out[4096] = "";
	struct run *r;
	FILE *p;
	size_t n;

	bare = true;
	r = ctl(NULL, "--version", NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_expect(!strncmp(r->out, "rolloutctl " PACKAGE_VERSION, strlen("rolloutctl " PACKAGE_VERSION)),
		  "%s", r->out);
	cr_expect(strstr(r->out, "\ncuda: yes\n") || strstr(r->out, "\ncuda: no\n"), "%s", r->out);
	cr_expect(strstr(r->out, "\nlibfabric: "), "%s", r->out);
	(void)snprintf(cmd, sizeof(cmd), "'%s' --version", getenv("RO_ROLLOUTD"));
	p = popen(cmd, "r");
	cr_assert(p);
	n = fread(out, 1, sizeof(out) - 1, p);
	out[n] = 0;
	cr_expect_eq(pclose(p), 0);
	cr_expect(!strncmp(out, "rolloutd " PACKAGE_VERSION, strlen("rolloutd " PACKAGE_VERSION)), "%s",
		  out);
	cr_expect(strstr(out, "\nlibfabric: "), "%s", out);
}

/* --json: errors are JSON objects on stderr with the exit status as their code */
Test(ctl, json_errors_carry_their_code)
{
	struct run *r = ctl(NULL, "--json", "dead", NULL);

	cr_assert_eq(r->status, 2, "%s", r->err);
	cr_expect(!strncmp(r->err, "{\"error\":\"usage: rolloutctl", 27), "%s", r->err);
	cr_expect(strstr(r->err, "\"code\":2}\n"), "%s", r->err);
	cr_expect_eq(strchr(r->err, '\n') - r->err + 1, (long)strlen(r->err), "one line: %s",
		     r->err);
	r = ctl(NULL, "--json", "dead", "retry", "no-such-unit", NULL);
	cr_assert_eq(r->status, 1, "%s", r->err);
	cr_expect(!strncmp(r->err, "{\"error\":\"", 10) && strstr(r->err, "\"code\":1}\n"), "%s",
		  r->err);
	r = ctl(NULL, "dead", "retry", "no-such-unit", NULL);
	cr_assert_eq(r->status, 1, "%s", r->err);
	cr_expect(!strncmp(r->err, "rolloutctl: ", 12), "text without --json: %s", r->err);
}

/* unit ID: a done unit's published samples, a leased unit's owner, lease and checkpoint,
 * a missing one named (exit 1), and a record bloated by someone with write access still
 * answered in bounds */
Test(ctl, unit_shows_owner_lease_samples_and_checkpoints)
{
	struct ro_queue *q = ro_test_queue(ro_test_redis_url(), Q, "w1", 3);
	struct ro_claim *c;
	int32_t toks[5] = {7, 8, 9, 10, 11};
	float lps[5] = {-1, -1, -1, -1, -1};
	struct ro_progress p = {.idx = 1, .len = 5, .tokens = toks, .logprobs = lps,
				.sampler_pos = 5};
	struct run *r;
	size_t n;
	char id[32];

	ro_test_enqueue(q, "k", 0, 1, 2, false);
	cr_assert_eq(ro_test_worker_run(ro_test_redis_url(), Q, "w2", 1, 20, 10000, false), 1);
	r = ctl(NULL, "--json", "unit", "k-0", NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_expect(strstr(r->out, "\"state\":\"done\""), "%s", r->out);
	cr_expect(strstr(r->out, "\"idx\":0,\"published\":\"") ||
		      strstr(r->out, "\"published\":\""), "%s", r->out);
	cr_expect(strstr(r->out, "\"history\":[{\"t\":"), "%s", r->out);
	cr_expect(strstr(r->out, "\"attempt\":1"), "numbers are numbers: %s", r->out);

	ro_test_enqueue(q, "k", 1, 1, 2, false);
	cr_assert_eq(ro_queue_claim(q, 1, 60000, &c, &n), 1);
	(void)snprintf(id, sizeof(id), "%s", c[0].id);
	cr_assert_eq(ro_queue_checkpoint(q, c, &p, 1), 1);
	r = ctl(NULL, "unit", id, NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_expect(strstr(r->out, "state    leased"), "%s", r->out);
	cr_expect(strstr(r->out, "owner    w1"), "%s", r->out);
	cr_expect(strstr(r->out, "lease_until_ms "), "%s", r->out);
	cr_expect(strstr(r->out, "sample 0   not published"), "%s", r->out);
	cr_expect(strstr(r->out, "sample 1   not published, checkpoint at 5 tokens"), "%s", r->out);

	/* 2 MB of checkpoint and a history that is not JSON: measured, never sent whole */
	{
		char *big = malloc(2 << 20);

		memset(big, 'x', 2 << 20);
		freeReplyObject(redisCommand(R, "HSET ro:{%s}:unit:%s p:0 %b hist {oops", Q, id,
					     big, (size_t)(2 << 20)));
		free(big);
	}
	r = ctl(NULL, "--json", "unit", id, NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_expect(strstr(r->out, "\"checkpoint_bytes\":2097152"), "%.300s", r->out);
	cr_expect(strstr(r->out, "\"history\":[]"), "%.300s", r->out);
	cr_expect_lt(strlen(r->out), 4096);
	ro_claims_free(c, n);

	r = ctl(NULL, "unit", "nope", NULL);
	cr_expect_eq(r->status, 1);
	cr_expect(strstr(r->err, "no unit nope"), "%s", r->err);
	r = ctl(NULL, "unit", "bad id!", NULL);
	cr_expect_eq(r->status, 2, "%s", r->err);
	freeReplyObject(redisCommand(R, "SET ro:{%s}:unit:str x", Q));
	r = ctl(NULL, "unit", "str", NULL);
	cr_expect_eq(r->status, 1);
	cr_expect(strstr(r->err, "not a hash"), "%s", r->err);
	ro_queue_free(q);
}

/* queues: every queue with keys under the prefix, sorted; other prefixes' are not listed */
Test(ctl, queues_lists_the_queues_under_the_prefix)
{
	char q2[sizeof(Q) + 2], line[200];
	struct run *r;

	(void)snprintf(q2, sizeof(q2), "%s-b", Q);
	cr_assert_eq(ctl(write_file("u.jsonl", UNIT("x-1")), "enqueue", "-", NULL)->status, 0);
	{
		struct ro_queue *q = ro_test_queue(ro_test_redis_url(), q2, "w", 3);

		ro_test_enqueue(q, "y", 0, 1, 1, false);
		ro_queue_free(q);
	}
	freeReplyObject(redisCommand(R, "SET other:{%s-c}:pending x", Q));
	r = ctl(NULL, "queues", NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	(void)snprintf(line, sizeof(line), "\n%s\n%s\n", Q, q2);
	{
		char all[65600];

		(void)snprintf(all, sizeof(all), "\n%s", r->out);
		cr_expect(strstr(all, line), "both, sorted: %s", r->out);
	}
	(void)snprintf(line, sizeof(line), "%s-c", Q);
	cr_expect(!strstr(r->out, line), "another prefix's queue: %s", r->out);
	r = ctl(NULL, "--json", "queues", NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	cr_expect(r->out[0] == '[' && strstr(r->out, q2), "%s", r->out);
	r = ctl(NULL, "--prefix", "other", "--json", "queues", NULL);
	cr_assert_eq(r->status, 0, "%s", r->err);
	(void)snprintf(line, sizeof(line), "[\"%s-c\"]\n", Q);
	cr_expect_str_eq(r->out, line);
}

/* top, when stdout is not a terminal: a plain line a refresh, and a worker's state change
 * (a drain) as a line of its own once it happens. The test changes the heartbeat after the
 * first line came (events, not times). */
Test(ctl, top_plain_lines_and_drain_events)
{
	struct ro_queue *w = ro_test_queue(ro_test_redis_url(), Q, "wtop", 3);
	const char *running[] = {"state", "running", "units", "2", "in_flight", "4"};
	const char *draining[] = {"state", "draining", "units", "2", "in_flight", "4"};
	const char *argv[] = {getenv("RO_ROLLOUTCTL"), "--redis", ro_test_redis_url(), "--queue",
			      Q, "top", "--interval", "100", "--iterations", "600", NULL};
	char buf[65536] = "";
	size_t off = 0;
	int pfd[2], st;
	bool changed = false;
	pid_t pid;

	cr_assert_eq(ro_queue_heartbeat(w, running, 6), 0);
	cr_assert_eq(pipe(pfd), 0);
	pid = fork();
	if (pid == 0) {
		(void)dup2(pfd[1], 1);
		(void)close(pfd[0]);
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	(void)close(pfd[1]);
	for (ssize_t n; off + 1 < sizeof(buf) &&
			(n = read(pfd[0], buf + off, sizeof(buf) - 1 - off)) > 0;) {
		off += (size_t)n;
		buf[off] = '\0';
		if (!changed && strstr(buf, "workers 1\n")) {
			cr_assert_eq(ro_queue_heartbeat(w, draining, 6), 0);
			changed = true;
		}
		if (strstr(buf, "worker wtop: running -> draining"))
			break;
	}
	(void)kill(pid, SIGTERM);
	(void)waitpid(pid, &st, 0);
	(void)close(pfd[0]);
	cr_expect(strstr(buf, " pending 0 leased 0 done 0 dead 0 samples 0"), "%s", buf);
	cr_expect(strstr(buf, "worker wtop: running -> draining"), "%s", buf);
	cr_expect(!strchr(buf, '\033'), "no escape sequences when not a terminal");
	ro_queue_free(w);
}

/* top in a terminal (tmux): the screen shows the counts, the worker's line and its drain;
 * 'q' ends it. */
Test(ctl, top_in_tmux)
{
	struct ro_queue *w = ro_test_queue(ro_test_redis_url(), Q, "wtty", 3);
	const char *running[] = {"state", "running", "units", "3", "tokens_per_s", "41.5"};
	const char *draining[] = {"state", "draining", "units", "3", "tokens_per_s", "41.5"};
	char cmd[1024], sock[128], screen[16384] = "";
	bool shown = false, drained = false, gone = false;

	cr_assert_eq(system("command -v tmux >/dev/null"), 0,
		     "tmux is not installed (scripts/deps installs it)");
	(void)snprintf(sock, sizeof(sock), "%s/tmux.sock", dir);
	cr_assert_eq(ro_queue_heartbeat(w, running, 6), 0);
	cr_assert_eq(ctl(write_file("t.jsonl", UNIT("t-1") UNIT("t-2")), "enqueue", "-", NULL)->status,
		     0);
	(void)snprintf(cmd, sizeof(cmd),
		       "tmux -S %s -f /dev/null new-session -d -x 110 -y 30 "
		       "'LANG=C.UTF-8 %s --redis %s --queue %s top --interval 100; sleep 0.2'",
		       sock, getenv("RO_ROLLOUTCTL"), ro_test_redis_url(), Q);
	cr_assert_eq(system(cmd), 0, "%s", cmd);
	for (int i = 0; i < 600 && !drained; i++) {
		FILE *f;
		size_t n;

		(void)snprintf(cmd, sizeof(cmd), "tmux -S %s capture-pane -p 2>/dev/null", sock);
		f = popen(cmd, "r");
		n = f ? fread(screen, 1, sizeof(screen) - 1, f) : 0;
		screen[n] = '\0';
		if (f)
			(void)pclose(f);
		if (!shown && strstr(screen, "pending 2") && strstr(screen, "wtty") &&
		    strstr(screen, "41.5")) {
			shown = true;
			cr_assert_eq(ro_queue_heartbeat(w, draining, 6), 0);
		}
		drained = shown && strstr(screen, "worker wtty: running -> draining");
		if (!drained)
			usleep(50000);
	}
	cr_expect(shown, "the screen shows the queue and the worker: %s", screen);
	cr_expect(drained, "the drain appears as it happens: %s", screen);
	cr_expect(strstr(screen, "WORKER") && strstr(screen, "TOKENS/S"), "%s", screen);
	(void)snprintf(cmd, sizeof(cmd), "tmux -S %s send-keys q", sock);
	(void)system(cmd);
	for (int i = 0; i < 600 && !gone; i++) {
		(void)snprintf(cmd, sizeof(cmd), "tmux -S %s has-session 2>/dev/null", sock);
		gone = system(cmd) != 0;
		if (!gone)
			usleep(50000);
	}
	cr_expect(gone, "q quits");
	(void)snprintf(cmd, sizeof(cmd), "tmux -S %s kill-server 2>/dev/null", sock);
	(void)system(cmd);
	ro_queue_free(w);
}
