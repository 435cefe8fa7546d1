/* policy_bench: new weights reaching a running rolloutd. On the 0.9B bench model
 * (decode_bench's: 16 layers, hidden 1024, 64 experts top-8, vocab 32768, bf16) an agent
 * decodes 8 sequences (--seqs); a new version is published (file://, then s3:// on a loopback
 * moto_server) and the bench reads from the agent's status: publish -> swap (the version
 * loaded beside the serving one and swapped in between two steps), publish -> the first
 * token drawn with it, and the decode step times around the swap (the median of the steps
 * before, the longest from the swap until the caches were rebuilt, recompute) against the
 * goal of 2x. Then the fetcher's download throughput from moto against the curl CLI
 * fetching the same objects in the same run.
 *
 * moto_server reads a whole object for every ranged GET, so the S3 rows (--s3) measure moto
 * more than the fetcher on a 1.8 GB object: they are off by default.
 *
 *   policy_bench [--models DIR] [--threads N] [--swap recompute|finish] [--chunk C]
 *                [--rebuild R (0: auto)] [--seqs N (8)] [--s3] */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent/fetch.h"
#include "kernels/model.h"
#include "tests/bench/bench_model.h"
#include "tests/redis_fixture.h"
#include "tests/testutil.h"

static const char *bin(const char *env, const char *dflt)
{
	const char *p = getenv(env);

	return p && *p ? p : dflt;
}

static const char *status(const char *sock)
{
	static char buf[8192];
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM, 0);
	ssize_t n;

	buf[0] = '\0';
	(void)snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 && write(fd, "status\n", 7) == 7 &&
	    (n = read(fd, buf, sizeof(buf) - 1)) > 0)
		buf[n] = '\0';
	close(fd);
	return buf;
}

static double field(const char *js, const char *k)
{
	char pat[64];
	const char *p;

	(void)snprintf(pat, sizeof(pat), "\"%s\":", k);
	p = strstr(js, pat);
	if (!p)
		return -1;
	p += strlen(pat);
	return !strncmp(p, "true", 4) ? 1 : !strncmp(p, "false", 5) ? 0 : strtod(p, NULL);
}

static int run(const char *const *argv)
{
	int st;
	pid_t pid = fork();

	if (pid == 0) {
		int fd = open("/dev/null", O_WRONLY);

		(void)dup2(fd, 1);
		execvp(argv[0], (char *const *)argv);
		_exit(127);
	}
	(void)waitpid(pid, &st, 0);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

struct swap_row {
	double to_swap_ms, to_token_ms, median_ms, max_ms;
	double to_rebuilt_ms, after_ms; /* publish -> the watch over; the step then (its EWMA) */
};

/* publish version v at uri and read the swap's figures from the agent */
static int measure(const char *redis, const char *q, const char *sock, int v, const char *uri,
		   const char *s3ep, struct swap_row *row)
{
	char ver[16];
	const char *argv[] = {bin("RO_ROLLOUTCTL", "./rolloutctl"), "--redis", redis, "--queue", q,
			      "policy", "publish", "--version", ver, "--uri", uri,
			      s3ep ? "--s3-endpoint" : NULL, s3ep, NULL};
	int64_t t0, deadline;
	double at, first;

	(void)snprintf(ver, sizeof(ver), "%d", v);
	t0 = ro_test_wall_ms();
	if (run(argv)) {
		(void)fprintf(stderr, "policy_bench: publish %s failed\n", uri);
		return -1;
	}
	/* the status's times are the agent's monotonic clock: map by the difference now */
	deadline = ro_test_mono_ms() + 600000;
	for (;;) {
		const char *js = status(sock);

		if (field(js, "policy_version") >= v && field(js, "swap_first_token_ms") > 0 &&
		    field(js, "swap_watching") == 0) {
			int64_t mono_now = ro_test_mono_ms(), wall_now = ro_test_wall_ms();

			at = field(js, "swap_at_ms");
			first = field(js, "swap_first_token_ms");
			row->to_swap_ms = at - (double)(mono_now - (wall_now - t0));
			row->to_token_ms = first - (double)(mono_now - (wall_now - t0));
			row->median_ms = field(js, "swap_median_step_ms");
			row->max_ms = field(js, "swap_max_step_ms");
			/* the watch ends eight decode-only steps after the last rebuild: step_ms
			 * (0.8 of the last step's EWMA each step) is mostly theirs, at the
			 * contexts the sequences reached while their caches were rebuilt */
			row->after_ms = field(js, "step_ms");
			row->to_rebuilt_ms = (double)(wall_now - t0);
			return 0;
		}
		if (ro_test_mono_ms() > deadline || !js[0]) {
			(void)fprintf(stderr, "policy_bench: version %d never served: %s\n", v, js);
			return -1;
		}
		ro_test_msleep(5);
	}
}

int main(int argc, char **argv)
{
	const char *models = "/tmp/ro-policy-bench", *swap = "recompute", *chunk = "256";
	const char *rebuild = "0";
	int seqs = 8;
	char seqs_s[16];
	char a_dir[512], b_dir[512], c_dir[512], sock[600], log[600], uri[700], work[64];
	const char *threads = "2";
	struct ro_test_redis R;
	struct swap_row file_row = {0}, s3_row = {0};
	bool have_s3 = false, want_s3 = false;
	pid_t agent, moto = -1;
	char q[64] = "bench";
	char s3ep[64] = "";

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--models") && i + 1 < argc)
			models = argv[++i];
		else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
			threads = argv[++i];
		else if (!strcmp(argv[i], "--swap") && i + 1 < argc)
			swap = argv[++i];
		else if (!strcmp(argv[i], "--chunk") && i + 1 < argc)
			chunk = argv[++i];
		else if (!strcmp(argv[i], "--s3"))
			want_s3 = true;
		else if (!strcmp(argv[i], "--rebuild") && i + 1 < argc)
			rebuild = argv[++i];
		else if (!strcmp(argv[i], "--seqs") && i + 1 < argc && atoi(argv[i + 1]) > 0)
			seqs = atoi(argv[++i]);
		else {
			(void)fprintf(stderr, "usage: policy_bench [--models DIR] [--threads N] "
					      "[--swap recompute|finish] [--chunk C] [--rebuild R] "
					      "[--seqs N] [--s3]\n");
			return 2;
		}
	}
	(void)snprintf(seqs_s, sizeof(seqs_s), "%d", seqs);
	(void)mkdir(models, 0755);
	(void)snprintf(a_dir, sizeof(a_dir), "%s/a", models);
	(void)snprintf(b_dir, sizeof(b_dir), "%s/b", models);
	(void)snprintf(c_dir, sizeof(c_dir), "%s/c", models);
	if (ro_bench_model_ensure("policy_bench", a_dir, 2026) ||
	    ro_bench_model_ensure("policy_bench", b_dir, 2027) ||
	    (want_s3 && ro_bench_model_ensure("policy_bench", c_dir, 2028)))
		return 1;
	(void)snprintf(work, sizeof(work), "/tmp/ro-pbench-XXXXXX");
	if (!mkdtemp(work) || ro_test_redis_start(&R, false))
		return 1;
	(void)snprintf(sock, sizeof(sock), "%s/agent.sock", work);
	(void)snprintf(log, sizeof(log), "%s/agent.log", work);

	/* moto_server with the third model as an S3 policy (curl CLI, SigV4) */
	if (want_s3) {
		int port = 20000 + (int)(getpid() % 20000);

		(void)snprintf(s3ep, sizeof(s3ep), "http://127.0.0.1:%d", port);
		moto = fork();
		if (moto == 0) {
			char p[16];
			int fd = open("/dev/null", O_WRONLY);

			(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
			(void)setpgid(0, 0);
			(void)dup2(fd, 1);
			(void)dup2(fd, 2);
			(void)snprintf(p, sizeof(p), "%d", port);
			execlp("moto_server", "moto_server", "-H", "127.0.0.1", "-p", p, (char *)NULL);
			_exit(127);
		}
		(void)setenv("AWS_ACCESS_KEY_ID", "bench", 1);
		(void)setenv("AWS_SECRET_ACCESS_KEY", "bench-secret", 1);
		(void)setenv("AWS_REGION", "us-east-1", 1);
		for (int i = 0; i < 300 && !have_s3; i++) {
			char url[128];
			const char *mk[] = {"curl", "-sf", "-X", "PUT", "--aws-sigv4",
					    "aws:amz:us-east-1:s3", "--user", "bench:bench-secret",
					    url, NULL};

			(void)snprintf(url, sizeof(url), "%s/bench", s3ep);
			have_s3 = run(mk) == 0;
			if (!have_s3)
				ro_test_msleep(100);
		}
		for (const char *f = "config.json"; have_s3 && f; f = strcmp(f, "config.json") ? NULL : "model.safetensors") {
			char url[256], src[700];
			const char *up[] = {"curl", "-sf", "-T", src, "--aws-sigv4",
					    "aws:amz:us-east-1:s3", "--user", "bench:bench-secret",
					    url, NULL};

			(void)snprintf(src, sizeof(src), "%s/%s", c_dir, f);
			(void)snprintf(url, sizeof(url), "%s/bench/c/%s", s3ep, f);
			have_s3 = run(up) == 0;
		}
		if (!have_s3)
			(void)fprintf(stderr, "policy_bench: no moto_server: the S3 rows are skipped\n");
	}

	/* the agent, decoding seqs long sequences on version 1 */
	{
		char cache[600];
		const char *enq[] = {bin("RO_ROLLOUTCTL", "./rolloutctl"), "--redis", R.url, "--queue",
				     q, "enqueue", NULL, NULL};
		char units[600];
		FILE *f;

		(void)snprintf(units, sizeof(units), "%s/units.jsonl", work);
		f = fopen(units, "w");
		for (int i = 0; f && i < 2 * seqs; i++)
			(void)fprintf(f,
				      "{\"id\":\"b-%d\",\"prompt\":[%d,%d,%d,%d],\"n\":1,"
				      "\"max_new_tokens\":6000,\"sampling\":{\"seed\":%d}}\n",
				      i, i + 1, i + 2, i + 3, i + 4, i);
		if (f)
			(void)fclose(f);
		enq[6] = units;
		if (run(enq))
			return 1;
		(void)snprintf(cache, sizeof(cache), "%s/cache", work);
		agent = fork();
		if (agent == 0) {
			int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);

			(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
			(void)dup2(fd, 2);
			execl(bin("RO_ROLLOUTD", "./rolloutd"), "rolloutd", "--redis", R.url, "--queue",
			      q, "--model", a_dir, "--threads", threads, "--max-inflight", seqs_s,
			      "--policy-version", "1", "--policy-swap", swap, "--prefill-chunk", chunk,
			      "--policy-rebuild-chunk", rebuild,
			      "--imds", "false", "--control-socket", sock, "--status-interval-ms",
			      "100", "--weights-cache", cache, "--s3-endpoint", s3ep,
			      "--checkpoint-tokens", "1000000", "--checkpoint-ms", "3600000",
			      "--worker-id", "bench", (char *)NULL);
			_exit(127);
		}
		/* steady decoding: every sequence running, a few hundred steps done */
		for (int i = 0; i < 60000; i++) {
			const char *js = status(sock);

			if (field(js, "in_flight") >= seqs && field(js, "tokens_per_s") > 0 &&
			    field(js, "uncheckpointed_max") >= 300)
				break;
			ro_test_msleep(10);
		}
	}
	(void)snprintf(uri, sizeof(uri), "file://%s/", b_dir);
	if (measure(R.url, q, sock, 2, uri, NULL, &file_row))
		goto out;
	if (have_s3 && measure(R.url, q, sock, 3, "s3://bench/c/", s3ep, &s3_row))
		have_s3 = false;

	(void)printf("policy_bench: 0.9B Qwen3-MoE (bf16, 1.8 GB of weights), %d sequences "
		     "decoding, %s threads, policy-swap %s, prefill-chunk %s, policy-rebuild-chunk "
		     "%s%s, %ld cores\n\n",
		     seqs, threads, swap, chunk, rebuild, strcmp(rebuild, "0") ? "" : " (auto)",
		     sysconf(_SC_NPROCESSORS_ONLN));
	(void)printf("%-24s %13s %14s %16s %10s %9s %8s %9s %9s\n", "policy", "publish->swap",
		     "publish->token", "publish->rebuilt", "median ms", "after ms", "max ms",
		     "max/med", "max/after");
	for (int k = 0; k < 2; k++) {
		const struct swap_row *w = k ? &s3_row : &file_row;

		if (k && !have_s3)
			break;
		(void)printf("%-24s %10.0f ms %11.0f ms %13.0f ms %10.2f %9.2f %8.2f %9.2f %9.2f\n",
			     k ? "s3:// (moto, loopback)" : "file:// (read in place)", w->to_swap_ms,
			     w->to_token_ms, w->to_rebuilt_ms, w->median_ms, w->after_ms, w->max_ms,
			     w->median_ms > 0 ? w->max_ms / w->median_ms : 0,
			     w->after_ms > 0 ? w->max_ms / w->after_ms : 0);
	}

	/* download throughput: the fetcher against the curl CLI, the same objects */
	if (have_s3) {
		struct ro_fetch_opts fo = {.s3_endpoint = s3ep, .region = "us-east-1"};
		struct ro_policy_manifest m = {0};
		char err[1024], dir[4096], cache[600], out[700], url[256];
		double t0, t_ours, t_curl;
		uint64_t bytes = 0;

		(void)snprintf(cache, sizeof(cache), "%s/cache2", work);
		fo.cache_dir = cache;
		if (ro_policy_manifest_compute(&fo, "s3://bench/c/", &m, err, sizeof(err))) {
			(void)fprintf(stderr, "policy_bench: %s\n", err);
			goto out;
		}
		for (size_t i = 0; i < m.n; i++)
			bytes += m.files[i].size;
		t0 = (double)ro_test_mono_ms();
		if (ro_policy_fetch(&fo, "s3://bench/c/", 9, &m, dir, sizeof(dir), err, sizeof(err))) {
			(void)fprintf(stderr, "policy_bench: %s\n", err);
			goto out;
		}
		t_ours = (double)ro_test_mono_ms() - t0;
		t0 = (double)ro_test_mono_ms();
		for (size_t i = 0; i < m.n; i++) {
			const char *get[] = {"curl", "-sf", "-o", out, "--aws-sigv4",
					     "aws:amz:us-east-1:s3", "--user", "bench:bench-secret",
					     url, NULL};

			(void)snprintf(out, sizeof(out), "%s/curl-%zu", work, i % 1);
			(void)snprintf(url, sizeof(url), "%s/bench/c/%s", s3ep, m.files[i].name);
			if (run(get))
				(void)fprintf(stderr, "policy_bench: curl %s failed\n", url);
		}
		t_curl = (double)ro_test_mono_ms() - t0;
		(void)printf("\ndownload of the S3 policy (%.0f MB, %zu files) from moto on loopback:\n",
			     bytes / 1e6, m.n);
		(void)printf("  %-40s %8.0f MB/s\n", "curl CLI, one GET per object (baseline)",
			     bytes / 1e3 / t_curl);
		(void)printf("  %-40s %8.0f MB/s  (%.2fx, sha256 included)\n",
			     "rolloutd fetcher, ranged GETs x8", bytes / 1e3 / t_ours, t_curl / t_ours);
		ro_policy_manifest_clear(&m);
	}
	(void)printf("\npublish->swap: the version loaded beside the serving one (files checked "
		     "against the manifest, weights read) and swapped in between two steps;\n"
		     "publish->token: the first token drawn with it (recompute: after the caches "
		     "were rebuilt in prefill-chunk pieces);\n"
		     "publish->rebuilt: until no cache was rebuilding and eight steps beyond;\n"
		     "steps: the median of the 256 before the swap (the load beside them), the "
		     "longest from the swap until no cache was rebuilding,\nand the decode step "
		     "after the rebuild (the EWMA of the last steps: the contexts grew while the caches "
		     "were rebuilt) (goal: max/med <= 2)\n");
out:
	(void)kill(agent, SIGKILL);
	(void)waitpid(agent, NULL, 0);
	if (moto > 0) {
		(void)kill(-moto, SIGKILL);
		(void)kill(moto, SIGKILL);
		(void)waitpid(moto, NULL, 0);
	}
	ro_test_redis_stop(&R);
	{
		char cmd[128];

		(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", work);
		(void)system(cmd);
	}
	return 0;
}
