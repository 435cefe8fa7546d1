/* The chaos soak's invariant checker: reads what a run left in Redis, the driver's record
 * (DIR/run.log, DIR/units.tsv) and the agents' logs and metrics textfiles, and fails (exit 1)
 * on any violation, each listed:
 *
 *   units   every unit is done, or dead-lettered with a reason; a healthy unit dead-lettered
 *           is a violation unless every lease of it that expired was held through an
 *           injected fault (its holder killed or stopped, Redis down or paused; or a
 *           claim Redis ran only after its worker had exited, that worker having left
 *           while Redis stood paused: a command it wrote into the stopped server); poison
 *           units whose body cannot be trusted must be dead; nothing is left pending or
 *           leased; dead units are in the dead list once, done units have one groups entry.
 *   samples every sample of a done unit is in ro:{q}:samples exactly once, no sample is there
 *           twice or for an unknown unit, and every sample is bitwise the fault-free run's:
 *           the same tokens, the same logprobs text (the daemon writes each float with %.9g,
 *           which round-trips float32; we format our reference the same way) and the same
 *           finish. The reference runs in this process through kernels/model.h, decoding
 *           exactly as agent/engine.c does (prefill the prompt, fork it per sample, sample
 *           position by position with ro_sample_key(unit id), forward each token).
 *   fencing each sample's (worker, attempt) is the holder of the lease at the time the
 *           stream entry was written: the last claim in the unit's history before the
 *           entry's id time is that worker's, with that attempt, and no expiry, requeue,
 *           release or dead-letter ended it before the write. Where the history was cut
 *           (it keeps ~3 KB), the claim must at least appear in it or in the agent's log.
 *   drains  every drain exited 0 before its deadline: a spot notice's termination time;
 *           SIGTERM: the signal + sigterm-grace-s + drain-margin-ms; rolloutctl drain: the
 *           request + its deadline + the margin; rebalance and ASG lifecycle: the post +
 *           notice-s (+ the 0.5 s slow poll in which the watcher sees it).
 *   agents  no agent exits by itself with a failure (a crash); a flooded control socket
 *           still answers, and a command split across two writes is understood.
 *   always  (appendfsync always only) an acknowledged completion is never lost: every unit
 *           an agent logged "completed" is done.
 *
 * What appendfsync everysec can lose. With everysec Redis acknowledges a write before it
 * is fsynced and fsyncs the append-only file once a second, so a crash of the machine (a
 * power cut, a kernel panic, an instance taken back) can lose up to about one second of
 * acknowledged writes (two, when the disk is slow and an fsync is still running):
 * completions, samples, checkpoints, claims, renewals, requeues. (A crash of the redis
 * process alone loses nothing: the writes are in the page cache. The driver simulates the
 * machine crash by cutting the AOF back to its length of a second before it kills the
 * server; --no-power-loss turns that off.) What is lost is always a suffix: the AOF is a
 * prefix of the history, and every change is one function call, so the server comes back
 * in the state it had a second earlier, consistent. The final-state checks hold as they
 * are: a lost completion leaves the unit leased, its lease expires, it is reaped and done
 * again, its samples are published again (the stream lost them with it), bitwise the same.
 * What differs from always: (1) the agents' view is not Redis's: a unit an agent saw
 * complete may be done again by another (the "always" check above is skipped after a
 * loss, and such units are counted); (2) a lost claim lets the server hand out the same
 * lease token again, and the fencing token is not bound to the worker, so the holder of
 * the lost claim can write under the new holder's lease: the fencing check reports it, as
 * a violation after a loss too (the daemon cannot tell; the queue could, by checking the
 * owner as well as the token); (3) a lost checkpoint only costs regenerated tokens. */
#include <errno.h>
#include <glob.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/model.h"
#include "queue/queue.h"
/* the stream's own encoders: the reference is spelled as the agents spell it */
#include "queue/internal.h"
#include "tests/chaos/chaos.h"
#include "tests/redis_fixture.h"
#include "tests/testutil.h"

#define MAXV 4096

/* ---- the record ------------------------------------------------------------------------- */

struct agent {
	char name[32], worker[48], log[240], metrics[240];
	int64_t start, exit_at;
	int rc, sig;
	bool exited;
	char cause[16];
};

struct drain {
	char name[32], how[24];
	int fault;
	int64_t posted, deadline;
};

struct disruption { /* a time when a lease could expire through no fault of the daemon */
	char worker[48]; /* "*": every worker (Redis) */
	int64_t from, to;
	bool pause; /* Redis SIGSTOP to SIGCONT */
};

struct unit {
	char id[64], expect[8], variant[16];
	char *json;
	/* from Redis */
	char state[16], reason[512];
	char *hist;
	unsigned n, attempt;
	bool in_redis;
	/* reference */
	bool ref_done;
	int32_t **rtok;
	float **rlp;
	uint32_t *rlen;
	const char **rfin;
	char **rtok_s, **rlp_s;
	unsigned rn;
	int groups, dead_list;
};

struct sample {
	char eid[32], unit[64], worker[48], finish[16];
	unsigned idx, attempt, resumed;
	int64_t ms;
	char *tokens, *logprobs;
	long len;
};

static struct {
	char dir[240], queue[64], url[128], aof[16], model[240];
	bool power_loss, lost; /* everysec with the simulated loss; and a loss happened */
	long long lease_ms, margin_ms, grace_s, seed;
	struct agent ag[512];
	int nag;
	struct drain dr[1024];
	int ndr;
	struct disruption ds[2048];
	int nds;
	int kinds[CH_NKINDS], skipped;
	struct unit *u;
	int nu;
	struct sample *s;
	long ns;
	char floods[64][240];
	int nfl;
	char end_reason[32];
	long violations;
	redisContext *c;
	struct ro_test_redis own; /* when the run's server is gone: started from its AOF */
} C;

static void violation(const char *cat, const char *fmt, ...)
{
	va_list ap;

	C.violations++;
	if (C.violations > 200)
		return;
	(void)printf("VIOLATION [%s] ", cat);
	va_start(ap, fmt);
	(void)vprintf(fmt, ap);
	va_end(ap);
	(void)putchar('\n');
}

static void note(const char *fmt, ...)
{
	va_list ap;

	(void)printf("note: ");
	va_start(ap, fmt);
	(void)vprintf(fmt, ap);
	va_end(ap);
	(void)putchar('\n');
}

static struct agent *agent_by_name(const char *name)
{
	for (int i = 0; i < C.nag; i++)
		if (!strcmp(C.ag[i].name, name))
			return &C.ag[i];
	return NULL;
}

static struct unit *unit_by_id(const char *id)
{
	for (int i = 0; i < C.nu; i++)
		if (!strcmp(C.u[i].id, id))
			return &C.u[i];
	return NULL;
}

static struct disruption *add_disruption(const char *worker, int64_t from, int64_t to)
{
	if (C.nds == 2048)
		return NULL;
	C.ds[C.nds] = (struct disruption){.from = from, .to = to};
	(void)snprintf(C.ds[C.nds].worker, sizeof(C.ds[0].worker), "%s", worker);
	return &C.ds[C.nds++];
}

static void read_record(void)
{
	char path[300], line[4096];
	FILE *f;
	int64_t pause_at = 0, crash_at = 0;
	struct {
		char name[32];
		int64_t at;
	} stops[256];
	int nstops = 0;

	(void)snprintf(path, sizeof(path), "%s/run.log", C.dir);
	f = fopen(path, "r");
	if (!f) {
		(void)fprintf(stderr, "check: %s: %s\n", path, strerror(errno));
		exit(99);
	}
	while (fgets(line, sizeof(line), f)) {
		char v[256];

		if (ch_is(line, "config")) {
			(void)ch_kv(line, "queue", C.queue, sizeof(C.queue));
			(void)ch_kv(line, "redis", C.url, sizeof(C.url));
			(void)ch_kv(line, "aof", C.aof, sizeof(C.aof));
			(void)ch_kv(line, "model", C.model, sizeof(C.model));
			C.power_loss = ch_kv_ll(line, "power_loss", 0);
			C.lease_ms = ch_kv_ll(line, "lease_ms", 0);
			C.margin_ms = ch_kv_ll(line, "margin_ms", 0);
			C.grace_s = ch_kv_ll(line, "grace_s", 0);
			C.seed = ch_kv_ll(line, "seed", 0);
			if (ch_kv_ll(line, "short_lease", 0))
				C.kinds[CH_SHORT_LEASE]++;
		} else if (ch_is(line, "agent") && C.nag < 512) {
			struct agent *a = &C.ag[C.nag++];

			memset(a, 0, sizeof(*a));
			(void)ch_kv(line, "name", a->name, sizeof(a->name));
			(void)ch_kv(line, "worker", a->worker, sizeof(a->worker));
			(void)ch_kv(line, "log", a->log, sizeof(a->log));
			(void)ch_kv(line, "metrics", a->metrics, sizeof(a->metrics));
			a->start = ch_kv_ll(line, "at", 0);
		} else if (ch_is(line, "exit")) {
			struct agent *a;

			(void)ch_kv(line, "name", v, sizeof(v));
			a = agent_by_name(v);
			if (!a || a->exited)
				continue;
			a->exited = true;
			a->rc = (int)ch_kv_ll(line, "rc", -1);
			a->sig = (int)ch_kv_ll(line, "sig", 0);
			a->exit_at = ch_kv_ll(line, "at", 0);
			(void)ch_kv(line, "cause", a->cause, sizeof(a->cause));
			if (strcmp(a->cause, "drain") && strcmp(a->cause, "final"))
				add_disruption(a->worker, a->exit_at, a->exit_at);
		} else if (ch_is(line, "drain") && C.ndr < 1024) {
			struct drain *d = &C.dr[C.ndr++];

			(void)ch_kv(line, "name", d->name, sizeof(d->name));
			(void)ch_kv(line, "how", d->how, sizeof(d->how));
			d->fault = (int)ch_kv_ll(line, "fault", -1);
			d->posted = ch_kv_ll(line, "posted", 0);
			d->deadline = ch_kv_ll(line, "deadline", 0);
		} else if (ch_is(line, "fault")) {
			int k;

			(void)ch_kv(line, "kind", v, sizeof(v));
			k = ch_kind_of(v);
			if (ch_kv_ll(line, "skipped", 0)) {
				C.skipped++;
				continue;
			}
			if (k >= 0)
				C.kinds[k]++;
			if (k == CH_STOP && nstops < 256) {
				(void)ch_kv(line, "target", stops[nstops].name, sizeof(stops[0].name));
				stops[nstops++].at = ch_kv_ll(line, "at", 0);
			}
			if (k == CH_FLOOD && C.nfl < 64)
				(void)ch_kv(line, "rec", C.floods[C.nfl++], sizeof(C.floods[0]));
		} else if (ch_is(line, "cont")) {
			(void)ch_kv(line, "name", v, sizeof(v));
			for (int i = nstops - 1; i >= 0; i--)
				if (!strcmp(stops[i].name, v)) {
					struct agent *a = agent_by_name(v);

					add_disruption(a ? a->worker : v, stops[i].at,
						       ch_kv_ll(line, "at", 0));
					stops[i].name[0] = '\0';
					break;
				}
		} else if (ch_is(line, "redis")) {
			int64_t at = ch_kv_ll(line, "at", 0);

			(void)ch_kv(line, "event", v, sizeof(v));
			if (!strcmp(v, "pause"))
				pause_at = at;
			else if (!strcmp(v, "cont")) {
				struct disruption *d = add_disruption("*", pause_at, at);

				if (d)
					d->pause = true;
			} else if (!strcmp(v, "crash")) {
				crash_at = at;
				if (ch_kv_ll(line, "lost_bytes", 0) > 0)
					C.lost = true;
			} else if (!strcmp(v, "up"))
				add_disruption("*", crash_at, at);
		} else if (ch_is(line, "end")) {
			(void)ch_kv(line, "reason", C.end_reason, sizeof(C.end_reason));
		}
	}
	(void)fclose(f);
	/* units.tsv: id, expect, variant, the unit's JSON (empty: none usable) */
	(void)snprintf(path, sizeof(path), "%s/units.tsv", C.dir);
	f = fopen(path, "r");
	if (!f) {
		(void)fprintf(stderr, "check: %s: %s\n", path, strerror(errno));
		exit(99);
	}
	{
		char *l = NULL;
		size_t cap = 0;

		while (getline(&l, &cap, f) > 0) {
			char *save = NULL, *id = strtok_r(l, "\t\n", &save);
			char *ex = strtok_r(NULL, "\t\n", &save), *va = strtok_r(NULL, "\t\n", &save);
			char *js = strtok_r(NULL, "\n", &save);
			struct unit *u;

			if (!id || !ex || !va)
				continue;
			C.u = realloc(C.u, (size_t)(C.nu + 1) * sizeof(*C.u));
			u = &C.u[C.nu++];
			memset(u, 0, sizeof(*u));
			(void)snprintf(u->id, sizeof(u->id), "%s", id);
			(void)snprintf(u->expect, sizeof(u->expect), "%s", ex);
			(void)snprintf(u->variant, sizeof(u->variant), "%s", va);
			u->json = js && *js ? strdup(js) : NULL;
		}
		free(l);
	}
	(void)fclose(f);
}

/* ---- Redis ------------------------------------------------------------------------------ */

static redisReply *cmdv(const char *fmt, ...)
{
	va_list ap;
	redisReply *r;

	va_start(ap, fmt);
	r = redisvCommand(C.c, fmt, ap);
	va_end(ap);
	if (!r || r->type == REDIS_REPLY_ERROR) {
		(void)fprintf(stderr, "check: redis: %s: %s\n", fmt, r ? r->str : C.c->errstr);
		exit(99);
	}
	return r;
}

static void connect_redis(void)
{
	int port = 0;
	const char *p = strrchr(C.url, ':');

	if (p)
		port = atoi(p + 1);
	C.c = port ? redisConnectWithTimeout("127.0.0.1", port, (struct timeval){1, 0}) : NULL;
	if (!C.c || C.c->err) {
		char rdir[300];

		/* the driver is gone: replay the run's AOF into a server of our own */
		redisFree(C.c);
		(void)snprintf(rdir, sizeof(rdir), "%s/redis", C.dir);
		if (ro_test_redis_start_opts(&C.own, &(struct ro_test_redis_opts){
						     .aof = true,
						     .everysec = !strcmp(C.aof, "everysec"),
						     .growing_aof = true,
						     .dir = rdir})) {
			(void)fprintf(stderr, "check: cannot reach %s nor start redis on %s\n", C.url,
				      rdir);
			exit(99);
		}
		(void)printf("check: the run's redis is gone: replayed its AOF into %s\n", C.own.url);
		C.c = redisConnect("127.0.0.1", C.own.port);
		if (!C.c || C.c->err)
			exit(99);
	}
	(void)redisSetTimeout(C.c, (struct timeval){30, 0});
}

static void read_units(void)
{
	/* units in Redis that nobody enqueued */
	char cursor[32] = "0";

	do {
		redisReply *r = cmdv("SCAN %s MATCH ro:{%s}:unit:* COUNT 1000", cursor, C.queue);

		(void)snprintf(cursor, sizeof(cursor), "%s", r->element[0]->str);
		for (size_t i = 0; i < r->element[1]->elements; i++) {
			const char *k = r->element[1]->element[i]->str, *id = strstr(k, ":unit:") + 6;

			if (!unit_by_id(id))
				violation("units", "%s is in Redis but was never enqueued", id);
		}
		freeReplyObject(r);
	} while (strcmp(cursor, "0"));
	for (int i = 0; i < C.nu; i++) {
		struct unit *u = &C.u[i];
		redisReply *r = cmdv("HGETALL ro:{%s}:unit:%s", C.queue, u->id);

		u->in_redis = r->elements > 0;
		for (size_t j = 0; j + 1 < r->elements; j += 2) {
			const char *k = r->element[j]->str, *v = r->element[j + 1]->str;

			if (!strcmp(k, "state"))
				(void)snprintf(u->state, sizeof(u->state), "%s", v);
			else if (!strcmp(k, "reason"))
				(void)snprintf(u->reason, sizeof(u->reason), "%s", v);
			else if (!strcmp(k, "hist"))
				u->hist = strdup(v);
			else if (!strcmp(k, "n"))
				u->n = (unsigned)atoi(v);
			else if (!strcmp(k, "attempt"))
				u->attempt = (unsigned)atoi(v);
		}
		freeReplyObject(r);
	}
	{
		redisReply *r = cmdv("LRANGE ro:{%s}:dead 0 -1", C.queue);

		for (size_t i = 0; i < r->elements; i++) {
			struct unit *u = unit_by_id(r->element[i]->str);

			if (u)
				u->dead_list++;
			else
				violation("units", "dead list holds %s, never enqueued",
					  r->element[i]->str);
		}
		freeReplyObject(r);
	}
}

static void read_stream(const char *which, bool samples)
{
	char from[48] = "-";

	for (;;) {
		redisReply *r = cmdv("XRANGE ro:{%s}:%s %s + COUNT 500", C.queue, which, from);

		for (size_t i = 0; i < r->elements; i++) {
			redisReply *e = r->element[i], *f = e->element[1];
			struct sample s = {0};

			(void)snprintf(s.eid, sizeof(s.eid), "%s", e->element[0]->str);
			s.ms = strtoll(s.eid, NULL, 10);
			for (size_t j = 0; j + 1 < f->elements; j += 2) {
				const char *k = f->element[j]->str, *v = f->element[j + 1]->str;

				if (!strcmp(k, "unit"))
					(void)snprintf(s.unit, sizeof(s.unit), "%s", v);
				else if (!strcmp(k, "idx"))
					s.idx = (unsigned)atoi(v);
				else if (!strcmp(k, "worker"))
					(void)snprintf(s.worker, sizeof(s.worker), "%s", v);
				else if (!strcmp(k, "attempt"))
					s.attempt = (unsigned)atoi(v);
				else if (!strcmp(k, "tokens"))
					s.tokens = strdup(v);
				else if (!strcmp(k, "logprobs"))
					s.logprobs = strdup(v);
				else if (!strcmp(k, "finish"))
					(void)snprintf(s.finish, sizeof(s.finish), "%s", v);
				else if (!strcmp(k, "resumed_from"))
					s.resumed = (unsigned)atoi(v);
			}
			if (samples) {
				C.s = realloc(C.s, (size_t)(C.ns + 1) * sizeof(*C.s));
				C.s[C.ns++] = s;
			} else {
				struct unit *u = unit_by_id(s.unit);

				if (u)
					u->groups++;
				else
					violation("units", "groups entry %s for unknown unit %s", s.eid,
						  s.unit);
				free(s.tokens);
				free(s.logprobs);
			}
			(void)snprintf(from, sizeof(from), "(%s", s.eid);
		}
		if (r->elements < 500) {
			freeReplyObject(r);
			break;
		}
		freeReplyObject(r);
	}
}

/* ---- the fault-free reference --------------------------------------------------------------- */

static bool is_stop(const struct ro_unit *u, int32_t t)
{
	for (uint32_t i = 0; i < u->stop_len; i++)
		if (u->stop[i] == t)
			return true;
	return false;
}

/* One unit's fault-free run in progress, as agent/engine.c runs it: prefill the prompt
 * once, fork it per sample, then sample each position with the unit's key, the sample
 * index and the position; stop on a stop token or max_new_tokens; else forward the token. Units share the forward batches: each token's result does not depend on the
 * batch (kernels/model.h), which is what lets the agents batch them in the first place. */
struct job {
	struct unit *un;
	struct ro_unit u;
	struct ro_sampling sp;
	uint64_t key;
	struct ro_seq **seq;
	float **logits;
	bool *fin;
	uint32_t left;
};

static int job_start(struct ro_model *m, struct job *j, struct unit *un)
{
	const uint32_t V = ro_model_config(m)->vocab;
	struct ro_unit_bounds b;
	struct ro_seq *base = NULL;
	float *base_logits;
	char why[256];
	int r;

	memset(j, 0, sizeof(*j));
	ro_unit_bounds_default(&b);
	if (!un->json || ro_unit_parse(un->json, strlen(un->json), &b, &j->u, why, sizeof(why)))
		return -EINVAL;
	j->un = un;
	j->sp = (struct ro_sampling){j->u.temperature, j->u.top_p, j->u.top_k, j->u.seed};
	j->key = ro_sample_key(j->u.id);
	j->left = j->u.n;
	un->rn = j->u.n;
	un->rtok = calloc(j->u.n, sizeof(*un->rtok));
	un->rlp = calloc(j->u.n, sizeof(*un->rlp));
	un->rlen = calloc(j->u.n, sizeof(*un->rlen));
	un->rfin = calloc(j->u.n, sizeof(*un->rfin));
	un->rtok_s = calloc(j->u.n, sizeof(*un->rtok_s));
	un->rlp_s = calloc(j->u.n, sizeof(*un->rlp_s));
	j->seq = calloc(j->u.n, sizeof(*j->seq));
	j->logits = calloc(j->u.n, sizeof(*j->logits));
	j->fin = calloc(j->u.n, sizeof(*j->fin));
	base_logits = malloc(V * sizeof(float));
	r = ro_seq_new(m, j->u.prompt_len + j->u.max_new_tokens + 1, &base);
	if (!r) {
		struct ro_fwd_item it = {base, j->u.prompt, j->u.prompt_len, base_logits, false};

		r = ro_model_forward(m, &it, 1);
	}
	for (uint32_t i = 0; !r && i < j->u.n; i++) {
		un->rtok[i] = malloc((j->u.max_new_tokens + 1) * sizeof(int32_t));
		un->rlp[i] = malloc((j->u.max_new_tokens + 1) * sizeof(float));
		j->logits[i] = malloc(V * sizeof(float));
		memcpy(j->logits[i], base_logits, V * sizeof(float));
		r = ro_seq_fork(base, &j->seq[i]);
	}
	ro_seq_free(base);
	free(base_logits);
	return r;
}

static void job_end(struct job *j, bool ok)
{
	struct unit *un = j->un;

	for (uint32_t i = 0; i < j->u.n; i++) {
		if (ok) {
			un->rtok_s[i] = ro_json_ints(un->rtok[i], un->rlen[i]);
			un->rlp_s[i] = ro_json_floats(un->rlp[i], un->rlen[i]);
		}
		ro_seq_free(j->seq[i]);
		free(j->logits[i]);
	}
	free(j->seq);
	free(j->logits);
	free(j->fin);
	ro_unit_clear(&j->u);
	un->ref_done = ok;
	if (!ok)
		violation("samples", "the reference run of %s failed", un->id);
}

/* The reference of every unit in todo[], up to 64 sequences at a time. */
static void references(struct ro_model *m, struct unit **todo, int ntodo)
{
	const uint32_t V = ro_model_config(m)->vocab;
	struct job jobs[64];
	struct ro_fwd_item items[64];
	int nj = 0, next = 0;
	uint32_t active = 0;

	while (next < ntodo || nj) {
		size_t k = 0;
		int r = 0;

		while (next < ntodo && nj < 64 && active + todo[next]->n <= 64) {
			struct unit *un = todo[next++];

			if (job_start(m, &jobs[nj], un)) {
				job_end(&jobs[nj], false);
				continue;
			}
			active += jobs[nj].u.n;
			nj++;
		}
		if (!nj && next < ntodo) { /* a unit wider than the batch: on its own */
			if (!job_start(m, &jobs[0], todo[next++])) {
				active += jobs[0].u.n;
				nj = 1;
			} else {
				job_end(&jobs[0], false);
				continue;
			}
		}
		for (int a = 0; a < nj; a++) {
			struct job *j = &jobs[a];
			struct unit *un = j->un;

			for (uint32_t i = 0; i < j->u.n; i++) {
				int32_t t;

				if (j->fin[i])
					continue;
				t = ro_sample(j->logits[i], V, &j->sp, j->key, i, un->rlen[i],
					      &un->rlp[i][un->rlen[i]]);
				un->rtok[i][un->rlen[i]++] = t;
				if (is_stop(&j->u, t) || un->rlen[i] >= j->u.max_new_tokens) {
					j->fin[i] = true;
					un->rfin[i] = is_stop(&j->u, t) ? "stop" : "length";
					j->left--;
					continue;
				}
				if (k < 64)
					items[k++] = (struct ro_fwd_item){
					    j->seq[i], &un->rtok[i][un->rlen[i] - 1], 1, j->logits[i],
					    false};
			}
		}
		if (k)
			r = ro_model_forward(m, items, k);
		for (int a = 0; a < nj;) {
			if (jobs[a].left && !r) {
				a++;
				continue;
			}
			active -= jobs[a].u.n;
			job_end(&jobs[a], !r);
			jobs[a] = jobs[--nj];
		}
	}
}

/* the first index where two JSON arrays of numbers differ (-1: same length and values) */
static long first_diff(const char *a, const char *b)
{
	long i = 0;

	a++;
	b++;
	while (*a && *b && *a != ']' && *b != ']') {
		size_t na = strcspn(a, ",]"), nb = strcspn(b, ",]");

		if (na != nb || strncmp(a, b, na))
			return i;
		a += na + (a[na] == ',');
		b += nb + (b[nb] == ',');
		i++;
	}
	return *a == *b ? -1 : i;
}

/* ---- history ------------------------------------------------------------------------------------ */

struct ev {
	int64_t t;
	char ev[16], w[48], why[160];
	unsigned a;
};

static int parse_hist(const char *h, struct ev **ret)
{
	char *txt;
	struct json_object *o;
	int n = 0;
	struct ev *e = NULL;

	*ret = NULL;
	if (!h || !*h)
		return 0;
	if (asprintf(&txt, "[%s]", h) < 0)
		return 0;
	o = json_tokener_parse(txt);
	free(txt);
	if (!o || !json_object_is_type(o, json_type_array)) {
		json_object_put(o);
		return -1;
	}
	n = (int)json_object_array_length(o);
	e = calloc((size_t)n + 1, sizeof(*e));
	for (int i = 0; i < n; i++) {
		struct json_object *x = json_object_array_get_idx(o, (size_t)i), *v;

		if (json_object_object_get_ex(x, "t", &v))
			e[i].t = json_object_get_int64(v);
		if (json_object_object_get_ex(x, "ev", &v))
			(void)snprintf(e[i].ev, sizeof(e[i].ev), "%s", json_object_get_string(v));
		if (json_object_object_get_ex(x, "w", &v))
			(void)snprintf(e[i].w, sizeof(e[i].w), "%s", json_object_get_string(v));
		if (json_object_object_get_ex(x, "a", &v))
			e[i].a = (unsigned)json_object_get_int(v);
		if (json_object_object_get_ex(x, "why", &v))
			(void)snprintf(e[i].why, sizeof(e[i].why), "%s", json_object_get_string(v));
	}
	json_object_put(o);
	*ret = e;
	return n;
}

static bool ends_lease(const struct ev *e)
{
	return !strcmp(e->ev, "expired") || !strcmp(e->ev, "requeue") ||
	       !strcmp(e->ev, "release") || !strcmp(e->ev, "dead");
}

static bool is_expiry(const struct ev *e)
{
	return !strcmp(e->ev, "expired") ||
	       (!strcmp(e->ev, "dead") && !strncmp(e->why, "lease expired", 13));
}

static bool explained(const char *worker, int64_t from, int64_t to)
{
	for (int i = 0; i < C.nds; i++) {
		const struct disruption *d = &C.ds[i];

		if ((!strcmp(d->worker, "*") || !strcmp(d->worker, worker)) && d->from <= to &&
		    d->to >= from)
			return true;
	}
	return false;
}

/* how long after SIGCONT a stopped server may still be running what waited in its sockets
 * (it reads them at once; a busy sanitizer box is slow) */
#define GHOST_MS 10000

/* A claim Redis ran at `at` for a worker id no agent process held then (every process of
 * it had exited, none had started yet again) can only be a command one of them wrote
 * before it left, run late. That is an injected fault's doing when the one that left last
 * exited while Redis stood paused: the claim sat in the stopped server's socket and ran at
 * SIGCONT, for nobody. (A process alive at `at` must take such a claim up itself: the next
 * claim it sends carries the same request id; so must one that starts under that worker id
 * before the lease expires: it asks what the id holds.) */
static bool ghost_claim(const char *worker, int64_t at, int64_t expired_at)
{
	const struct agent *last = NULL;

	for (int i = 0; i < C.nag; i++) {
		const struct agent *a = &C.ag[i];

		if (strcmp(a->worker, worker))
			continue;
		if (a->start > at && a->start <= expired_at)
			return false; /* a restart under that id must take up what it holds */
		if (a->start > at)
			continue;
		if (!a->exited || a->exit_at >= at)
			return false; /* alive when the claim ran */
		if (!last || a->exit_at > last->exit_at)
			last = a;
	}
	if (!last)
		return false;
	for (int i = 0; i < C.nds; i++) {
		const struct disruption *d = &C.ds[i];

		if (d->pause && d->from <= last->exit_at && last->exit_at <= d->to && at >= d->to &&
		    at <= d->to + GHOST_MS)
			return true;
	}
	return false;
}

/* Whether history event j, an expiry, went through an injected fault: the lease it ended,
 * from its claim (*ret_from) on, met one, or the claim itself was a ghost's. */
static bool expiry_explained(const struct ev *e, int j, int64_t *ret_from)
{
	int64_t from = 0;

	for (int k = j - 1; k >= 0; k--)
		if (!strcmp(e[k].ev, "claim")) {
			from = e[k].t;
			break;
		}
	if (ret_from)
		*ret_from = from;
	return explained(e[j].w, from, e[j].t) || ghost_claim(e[j].w, from, e[j].t);
}

/* ---- agent logs ------------------------------------------------------------------------------ */

struct logscan {
	long lease_lost, lost_publish, lost_checkpoint, lost_requeue, lost_complete, lost_renew;
	long completed_logged, completed_missing, completed_skipped, hard_deadline;
};

/* claims of unit by worker seen in its logs (the history keeps only its last ~3 KB) */
static bool log_claimed(const char *unit, const char *worker, unsigned attempt)
{
	char pat[160], line[1024];

	(void)snprintf(pat, sizeof(pat), "claimed %s: attempt %u,", unit, attempt);
	for (int i = 0; i < C.nag; i++) {
		FILE *f;
		bool hit = false;

		if (strcmp(C.ag[i].worker, worker))
			continue;
		f = fopen(C.ag[i].log, "r");
		while (f && !hit && fgets(line, sizeof(line), f))
			hit = strstr(line, pat) != NULL;
		if (f)
			(void)fclose(f);
		if (hit)
			return true;
	}
	return false;
}

static void scan_logs(struct logscan *ls)
{
	for (int i = 0; i < C.nag; i++) {
		struct agent *a = &C.ag[i];
		char line[1200], last_err[300] = "", drain_why[200] = "";
		FILE *f = fopen(a->log, "r");

		while (f && fgets(line, sizeof(line), f)) {
			char id[96];

			line[strcspn(line, "\n")] = '\0';
			if (strstr(line, "lease lost")) {
				ls->lease_lost++;
				if (strstr(line, "(publish refused)"))
					ls->lost_publish++;
				else if (strstr(line, "(checkpoint refused)"))
					ls->lost_checkpoint++;
				else if (strstr(line, "(requeue refused)"))
					ls->lost_requeue++;
				else if (strstr(line, "(complete refused)"))
					ls->lost_complete++;
				else
					ls->lost_renew++;
			}
			if (!strncmp(line, "<3>", 3))
				(void)snprintf(last_err, sizeof(last_err), "%.290s", line + 3);
			if (strstr(line, "hard deadline passed"))
				ls->hard_deadline++;
			if (strstr(line, "draining ("))
				(void)snprintf(drain_why, sizeof(drain_why), "%s",
					       strstr(line, "draining ("));
			if (sscanf(line, "<7>unit %95s completed", id) == 1) {
				struct unit *u = unit_by_id(id);

				ls->completed_logged++;
				if (u && strcmp(u->state, "done")) {
					if (!strcmp(C.aof, "always") || !C.lost) {
						ls->completed_missing++;
						violation("always",
							  "%s (worker %s) logged unit %s completed, "
							  "but it is %s%s%s",
							  a->name, a->worker, id, u->state,
							  u->reason[0] ? ": " : "", u->reason);
					} else {
						ls->completed_skipped++;
					}
				}
			}
		}
		if (f)
			(void)fclose(f);
		if (a->exited && !strcmp(a->cause, "none")) {
			if (a->rc == 0)
				note("%s exited 0 without being asked to (%s)", a->name,
				     drain_why[0] ? drain_why : "no drain in its log");
			else
				violation("agents",
					  "%s exited by itself with %s %d (last error: %s)", a->name,
					  a->sig ? "signal" : "status", a->sig ? a->sig : a->rc,
					  last_err[0] ? last_err : "none");
		}
		if (a->exited && !strcmp(a->cause, "overrun"))
			violation("drains", "%s did not exit by its drain deadline + 30 s: killed",
				  a->name);
	}
}

static long long metric(const char *path, const char *name)
{
	char line[512];
	FILE *f = fopen(path, "r");
	long long v = -1;
	size_t n = strlen(name);

	while (f && fgets(line, sizeof(line), f))
		if (!strncmp(line, name, n) && line[n] == '{') {
			const char *p = strrchr(line, ' ');

			v = p ? strtoll(p + 1, NULL, 10) : -1;
		}
	if (f)
		(void)fclose(f);
	return v;
}

/* ---- checks ------------------------------------------------------------------------------ */

static int cmp_ll(const void *a, const void *b)
{
	long long x = *(const long long *)a, y = *(const long long *)b;

	return x < y ? -1 : x > y;
}

static int cmp_sample(const void *a, const void *b)
{
	const struct sample *x = a, *y = b;
	int c = strcmp(x->unit, y->unit);

	return c ? c : x->idx != y->idx ? (x->idx < y->idx ? -1 : 1) : strcmp(x->eid, y->eid);
}

int main(int argc, char **argv)
{
	struct ro_model *m = NULL;
	struct ro_model_opts mo = {.threads = 0};
	char err[256];
	struct logscan ls = {0};
	long done = 0, dead = 0, dead_poison = 0, dead_excused = 0, stuck = 0, expected = 0;
	long equal = 0, resumed = 0, requeue_ev = 0, expired_ev = 0, expired_unexplained = 0,
	     release_ev = 0, final_tokens = 0, dups = 0;
	long long gen_tokens = 0, slack[1024];
	int nslack = 0, late = 0, pending = 0, leases = 0;
	int64_t t0 = ro_test_mono_ms();

	(void)setvbuf(stdout, NULL, _IOLBF, 0);
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--dir") && i + 1 < argc)
			(void)snprintf(C.dir, sizeof(C.dir), "%s", argv[++i]);
		else if (!strcmp(argv[i], "--redis") && i + 1 < argc)
			(void)snprintf(C.url, sizeof(C.url), "%s", argv[++i]);
		else {
			(void)fprintf(stderr, "usage: check --dir RUNDIR [--redis URL]\n");
			return 2;
		}
	}
	if (!C.dir[0]) {
		(void)fprintf(stderr, "usage: check --dir RUNDIR [--redis URL]\n");
		return 2;
	}
	{
		char url[128];

		(void)snprintf(url, sizeof(url), "%s", C.url);
		read_record();
		if (url[0])
			(void)snprintf(C.url, sizeof(C.url), "%s", url);
	}
	connect_redis();
	read_units();
	read_stream("samples", true);
	read_stream("groups", false);
	{
		redisReply *r = cmdv("LLEN ro:{%s}:pending", C.queue);

		pending = (int)r->integer;
		freeReplyObject(r);
		r = cmdv("ZCARD ro:{%s}:leases", C.queue);
		leases = (int)r->integer;
		freeReplyObject(r);
	}
	/* the reference, for every unit with a sample in the stream */
	if (ro_model_load(C.model, &mo, &m, err, sizeof(err))) {
		(void)fprintf(stderr, "check: model %s: %s\n", C.model, err);
		return 99;
	}
	qsort(C.s, (size_t)C.ns, sizeof(*C.s), cmp_sample);
	{
		struct unit **todo = calloc((size_t)C.nu + 1, sizeof(*todo));
		int nt = 0;

		for (int i = 0; i < C.nu; i++) {
			bool has = false;

			for (long j = 0; j < C.ns && !has; j++)
				has = !strcmp(C.s[j].unit, C.u[i].id);
			if (has && C.u[i].json) {
				C.u[i].n = C.u[i].n ? C.u[i].n : 1;
				todo[nt++] = &C.u[i];
			}
		}
		int64_t r0 = ro_test_mono_ms();
		long toks = 0;

		references(m, todo, nt);
		for (int i = 0; i < nt; i++)
			for (unsigned j = 0; j < todo[i]->rn && todo[i]->rlen; j++)
				toks += todo[i]->rlen[j];
		(void)printf("check: fault-free reference of %d units (%ld tokens) in %.1f s\n", nt,
			     toks, (ro_test_mono_ms() - r0) / 1000.0);
		free(todo);
	}

	/* ---- units ---- */
	for (int i = 0; i < C.nu; i++) {
		struct unit *u = &C.u[i];
		struct ev *e;
		int ne = parse_hist(u->hist, &e);
		bool healthy = !strcmp(u->expect, "done");

		for (int j = 0; j < ne; j++) {
			requeue_ev += !strcmp(e[j].ev, "requeue");
			release_ev += !strcmp(e[j].ev, "release");
			if (is_expiry(&e[j])) {
				int64_t from;

				expired_ev++;
				if (!expiry_explained(e, j, &from)) {
					expired_unexplained++;
					note("lease of %s (worker %s, attempt %u) expired at %lld with "
					     "no injected fault on its holder or Redis since its claim "
					     "at %lld",
					     u->id, e[j].w, e[j].a, (long long)e[j].t, (long long)from);
				}
			}
		}
		if (!u->in_redis) {
			violation("units", "%s (%s) is not in Redis", u->id, u->variant);
		} else if (!strcmp(u->state, "done")) {
			done++;
			if (!strcmp(u->expect, "dead"))
				violation("units", "poison unit %s (%s) was completed", u->id,
					  u->variant);
			if (u->groups != 1)
				violation("units", "done unit %s has %d groups entries", u->id,
					  u->groups);
			if (u->dead_list)
				violation("units", "done unit %s is in the dead list", u->id);
			expected += u->n;
		} else if (!strcmp(u->state, "dead")) {
			bool excused = true;

			dead++;
			if (!u->reason[0])
				violation("units", "%s is dead without a reason", u->id);
			if (u->dead_list != 1)
				violation("units", "dead unit %s is %d times in the dead list", u->id,
					  u->dead_list);
			if (!healthy) {
				dead_poison++;
			} else {
				for (int j = 0; j < ne; j++)
					if (is_expiry(&e[j]))
						excused = excused && expiry_explained(e, j, NULL);
				if (strncmp(u->reason, "lease expired", 13))
					excused = false;
				if (excused) {
					dead_excused++;
					note("healthy unit %s dead-lettered, every expiry through an "
					     "injected fault: %s",
					     u->id, u->reason);
				} else {
					violation("units", "healthy unit %s dead-lettered: %s", u->id,
						  u->reason);
				}
			}
		} else {
			char evs[256] = "";
			int cnt[6] = {0};
			static const char *const names[6] = {"claim", "expired", "requeue",
							     "release", "dead", "retry"};

			stuck++;
			for (int j = 0; j < ne; j++)
				for (int k = 0; k < 6; k++)
					cnt[k] += !strcmp(e[j].ev, names[k]);
			for (int k = 0; k < 6; k++)
				if (cnt[k])
					(void)snprintf(evs + strlen(evs), sizeof(evs) - strlen(evs),
						       " %s x%d", names[k], cnt[k]);
			violation("units", "%s (%s) ended %s, attempt %u; history (last ~3 KB):%s",
				  u->id, u->variant, u->state[0] ? u->state : "(none)", u->attempt,
				  evs[0] ? evs : " empty");
		}
		free(e);
	}

	/* ---- samples ---- */
	for (long i = 0; i < C.ns; i++) {
		struct sample *s = &C.s[i];
		struct unit *u = unit_by_id(s->unit);
		struct ev *e;
		int ne;

		s->len = s->tokens && strcmp(s->tokens, "[]") ? 1 : 0;
		for (const char *p = s->tokens; p && *p; p++)
			s->len += *p == ',';
		final_tokens += s->len;
		resumed += s->resumed > 0;
		if (i > 0 && !strcmp(C.s[i - 1].unit, s->unit) && C.s[i - 1].idx == s->idx) {
			dups++;
			violation("samples", "%s sample %u is in the stream twice (%s by %s, %s by %s)",
				  s->unit, s->idx, C.s[i - 1].eid, C.s[i - 1].worker, s->eid,
				  s->worker);
		}
		if (!u) {
			violation("samples", "sample %s of unknown unit %s", s->eid, s->unit);
			continue;
		}
		if (u->n && s->idx >= u->n)
			violation("samples", "%s sample %u is beyond n = %u", s->unit, s->idx, u->n);
		if (!u->ref_done) {
			if (strcmp(u->expect, "dead"))
				violation("samples", "%s sample %u: no reference to compare with",
					  s->unit, s->idx);
		} else if (s->idx >= u->rn) {
			violation("samples", "%s sample %u: the unit's body has n = %u", s->unit,
				  s->idx, u->rn);
		} else if (!s->tokens || !s->logprobs || strcmp(s->tokens, u->rtok_s[s->idx])) {
			violation("samples",
				  "%s sample %u (by %s, attempt %u, resumed from %u): tokens differ "
				  "from the fault-free run at position %ld",
				  s->unit, s->idx, s->worker, s->attempt, s->resumed,
				  s->tokens ? first_diff(s->tokens, u->rtok_s[s->idx]) : 0);
		} else if (strcmp(s->logprobs, u->rlp_s[s->idx])) {
			violation("samples",
				  "%s sample %u (by %s, resumed from %u): logprobs differ from the "
				  "fault-free run at position %ld",
				  s->unit, s->idx, s->worker, s->resumed,
				  first_diff(s->logprobs, u->rlp_s[s->idx]));
		} else if (strcmp(s->finish, u->rfin[s->idx])) {
			violation("samples", "%s sample %u: finish %s, the fault-free run's %s",
				  s->unit, s->idx, s->finish, u->rfin[s->idx]);
		} else {
			equal++;
		}
		/* fencing: the holder of the lease at the time of the write */
		ne = parse_hist(u->hist, &e);
		if (ne > 0 && s->ms >= e[0].t) {
			int c = -1;

			for (int j = 0; j < ne; j++)
				if (!strcmp(e[j].ev, "claim") && e[j].t <= s->ms)
					c = j;
			if (c < 0) {
				violation("fencing", "%s sample %u written at %lld before any claim",
					  s->unit, s->idx, (long long)s->ms);
			} else if (strcmp(e[c].w, s->worker) || e[c].a != s->attempt) {
				violation("fencing",
					  "%s sample %u by %s (attempt %u) accepted at %lld while the "
					  "lease was %s's (attempt %u, claimed at %lld)%s",
					  s->unit, s->idx, s->worker, s->attempt, (long long)s->ms,
					  e[c].w, e[c].a, (long long)e[c].t,
					  C.lost ? " [after an AOF loss]" : "");
			} else {
				for (int j = c + 1; j < ne; j++)
					if (ends_lease(&e[j]) && e[j].t < s->ms) {
						violation("fencing",
							  "%s sample %u by %s accepted at %lld after "
							  "its lease ended (%s at %lld)",
							  s->unit, s->idx, s->worker, (long long)s->ms,
							  e[j].ev, (long long)e[j].t);
						break;
					}
			}
		} else {
			bool seen = false;

			for (int j = 0; j < ne && !seen; j++)
				seen = !strcmp(e[j].ev, "claim") && !strcmp(e[j].w, s->worker) &&
				       e[j].a == s->attempt;
			if (!seen && !log_claimed(s->unit, s->worker, s->attempt))
				violation("fencing", "%s sample %u by %s (attempt %u): no such claim",
					  s->unit, s->idx, s->worker, s->attempt);
		}
		free(e);
	}
	/* every sample of a done unit once */
	for (int i = 0; i < C.nu; i++) {
		struct unit *u = &C.u[i];

		if (strcmp(u->state, "done"))
			continue;
		for (unsigned idx = 0; idx < u->n; idx++) {
			bool found = false;

			for (long j = 0; j < C.ns && !found; j++)
				found = C.s[j].idx == idx && !strcmp(C.s[j].unit, u->id);
			if (!found)
				violation("samples", "done unit %s has no sample %u", u->id, idx);
		}
	}
	if (pending)
		note("%d ids left in the pending list", pending);
	if (leases)
		note("%d leases left in the leases set", leases);

	/* ---- agents and drains ---- */
	scan_logs(&ls);
	for (int i = 0; i < C.ndr; i++) {
		struct drain *d = &C.dr[i];
		struct agent *a = agent_by_name(d->name);

		if (!a || !a->exited) {
			violation("drains", "%s (%s drain) never exited", d->name, d->how);
			continue;
		}
		if (!strcmp(a->cause, "overrun"))
			continue; /* reported with the agent */
		if (a->rc != 0)
			violation("drains", "%s drained (%s) but exited with %s %d", d->name, d->how,
				  a->sig ? "signal" : "status", a->sig ? a->sig : a->rc);
		if (a->exit_at > d->deadline) {
			late++;
			violation("drains",
				  "%s (%s drain, fault %d) exited %lld ms after its deadline "
				  "(posted %lld ms before it)",
				  d->name, d->how, d->fault, (long long)(a->exit_at - d->deadline),
				  (long long)(d->deadline - d->posted));
		}
		if (nslack < 1024)
			slack[nslack++] = d->deadline - a->exit_at;
	}
	for (int i = 0; i < C.nfl; i++) {
		char line[512];
		FILE *f = fopen(C.floods[i], "r");

		if (!f || !fgets(line, sizeof(line), f)) {
			violation("agents", "flood %s left no record", C.floods[i]);
		} else {
			char rep[200] = "";

			(void)ch_kv(line, "split_reply", rep, sizeof(rep));
			if (!ch_kv_ll(line, "split_ok", 0))
				violation("control",
					  "a \"status\" command sent in two writes (300 ms apart) got "
					  "%s, not a status",
					  rep);
			if (ch_kv_ll(line, "junk_drained", 0))
				violation("control", "the junk line \"drainage-is-not-a-command\" "
						     "drained the agent (a prefix match on \"drain\")");
			if (ch_kv_ll(line, "after_ok", 0) == 0)
				violation("control", "no status reply after the flood (%s)",
					  C.floods[i]);
			else if (ch_kv_ll(line, "after_ok", 0) < 0)
				note("flood %d: the agent was gone by the end of the flood", i);
			note("flood %d: up to %lld idle connections open at once (%lld opened in all, "
			     "the daemon closing each after its 200 ms read); the split command "
			     "answered in %lld ms",
			     i, ch_kv_ll(line, "idle_max", -1), ch_kv_ll(line, "idle_total", -1),
			     ch_kv_ll(line, "split_ms", -1));
			(void)ch_kv(line, "junk", rep, sizeof(rep));
			note("flood %d: status after %lld ms; junk replies %s (e error, r other, - "
			     "none)",
			     i, ch_kv_ll(line, "after_ms", -1), rep);
		}
		if (f)
			(void)fclose(f);
	}
	for (int i = 0; i < C.nag; i++) {
		long long v = metric(C.ag[i].metrics, "rolloutd_tokens_generated_total");

		if (v > 0)
			gen_tokens += v;
	}

	/* ---- report ---- */
	qsort(slack, (size_t)nslack, sizeof(*slack), cmp_ll);
	(void)printf("check: seed %lld, aof %s%s, %d agent processes, end: %s, %.1f s to check\n",
		     C.seed, C.aof, C.lost ? " (a simulated power loss cut the AOF)" : "", C.nag,
		     C.end_reason, (ro_test_mono_ms() - t0) / 1000.0);
	(void)printf("units: %d (%ld done, %ld dead: %ld poison, %ld healthy of which %ld through "
		     "injected faults; %ld not finished)\n",
		     C.nu, done, dead, dead_poison, dead - dead_poison, dead_excused, stuck);
	(void)printf("samples: %ld in the stream (%ld owed by the done units), %ld duplicates, %ld "
		     "bitwise equal to the fault-free run\n",
		     C.ns, expected, dups, equal);
	(void)printf("faults:");
	for (int k = 0; k < CH_NKINDS; k++)
		if (C.kinds[k])
			(void)printf(" %s %d", ch_kind_name[k], C.kinds[k]);
	(void)printf(" (skipped %d)\n", C.skipped);
	(void)printf("requeues: %ld drain requeues, %ld lease expiries reaped (%ld with no injected "
		     "fault), %ld releases\n",
		     requeue_ev, expired_ev, expired_unexplained, release_ev);
	(void)printf("resumes: %ld samples resumed from a checkpoint (resumed_from > 0)\n", resumed);
	(void)printf("tokens: %lld generated (sum of rolloutd_tokens_generated_total over every "
		     "agent process's last textfile), %ld in the stream's samples: %lld "
		     "regenerated (a lower bound: a SIGKILLed agent's textfile is up to 200 ms "
		     "old%s)\n",
		     gen_tokens, final_tokens, gen_tokens > final_tokens ? gen_tokens - final_tokens : 0,
		     gen_tokens < final_tokens ? "; here the killed agents' textfiles missed more "
						 "than was regenerated"
					       : "");
	(void)printf("stale writes refused: %ld (\"lease lost\" in agent logs: publish %ld, "
		     "checkpoint %ld, requeue %ld, complete %ld, renew %ld)\n",
		     ls.lease_lost, ls.lost_publish, ls.lost_checkpoint, ls.lost_requeue,
		     ls.lost_complete, ls.lost_renew);
	if (ls.completed_skipped)
		(void)printf("completions lost with the AOF's last second and done again: %ld\n",
			     ls.completed_skipped);
	if (nslack)
		(void)printf("drains: %d checked, %d late; deadline slack min %lld ms, p50 %lld ms\n",
			     nslack, late, slack[0], slack[nslack / 2]);
	else
		(void)printf("drains: none\n");
	if (ls.hard_deadline)
		(void)printf("drains that hit the hard deadline with units not requeued: %ld\n",
			     ls.hard_deadline);
	(void)printf("violations: %ld\n", C.violations);
	ro_model_free(m);
	redisFree(C.c);
	if (C.own.pid)
		ro_test_redis_stop(&C.own);
	return C.violations ? 1 : 0;
}
