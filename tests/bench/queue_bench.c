/* queue_bench: the rolloutd queue cycle (claim with lease + publish n samples with fencing
 * + complete) against what a user would build instead, plain Redis Streams consumer
 * groups (XREADGROUP, XADD, XACK), on one local redis-server, with 1, 4 and 16 client
 * processes. Prints units/s, p50/p99 per operation and the ratio, in the same run.
 *
 *   queue_bench [--units N] [--n SAMPLES] [--clients 1,4,16] [--transports 16]
 *
 * Two shapes: "one by one" publishes each sample in its own round trip (samples finish
 * at different decode steps); "batched" sends the n samples (and the completion, or the
 * XACK) in one round trip, as a worker does when several samples finish in one step. */
#include <errno.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/redis_fixture.h"

enum { OP_CLAIM, OP_PUBLISH, OP_COMPLETE, OP_N };

struct lat {
	uint32_t *v;
	size_t n, cap;
};

static struct ro_test_redis S;
/* where the rolloutd cycle runs (the transports section changes it) */
static struct ro_queue_opts Q = {.timeout_ms = 3000, .retry_ms = 15000, .max_attempts = 3};
static unsigned n_samples = 4;
static bool profile;
static long n_units = 2000;

static int64_t now_us(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void lat_add(struct lat *l, int64_t us)
{
	if (l->n == l->cap) {
		l->cap = l->cap ? l->cap * 2 : 4096;
		l->v = realloc(l->v, l->cap * sizeof(*l->v));
		if (!l->v)
			abort();
	}
	l->v[l->n++] = (uint32_t)us;
}

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

	return x < y ? -1 : x > y;
}

static double pct(struct lat *l, double p)
{
	if (!l->n)
		return 0;
	qsort(l->v, l->n, sizeof(*l->v), cmp_u32);
	return l->v[(size_t)((double)(l->n - 1) * p)];
}

static const int32_t TOK[16] = {11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26};
static const float LP[16] = {-0.5f, -0.25f, -1.5f, -2.0f, -0.5f, -0.25f, -1.5f, -2.0f,
			     -0.5f, -0.25f, -1.5f, -2.0f, -0.5f, -0.25f, -1.5f, -2.0f};

/* ---- the rolloutd queue --------------------------------------------------------- */

static struct ro_queue *open_q(const char *queue, const char *worker)
{
	struct ro_queue_opts o = Q;
	struct ro_queue *q = NULL;

	o.url = Q.url ? Q.url : S.url;
	o.queue = queue;
	o.worker = worker;
	if (ro_queue_new(&o, &q)) {
		(void)fprintf(stderr, "queue_bench: %s\n", ro_queue_errmsg(NULL));
		abort();
	}
	return q;
}

static void ours_client(const char *queue, int id, bool batched, struct lat *l)
{
	char w[32];
	struct ro_queue *q;

	(void)snprintf(w, sizeof(w), "bench%d", id);
	q = open_q(queue, w);
	for (;;) {
		struct ro_claim *c;
		size_t n;
		int64_t t0 = now_us();
		struct ro_sample s[16];
		char ids[16][24];

		if (ro_queue_claim(q, 1, 30000, &c, &n) < 0)
			abort();
		lat_add(&l[OP_CLAIM], now_us() - t0);
		if (n == 0) {
			ro_claims_free(c, n);
			break;
		}
		for (unsigned i = 0; i < n_samples; i++)
			s[i] = (struct ro_sample){.idx = i,
						  .tokens = TOK,
						  .logprobs = LP,
						  .len = 16,
						  .finish = "length",
						  .policy_version = 1};
		if (batched) {
			bool done = false;

			t0 = now_us();
			if (ro_queue_publish(q, c, s, n_samples, true, ids, &done) || !done)
				abort();
			lat_add(&l[OP_PUBLISH], now_us() - t0);
		} else {
			/* the last sample's publish completes the unit in the same step, as the
			 * daemon does; no separate complete round trip */
			for (unsigned i = 0; i < n_samples; i++) {
				bool last = i + 1 == n_samples, done = false;

				t0 = now_us();
				if (ro_queue_publish(q, c, &s[i], 1, last, ids, &done) ||
				    done != last)
					abort();
				lat_add(&l[OP_PUBLISH], now_us() - t0);
			}
		}
		ro_claims_free(c, n);
	}
	ro_queue_free(q);
}

static void ours_setup(const char *queue)
{
	struct ro_queue *q = open_q(queue, "producer");

	ro_test_enqueue(q, "b", 0, (int)n_units, n_samples, false);
	ro_queue_free(q);
}

/* ---- the baseline: Redis Streams consumer groups --------------------------------- */

static void check(redisReply *r)
{
	if (!r || r->type == REDIS_REPLY_ERROR) {
		(void)fprintf(stderr, "baseline: %s\n", r ? r->str : "connection lost");
		abort();
	}
}

static void streams_setup(const char *queue)
{
	redisContext *c = ro_test_redis_connect(S.url);

	check(redisCommand(c, "XGROUP CREATE bench:{%s}:units workers $ MKSTREAM", queue));
	for (long i = 0; i < n_units; i++)
		(void)redisAppendCommand(c, "XADD bench:{%s}:units * unit b-%ld body %s", queue, i,
					 "{\"prompt\":[1,2,3],\"n\":4,\"max_new_tokens\":4}");
	for (long i = 0; i < n_units; i++) {
		redisReply *r;

		if (redisGetReply(c, (void **)&r) != REDIS_OK)
			abort();
		freeReplyObject(r);
	}
	redisFree(c);
}

static void streams_client(const char *queue, int id, bool batched, struct lat *l)
{
	redisContext *c = ro_test_redis_connect(S.url);
	char tokens[128], logprobs[256];

	(void)snprintf(tokens, sizeof(tokens), "[11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26]");
	(void)snprintf(
	    logprobs, sizeof(logprobs),
	    "[-0.5,-0.25,-1.5,-2,-0.5,-0.25,-1.5,-2,-0.5,-0.25,-1.5,-2,-0.5,-0.25,-1.5,-2]");
	for (;;) {
		int64_t t0 = now_us();
		redisReply *r = redisCommand(
		    c, "XREADGROUP GROUP workers c%d COUNT 1 STREAMS bench:{%s}:units >", id,
		    queue);
		char eid[64], unit[64];

		check(r);
		lat_add(&l[OP_CLAIM], now_us() - t0);
		if (r->type != REDIS_REPLY_ARRAY || r->element[0]->element[1]->elements == 0) {
			freeReplyObject(r);
			break;
		}
		{
			redisReply *e = r->element[0]->element[1]->element[0];

			(void)snprintf(eid, sizeof(eid), "%s", e->element[0]->str);
			(void)snprintf(unit, sizeof(unit), "%s", e->element[1]->element[1]->str);
		}
		freeReplyObject(r);
		if (batched) {
			t0 = now_us();
			for (unsigned i = 0; i < n_samples; i++)
				(void)redisAppendCommand(
				    c,
				    "XADD bench:{%s}:samples * unit %s idx %u tokens %s logprobs "
				    "%s finish length policy_version 1",
				    queue, unit, i, tokens, logprobs);
			(void)redisAppendCommand(c, "XACK bench:{%s}:units workers %s", queue, eid);
			for (unsigned i = 0; i <= n_samples; i++) {
				if (redisGetReply(c, (void **)&r) != REDIS_OK)
					abort();
				check(r);
				freeReplyObject(r);
			}
			lat_add(&l[OP_PUBLISH], now_us() - t0);
		} else {
			for (unsigned i = 0; i < n_samples; i++) {
				t0 = now_us();
				r = redisCommand(c,
						 "XADD bench:{%s}:samples * unit %s idx %u tokens "
						 "%s logprobs %s finish length policy_version 1",
						 queue, unit, i, tokens, logprobs);
				check(r);
				freeReplyObject(r);
				lat_add(&l[OP_PUBLISH], now_us() - t0);
			}
			t0 = now_us();
			r = redisCommand(c, "XACK bench:{%s}:units workers %s", queue, eid);
			check(r);
			freeReplyObject(r);
			lat_add(&l[OP_COMPLETE], now_us() - t0);
		}
	}
	redisFree(c);
}

/* ---- the harness ----------------------------------------------------------------- */

typedef void (*client_fn)(const char *queue, int id, bool batched, struct lat *l);

struct result {
	double units_per_s;
	double p50[OP_N], p99[OP_N];
};

static int run_round; /* run()'s queues are "<name>-<run_round>" */

static struct result run(const char *name, void (*setup)(const char *), client_fn client,
			 int clients, bool batched)
{
	char queue[64], path[256];
	int go[2];
	pid_t pid[64];
	struct lat all[OP_N] = {0};
	struct result res = {0};
	int64_t t0, t1;

	(void)snprintf(queue, sizeof(queue), "%s-%d", name, run_round++);
	setup(queue);
	if (pipe(go))
		abort();
	for (int i = 0; i < clients; i++) {
		pid[i] = fork();
		if (pid[i] == 0) {
			struct lat l[OP_N] = {0};
			char b;
			FILE *f;

			(void)close(go[1]);
			if (read(go[0], &b, 1) < 0)
				_exit(1);
			client(queue, i, batched, l);
			(void)snprintf(path, sizeof(path), "%s/lat-%d", S.dir, i);
			f = fopen(path, "w");
			for (int o = 0; o < OP_N; o++) {
				(void)fwrite(&l[o].n, sizeof(l[o].n), 1, f);
				(void)fwrite(l[o].v, sizeof(uint32_t), l[o].n, f);
			}
			(void)fclose(f);
			_exit(0);
		}
	}
	(void)close(go[0]);
	t0 = now_us();
	(void)close(go[1]); /* every client starts now */
	for (int i = 0; i < clients; i++) {
		int st;

		(void)waitpid(pid[i], &st, 0);
		if (!WIFEXITED(st) || WEXITSTATUS(st)) {
			(void)fprintf(stderr, "client %d failed\n", i);
			exit(1);
		}
	}
	t1 = now_us();
	for (int i = 0; i < clients; i++) {
		FILE *f;

		(void)snprintf(path, sizeof(path), "%s/lat-%d", S.dir, i);
		f = fopen(path, "r");
		for (int o = 0; o < OP_N; o++) {
			size_t n = 0;

			if (fread(&n, sizeof(n), 1, f) != 1)
				abort();
			for (size_t k = 0; k < n; k++) {
				uint32_t v;

				if (fread(&v, sizeof(v), 1, f) != 1)
					abort();
				lat_add(&all[o], v);
			}
		}
		(void)fclose(f);
		(void)unlink(path);
	}
	res.units_per_s = (double)n_units / ((double)(t1 - t0) / 1e6);
	for (int o = 0; o < OP_N; o++) {
		res.p50[o] = pct(&all[o], 0.50);
		res.p99[o] = pct(&all[o], 0.99);
		free(all[o].v);
	}
	return res;
}

static void print_row(const char *label, int clients, const struct result *r, double ratio)
{
	(void)printf("%7d  %-28s %9.0f", clients, label, r->units_per_s);
	for (int o = 0; o < OP_N; o++)
		(void)printf("  %6.0f/%-6.0f", r->p50[o], r->p99[o]);
	if (ratio > 0)
		(void)printf("  %5.2f", ratio);
	(void)printf("\n");
}

/* --profile: the server's own time per call of each function, from the slow log */
static void print_profile(void)
{
	redisContext *c = ro_test_redis_connect(S.url);
	redisReply *r = redisCommand(c, "SLOWLOG GET 2000000");
	struct {
		char name[48];
		long long n, us;
	} agg[64] = {0};
	int na = 0;

	check(r);
	for (size_t i = 0; i < r->elements; i++) {
		redisReply *e = r->element[i], *args = e->element[3];
		char name[48];
		int k;

		if (args->elements < 1)
			continue;
		(void)snprintf(
		    name, sizeof(name), "%s%s%s", args->element[0]->str,
		    args->elements > 1 && !strcasecmp(args->element[0]->str, "fcall") ? " " : "",
		    args->elements > 1 && !strcasecmp(args->element[0]->str, "fcall")
			? args->element[1]->str
			: "");
		for (k = 0; k < na && strcmp(agg[k].name, name); k++)
			;
		if (k == na) {
			if (na == 64)
				continue;
			(void)snprintf(agg[na++].name, sizeof(agg[0].name), "%s", name);
		}
		agg[k].n++;
		agg[k].us += e->element[2]->integer;
	}
	(void)printf("\nserver time by command (--profile, slow log at 0 us):\n");
	for (int k = 0; k < na; k++) {
		if (agg[k].n >= 100)
			(void)printf("  %-22s %9lld calls  %7.2f us/call\n", agg[k].name, agg[k].n,
				     (double)agg[k].us / (double)agg[k].n);
	}
	freeReplyObject(r);
	redisFree(c);
}

/* The one-by-one cycle at `clients` clients over managed Redis's transports, against
 * plain TCP to one server in the same run: TLS (a server with certificates made here), a
 * Redis Cluster node (3 primaries + 3 replicas: the client seeded at a node that does not
 * own the queue's slot), and the cluster with redis-wait-replicas 1 (every publish and
 * completion confirmed by a replica). */
static void print_transports(int clients)
{
	static struct ro_test_cluster c;
	struct ro_test_redis t;
	struct ro_test_redis_opts to = {.tls = true};
	static const char *const label[4] = {"plain TCP", "TLS (OpenSSL, TLS 1.3)",
					     "cluster node, via a seed", "cluster, wait-replicas 1"};
	struct result res[4][3], med[4];
	char seed[96];

	if (ro_test_redis_start_opts(&t, &to) || ro_test_cluster_start(&c, 3, 1)) {
		(void)fprintf(stderr, "queue_bench: the TLS server or the cluster did not start\n");
		exit(1);
	}
	/* three rounds, the transports in turn, so that a busy moment of the machine does not
	 * fall on one of them only; the median round is printed */
	for (int round = 0; round < 3; round++) {
		for (int k = 0; k < 4; k++) {
			const char *name = k == 0 ? "tcp" : k == 1 ? "tls" : "cl";

			Q = (struct ro_queue_opts){.timeout_ms = 3000, .retry_ms = 15000,
						   .max_attempts = 3};
			if (k == 1) {
				Q.url = t.url;
				Q.tls_ca = t.ca;
			} else if (k >= 2) {
				int owner;

				/* the queue run() makes next decides the owner: seed elsewhere */
				(void)snprintf(seed, sizeof(seed), "%s-%d", name, run_round);
				owner = ro_test_cluster_owner(&c, seed);
				(void)snprintf(seed, sizeof(seed), "%s", c.node[(owner + 1) % c.n].url);
				Q.url = seed;
				Q.wait_replicas = k == 3 ? 1 : 0;
				Q.wait_timeout_ms = 5000;
			}
			res[k][round] = run(name, ours_setup, ours_client, clients, false);
		}
	}
	Q = (struct ro_queue_opts){.timeout_ms = 3000, .retry_ms = 15000, .max_attempts = 3};
	for (int k = 0; k < 4; k++) {
		struct result *r = res[k];
		int lo = 0, hi = 0;

		for (int i = 1; i < 3; i++) {
			if (r[i].units_per_s < r[lo].units_per_s)
				lo = i;
			if (r[i].units_per_s >= r[hi].units_per_s)
				hi = i;
		}
		med[k] = r[lo == hi ? 0 : 3 - lo - hi];
	}
	(void)printf("\ntransports (rolloutd cycle, one by one, %d clients, median of 3 rounds; "
		     "ratio against plain TCP in this run):\n",
		     clients);
	for (int k = 0; k < 4; k++)
		print_row(label[k], clients, &med[k], med[k].units_per_s / med[0].units_per_s);
	ro_test_cluster_stop(&c);
	ro_test_redis_stop(&t);
}

int main(int argc, char **argv)
{
	int clients[8] = {1, 4, 16};
	int n_clients = 3, transports = 0;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--units") && i + 1 < argc) {
			n_units = atol(argv[++i]);
		} else if (!strcmp(argv[i], "--n") && i + 1 < argc) {
			n_samples = (unsigned)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--profile")) {
			profile = true;
		} else if (!strcmp(argv[i], "--transports") && i + 1 < argc) {
			transports = atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--clients") && i + 1 < argc) {
			char *s = argv[++i], *tok, *save = NULL;

			n_clients = 0;
			for (tok = strtok_r(s, ",", &save); tok && n_clients < 8;
			     tok = strtok_r(NULL, ",", &save))
				clients[n_clients++] = atoi(tok);
		} else {
			(void)fprintf(
			    stderr,
			    "usage: queue_bench [--units N] [--n SAMPLES] [--clients 1,4,16] "
			    "[--transports CLIENTS] [--profile]\n");
			return 2;
		}
	}
	if (n_units < 1 || n_samples < 1 || n_samples > 16) {
		(void)fprintf(stderr, "queue_bench: --units >= 1, 1 <= --n <= 16\n");
		return 2;
	}
	if (ro_test_redis_start(&S, false))
		return 1;
	if (profile) {
		redisContext *c = ro_test_redis_connect(S.url);

		check(redisCommand(c, "CONFIG SET slowlog-log-slower-than 0"));
		check(redisCommand(c, "CONFIG SET slowlog-max-len 2000000"));
		redisFree(c);
	}
	(void)printf("queue_bench: %ld units x %u samples (16 tokens each), redis-server on "
		     "127.0.0.1, %ld cores\n",
		     n_units, n_samples, sysconf(_SC_NPROCESSORS_ONLN));
	(void)printf(
	    "baseline: Redis Streams consumer group (XREADGROUP COUNT 1, XADD per sample, XACK)\n");
	(void)printf(
	    "latency columns: p50/p99 in microseconds. rolloutd completes a unit with its last\n"
	    "publish (batched: all n samples and the completion in one call); streams XACKs\n"
	    "separately (batched: n XADD + XACK pipelined in one round trip)\n\n");
	(void)printf("clients  %-28s %9s  %-13s  %-13s  %-13s  %s\n", "cycle", "units/s", "claim",
		     "publish", "complete", "ratio");
	for (int b = 0; b < 2; b++) {
		for (int i = 0; i < n_clients; i++) {
			struct result base =
			    run("streams", streams_setup, streams_client, clients[i], b);
			struct result ours = run("ours", ours_setup, ours_client, clients[i], b);

			print_row(b ? "streams, batched" : "streams, one by one", clients[i], &base,
				  0);
			print_row(b ? "rolloutd, batched" : "rolloutd, one by one", clients[i],
				  &ours, ours.units_per_s / base.units_per_s);
		}
	}
	{
		/* where the server's time went: microseconds per call, by command */
		redisContext *c = ro_test_redis_connect(S.url);
		redisReply *r = redisCommand(c, "INFO commandstats");
		char *line, *save = NULL;

		(void)printf("\nserver time per call (INFO commandstats):\n");
		for (line = strtok_r(r->str, "\r\n", &save); line;
		     line = strtok_r(NULL, "\r\n", &save)) {
			char name[64];
			long long calls = 0;
			double per = 0;

			if (sscanf(line, "cmdstat_%63[^:]:calls=%lld,usec=%*d,usec_per_call=%lf",
				   name, &calls, &per) == 3 &&
			    calls >= n_units)
				(void)printf("  %-12s %9lld calls  %7.2f us/call\n", name, calls,
					     per);
		}
		freeReplyObject(r);
		redisFree(c);
	}
	if (profile)
		print_profile();
	if (transports)
		print_transports(transports);
	(void)printf(
	    "\nratio = rolloutd units/s / streams units/s at the same client count and shape;\n"
	    "rolloutd also does leases, fencing tokens, idempotent publish and completion "
	    "groups.\n");
	ro_test_redis_stop(&S);
	return 0;
}
