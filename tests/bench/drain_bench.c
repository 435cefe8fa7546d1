/* drain_bench: one rolloutd with 64 sequences in flight (16 units x n=4, long samples)
 * gets a Spot notice from the mock IMDS. Measured: notice detected -> every unfinishable
 * unit requeued (ms), time to exit, and tokens kept vs thrown away, beside the naive policy
 * a user would otherwise pick (stop, requeue everything, restart from scratch: every token
 * of an unpublished sample is lost), computed from the same run.
 *
 *   drain_bench [--rolloutd PATH] [--max-new N] [--lead S] */
#include <errno.h>
#include <getopt.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "imds/imds.h"
#include "kernels/model.h"
#include "tests/mock_fixture.h"
#include "tests/redis_fixture.h"
#include "tests/testutil.h"

static long long cmd_int(redisContext *c, const char *fmt, const char *q)
{
	redisReply *r = redisCommand(c, fmt, q);
	long long v = 0;

	if (r && r->type == REDIS_REPLY_INTEGER)
		v = r->integer;
	else if (r && r->type == REDIS_REPLY_STRING)
		v = strtoll(r->str, NULL, 10);
	if (r)
		freeReplyObject(r);
	return v;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {{"rolloutd", required_argument, NULL, 'd'},
					     {"max-new", required_argument, NULL, 'm'},
					     {"lead", required_argument, NULL, 'l'},
					     {0}};
	const char *daemon = getenv("RO_ROLLOUTD") ? getenv("RO_ROLLOUTD") : "./rolloutd";
	unsigned max_new = 3000, lead_s = 8;
	struct ro_test_redis rs;
	struct ro_test_mock mk = {0};
	struct ro_make_model_opts mo;
	char dir[] = "/tmp/ro-drainbench-XXXXXX", model[96], logp[96], prom[96], err[256];
	struct ro_queue *q;
	redisContext *c;
	pid_t pid;
	int ch, st;
	int64_t fired, requeued_at = 0, exited_at, detected = 0;
	long gen = 0, kept_ckpt = 0, published_tok = 0, unpublished_progress = 0;

	while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (ch == 'd')
			daemon = optarg;
		else if (ch == 'm')
			max_new = (unsigned)atoi(optarg);
		else if (ch == 'l')
			lead_s = (unsigned)atoi(optarg);
		else
			return 2;
	}
	if (!mkdtemp(dir) || ro_test_redis_start(&rs, false) || ro_test_mock_start(&mk, 0, NULL))
		return 1;
	(void)snprintf(model, sizeof(model), "%s/model", dir);
	(void)snprintf(logp, sizeof(logp), "%s/agent.log", dir);
	(void)snprintf(prom, sizeof(prom), "%s/agent.prom", dir);
	ro_make_model_defaults(&mo);
	mo.layers = 4;
	mo.hidden = 256;
	mo.heads = 4;
	mo.kv_heads = 2;
	mo.head_dim = 64;
	mo.expert_ffn = 256;
	mo.vocab = 1024;
	if (ro_make_model(&mo, model, err, sizeof(err)))
		return 1;
	q = ro_test_queue(rs.url, "bench", "enq", 3);
	for (int i = 0; i < 16; i++) {
		char js[256], why[128];
		struct ro_unit u = {0};
		int s2;

		(void)snprintf(js, sizeof(js),
			       "{\"id\":\"d-%02d\",\"prompt\":[%d,2,3],\"n\":4,\"max_new_tokens\":%u,"
			       "\"sampling\":{\"temperature\":1.0,\"seed\":%d}}",
			       i, i, max_new, i);
		if (ro_unit_parse(js, strlen(js), &(struct ro_unit_bounds){100, 64, 100000, 1 << 20},
				  &u, why, sizeof(why)) ||
		    ro_queue_enqueue(q, &u, 1, &s2))
			return 1;
		ro_unit_clear(&u);
	}
	ro_queue_free(q);
	pid = fork();
	if (pid == 0) {
		FILE *f = freopen(logp, "w", stderr);

		(void)f;
		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		execl(daemon, daemon, "--redis", rs.url, "--queue", "bench", "--model", model,
		      "--worker-id", "bench", "--imds-endpoint", mk.url, "--imds-poll-ms", "200",
		      "--drain-margin-ms", "2000", "--max-inflight", "64", "--claim-batch", "16",
		      "--checkpoint-tokens", "32", "--control-socket", "", "--metrics-file", prom,
		      "--metrics-interval-ms", "200", (char *)NULL);
		_exit(127);
	}
	c = redisConnect("127.0.0.1", rs.port);
	/* 64 sequences in flight, a few seconds into their samples */
	for (int i = 0; i < 400 && cmd_int(c, "ZCARD ro:{%s}:leases", "bench") < 16; i++)
		usleep(25000);
	sleep(3);
	{
		char fire[96];
		int64_t t = ro_test_wall_ms() / 1000 + lead_s;

		(void)snprintf(fire, sizeof(fire), "spot?in=0&time=%lld", (long long)t);
		fired = ro_test_wall_ms();
		free(ro_test_mock_ctl(&mk, fire));
	}
	/* every unit requeued (none of these long units can finish in the lead time) */
	while (ro_test_wall_ms() - fired < 30000) {
		if (cmd_int(c, "LLEN ro:{%s}:pending", "bench") +
			cmd_int(c, "HGET ro:{%s}:stats done", "bench") >=
		    16) {
			requeued_at = ro_test_wall_ms();
			break;
		}
		usleep(2000);
	}
	(void)waitpid(pid, &st, 0);
	exited_at = ro_test_wall_ms();
	{
		/* the watcher's own timestamp of the event: detection, apart from poll phase */
		FILE *f = fopen(logp, "r");
		char line[2048];

		while (f && fgets(line, sizeof(line), f)) {
			static const char pat[] = "\"event\":\"interruption\",\"at\":\"";
			char *p = strstr(line, pat);
			int64_t ms;

			if (p) {
				char ts[40] = "";

				(void)sscanf(p + sizeof(pat) - 1, "%39[^\"]", ts);
				if (!ro_imds_parse_time(ts, &ms))
					detected = ms;
			}
		}
		if (f)
			fclose(f);
		f = fopen(prom, "r");
		while (f && fgets(line, sizeof(line), f))
			if (!strncmp(line, "rolloutd_tokens_generated_total", 31))
				gen = strtol(strrchr(line, ' ') + 1, NULL, 10);
		if (f)
			fclose(f);
	}
	/* kept: checkpointed prefixes of requeued samples + published samples' tokens */
	for (int i = 0; i < 16; i++) {
		redisReply *r = redisCommand(c, "HGETALL ro:{bench}:unit:d-%02d", i);

		for (size_t j = 0; r && j + 1 < r->elements; j += 2) {
			const char *k = r->element[j]->str, *v = r->element[j + 1]->str;

			if (!strncmp(k, "p:", 2))
				kept_ckpt += ro_test_json_array_len(v, "tokens");
		}
		if (r)
			freeReplyObject(r);
	}
	{
		redisReply *r = redisCommand(c, "XRANGE ro:{bench}:samples - +");

		for (size_t i = 0; r && i < r->elements; i++) {
			redisReply *f = r->element[i]->element[1];

			for (size_t j = 0; j + 1 < f->elements; j += 2)
				if (!strcmp(f->element[j]->str, "tokens"))
					published_tok += ro_test_json_array_len(f->element[j + 1]->str, NULL);
		}
		if (r)
			freeReplyObject(r);
	}
	unpublished_progress = gen - published_tok;
	(void)printf("drain_bench: 16 units x n=4 = 64 sequences of up to %u tokens, notice with %u "
		     "s lead, drain margin 2 s, IMDS poll 200 ms\n\n",
		     max_new, lead_s);
	(void)printf("notice posted -> detected by the watcher   %6lld ms\n",
		     (long long)(detected - fired));
	(void)printf("detected -> every unit requeued            %6lld ms   (goal <= 250)\n",
		     requeued_at ? (long long)(requeued_at - detected) : -1LL);
	(void)printf("notice posted -> process exited (status %d) %6lld ms   (termination at +%u "
		     "s)\n\n",
		     WIFEXITED(st) ? WEXITSTATUS(st) : -1, (long long)(exited_at - fired), lead_s);
	(void)printf("%-34s %12s %12s %12s\n", "policy", "generated", "kept", "thrown away");
	(void)printf("%-34s %12ld %12ld %12ld\n", "rolloutd (checkpointed requeue)", gen,
		     published_tok + kept_ckpt, gen - published_tok - kept_ckpt);
	(void)printf("%-34s %12ld %12ld %12ld\n", "naive (requeue, restart from 0)", gen,
		     published_tok, unpublished_progress);
	(void)printf("\nwasted-token ratio rolloutd / naive = %.4f (goal: 0 tokens thrown away)\n",
		     unpublished_progress ? (double)(gen - published_tok - kept_ckpt) /
						(double)unpublished_progress
					  : 0.0);
	redisFree(c);
	ro_test_mock_stop(&mk);
	ro_test_redis_stop(&rs);
	{
		char cmd[128];

		(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
		(void)system(cmd);
	}
	return 0;
}
