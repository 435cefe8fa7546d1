/* New policy weights while rolloutd runs: a policy published mid-run over file:// is
 * loaded beside the serving weights and swapped in at a step boundary. With recompute, a
 * sample that spans the swap is bitwise the reference made without the queue (its first k
 * tokens from version A, the rest from version B continuing that prefix: `rolloutctl
 * generate --prefix`); with finish, every sample is wholly one version. A policy that
 * cannot serve (other shapes, a file that is not what the manifest says) keeps the old
 * weights serving, counted. */
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

#include "agent/fetch.h"
#include "kernels/model.h"
#include "tests/agent_fixture.h"
#include "tests/agent_model.h"
#include "tests/mock_fixture.h"
#include "tests/redis_hooks.h"
#include "tests/testutil.h"

static char dir[64], model_a[128], model_b[128], model_c[128];

static void make(const char *path, uint64_t seed, uint32_t hidden)
{
	struct ro_make_model_opts o;
	char err[256];

	ro_test_agent_model(&o);
	o.seed = seed;
	if (hidden)
		o.hidden = hidden;
	cr_assert_eq(ro_make_model(&o, path, err, sizeof(err)), 0, "%s", err);
}

static void setup(void)
{
	(void)snprintf(dir, sizeof(dir), "/tmp/ro-policy-XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
	(void)snprintf(model_a, sizeof(model_a), "%s/a", dir);
	(void)snprintf(model_b, sizeof(model_b), "%s/b", dir);
	(void)snprintf(model_c, sizeof(model_c), "%s/c", dir);
	make(model_a, 1, 0);
	make(model_b, 2, 0);
	make(model_c, 3, 128); /* other shapes */
}

static void teardown(void)
{
	char cmd[128];

	(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	if (!getenv("RO_KEEP")) /* RO_KEEP=1 keeps the logs and models */
		(void)system(cmd);
}

TestSuite(policy, .init = setup, .fini = teardown, .timeout = 180);


static bool wait_field(const struct ro_test_agent *ag, const char *key, double at_least, long ms)
{
	for (int64_t end = ro_test_mono_ms() + ms; ro_test_mono_ms() < end;) {
		if (ro_test_agent_field(ag, key) >= at_least)
			return true;
		ro_test_msleep(20);
	}
	return false;
}

/* units p-first .. p-(first+count-1); max_new 0: lengths staggered over 80..199, so units
 * claimed together do not all end at the same step */
static void enqueue_from(const char *q, int first, int count, unsigned n, unsigned max_new)
{
	struct ro_queue *qq = ro_test_queue(ro_test_redis_url(), q, "enq", 3);

	for (int i = first; i < first + count; i++) {
		char js[512], why[256];
		struct ro_unit u = {0};
		int st;

		(void)snprintf(js, sizeof(js),
			       "{\"id\":\"p-%d\",\"prompt\":[%d,%d,5],\"n\":%u,\"max_new_tokens\":%u,"
			       "\"sampling\":{\"temperature\":1.0,\"top_p\":1.0,\"seed\":%d}}",
			       i, 10 + i, 20 + i, n, max_new ? max_new : 80 + (unsigned)(i * 53) % 120,
			       100 + i);
		cr_assert_eq(ro_unit_parse(js, strlen(js),
					   &(struct ro_unit_bounds){1000, 64, 100000, 1 << 20}, &u,
					   why, sizeof(why)),
			     0, "%s", why);
		cr_assert_eq(ro_queue_enqueue(qq, &u, 1, &st), 0);
		ro_unit_clear(&u);
	}
	ro_queue_free(qq);
}

static void enqueue(const char *q, int count, unsigned n, unsigned max_new)
{
	enqueue_from(q, 0, count, n, max_new);
}

static void publish(const char *q, const char *model, const char *version, int want)
{
	char out[4096], uri[200];

	(void)snprintf(uri, sizeof(uri), "file://%s/", model);
	cr_assert_eq(ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue", q, "policy",
			 "publish", "--version", version, "--uri", uri, NULL),
		     want, "%s", out);
}

struct smp {
	char unit[32];
	int idx, n_tok, seg[4][3], n_seg;
	int32_t tok[2048];
	float lp[2048];
};

static void on_sample(void *arg, const char *js)
{
	struct smp **v = arg, *s;
	struct json_object *o = json_tokener_parse(js), *x, *t, *l, *pv;
	size_t k;

	for (k = 0; v[k]; k++)
		;
	s = v[k] = calloc(1, sizeof(*s));
	cr_assert(o && s);
	cr_assert(json_object_object_get_ex(o, "unit", &x) && json_object_object_get_ex(o, "tokens", &t) &&
		  json_object_object_get_ex(o, "logprobs", &l) &&
		  json_object_object_get_ex(o, "policy_versions", &pv),
		  "%s", js);
	(void)snprintf(s->unit, sizeof(s->unit), "%s", json_object_get_string(x));
	cr_assert(json_object_object_get_ex(o, "idx", &x));
	s->idx = json_object_get_int(x);
	s->n_tok = (int)json_object_array_length(t);
	for (int i = 0; i < s->n_tok && i < 2048; i++) {
		s->tok[i] = json_object_get_int(json_object_array_get_idx(t, i));
		s->lp[i] = (float)json_object_get_double(json_object_array_get_idx(l, i));
	}
	s->n_seg = (int)json_object_array_length(pv);
	for (int i = 0; i < s->n_seg && i < 4; i++)
		for (int j = 0; j < 3; j++)
			s->seg[i][j] = json_object_get_int(
			    json_object_array_get_idx(json_object_array_get_idx(pv, i), (size_t)j));
	json_object_put(o);
}

static struct smp **samples(const char *q, size_t *n)
{
	struct ro_queue *qq = ro_test_queue(ro_test_redis_url(), q, "rd", 3);
	struct smp **v = calloc(1024, sizeof(*v));
	char cursor[48] = "0";
	int r;

	do {
		r = ro_queue_read_samples(qq, cursor, 100, 0, on_sample, v);
		cr_assert_geq(r, 0);
	} while (r > 0);
	ro_queue_free(qq);
	for (*n = 0; v[*n]; (*n)++)
		;
	return v;
}

/* The reference: `rolloutctl generate` for (unit, idx) on model, continuing prefix. */
static void reference(const char *model, const struct smp *s, int k, int max_new, int32_t *tok,
		      float *lp, int *n)
{
	char out[65536], prompt[64], idx[16], seed[16], mx[16], pre[16384] = "", unit_i[32];
	struct json_object *o, *sm, *t, *l, *x;
	int u = atoi(s->unit + 2);

	(void)snprintf(prompt, sizeof(prompt), "%d,%d,5", 10 + u, 20 + u);
	(void)snprintf(idx, sizeof(idx), "%d", s->idx);
	(void)snprintf(seed, sizeof(seed), "%d", 100 + u);
	(void)snprintf(mx, sizeof(mx), "%d", max_new);
	(void)snprintf(unit_i, sizeof(unit_i), "%s", s->unit);
	for (int i = 0; i < k; i++)
		(void)snprintf(pre + strlen(pre), sizeof(pre) - strlen(pre), "%s%d", i ? "," : "",
			       s->tok[i]);
	cr_assert_eq(k ? ro_test_ctl(out, sizeof(out), "generate", "--model", model, "--prompt", prompt,
			     "--n", "1", "--first-idx", idx, "--unit", unit_i, "--seed", seed,
			     "--max-new-tokens", mx, "--threads", "1", "--prefix", pre, NULL)
		       : ro_test_ctl(out, sizeof(out), "generate", "--model", model, "--prompt", prompt,
			     "--n", "1", "--first-idx", idx, "--unit", unit_i, "--seed", seed,
			     "--max-new-tokens", mx, "--threads", "1", NULL),
		     0, "%s", out);
	o = json_tokener_parse(out);
	cr_assert(o && json_object_object_get_ex(o, "samples", &x), "%s", out);
	sm = json_object_array_get_idx(x, 0);
	cr_assert(json_object_object_get_ex(sm, "tokens", &t) &&
		  json_object_object_get_ex(sm, "logprobs", &l));
	*n = (int)json_object_array_length(t);
	for (int i = 0; i < *n; i++) {
		tok[i] = json_object_get_int(json_object_array_get_idx(t, i));
		lp[i] = (float)json_object_get_double(json_object_array_get_idx(l, i));
	}
	json_object_put(o);
}

/* every sample's tokens and logprobs are the reference's, segment by segment */
static void check_bitwise(const struct smp *s, int max_new)
{
	static int32_t tok[2048];
	static float lp[2048];
	int n;

	for (int g = 0; g < s->n_seg; g++) {
		int start = s->seg[g][0], end = s->seg[g][1], v = s->seg[g][2];

		reference(v == 1 ? model_a : model_b, s, start, max_new, tok, lp, &n);
		cr_expect_geq(n, end - start, "%s/%d segment %d: the reference is short", s->unit,
			      s->idx, g);
		for (int i = start; i < end && i - start < n; i++) {
			cr_expect_eq(s->tok[i], tok[i - start], "%s/%d token %d (segment %d, v%d)",
				     s->unit, s->idx, i, g, v);
			cr_expect(s->lp[i] == lp[i - start], "%s/%d logprob %d: %.9g vs %.9g",
				  s->unit, s->idx, i, s->lp[i], lp[i - start]);
			if (s->tok[i] != tok[i - start])
				return;
		}
	}
}

/* Publishes version 2 of model from a child process (and checks that publishing it again
 * is refused), so the test goes on feeding the agent meanwhile. */
static pid_t publish_bg(const char *q, const char *model)
{
	pid_t pid = fork();

	cr_assert_geq(pid, 0);
	if (pid == 0) {
		char out[4096], uri[200];
		int r1, r2 = -1;

		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		(void)snprintf(uri, sizeof(uri), "file://%s/", model);
		r1 = ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue", q,
				 "policy", "publish", "--version", "2", "--uri", uri, NULL);
		if (r1)
			(void)fprintf(stderr, "policy publish: exit %d: %s\n", r1, out);
		else if ((r2 = ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue",
					   q, "policy", "publish", "--version", "2", "--uri", uri,
					   NULL)) != 2) /* not above the current: refused */
			(void)fprintf(stderr, "policy publish again: exit %d: %s\n", r2, out);
		_exit(r1 == 0 && r2 == 2 ? 0 : 1);
	}
	return pid;
}

/* Takes the units still waiting off the queue, atomically (no claim sees half of it): how
 * many there were. */
static int take_waiting(const char *q)
{
	struct ro_queue *qq = ro_test_queue(ro_test_redis_url(), q, "take", 3);
	redisContext *c = ro_test_redis_connect(ro_test_redis_url());
	redisReply *r;
	char key[300];
	long long n;

	(void)ro_queue_key(qq, "pending", key, sizeof(key));
	r = redisCommand(c, "EVAL %s 1 %s",
			 "local n = redis.call('LLEN', KEYS[1]) redis.call('DEL', KEYS[1]) return n",
			 key);
	cr_assert(r && r->type == REDIS_REPLY_INTEGER, "redis: %s",
		  r ? (r->str ? r->str : "not an integer") : c->errstr);
	n = r->integer;
	freeReplyObject(r);
	redisFree(c);
	ro_queue_free(qq);
	return (int)n;
}

/* The agent decodes while the new weights load, and a fast machine finishes short units
 * before the load is in. So the queue holds more units than the agent decodes in the time
 * the swap may take (staggered lengths, so that some sample is part-way through whenever
 * it comes), and those still waiting once it is in are taken off the queue: the supply
 * depends on nothing this process does meanwhile. Topped up from this loop instead (a dozen
 * ahead), one run on 2 busy cores saw no sample part-way: the queue ran dry and the agent
 * swapped idle, as it does when this process stalls 3 s right after the publish. The test
 * model decodes ~20 units a second here: 1,000 last this process ~50 s off the CPU. */
#define SUPPLY 1000

static void run(const char *mode)
{
	char q[64];
	struct ro_test_agent a;
	const char *extra[] = {"--policy-version", "1", "--policy-swap", mode, "--max-inflight",
			       "4", "--claim-batch", "1", NULL};
	const int max_new = 200;
	int units = SUPPLY, st = -1;
	size_t n = 0, spanning = 0, v1 = 0, v2 = 0;
	struct smp **v;
	pid_t pub = -1;
	int64_t end;

	ro_test_name("pol", q, sizeof(q));
	enqueue_from(q, 0, units, 2, 0);
	ro_test_agent_start(&a, dir, model_a, ro_test_redis_url(), mode, q, extra, NULL);
	for (end = ro_test_mono_ms() + 60000; ro_test_mono_ms() < end;) {
		if (pub < 0 && ro_test_agent_field(&a, "in_flight") >= 1)
			pub = publish_bg(q, model_b);
		if (pub > 0 && st < 0 && waitpid(pub, &st, WNOHANG) != pub)
			st = -1;
		if (st >= 0 && ro_test_agent_field(&a, "policy_version") >= 2)
			break;
		ro_test_msleep(10);
	}
	units -= take_waiting(q);
	cr_assert_gt(pub, 0, "the agent had units in flight");
	if (st < 0)
		cr_assert_eq(waitpid(pub, &st, 0), pub);
	cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "published, and refused the second time");
	cr_expect(wait_field(&a, "policy_version", 2, 30000), "swapped to version 2");
	cr_expect(wait_field(&a, "completed", units, 120000));
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	v = samples(q, &n);
	cr_expect_eq(n, (size_t)units * 2);
	for (size_t i = 0; i < n; i++) {
		const struct smp *s = v[i];

		cr_expect_eq(s->seg[0][0], 0);
		cr_expect_eq(s->seg[s->n_seg - 1][1], s->n_tok, "segments cover the sample");
		spanning += s->n_seg > 1;
		v1 += s->n_seg == 1 && s->seg[0][2] == 1;
		v2 += s->n_seg == 1 && s->seg[0][2] == 2;
		check_bitwise(s, max_new);
	}
	if (!strcmp(mode, "recompute"))
		cr_expect_gt(spanning, 0, "a sample ran across the swap");
	else
		cr_expect_eq(spanning, 0, "finish: every sample wholly one version");
	cr_expect_gt(v1 + spanning, 0);
	(void)fprintf(stderr, "policy-swap %s: %zu samples, %zu on v1 only, %zu on v2 only, %zu "
			      "across the swap\n",
		      mode, n, v1, v2, spanning);
	for (size_t i = 0; i < n; i++)
		free(v[i]);
	free(v);
}

Test(policy, recompute_spans_are_bitwise_the_reference)
{
	run("recompute");
}

Test(policy, finish_keeps_each_sample_on_one_version)
{
	run("finish");
}

/* Weights that cannot serve keep the old ones serving, counted; the units complete. */
Test(policy, a_bad_policy_keeps_the_old_one)
{
	char q[64], path[300];
	struct ro_test_agent a;
	const char *extra[] = {"--policy-version", "1", NULL};
	FILE *f;

	ro_test_name("bad", q, sizeof(q));
	enqueue(q, 4, 2, 40);
	ro_test_agent_start(&a, dir, model_a, ro_test_redis_url(), "bad", q, extra, NULL);
	cr_assert(wait_field(&a, "completed", 4, 60000));
	publish(q, model_c, "2", 0); /* other shapes */
	cr_expect(wait_field(&a, "policy_errors", 1, 30000), "refused, counted");
	cr_expect_eq(ro_test_agent_field(&a, "policy_version"), 1, "the old weights serve on");
	cr_expect(ro_test_agent_log_has(&a, "hidden is 128"), "the cause named");
	/* a file changed after its manifest was made: its hash says so */
	{
		char cmd[400], err[512], uri[300];
		struct ro_policy_manifest m = {0};
		struct ro_fetch_opts fo = {0};
		struct ro_queue *qq = ro_test_queue(ro_test_redis_url(), q, "pub", 3);
		char *js;

		(void)snprintf(cmd, sizeof(cmd), "cp -r %s %s/b2", model_b, dir);
		cr_assert_eq(system(cmd), 0);
		(void)snprintf(uri, sizeof(uri), "file://%s/b2/", dir);
		cr_assert_eq(ro_policy_manifest_compute(&fo, uri, &m, err, sizeof(err)), 0, "%s",
			     err);
		js = ro_policy_manifest_json(&m);
		(void)snprintf(path, sizeof(path), "%s/b2/config.json", dir);
		f = fopen(path, "a");
		cr_assert_not_null(f);
		(void)fputs(" ", f);
		(void)fclose(f);
		cr_assert_eq(ro_queue_policy_publish(qq, 3, uri, js, "test"), 0);
		free(js);
		ro_policy_manifest_clear(&m);
		ro_queue_free(qq);
	}
	cr_expect(wait_field(&a, "policy_errors", 2, 30000));
	cr_expect(ro_test_agent_log_has(&a, "config.json"), "the file named");
	cr_expect_eq(ro_test_agent_field(&a, "policy_version"), 1);
	enqueue(q, 1, 2, 20); /* still working */
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
}

/* A Spot notice while a policy downloads: the drain goes as before (exit 0 before the
 * notice's time, units requeued), nothing waits for the download, the old version served
 * to the end. */
static const char slow_server[] =
    "import http.server, os, socketserver, sys, time\n"
    "root = sys.argv[1]\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def body(self, send):\n"
    "        p = os.path.join(root, self.path.split('?')[0].lstrip('/'))\n"
    "        if not os.path.isfile(p):\n"
    "            self.send_response(404); self.send_header('Content-Length', '0'); self.end_headers(); return\n"
    "        data = open(p, 'rb').read(); a, b = 0, len(data) - 1\n"
    "        r = self.headers.get('Range')\n"
    "        if r:\n"
    "            x, y = r.split('=')[1].split('-'); a = int(x); b = int(y) if y else b\n"
    "        self.send_response(206 if r else 200)\n"
    "        self.send_header('Content-Length', str(b - a + 1))\n"
    "        if r: self.send_header('Content-Range', 'bytes %d-%d/%d' % (a, b, len(data)))\n"
    "        self.end_headers()\n"
    "        if not send: return\n"
    "        chunk = data[a:b + 1]\n"
    "        try:\n"
    "            for i in range(0, len(chunk), 512):\n"
    "                self.wfile.write(chunk[i:i + 512]); self.wfile.flush()\n"
    "                if not p.endswith('manifest.json'): time.sleep(0.05)\n"
    "        except OSError: pass\n"
    "    def do_GET(self): self.body(True)\n"
    "    def do_HEAD(self): self.body(False)\n"
    "    def log_message(self, *a): pass\n"
    "class S(socketserver.ThreadingMixIn, http.server.HTTPServer): daemon_threads = True\n"
    "s = S(('127.0.0.1', 0), H)\n"
    "print(s.server_address[1], flush=True)\n"
    "s.serve_forever()\n";

Test(policy, a_drain_does_not_wait_for_a_download)
{
	char q[64], py[600], mdir[200], uri[300], err[512], line[32] = "", out[4096];
	struct ro_policy_manifest m = {0};
	struct ro_fetch_opts fo = {0};
	struct ro_test_agent a;
	struct ro_test_mock mk = {0};
	char ep[128], fire[96];
	const char *extra[] = {"--policy-version", "1",	 "--max-inflight", "4",
			       "--claim-batch",	   "1",	 "--imds-poll-ms", "200",
			       "--drain-margin-ms", "1000", "--imds-endpoint", ep,
			       NULL};
	int64_t notice;
	int pfd[2], st;
	pid_t srv;
	FILE *f;
	char *js;

	/* the weights served slowly (10 KB/s), their manifest at once */
	(void)snprintf(mdir, sizeof(mdir), "%s/slow", dir);
	(void)snprintf(py, sizeof(py), "cp -r %s %s", model_b, mdir);
	cr_assert_eq(system(py), 0);
	(void)snprintf(uri, sizeof(uri), "file://%s/", mdir);
	cr_assert_eq(ro_policy_manifest_compute(&fo, uri, &m, err, sizeof(err)), 0, "%s", err);
	js = ro_policy_manifest_json(&m);
	(void)snprintf(py, sizeof(py), "%s/manifest.json", mdir);
	f = fopen(py, "w");
	cr_assert(f && js);
	(void)fputs(js, f);
	(void)fclose(f);
	free(js);
	ro_policy_manifest_clear(&m);
	(void)snprintf(py, sizeof(py), "%s/slow.py", dir);
	f = fopen(py, "w");
	cr_assert_not_null(f);
	(void)fputs(slow_server, f);
	(void)fclose(f);
	cr_assert_eq(pipe(pfd), 0);
	srv = fork();
	if (srv == 0) {
		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		(void)dup2(pfd[1], 1);
		close(pfd[0]);
		execlp("python3", "python3", py, mdir, (char *)NULL);
		_exit(127);
	}
	close(pfd[1]);
	cr_assert_gt(read(pfd[0], line, sizeof(line) - 1), 0, "the server's port");
	(void)snprintf(uri, sizeof(uri), "http://127.0.0.1:%d/", atoi(line));

	cr_assert_eq(ro_test_mock_start(&mk, 0, NULL), 0);
	(void)snprintf(ep, sizeof(ep), "%s", mk.url);
	ro_test_name("dl", q, sizeof(q));
	enqueue(q, 8, 2, 400);
	ro_test_agent_start(&a, dir, model_a, ro_test_redis_url(), "dl", q, extra, NULL);
	cr_assert(wait_field(&a, "in_flight", 1, 30000));
	cr_expect_eq(ro_test_ctl(out, sizeof(out), "--redis", ro_test_redis_url(), "--queue", q, "policy",
			 "publish", "--version", "2", "--uri", uri, NULL),
		     0, "%s", out);
	cr_expect(wait_field(&a, "policy_bytes_done", 1, 30000), "downloading");
	cr_expect_eq(ro_test_agent_field(&a, "policy_loading"), 1);
	/* a spot notice: terminate in 4 s */
	notice = (ro_test_wall_ms() / 1000 + 4) * 1000;
	(void)snprintf(fire, sizeof(fire), "spot?in=0&time=%lld", (long long)(notice / 1000));
	free(ro_test_mock_ctl(&mk, fire));
	st = ro_test_agent_wait_exit(&a, 30000);
	cr_expect_eq(st, 0, "the drain as before");
	cr_expect_lt(ro_test_wall_ms(), notice, "before the notice's time, not the download's");
	cr_expect(ro_test_agent_log_has(&a, "draining"), "drained on the notice");
	ro_test_mock_stop(&mk);
	cr_expect(!ro_test_agent_log_has(&a, "policy version 2 serving"));
	(void)kill(srv, SIGKILL);
	(void)waitpid(srv, NULL, 0);
	close(pfd[0]);
}

/* An expert-parallel group of two ranks (tcp on lo) swaps at the same group round on both
 * ranks, once both have the version; every sample is still bitwise the single-process
 * reference on each side of its swap. */
Test(policy, an_ep_group_swaps_at_the_same_round)
{
	static const char *const fi_env[] = {"FI_TCP_IFACE", "lo", "FI_SOCKETS_IFACE", "lo", NULL};
	const char *extra[] = {"--policy-version", "1", "--imds", "false", "--ep-local-ranks", "2",
			       "--fabric-provider", "tcp", "--max-inflight", "4", "--claim-batch",
			       "1", NULL};
	char q[64], line[4096];
	long round[2] = {-1, -1};
	struct ro_test_agent a;
	struct smp **v;
	size_t n = 0, spanning = 0;
	int units = SUPPLY, st = -1;
	pid_t pub = -1;
	FILE *f;

	ro_test_name("ep", q, sizeof(q));
	enqueue_from(q, 0, units, 2, 0);
	ro_test_agent_start(&a, dir, model_a, ro_test_redis_url(), "ep", q, extra, fi_env);
	/* supplied until both ranks swapped, as in run() */
	for (int64_t end = ro_test_mono_ms() + 60000; ro_test_mono_ms() < end;) {
		if (pub < 0 && ro_test_agent_log_has(&a, "claimed p-"))
			pub = publish_bg(q, model_b);
		if (pub > 0 && st < 0 && waitpid(pub, &st, WNOHANG) != pub)
			st = -1;
		if (st >= 0 && ro_test_agent_log_has(&a, "rank 0 at group round") &&
		    ro_test_agent_log_has(&a, "rank 1 at group round"))
			break;
		ro_test_msleep(10);
	}
	units -= take_waiting(q);
	cr_assert_gt(pub, 0, "the agent claimed a unit");
	if (st < 0)
		cr_assert_eq(waitpid(pub, &st, 0), pub);
	cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "published, and refused the second time");
	{
		struct ro_queue *qq = ro_test_queue(ro_test_redis_url(), q, "w", 3);

		for (int i = 0; i < 6000; i++) {
			struct ro_queue_stats qs = {0};
			bool done = ro_queue_stats(qq, &qs) == 0 && qs.done >= units;

			ro_queue_stats_clear(&qs);
			if (done)
				break;
			ro_test_msleep(20);
		}
		ro_queue_free(qq);
	}
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 60000), 0);
	f = fopen(a.log, "r");
	cr_assert_not_null(f);
	while (fgets(line, sizeof(line), f)) {
		const char *p = strstr(line, "at group round ");
		int rank;

		if (p && (strstr(line, "rank 0 at") || strstr(line, "rank 1 at"))) {
			rank = strstr(line, "rank 0 at") ? 0 : 1;
			round[rank] = strtol(p + 15, NULL, 10);
		}
	}
	(void)fclose(f);
	cr_expect_geq(round[0], 0, "rank 0 swapped");
	cr_expect_eq(round[0], round[1], "both ranks at the same round (%ld, %ld)", round[0],
		     round[1]);
	v = samples(q, &n);
	cr_expect_eq(n, (size_t)units * 2);
	for (size_t i = 0; i < n; i++) {
		spanning += v[i]->n_seg > 1;
		check_bitwise(v[i], 200);
		free(v[i]);
	}
	free(v);
	(void)fprintf(stderr, "EP group: both ranks swapped at round %ld; %zu samples, %zu across "
			      "the swap\n",
		      round[0], n, spanning);
}

/* max-policy-lag 1: two versions behind (the newer ones cannot load), the worker claims
 * nothing; once it has caught up it claims, and the units run wholly on the new version. */
Test(policy, max_policy_lag_stops_claims_until_caught_up)
{
	char q[64];
	struct ro_test_agent a;
	const char *extra[] = {"--policy-version", "1", "--max-policy-lag", "1", NULL};
	struct smp **v;
	size_t n = 0;

	ro_test_name("lag", q, sizeof(q));
	ro_test_agent_start(&a, dir, model_a, ro_test_redis_url(), "lag", q, extra, NULL);
	cr_assert(wait_field(&a, "ready", 1, 30000));
	publish(q, model_c, "2", 0); /* other shapes: refused, one behind */
	cr_assert(wait_field(&a, "policy_errors", 1, 30000));
	cr_expect_eq(ro_test_agent_field(&a, "policy_lagging"), 0, "one behind is within the bound");
	publish(q, model_c, "3", 0);
	cr_assert(wait_field(&a, "policy_lagging", 1, 30000), "two behind");
	enqueue(q, 2, 2, 30);
	publish(q, model_b, "4", 0);
	cr_expect(wait_field(&a, "policy_version", 4, 30000), "caught up");
	cr_expect(wait_field(&a, "completed", 2, 60000));
	ro_test_agent_term(&a);
	cr_expect_eq(ro_test_agent_wait_exit(&a, 30000), 0);
	v = samples(q, &n);
	cr_expect_eq(n, 4);
	for (size_t i = 0; i < n; i++) {
		cr_expect(v[i]->n_seg == 1 && v[i]->seg[0][2] == 4,
			  "%s/%d: claimed only once caught up (v%d)", v[i]->unit, v[i]->idx,
			  v[i]->seg[0][2]);
		free(v[i]);
	}
	free(v);
}
