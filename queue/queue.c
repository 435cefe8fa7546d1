/* The queue's client side: one hiredis connection, reconnected with jittered backoff, the
 * function library loaded on demand, and one C call per server-side function of
 * queue/scripts.lua. Every operation that could not be confirmed (the connection died
 * between send and reply) is sent again: the functions are idempotent, so a retry never
 * duplicates a write. */
#include "queue/queue.h"
#include "queue/internal.h"
#include "queue/conn.h"

#include <errno.h>
#include <poll.h>
#include <hiredis/hiredis.h>
#include <json-c/json.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

extern const char ro_queue_scripts_lua[];
extern const char ro_queue_scripts_version[];

struct ro_queue {
	struct ro_conn *conn;
	struct ro_redis_url url;
	char *prefix; /* "ro:{q}:" */
	char *worker;
	struct ro_queue_opts o;
	uint64_t rng;
	/* the request id of a claim that was sent and never answered (a timeout, a lost
	 * connection): it may have run and leased units to this worker that it never heard
	 * of. The next claim sends the same id, so the server answers with what that claim
	 * took (scripts.lua, claim) instead of leaving those leases to expire, each charging
	 * its unit an attempt. 0: none. */
	uint64_t claim_unsure;
	char err[256];
};

/* ---- small helpers ---------------------------------------------------------------- */

static int64_t mono_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int64_t ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static uint64_t rng_next(struct ro_queue *q)
{
	/* xorshift64*: jitter and request ids, nothing that needs to be secret */
	q->rng ^= q->rng >> 12;
	q->rng ^= q->rng << 25;
	q->rng ^= q->rng >> 27;
	return q->rng * 2685821657736338717ull;
}

static int fail(struct ro_queue *q, int r, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	(void)vsnprintf(q->err, sizeof(q->err), fmt, ap);
	va_end(ap);
	return r;
}

/* why the last ro_queue_new() of this thread failed, for ro_queue_errmsg(NULL) */
static __thread char new_err[256];

const char *ro_queue_errmsg(const struct ro_queue *q)
{
	return q ? q->err : new_err;
}

uint64_t ro_queue_connects(const struct ro_queue *q)
{
	return ro_conn_connects(q->conn);
}

const char *ro_queue_key(struct ro_queue *q, const char *suffix, char *buf, size_t len)
{
	(void)snprintf(buf, len, "%s%s", q->prefix, suffix);
	return buf;
}

/* Argument vectors for redisCommandArgv: borrowed strings, or owned formatted ones. */
struct args {
	size_t n, cap;
	const char **v;
	size_t *len;
	char **own;
	size_t nown;
	bool oom;
	uint64_t reqid; /* a claim's request id (0: not a claim) */
};

static void args_add(struct args *a, const char *s, size_t len)
{
	if (a->n == a->cap) {
		size_t cap = a->cap ? a->cap * 2 : 16;
		const char **v = realloc(a->v, cap * sizeof(*v));
		size_t *l = v ? realloc(a->len, cap * sizeof(*l)) : NULL;
		char **own = l ? realloc(a->own, cap * sizeof(*own)) : NULL;

		if (v)
			a->v = v;
		if (l)
			a->len = l;
		if (own)
			a->own = own;
		if (!own) {
			a->oom = true;
			return;
		}
		a->cap = cap;
	}
	a->v[a->n] = s;
	a->len[a->n] = len;
	a->n++;
}

static void args_str(struct args *a, const char *s)
{
	args_add(a, s, strlen(s));
}

static void args_take(struct args *a, char *s)
{
	if (!s) {
		a->oom = true;
		return;
	}
	args_str(a, s);
	if (a->oom) {
		free(s);
		return;
	}
	a->own[a->nown++] = s;
}

__attribute__((format(printf, 2, 3))) static void args_fmt(struct args *a, const char *fmt, ...)
{
	va_list ap;
	char *s = NULL;

	va_start(ap, fmt);
	if (vasprintf(&s, fmt, ap) < 0)
		s = NULL;
	va_end(ap);
	args_take(a, s);
}

static void args_clear(struct args *a)
{
	for (size_t i = 0; i < a->nown; i++)
		free(a->own[i]);
	free(a->own);
	free(a->v);
	free(a->len);
	memset(a, 0, sizeof(*a));
}

static void fcall_start(struct ro_queue *q, struct args *a, const char *fn)
{
	args_str(a, "FCALL");
	args_str(a, fn);
	args_str(a, "1");
	args_str(a, q->prefix);
}

/* ---- connection ------------------------------------------------------------------- */

/* The longest value a reply may carry: a unit body, a checkpoint, or anything else the
 * clients read (a policy manifest, a sample, a dead unit's history), with room to spare.
 * The claims are bounded on the server (ro_unit_bounds); this is the client's own guard. */
static size_t reply_cap(const struct ro_unit_bounds *b)
{
	size_t ckpt = ro_progress_max_bytes(b->max_new_tokens);

	return (b->max_body > ckpt ? b->max_body : ckpt) + ((size_t)8 << 20);
}

int ro_queue_new(const struct ro_queue_opts *o, struct ro_queue **ret)
{
	struct ro_queue *q;
	const char *pfx = o->prefix && *o->prefix ? o->prefix : "ro";
	const char *name = o->queue && *o->queue ? o->queue : "default";
	struct ro_conn_opts co = {0};
	char cname[200];
	int r;

	q = calloc(1, sizeof(*q));
	if (!q)
		return -ENOMEM;
	q->o = *o;
	if (!q->o.timeout_ms)
		q->o.timeout_ms = 5000;
	if (!q->o.retry_ms)
		q->o.retry_ms = 10000;
	if (!q->o.max_attempts)
		q->o.max_attempts = 3;
	if (!q->o.worker_ttl_ms)
		q->o.worker_ttl_ms = 30000;
	{
		/* each bound not given is the default one (a claim enforces them all) */
		struct ro_unit_bounds d;

		ro_unit_bounds_default(&d);
		if (!q->o.bounds.max_prompt)
			q->o.bounds.max_prompt = d.max_prompt;
		if (!q->o.bounds.max_n)
			q->o.bounds.max_n = d.max_n;
		if (!q->o.bounds.max_new_tokens)
			q->o.bounds.max_new_tokens = d.max_new_tokens;
		if (!q->o.bounds.max_body)
			q->o.bounds.max_body = d.max_body;
	}
	q->rng = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)mono_ms() ^ (uintptr_t)q;
	if (!q->rng)
		q->rng = 1;
	if (!ro_unit_id_valid(name)) {
		r = -EINVAL;
		(void)fail(q, r, "queue name \"%s\" must be 1-128 characters of [A-Za-z0-9._:-]",
			   name);
		goto out_free;
	}
	if (asprintf(&q->prefix, "%s:{%s}:", pfx, name) < 0) {
		q->prefix = NULL;
		r = -ENOMEM;
		goto out_free;
	}
	q->worker = strdup(o->worker && *o->worker ? o->worker : "anonymous");
	if (!q->worker) {
		r = -ENOMEM;
		goto out_free;
	}
	if (!ro_unit_id_valid(q->worker)) {
		r = -EINVAL;
		(void)fail(q, r, "worker id \"%s\" must be 1-128 characters of [A-Za-z0-9._:-]",
			   q->worker);
		goto out_free;
	}
	r = ro_redis_url_parse(o->url && *o->url ? o->url : "redis://127.0.0.1:6379/0", &q->url,
			       q->err, sizeof(q->err));
	if (r)
		goto out_free;
	/* named, so an operator's CLIENT LIST shows which worker holds which connection */
	(void)snprintf(cname, sizeof(cname), "rolloutd:%s", q->worker);
	co.url = &q->url;
	co.password = o->password;
	co.sentinel_password = o->sentinel_password;
	co.tls_ca = o->tls_ca;
	co.tls_cert = o->tls_cert;
	co.tls_key = o->tls_key;
	co.tls_server_name = o->tls_server_name;
	co.cluster = o->cluster;
	co.slot_key = q->prefix;
	co.client_name = cname;
	co.timeout_ms = q->o.timeout_ms;
	co.library = ro_queue_scripts_lua;
	co.library_version = ro_queue_scripts_version;
	co.max_reply = reply_cap(&q->o.bounds);
	co.after_send = o->after_send;
	co.after_send_arg = o->after_send_arg;
	if (!q->o.wait_timeout_ms)
		q->o.wait_timeout_ms = 1000;
	r = ro_conn_new(&co, &q->conn, q->err, sizeof(q->err));
	if (r)
		goto out_free;
	q->o.url = NULL; /* borrowed strings are not kept */
	q->o.queue = q->o.prefix = q->o.worker = NULL;
	q->o.password = q->o.sentinel_password = NULL;
	q->o.tls_ca = q->o.tls_cert = q->o.tls_key = q->o.tls_server_name = NULL;
	*ret = q;
	return 0;
out_free:
	(void)snprintf(new_err, sizeof(new_err), "%s", q->err[0] ? q->err : strerror(-r));
	(void)ro_queue_free(q);
	return r;
}

struct ro_queue *ro_queue_free(struct ro_queue *q)
{
	if (!q)
		return NULL;
	q->conn = ro_conn_free(q->conn);
	if (q->url.password)
		explicit_bzero(q->url.password, strlen(q->url.password));
	ro_redis_url_clear(&q->url);
	free(q->prefix);
	free(q->worker);
	free(q);
	return NULL;
}

static int map_error(char *msg, size_t len, const char *s)
{
	int r = -EPROTO;

	if (!strncmp(s, "STALE", 5))
		r = -ESTALE;
	else if (!strncmp(s, "INCOMPLETE", 10))
		r = -EBUSY;
	else if (!strncmp(s, "NOTFOUND", 8))
		r = -ENOENT;
	else if (!strncmp(s, "BADARG", 6))
		r = -EINVAL;
	else if (!strncmp(s, "BADUNIT", 7))
		r = -EBADMSG;
	(void)snprintf(msg, len, "%s", s);
	return r;
}

/* ---- operations in flight ----------------------------------------------------------- */

/* One operation: its command(s) on the connection, its reply parsed into res, then the
 * caller's callback. The synchronous API is the same operation awaited with poll(). */
struct op {
	struct ro_queue *q;
	int (*parse)(struct op *op, redisReply *rep);
	ro_queue_done_fn done;
	void *arg;
	struct ro_queue_result res;
	size_t count;  /* what the reply must hold (renew, publish, enqueue) */
	int stages;    /* replies still to come (an operation of several commands) */
	redisReply *raw; /* the reply itself, for synchronous callers that parse it */
	bool keep_raw;
	bool parse_errors; /* error replies go to parse too */
	bool replied;	   /* a reply came (an error reply too): the outcome is known */
	uint64_t reqid;	   /* a claim's request id */
	char *group;
	char msg[256];
};

void ro_policy_info_clear(struct ro_policy_info *p)
{
	free(p->uri);
	free(p->manifest);
	free(p->by);
	memset(p, 0, sizeof(*p));
}

static void result_clear(struct ro_queue_result *res)
{
	if (res->policy) {
		ro_policy_info_clear(res->policy);
		free(res->policy);
	}
	ro_claims_free(res->claims, res->n_claims);
	for (size_t i = 0; i < res->n_refused; i++)
		free(res->refused[i]);
	free(res->refused);
	free(res->ok);
	free(res->ids);
	free(res->status);
	memset(res, 0, sizeof(*res));
}

static void op_reply(void *arg, int r, redisReply *rep, const char *why, int64_t sent_ms)
{
	struct op *op = arg;

	if (sent_ms > op->res.sent_ms)
		op->res.sent_ms = sent_ms;

	if (!r)
		op->replied = true;
	if (r) {
		if (!op->res.r) {
			op->res.r = r;
			(void)snprintf(op->msg, sizeof(op->msg), "%s", why ? why : strerror(-r));
		}
	} else if (rep->type == REDIS_REPLY_ERROR && !op->keep_raw && !op->parse_errors) {
		if (!op->res.r)
			op->res.r = map_error(op->msg, sizeof(op->msg), rep->str);
		freeReplyObject(rep);
	} else if (op->keep_raw) {
		if (rep->type == REDIS_REPLY_ERROR) {
			op->res.r = map_error(op->msg, sizeof(op->msg), rep->str);
			freeReplyObject(rep);
		} else {
			op->raw = rep;
		}
	} else if (op->res.r) {
		freeReplyObject(rep);
	} else {
		int pr = op->parse ? op->parse(op, rep) : (freeReplyObject(rep), 0);

		if (pr < 0 && !op->msg[0])
			(void)snprintf(op->msg, sizeof(op->msg), "unexpected reply");
		op->res.r = pr;
	}
	if (--op->stages > 0)
		return;
	if (op->reqid) {
		/* a claim written and never answered may have run; one answered has not or
		 * has told what it took (an error reply means it ran no write) */
		if (!op->replied && op->res.sent_ms)
			op->q->claim_unsure = op->reqid;
		else if (op->replied && op->q->claim_unsure == op->reqid)
			op->q->claim_unsure = 0;
	}
	op->res.msg = op->msg;
	if (op->done)
		op->done(op->arg, &op->res);
	result_clear(&op->res);
	if (op->raw)
		freeReplyObject(op->raw);
	free(op->group);
	free(op);
}

/* With redis-wait-replicas, the writes whose loss in a failover would cost more than a
 * repeat are confirmed only once replicated: a unit enqueued, a sample published, a unit
 * completed or requeued with its checkpoints. */
static uint32_t wait_for(const struct ro_queue *q, const struct args *a)
{
	static const char *const waited[] = {"ro_enqueue", "ro_publish", "ro_complete",
					     "ro_requeue"};

	if (!q->o.wait_replicas || a->n < 2 || strcmp(a->v[0], "FCALL"))
		return 0;
	for (size_t i = 0; i < sizeof(waited) / sizeof(waited[0]); i++)
		if (!strcmp(a->v[1], waited[i]))
			return q->o.wait_replicas;
	return 0;
}

/* Send a built command as an operation that ends within timeout_ms. */
static int submit_blocking(struct ro_queue *q, struct args *a,
			   int (*parse)(struct op *, redisReply *), size_t count, uint32_t block_ms,
			   const struct ro_queue_cb *cb, struct op **ret_op)
{
	struct op *op;
	int r;

	if (a->oom)
		return fail(q, -ENOMEM, "out of memory");
	op = calloc(1, sizeof(*op));
	if (!op)
		return fail(q, -ENOMEM, "out of memory");
	op->q = q;
	op->parse = parse;
	op->done = cb->fn;
	op->arg = cb->arg;
	op->count = count;
	op->stages = 1;
	op->reqid = a->reqid;
	r = ro_conn_send(q->conn, (int)a->n, a->v, a->len,
			 mono_ms() + (cb->timeout_ms ? cb->timeout_ms : q->o.retry_ms), block_ms,
			 wait_for(q, a), q->o.wait_timeout_ms, op_reply, op);
	if (r) {
		free(op);
		return fail(q, r, "out of memory");
	}
	if (ret_op)
		*ret_op = op;
	return 0;
}

static int submit(struct ro_queue *q, struct args *a, int (*parse)(struct op *, redisReply *),
		  size_t count, const struct ro_queue_cb *cb, struct op **ret_op)
{
	return submit_blocking(q, a, parse, count, 0, cb, ret_op);
}

/* ---- the synchronous face: an operation awaited ---------------------------------- */

struct waiter {
	struct ro_queue *q;
	bool done;
	struct ro_queue_result res;
	redisReply *raw;
	struct op *op;
};

static void waiter_done(void *arg, struct ro_queue_result *res)
{
	struct waiter *w = arg;

	const char *res_msg = res->msg ? res->msg : "";

	w->res = *res;
	memset(res, 0, sizeof(*res)); /* the waiter owns what the result holds */
	w->res.msg = NULL;
	if (w->res.r < 0)
		(void)fail(w->q, w->res.r, "%s", res_msg);
	if (w->op) {
		w->raw = w->op->raw;
		w->op->raw = NULL;
	}
	w->done = true;
}

/* Drive the connection until w is answered (or, with until_fatal, a permanent failure
 * of the connection, when its reply would only be the timeout). */
static int await_until(struct ro_queue *q, struct waiter *w, bool until_fatal)
{
	while (!w->done && !(until_fatal && ro_conn_fatal(q->conn))) {
		struct pollfd p = {.fd = ro_conn_fd(q->conn), .events = ro_conn_events(q->conn)};
		int64_t next = ro_conn_next_ms(q->conn), now = mono_ms();
		int timeout = next < 0 ? 100 : next <= now ? 0 : (int)(next - now);

		if (p.fd < 0) {
			if (timeout)
				sleep_ms(timeout);
			p.revents = 0;
		} else if (poll(&p, 1, timeout) < 0 && errno != EINTR) {
			p.revents = POLLERR;
		}
		ro_conn_process(q->conn, p.revents);
	}
	return w->res.r;
}

static int await(struct ro_queue *q, struct waiter *w)
{
	return await_until(q, w, false);
}

/* Run an operation to its end: its reply parsed into ret (which the caller clears). */
static int run_op(struct ro_queue *q, struct args *a, int (*parse)(struct op *, redisReply *),
		  size_t count, uint32_t block_ms, struct ro_queue_result *ret)
{
	struct waiter w = {.q = q};
	struct ro_queue_cb cb = {waiter_done, &w, q->o.retry_ms + block_ms};
	int r = submit_blocking(q, a, parse, count, block_ms, &cb, &w.op);

	args_clear(a);
	if (r)
		return r;
	r = await(q, &w);
	*ret = w.res;
	if (w.raw)
		freeReplyObject(w.raw);
	return r;
}

static int run(struct ro_queue *q, struct args *a, int (*parse)(struct op *, redisReply *),
	       size_t count, struct ro_queue_result *ret)
{
	return run_op(q, a, parse, count, 0, ret);
}

static int run_blocking(struct ro_queue *q, struct args *a,
			int (*parse)(struct op *, redisReply *), uint32_t block_ms,
			struct ro_queue_result *ret)
{
	return run_op(q, a, parse, 0, block_ms, ret);
}

/* One command with its raw reply (error replies become -errno), reconnecting and sending
 * again for up to retry_ms: a reply lost to a dead connection means the command may or may
 * not have run, and the idempotent functions make sending it again safe. */
static int call(struct ro_queue *q, struct args *a, redisReply **ret)
{
	struct waiter w = {.q = q};
	struct ro_queue_cb cb = {waiter_done, &w, q->o.retry_ms};
	int r = submit(q, a, NULL, 0, &cb, &w.op);

	if (r)
		return r;
	w.op->keep_raw = true;
	r = await(q, &w);
	result_clear(&w.res);
	if (!r)
		*ret = w.raw;
	else if (w.raw)
		freeReplyObject(w.raw);
	return r;
}

/* The connection as the caller's event loop sees it. */
int ro_queue_fd(const struct ro_queue *q)
{
	return ro_conn_fd(q->conn);
}

short ro_queue_events(const struct ro_queue *q)
{
	return ro_conn_events(q->conn);
}

int64_t ro_queue_next_ms(const struct ro_queue *q)
{
	return ro_conn_next_ms(q->conn);
}

void ro_queue_process(struct ro_queue *q, short revents)
{
	ro_conn_process(q->conn, revents);
}

size_t ro_queue_pending(const struct ro_queue *q)
{
	return ro_conn_pending(q->conn);
}

uint64_t ro_queue_socket_gen(const struct ro_queue *q)
{
	return ro_conn_sockets(q->conn);
}

const char *ro_queue_conn_errmsg(const struct ro_queue *q)
{
	return ro_conn_errmsg(q->conn);
}

bool ro_queue_connected(const struct ro_queue *q)
{
	return ro_conn_ready(q->conn);
}

int ro_queue_fatal(const struct ro_queue *q)
{
	return ro_conn_fatal(q->conn);
}

const char *ro_queue_mode(const struct ro_queue *q)
{
	return ro_conn_mode(q->conn);
}

const char *ro_queue_node(const struct ro_queue *q)
{
	return ro_conn_node(q->conn);
}

uint64_t ro_queue_redirects(const struct ro_queue *q)
{
	return ro_conn_redirects(q->conn);
}

int ro_queue_check(struct ro_queue *q, uint32_t timeout_ms)
{
	struct waiter w = {.q = q};
	struct ro_queue_cb cb = {waiter_done, &w, timeout_ms};
	struct args a = {0};
	int r;

	args_str(&a, "PING");
	r = submit(q, &a, NULL, 0, &cb, &w.op);
	args_clear(&a);
	if (r)
		return r;
	w.op->keep_raw = true;
	(void)await_until(q, &w, true);
	if (!w.done) {
		/* the PING stays queued: its callback must not outlive w */
		r = ro_conn_fatal(q->conn);
		w.op->done = NULL;
		return fail(q, r, "%s", ro_conn_errmsg(q->conn));
	}
	result_clear(&w.res);
	if (w.raw)
		freeReplyObject(w.raw);
	if (!w.res.r)
		return 0;
	r = ro_conn_fatal(q->conn);
	return r ? fail(q, r, "%s", ro_conn_errmsg(q->conn)) : w.res.r;
}

/* ---- replies ---------------------------------------------------------------------- */

static bool is_str(const redisReply *r)
{
	return r && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS);
}

static int bad_reply(struct ro_queue *q, redisReply *rep, const char *what)
{
	if (rep)
		freeReplyObject(rep);
	return fail(q, -EPROTO, "unexpected reply to %s", what);
}

void ro_claim_clear(struct ro_claim *c)
{
	free(c->id);
	free(c->body);
	free(c->meta);
	free(c->published_idx);
	for (uint32_t i = 0; i < c->n_published; i++)
		free(c->published_ids[i]);
	free(c->published_ids);
	for (uint32_t i = 0; i < c->n_progress; i++)
		ro_progress_clear(&c->progress[i]);
	free(c->progress);
}

void ro_claims_free(struct ro_claim *c, size_t count)
{
	if (!c)
		return;
	for (size_t i = 0; i < count; i++)
		ro_claim_clear(&c[i]);
	free(c);
}

static int parse_claim(const redisReply *u, size_t max_ckpt, struct ro_claim *c)
{
	const redisReply *pub, *prog;

	if (u->type != REDIS_REPLY_ARRAY || u->elements < 8 || !is_str(u->element[0]) ||
	    !is_str(u->element[1]) || u->element[2]->type != REDIS_REPLY_INTEGER ||
	    !is_str(u->element[3]) || u->element[4]->type != REDIS_REPLY_INTEGER)
		return -EPROTO;
	pub = u->element[5];
	prog = u->element[6];
	if (pub->type != REDIS_REPLY_ARRAY || prog->type != REDIS_REPLY_ARRAY)
		return -EPROTO;
	c->id = strdup(u->element[0]->str);
	c->body = strdup(u->element[1]->str);
	c->meta = strdup(is_str(u->element[7]) ? u->element[7]->str : "");
	c->attempt = (uint32_t)u->element[2]->integer;
	(void)snprintf(c->token, sizeof(c->token), "%s", u->element[3]->str);
	c->n = (uint32_t)u->element[4]->integer;
	c->published_idx = calloc(pub->elements / 2 + 1, sizeof(*c->published_idx));
	c->published_ids = calloc(pub->elements / 2 + 1, sizeof(*c->published_ids));
	c->progress = calloc(prog->elements / 2 + 1, sizeof(*c->progress));
	if (!c->id || !c->body || !c->meta || !c->published_idx || !c->published_ids ||
	    !c->progress)
		return -ENOMEM;
	for (size_t i = 0; i + 1 < pub->elements; i += 2) {
		char *s = strdup(pub->element[i + 1]->str ? pub->element[i + 1]->str : "");

		if (!s)
			return -ENOMEM;
		c->published_idx[c->n_published] =
		    (uint32_t)strtoul(pub->element[i]->str, NULL, 10);
		c->published_ids[c->n_published++] = s;
	}
	for (size_t i = 0; i + 1 < prog->elements; i += 2) {
		const redisReply *v = prog->element[i + 1];
		uint32_t idx = (uint32_t)strtoul(prog->element[i]->str, NULL, 10);

		/* an unreadable checkpoint only costs a restart of that sample; one longer than
		 * any this worker can resume is not even parsed (the server leaves those out) */
		if (is_str(v) && v->len <= max_ckpt &&
		    ro_progress_decode(v->str, idx, &c->progress[c->n_progress]) == 0)
			c->n_progress++;
		else
			c->n_progress_dropped++;
	}
	/* the checkpoints the server left out: (idx, bytes) each */
	if (u->elements > 8 && u->element[8]->type == REDIS_REPLY_ARRAY)
		c->n_progress_dropped += (uint32_t)(u->element[8]->elements / 2);
	return 0;
}

/* {id, reason}: a unit the server dead-lettered instead of sending it */
static bool is_refusal(const redisReply *u)
{
	return u->type == REDIS_REPLY_ARRAY && u->elements == 2 && is_str(u->element[0]) &&
	       is_str(u->element[1]);
}

static int parse_claims(struct ro_queue *q, redisReply *rep, struct ro_claim **ret,
			size_t *ret_count, char ***ret_refused, size_t *ret_n_refused)
{
	size_t max_ckpt = ro_progress_max_bytes(q->o.bounds.max_new_tokens), n = 0, nr = 0;
	struct ro_claim *c;
	char **refused;
	int r = 0;

	if (rep->type != REDIS_REPLY_ARRAY)
		return bad_reply(q, rep, "claim");
	c = calloc(rep->elements + 1, sizeof(*c));
	refused = calloc(rep->elements + 1, sizeof(*refused));
	if (!c || !refused) {
		free(c);
		free(refused);
		freeReplyObject(rep);
		return -ENOMEM;
	}
	for (size_t i = 0; i < rep->elements && !r; i++) {
		const redisReply *u = rep->element[i];

		if (!is_refusal(u)) {
			r = parse_claim(u, max_ckpt, &c[n++]);
		} else if (asprintf(&refused[nr], "%s: %s", u->element[0]->str,
				    u->element[1]->str) < 0) {
			refused[nr] = NULL;
			r = -ENOMEM;
		} else {
			nr++;
		}
	}
	if (!r && ret_refused) {
		*ret_refused = refused;
		*ret_n_refused = nr;
		refused = NULL;
		nr = 0;
	}
	for (size_t i = 0; i < nr; i++)
		free(refused[i]);
	free(refused);
	if (r) {
		ro_claims_free(c, n);
		freeReplyObject(rep);
		return fail(q, r, "bad claim reply");
	}
	*ret = c;
	*ret_count = n;
	freeReplyObject(rep);
	return (int)*ret_count;
}

/* ---- operations ------------------------------------------------------------------- */

int ro_queue_enqueue(struct ro_queue *q, const struct ro_unit *units, size_t count, int *ret_status)
{
	/* batches keep one script short: a long one would stall every other client */
	const size_t batch = 128;
	int r = 0;

	for (size_t off = 0; off < count && !r; off += batch) {
		size_t m = count - off < batch ? count - off : batch;
		struct args a = {0};
		redisReply *rep = NULL;

		fcall_start(q, &a, "ro_enqueue");
		for (size_t i = 0; i < m; i++) {
			const struct ro_unit *u = &units[off + i];

			args_str(&a, u->id);
			args_str(&a, u->body);
			args_fmt(&a, "%u", u->n);
			args_str(&a, u->meta ? u->meta : "");
		}
		r = call(q, &a, &rep);
		args_clear(&a);
		if (r)
			break;
		if (rep->type != REDIS_REPLY_ARRAY || rep->elements != m)
			return bad_reply(q, rep, "enqueue");
		for (size_t i = 0; i < m; i++) {
			long long v = rep->element[i]->integer;

			if (ret_status)
				ret_status[off + i] = v < 0 ? -EEXIST : (int)v;
		}
		freeReplyObject(rep);
	}
	return r;
}

/* Each operation below is written once, as a command and a reply parser; its _async face
 * submits it, its synchronous face submits it and awaits it. */

static int parse_claims_op(struct op *op, redisReply *rep)
{
	return parse_claims(op->q, rep, &op->res.claims, &op->res.n_claims, &op->res.refused,
			    &op->res.n_refused);
}

/* The bounds a claim enforces on the server (scripts.lua, bounds_of): max_body, the
 * longest checkpoint this worker can resume, max_n. */
static void args_bounds(struct ro_queue *q, struct args *a)
{
	args_fmt(a, "%u", q->o.bounds.max_body);
	args_fmt(a, "%zu", ro_progress_max_bytes(q->o.bounds.max_new_tokens));
	args_fmt(a, "%u", q->o.bounds.max_n);
}

static void args_claim(struct ro_queue *q, struct args *a, uint32_t k, uint32_t lease_ms)
{
	fcall_start(q, a, "ro_claim");
	args_str(a, q->worker);
	args_fmt(a, "%u", k);
	args_fmt(a, "%u", lease_ms);
	/* the request id makes a retried claim return what the lost one took: sent again by
	 * the connection after a reconnect, and by the next claim after one that was never
	 * answered */
	a->reqid = q->claim_unsure;
	while (!a->reqid)
		a->reqid = rng_next(q);
	args_fmt(a, "%016llx", (unsigned long long)a->reqid);
	args_fmt(a, "%u", q->o.max_attempts);
	args_fmt(a, "%u", q->o.worker_ttl_ms);
	args_bounds(q, a);
}

uint64_t ro_queue_claim_unsure(const struct ro_queue *q)
{
	return q->claim_unsure;
}

int ro_queue_claim_async(struct ro_queue *q, uint32_t k, uint32_t lease_ms,
			 const struct ro_queue_cb *cb)
{
	struct args a = {0};
	int r;

	args_claim(q, &a, k, lease_ms);
	r = submit(q, &a, parse_claims_op, 0, cb, NULL);
	args_clear(&a);
	return r;
}

/* The synchronous faces take what the result holds. */
static int take_claims(struct ro_queue_result *res, int r, struct ro_claim **ret,
		       size_t *ret_count)
{
	if (r >= 0) {
		*ret = res->claims;
		*ret_count = res->n_claims;
		res->claims = NULL;
		res->n_claims = 0;
	}
	result_clear(res);
	return r;
}

int ro_queue_claim(struct ro_queue *q, uint32_t k, uint32_t lease_ms, struct ro_claim **ret,
		   size_t *ret_count)
{
	struct ro_queue_result res = {0};
	struct args a = {0};

	*ret = NULL;
	*ret_count = 0;
	args_claim(q, &a, k, lease_ms);
	return take_claims(&res, run(q, &a, parse_claims_op, 0, &res), ret, ret_count);
}

int ro_queue_held_async(struct ro_queue *q, const struct ro_queue_cb *cb)
{
	struct args a = {0};
	int r;

	fcall_start(q, &a, "ro_held");
	args_str(&a, q->worker);
	args_bounds(q, &a);
	r = submit(q, &a, parse_claims_op, 0, cb, NULL);
	args_clear(&a);
	return r;
}

int ro_queue_held(struct ro_queue *q, struct ro_claim **ret, size_t *ret_count)
{
	struct ro_queue_result res = {0};
	struct args a = {0};

	*ret = NULL;
	*ret_count = 0;
	fcall_start(q, &a, "ro_held");
	args_str(&a, q->worker);
	args_bounds(q, &a);
	return take_claims(&res, run(q, &a, parse_claims_op, 0, &res), ret, ret_count);
}

static int parse_renew(struct op *op, redisReply *rep)
{
	if (rep->type != REDIS_REPLY_ARRAY || rep->elements != op->count)
		return bad_reply(op->q, rep, "renew");
	op->res.ok = calloc(op->count + 1, sizeof(*op->res.ok));
	if (!op->res.ok) {
		freeReplyObject(rep);
		return -ENOMEM;
	}
	for (size_t i = 0; i < op->count; i++)
		op->res.ok[i] = rep->element[i]->integer == 1;
	freeReplyObject(rep);
	return 0;
}

static void args_renew(struct ro_queue *q, struct args *a, const struct ro_claim *const *c,
		       size_t count, uint32_t lease_ms)
{
	fcall_start(q, a, "ro_renew");
	args_str(a, q->worker);
	args_fmt(a, "%u", lease_ms);
	args_fmt(a, "%u", q->o.worker_ttl_ms);
	for (size_t i = 0; i < count; i++) {
		args_str(a, c[i]->id);
		args_str(a, c[i]->token);
	}
}

int ro_queue_renew_async(struct ro_queue *q, const struct ro_claim *const *c, size_t count,
			 uint32_t lease_ms, const struct ro_queue_cb *cb)
{
	struct args a = {0};
	int r;

	args_renew(q, &a, c, count, lease_ms);
	r = submit(q, &a, parse_renew, count, cb, NULL);
	args_clear(&a);
	return r;
}

int ro_queue_renew(struct ro_queue *q, const struct ro_claim *const *c, size_t count,
		   uint32_t lease_ms, bool *ret_ok)
{
	struct ro_queue_result res = {0};
	struct args a = {0};
	int r;

	args_renew(q, &a, c, count, lease_ms);
	r = run(q, &a, parse_renew, count, &res);
	if (!r)
		memcpy(ret_ok, res.ok, count * sizeof(*ret_ok));
	result_clear(&res);
	return r;
}

static int parse_publish(struct op *op, redisReply *rep)
{
	if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 1 + 2 * op->count ||
	    !is_str(rep->element[0]))
		return bad_reply(op->q, rep, "publish");
	op->res.ids = calloc(op->count + 1, sizeof(*op->res.ids));
	if (!op->res.ids) {
		freeReplyObject(rep);
		return -ENOMEM;
	}
	for (size_t i = 0; i < op->count; i++)
		(void)snprintf(op->res.ids[i], 24, "%s",
			       is_str(rep->element[1 + 2 * i]) ? rep->element[1 + 2 * i]->str : "");
	op->res.completed = rep->element[0]->len > 0;
	freeReplyObject(rep);
	return 0;
}

static void args_publish(struct ro_queue *q, struct args *a, const struct ro_claim *c,
			 const struct ro_sample *s, size_t count, bool complete)
{
	fcall_start(q, a, "ro_publish");
	args_str(a, c->id);
	args_str(a, c->token);
	args_str(a, complete ? "1" : "0");
	for (size_t i = 0; i < count; i++) {
		const struct ro_sample *x = &s[i];
		bool meta = c->meta && c->meta[0];

		args_fmt(a, "%u", x->idx);
		args_str(a, meta ? "12" : "11");
		args_str(a, "unit");
		args_str(a, c->id);
		args_str(a, "idx");
		args_fmt(a, "%u", x->idx);
		args_str(a, "worker");
		args_str(a, q->worker);
		args_str(a, "attempt");
		args_fmt(a, "%u", c->attempt);
		args_str(a, "tokens");
		args_take(a, ro_json_ints(x->tokens, x->len));
		args_str(a, "logprobs");
		args_take(a, ro_json_floats(x->logprobs, x->len));
		args_str(a, "finish");
		args_str(a, x->finish ? x->finish : "length");
		args_str(a, "policy_version");
		args_fmt(a, "%lld", (long long)x->policy_version);
		args_str(a, "resumed_from");
		args_fmt(a, "%u", x->resumed_from);
		args_str(a, "policy_versions");
		args_take(a, ro_json_pv(x->pv, x->n_pv, x->len, x->policy_version));
		args_str(a, "gen_ms");
		args_fmt(a, "%llu", (unsigned long long)x->gen_ms);
		if (meta) {
			args_str(a, "meta");
			args_str(a, c->meta);
		}
	}
}

int ro_queue_publish_async(struct ro_queue *q, const struct ro_claim *c, const struct ro_sample *s,
			   size_t count, bool complete, const struct ro_queue_cb *cb)
{
	struct args a = {0};
	int r;

	args_publish(q, &a, c, s, count, complete);
	r = submit(q, &a, parse_publish, count, cb, NULL);
	args_clear(&a);
	return r;
}

int ro_queue_publish(struct ro_queue *q, const struct ro_claim *c, const struct ro_sample *s,
		     size_t count, bool complete, char (*ret_ids)[24], bool *ret_completed)
{
	struct ro_queue_result res = {0};
	struct args a = {0};
	int r;

	args_publish(q, &a, c, s, count, complete);
	r = run(q, &a, parse_publish, count, &res);
	if (!r) {
		if (ret_ids)
			memcpy(ret_ids, res.ids, count * sizeof(*ret_ids));
		if (ret_completed)
			*ret_completed = res.completed;
	}
	result_clear(&res);
	return r;
}

static void args_progress(struct args *a, const struct ro_progress *p, size_t count)
{
	for (size_t i = 0; i < count; i++) {
		args_fmt(a, "%u", p[i].idx);
		args_take(a, ro_progress_encode(&p[i]));
	}
}

static int parse_int(struct op *op, redisReply *rep)
{
	int r = rep->type == REDIS_REPLY_INTEGER ? 0 : -EPROTO;

	op->res.value = rep->type == REDIS_REPLY_INTEGER ? rep->integer : 0;
	freeReplyObject(rep);
	return r < 0 ? fail(op->q, r, "unexpected reply") : 0;
}

static int parse_str(struct op *op, redisReply *rep)
{
	if (!is_str(rep))
		return bad_reply(op->q, rep, "the call");
	op->res.ids = calloc(1, sizeof(*op->res.ids));
	if (op->res.ids)
		(void)snprintf(op->res.ids[0], 24, "%s", rep->str);
	freeReplyObject(rep);
	return op->res.ids ? 0 : -ENOMEM;
}

static int parse_any(struct op *op, redisReply *rep)
{
	(void)op;
	freeReplyObject(rep);
	return 0;
}

/* id, token, then extra (if any) and the progress pairs: the shape of every holder's write */
static void args_holder(struct ro_queue *q, struct args *a, const char *fn,
			const struct ro_claim *c, const char *extra, const struct ro_progress *p,
			size_t count)
{
	fcall_start(q, a, fn);
	args_str(a, c->id);
	args_str(a, c->token);
	if (extra)
		args_str(a, extra);
	args_progress(a, p, count);
}

static int holder_async(struct ro_queue *q, const char *fn, const struct ro_claim *c,
			const char *extra, const struct ro_progress *p, size_t count,
			int (*parse)(struct op *, redisReply *), const struct ro_queue_cb *cb)
{
	struct args a = {0};
	int r;

	args_holder(q, &a, fn, c, extra, p, count);
	r = submit(q, &a, parse, 0, cb, NULL);
	args_clear(&a);
	return r;
}

static int holder_sync(struct ro_queue *q, const char *fn, const struct ro_claim *c,
		       const char *extra, const struct ro_progress *p, size_t count,
		       int (*parse)(struct op *, redisReply *), struct ro_queue_result *res)
{
	struct args a = {0};

	args_holder(q, &a, fn, c, extra, p, count);
	return run(q, &a, parse, 0, res);
}

int ro_queue_checkpoint_async(struct ro_queue *q, const struct ro_claim *c,
			      const struct ro_progress *p, size_t count, const struct ro_queue_cb *cb)
{
	return holder_async(q, "ro_checkpoint", c, NULL, p, count, parse_int, cb);
}

int ro_queue_checkpoint(struct ro_queue *q, const struct ro_claim *c, const struct ro_progress *p,
			size_t count)
{
	struct ro_queue_result res = {0};
	int r = holder_sync(q, "ro_checkpoint", c, NULL, p, count, parse_int, &res);

	if (!r)
		r = (int)res.value;
	result_clear(&res);
	return r;
}

int ro_queue_complete_async(struct ro_queue *q, const struct ro_claim *c,
			    const struct ro_queue_cb *cb)
{
	return holder_async(q, "ro_complete", c, NULL, NULL, 0, parse_str, cb);
}

int ro_queue_complete(struct ro_queue *q, const struct ro_claim *c, char ret_group_id[24])
{
	struct ro_queue_result res = {0};
	int r = holder_sync(q, "ro_complete", c, NULL, NULL, 0, parse_str, &res);

	if (!r && ret_group_id)
		(void)snprintf(ret_group_id, 24, "%s", res.ids[0]);
	result_clear(&res);
	return r;
}

int ro_queue_requeue_async(struct ro_queue *q, const struct ro_claim *c,
			   const struct ro_progress *p, size_t count, const struct ro_queue_cb *cb)
{
	return holder_async(q, "ro_requeue", c, NULL, p, count, parse_any, cb);
}

int ro_queue_requeue(struct ro_queue *q, const struct ro_claim *c, const struct ro_progress *p,
		     size_t count)
{
	struct ro_queue_result res = {0};
	int r = holder_sync(q, "ro_requeue", c, NULL, p, count, parse_any, &res);

	result_clear(&res);
	return r;
}

int ro_queue_release_async(struct ro_queue *q, const struct ro_claim *c,
			   const struct ro_queue_cb *cb)
{
	return holder_async(q, "ro_release", c, NULL, NULL, 0, parse_any, cb);
}

int ro_queue_release(struct ro_queue *q, const struct ro_claim *c)
{
	struct ro_queue_result res = {0};
	int r = holder_sync(q, "ro_release", c, NULL, NULL, 0, parse_any, &res);

	result_clear(&res);
	return r;
}

int ro_queue_dead_letter_async(struct ro_queue *q, const struct ro_claim *c, const char *reason,
			       const struct ro_queue_cb *cb)
{
	return holder_async(q, "ro_dead_letter", c, reason, NULL, 0, parse_any, cb);
}

int ro_queue_dead_letter(struct ro_queue *q, const struct ro_claim *c, const char *reason)
{
	struct ro_queue_result res = {0};
	int r = holder_sync(q, "ro_dead_letter", c, reason, NULL, 0, parse_any, &res);

	result_clear(&res);
	return r;
}

/* The failure's reason and the attempt limit travel as one argument ("<max>:<reason>"),
 * so the holder's argument shape stays id, token, extra, progress. */
static char *fail_extra(const struct ro_queue *q, const char *reason)
{
	char *s = NULL;

	if (asprintf(&s, "%u:%s", q->o.max_attempts, reason ? reason : "") < 0)
		return NULL;
	return s;
}

int ro_queue_fail_async(struct ro_queue *q, const struct ro_claim *c, const char *reason,
			const struct ro_progress *p, size_t count, const struct ro_queue_cb *cb)
{
	char *x = fail_extra(q, reason);
	int r = x ? holder_async(q, "ro_fail", c, x, p, count, parse_int, cb) : -ENOMEM;

	free(x);
	return r;
}

int ro_queue_fail(struct ro_queue *q, const struct ro_claim *c, const char *reason,
		  const struct ro_progress *p, size_t count)
{
	struct ro_queue_result res = {0};
	char *x = fail_extra(q, reason);
	int r = x ? holder_sync(q, "ro_fail", c, x, p, count, parse_int, &res) : -ENOMEM;

	free(x);
	if (!r)
		r = (int)res.value;
	result_clear(&res);
	return r;
}

int ro_queue_reap(struct ro_queue *q, uint32_t *ret_requeued, uint32_t *ret_dead)
{
	uint32_t req = 0, dead = 0;
	int r = 0;

	/* in slices of 256 so a mass expiry never blocks the server for long */
	for (int round = 0; round < 4096; round++) {
		struct args a = {0};
		redisReply *rep = NULL;

		fcall_start(q, &a, "ro_reap");
		args_fmt(&a, "%u", q->o.max_attempts);
		args_str(&a, "256");
		r = call(q, &a, &rep);
		args_clear(&a);
		if (r)
			break;
		if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 2)
			return bad_reply(q, rep, "reap");
		req += (uint32_t)rep->element[0]->integer;
		dead += (uint32_t)rep->element[1]->integer;
		if (rep->element[0]->integer + rep->element[1]->integer == 0) {
			freeReplyObject(rep);
			break;
		}
		freeReplyObject(rep);
	}
	if (ret_requeued)
		*ret_requeued = req;
	if (ret_dead)
		*ret_dead = dead;
	return r;
}

void ro_dead_free(struct ro_dead *d, size_t count)
{
	if (!d)
		return;
	for (size_t i = 0; i < count; i++) {
		free(d[i].id);
		free(d[i].reason);
		free(d[i].history);
	}
	free(d);
}

int ro_queue_dead_list(struct ro_queue *q, uint32_t start, uint32_t count, struct ro_dead **ret,
		       size_t *ret_count)
{
	struct args a = {0};
	redisReply *rep = NULL;
	struct ro_dead *d;
	int r;

	*ret = NULL;
	*ret_count = 0;
	fcall_start(q, &a, "ro_dead_list");
	args_fmt(&a, "%u", start);
	args_fmt(&a, "%u", count);
	r = call(q, &a, &rep);
	args_clear(&a);
	if (r)
		return r;
	if (rep->type != REDIS_REPLY_ARRAY)
		return bad_reply(q, rep, "dead list");
	d = calloc(rep->elements + 1, sizeof(*d));
	if (!d) {
		freeReplyObject(rep);
		return -ENOMEM;
	}
	for (size_t i = 0; i < rep->elements; i++) {
		redisReply *e = rep->element[i];

		if (e->type != REDIS_REPLY_ARRAY || e->elements != 4) {
			ro_dead_free(d, i);
			return bad_reply(q, rep, "dead list");
		}
		d[i].id = strdup(e->element[0]->str);
		d[i].reason = strdup(e->element[1]->str);
		d[i].attempt = (uint32_t)strtoul(e->element[2]->str, NULL, 10);
		d[i].history = strdup(e->element[3]->str);
	}
	*ret = d;
	*ret_count = rep->elements;
	freeReplyObject(rep);
	return (int)*ret_count;
}

int ro_queue_dead_retry(struct ro_queue *q, const char *id)
{
	struct args a = {0};
	redisReply *rep = NULL;
	int r;

	fcall_start(q, &a, "ro_dead_retry");
	args_str(&a, id);
	r = call(q, &a, &rep);
	args_clear(&a);
	if (!r)
		freeReplyObject(rep);
	return r;
}

int ro_queue_unit_info(struct ro_queue *q, const char *id, char **ret_json)
{
	struct args a = {0};
	redisReply *rep = NULL;
	int r;

	*ret_json = NULL;
	if (!ro_unit_id_valid(id))
		return fail(q, -EINVAL, "\"%.64s\" is not a unit id ([A-Za-z0-9._:-]{1,128})", id);
	fcall_start(q, &a, "ro_unit_info");
	args_str(&a, id);
	r = call(q, &a, &rep);
	args_clear(&a);
	if (r)
		return r;
	if (rep->type != REDIS_REPLY_STRING)
		return bad_reply(q, rep, "unit info");
	*ret_json = strdup(rep->str);
	freeReplyObject(rep);
	return *ret_json ? 0 : -ENOMEM;
}

/* ---- the queues under a prefix ---------------------------------------------------- */

#define LIST_MAX_QUEUES 100000
#define LIST_MAX_ROUNDS 100000

static bool queue_name_char(char ch)
{
	return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
	       ch == '.' || ch == '_' || ch == '-' || ch == ':';
}

/* a sorted set of names, bounded */
static int names_add(char ***v, size_t *n, const char *s, size_t len)
{
	size_t lo = 0, hi = *n;
	char **nv, *d;

	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		int c = strncmp((*v)[mid], s, len);

		if (c == 0 && (*v)[mid][len] == '\0')
			return 0;
		if (c < 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (*n >= LIST_MAX_QUEUES)
		return -E2BIG;
	nv = realloc(*v, (*n + 1) * sizeof(*nv));
	if (!nv)
		return -ENOMEM;
	*v = nv;
	d = strndup(s, len);
	if (!d)
		return -ENOMEM;
	memmove(nv + lo + 1, nv + lo, (*n - lo) * sizeof(*nv));
	nv[lo] = d;
	(*n)++;
	return 0;
}

/* SCAN the node q's commands go to for "<prefix>:{NAME}:*" keys. */
static int scan_node(struct ro_queue *q, const char *prefix, char ***v, size_t *n)
{
	char pat[160], cursor[32] = "0";
	size_t pl = strlen(prefix);
	int r = 0;

	(void)snprintf(pat, sizeof(pat), "%s:{*}:*", prefix);
	for (int round = 0; round < LIST_MAX_ROUNDS; round++) {
		struct args a = {0};
		redisReply *rep = NULL, *keys;

		args_str(&a, "SCAN");
		args_str(&a, cursor);
		args_str(&a, "MATCH");
		args_str(&a, pat);
		args_str(&a, "COUNT");
		args_str(&a, "1000");
		r = call(q, &a, &rep);
		args_clear(&a);
		if (r)
			return r;
		if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 2 ||
		    rep->element[0]->type != REDIS_REPLY_STRING ||
		    rep->element[0]->len >= sizeof(cursor) ||
		    rep->element[1]->type != REDIS_REPLY_ARRAY)
			return bad_reply(q, rep, "SCAN");
		keys = rep->element[1];
		for (size_t i = 0; i < keys->elements && !r; i++) {
			const char *k = keys->element[i]->str, *name, *end;

			if (keys->element[i]->type != REDIS_REPLY_STRING || !k ||
			    strncmp(k, prefix, pl) || strncmp(k + pl, ":{", 2))
				continue;
			name = k + pl + 2;
			for (end = name; *end && *end != '}' && queue_name_char(*end); end++)
				;
			if (end > name && end - name <= 128 && end[0] == '}' && end[1] == ':')
				r = names_add(v, n, name, (size_t)(end - name));
		}
		memcpy(cursor, rep->element[0]->str, rep->element[0]->len + 1);
		freeReplyObject(rep);
		if (r || !strcmp(cursor, "0"))
			return r;
	}
	return fail(q, -ETIMEDOUT, "SCAN did not end within %d rounds", LIST_MAX_ROUNDS);
}

/* A Cluster keeps each queue on its slot's node: scan every primary. The queue's own
 * connection (same URL, credentials, TLS) reaches a node through the slot of the queue
 * name it is opened for, so each node is reached as a queue name that hashes into one of
 * its slots (a name, not a key: nothing is written). */
static int scan_cluster(struct ro_queue *q, const struct ro_queue_opts *qo, const char *prefix,
			char ***v, size_t *n)
{
	struct args a = {0};
	redisReply *rep = NULL;
	char seen[64][160];
	size_t nseen = 0;
	int r;

	args_str(&a, "CLUSTER");
	args_str(&a, "SLOTS");
	r = call(q, &a, &rep);
	args_clear(&a);
	if (r)
		return r;
	if (rep->type != REDIS_REPLY_ARRAY)
		return bad_reply(q, rep, "CLUSTER SLOTS");
	for (size_t i = 0; i < rep->elements && !r; i++) {
		redisReply *e = rep->element[i], *m;
		struct ro_queue_opts o = *qo;
		struct ro_queue *nq = NULL;
		char node[160], probe[32];
		bool dup = false;
		long long lo, hi;

		if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
		    e->element[0]->type != REDIS_REPLY_INTEGER ||
		    e->element[1]->type != REDIS_REPLY_INTEGER ||
		    e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
		    e->element[2]->element[0]->type != REDIS_REPLY_STRING)
			continue;
		lo = e->element[0]->integer;
		hi = e->element[1]->integer;
		m = e->element[2];
		(void)snprintf(node, sizeof(node), "%s:%lld", m->element[0]->str,
			       m->element[1]->integer);
		for (size_t j = 0; j < nseen; j++)
			dup = dup || !strcmp(seen[j], node);
		if (dup || nseen == 64)
			continue;
		(void)snprintf(seen[nseen++], sizeof(seen[0]), "%s", node);
		probe[0] = '\0';
		for (unsigned k = 0; k < 1000000 && !probe[0]; k++) {
			char t[32];
			unsigned sl;

			(void)snprintf(t, sizeof(t), "list-%u", k);
			sl = ro_key_slot(t, strlen(t));
			if ((long long)sl >= lo && (long long)sl <= hi)
				memcpy(probe, t, sizeof(t));
		}
		if (!probe[0])
			continue;
		o.queue = probe;
		r = ro_queue_new(&o, &nq);
		if (!r)
			r = scan_node(nq, prefix, v, n);
		if (r && nq)
			(void)snprintf(q->err, sizeof(q->err), "node %.80s: %.160s", node, nq->err);
		(void)ro_queue_free(nq);
	}
	freeReplyObject(rep);
	return r;
}

int ro_queue_list_queues(const struct ro_queue_opts *o, char ***ret, size_t *ret_count,
			 char *err, size_t errlen)
{
	const char *prefix = o->prefix && *o->prefix ? o->prefix : "ro";
	struct ro_queue *q = NULL;
	char **v = NULL;
	size_t n = 0;
	int r = ro_queue_new(o, &q);

	if (r) {
		(void)snprintf(err, errlen, "%s", ro_queue_errmsg(NULL));
		return r;
	}
	r = scan_node(q, prefix, &v, &n);
	if (!r && !strcmp(ro_queue_mode(q), "cluster"))
		r = scan_cluster(q, o, prefix, &v, &n);
	if (r) {
		(void)snprintf(err, errlen, "%s", q->err[0] ? q->err : strerror(-r));
		for (size_t i = 0; i < n; i++)
			free(v[i]);
		free(v);
	} else {
		*ret = v;
		*ret_count = n;
	}
	(void)ro_queue_free(q);
	return r;
}

int ro_queue_dead_purge(struct ro_queue *q)
{
	int total = 0;

	for (;;) {
		struct args a = {0};
		redisReply *rep = NULL;
		int r;
		long long n;

		fcall_start(q, &a, "ro_dead_purge");
		args_str(&a, "512");
		r = call(q, &a, &rep);
		args_clear(&a);
		if (r)
			return r;
		n = rep->type == REDIS_REPLY_INTEGER ? rep->integer : 0;
		freeReplyObject(rep);
		total += (int)n;
		if (n == 0)
			return total;
	}
}

static void args_heartbeat(struct ro_queue *q, struct args *a, const char *const *kv, size_t n_kv)
{
	fcall_start(q, a, "ro_heartbeat");
	args_str(a, q->worker);
	args_fmt(a, "%u", q->o.worker_ttl_ms);
	for (size_t i = 0; i + 1 < n_kv; i += 2) {
		args_str(a, kv[i]);
		args_str(a, kv[i + 1]);
	}
}

int ro_queue_heartbeat_async(struct ro_queue *q, const char *const *kv, size_t n_kv,
			     const struct ro_queue_cb *cb)
{
	struct args a = {0};
	int r;

	args_heartbeat(q, &a, kv, n_kv);
	r = submit(q, &a, parse_any, 0, cb, NULL);
	args_clear(&a);
	return r;
}

int ro_queue_heartbeat(struct ro_queue *q, const char *const *kv, size_t n_kv)
{
	struct ro_queue_result res = {0};
	struct args a = {0};
	int r;

	args_heartbeat(q, &a, kv, n_kv);
	r = run(q, &a, parse_any, 0, &res);
	result_clear(&res);
	return r;
}

static int parse_woken(struct op *op, redisReply *rep)
{
	op->res.woken = rep->type == REDIS_REPLY_ARRAY;
	freeReplyObject(rep);
	return 0;
}

static uint32_t wait_ms(uint32_t timeout_ms)
{
	/* the server's own wait stays well inside the budget the caller gave it */
	return timeout_ms > 60000 ? 60000 : timeout_ms ? timeout_ms : 1;
}

static void args_wait(struct ro_queue *q, struct args *a, uint32_t timeout_ms)
{
	char key[300];

	timeout_ms = wait_ms(timeout_ms);
	args_str(a, "BLPOP");
	args_fmt(a, "%s", ro_queue_key(q, "marker", key, sizeof(key)));
	args_fmt(a, "%.3f", timeout_ms / 1000.0);
}

int ro_queue_wait_async(struct ro_queue *q, uint32_t timeout_ms, const struct ro_queue_cb *cb)
{
	struct args a = {0};
	int r;

	args_wait(q, &a, timeout_ms);
	/* the reply may take the whole wait: the connection allows for it */
	r = submit_blocking(q, &a, parse_woken, 0, wait_ms(timeout_ms), cb, NULL);
	args_clear(&a);
	return r;
}

int ro_queue_wait(struct ro_queue *q, uint32_t timeout_ms, bool *ret_woken)
{
	struct ro_queue_result res = {0};
	struct args a = {0};
	int r;

	args_wait(q, &a, timeout_ms);
	r = run_blocking(q, &a, parse_woken, wait_ms(timeout_ms), &res);
	if (!r)
		*ret_woken = res.woken;
	result_clear(&res);
	return r;
}

static int cmd(struct ro_queue *q, redisReply **ret, int argc, const char **argv)
{
	struct args a = {0};
	int r;

	for (int i = 0; i < argc; i++)
		args_str(&a, argv[i]);
	r = call(q, &a, ret);
	args_clear(&a);
	return r;
}

static long long cmd_int(struct ro_queue *q, int *r, int argc, const char **argv)
{
	redisReply *rep = NULL;
	long long v = 0;

	if (*r)
		return 0;
	*r = cmd(q, &rep, argc, argv);
	if (*r)
		return 0;
	if (rep->type == REDIS_REPLY_INTEGER)
		v = rep->integer;
	else if (rep->type == REDIS_REPLY_STRING)
		v = strtoll(rep->str, NULL, 10);
	freeReplyObject(rep);
	return v;
}

static const redisReply *kv_get(const redisReply *h, const char *k)
{
	for (size_t i = 0; i + 1 < h->elements; i += 2) {
		if (is_str(h->element[i]) && !strcmp(h->element[i]->str, k))
			return h->element[i + 1];
	}
	return NULL;
}

/* XLEN, then XINFO GROUPS: one operation of two pipelined commands. */
static int parse_backlog(struct op *op, redisReply *rep)
{
	if (op->stages == 2) { /* XLEN */
		if (rep->type != REDIS_REPLY_INTEGER)
			return bad_reply(op->q, rep, "XLEN");
		op->res.len = rep->integer;
		op->res.lag = -1;
		freeReplyObject(rep);
		return 0;
	}
	if (rep->type == REDIS_REPLY_ARRAY) {
		for (size_t i = 0; i < rep->elements; i++) {
			const redisReply *g = rep->element[i], *name = kv_get(g, "name"),
					 *l = kv_get(g, "lag");
			int64_t v;

			if (op->group && (!name || !is_str(name) || strcmp(name->str, op->group)))
				continue;
			/* Redis reports no lag when it cannot tell (after XDEL): count all */
			v = l && l->type == REDIS_REPLY_INTEGER ? l->integer : op->res.len;
			if (v > op->res.lag)
				op->res.lag = v;
		}
	} /* an error: no stream yet */
	if (op->res.lag < 0)
		op->res.lag = op->res.len;
	freeReplyObject(rep);
	return 0;
}

int ro_queue_backlog_async(struct ro_queue *q, const char *group, const struct ro_queue_cb *cb)
{
	char key[300];
	struct args a = {0}, b = {0};
	struct op *op = NULL;
	int r;

	ro_queue_key(q, "samples", key, sizeof(key));
	args_str(&a, "XLEN");
	args_str(&a, key);
	args_str(&b, "XINFO");
	args_str(&b, "GROUPS");
	args_str(&b, key);
	r = submit(q, &a, parse_backlog, 0, cb, &op);
	if (!r) {
		op->stages = 2;
		op->parse_errors = true;
		op->group = group ? strdup(group) : NULL;
		r = ro_conn_send(q->conn, (int)b.n, b.v, b.len,
				 mono_ms() + (cb->timeout_ms ? cb->timeout_ms : q->o.retry_ms), 0, 0,
				 0, op_reply, op);
		if (r) /* the first reply then ends the operation */
			op->stages = 1;
	}
	args_clear(&a);
	args_clear(&b);
	return r;
}

int ro_queue_backlog(struct ro_queue *q, const char *group, int64_t *ret_len, int64_t *ret_lag)
{
	struct waiter w = {.q = q};
	struct ro_queue_cb cb = {waiter_done, &w, q->o.retry_ms};
	int r = ro_queue_backlog_async(q, group, &cb);

	if (r)
		return r;
	r = await(q, &w);
	if (!r) {
		*ret_len = w.res.len;
		*ret_lag = w.res.lag;
	}
	result_clear(&w.res);
	return r;
}

void ro_queue_stats_clear(struct ro_queue_stats *s)
{
	for (uint32_t i = 0; i < s->n_workers; i++) {
		free(s->workers[i].id);
		free(s->workers[i].fields);
	}
	free(s->workers);
	for (uint32_t i = 0; i < s->n_warnings; i++)
		free(s->warnings[i]);
	free(s->warnings);
	memset(s, 0, sizeof(*s));
}

__attribute__((format(printf, 2, 3))) static int stats_warn(struct ro_queue_stats *s,
							    const char *fmt, ...)
{
	char **w = realloc(s->warnings, (s->n_warnings + 1) * sizeof(*w));
	va_list ap;
	int n;

	if (!w)
		return -ENOMEM;
	s->warnings = w;
	va_start(ap, fmt);
	n = vasprintf(&w[s->n_warnings], fmt, ap);
	va_end(ap);
	if (n < 0)
		return -ENOMEM;
	s->n_warnings++;
	return 0;
}

/* Status reads each key on its own: anyone with write access can put anything there, and
 * one key of another type than the schema's (or a value too long to read) must not hide
 * the rest. Such a key (a suffix of the prefix) is said in s->warnings and skipped; a
 * failure of the connection (r not one of those) is everyone's, and returned. */
static int skip_key(struct ro_queue *q, struct ro_queue_stats *s, int r, const char *suffix,
		    const char *want)
{
	char key[600], type[32] = "";
	char msg[sizeof(q->err)];
	redisReply *t = NULL;

	if (r != -EPROTO && r != -EMSGSIZE)
		return r;
	(void)snprintf(msg, sizeof(msg), "%s", q->err);
	if (r == -EMSGSIZE)
		return stats_warn(s, "%s: a value too long to read, skipped", suffix);
	(void)snprintf(key, sizeof(key), "%s%s", q->prefix, suffix);
	if (!cmd(q, &t, 2, (const char *[]){"TYPE", key})) {
		if (is_str(t))
			(void)snprintf(type, sizeof(type), "%s", t->str);
		freeReplyObject(t);
	}
	if (type[0] && strcmp(type, want))
		return stats_warn(s, "%s: not a %s (%s), skipped", suffix, want, type);
	return stats_warn(s, "%s: %s, skipped", suffix, msg);
}

/* One count of the status from argv (argv[1] the key), or 0 with the key skipped. */
static int64_t stat_int(struct ro_queue *q, struct ro_queue_stats *s, int *r, const char *want,
			int argc, const char **argv)
{
	int e = 0;
	int64_t v;

	if (*r)
		return 0;
	v = cmd_int(q, &e, argc, argv);
	if (!e)
		return v;
	*r = skip_key(q, s, e, argv[1] + strlen(q->prefix), want);
	return 0;
}

static int stats_workers(struct ro_queue *q, struct ro_queue_stats *s)
{
	char key[300], wkey[600];
	const char *argv[5] = {"ZRANGE", ro_queue_key(q, "workers", key, sizeof(key)), "0", "-1",
			       "WITHSCORES"};
	redisReply *rep = NULL, *t = NULL;
	int64_t now;
	int r;

	r = cmd(q, &t, 1, (const char *[]){"TIME"});
	if (r)
		return r;
	now = strtoll(t->element[0]->str, NULL, 10) * 1000 +
	      strtoll(t->element[1]->str, NULL, 10) / 1000;
	freeReplyObject(t);
	r = cmd(q, &rep, 5, argv);
	if (r)
		return skip_key(q, s, r, "workers", "zset");
	s->workers = calloc(rep->elements / 2 + 1, sizeof(*s->workers));
	if (!s->workers) {
		freeReplyObject(rep);
		return -ENOMEM;
	}
	for (size_t i = 0; i + 1 < rep->elements && !r; i += 2) {
		redisReply *h = NULL;
		struct json_object *o;
		const char *hargv[2] = {"HGETALL", wkey};

		(void)snprintf(wkey, sizeof(wkey), "%sworker:%s", q->prefix, rep->element[i]->str);
		r = cmd(q, &h, 2, hargv);
		if (r) {
			r = skip_key(q, s, r, wkey + strlen(q->prefix), "hash");
			continue;
		}
		if (h->elements == 0) { /* heartbeat expired: the worker is gone */
			freeReplyObject(h);
			continue;
		}
		o = json_object_new_object();
		for (size_t j = 0; j + 1 < h->elements; j += 2) {
			const char *k = h->element[j]->str;

			/* a worker's claim memory, kept here by libraries before 2026-12-07
			 * (now in claim:<id>): a heartbeat hash written then keeps it */
			if (!strncmp(k, "claim_", 6))
				continue;
			json_object_object_add(o, k,
					       json_object_new_string(h->element[j + 1]->str));
		}
		s->workers[s->n_workers].id = strdup(rep->element[i]->str);
		s->workers[s->n_workers].age_ms = now - strtoll(rep->element[i + 1]->str, NULL, 10);
		s->workers[s->n_workers].fields =
		    strdup(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN));
		s->n_workers++;
		json_object_put(o);
		freeReplyObject(h);
	}
	freeReplyObject(rep);
	return r;
}

int ro_queue_policy_version(struct ro_queue *q, int64_t *ret)
{
	char k[300];
	int r = 0;
	int64_t v = cmd_int(
	    q, &r, 3, (const char *[]){"HGET", ro_queue_key(q, "policy", k, sizeof(k)), "version"});

	if (!r)
		*ret = v;
	return r;
}

int ro_queue_stats(struct ro_queue *q, struct ro_queue_stats *s)
{
	char k[6][300];
	int r = 0;

	memset(s, 0, sizeof(*s));
	s->pending = stat_int(
	    q, s, &r, "list", 2,
	    (const char *[]){"LLEN", ro_queue_key(q, "pending", k[0], sizeof(k[0]))});
	s->leased = stat_int(
	    q, s, &r, "zset", 2,
	    (const char *[]){"ZCARD", ro_queue_key(q, "leases", k[1], sizeof(k[1]))});
	s->done = stat_int(
	    q, s, &r, "hash", 3,
	    (const char *[]){"HGET", ro_queue_key(q, "stats", k[2], sizeof(k[2])), "done"});
	s->dead = stat_int(q, s, &r, "list", 2,
			   (const char *[]){"LLEN", ro_queue_key(q, "dead", k[3], sizeof(k[3]))});
	s->groups = stat_int(
	    q, s, &r, "stream", 2,
	    (const char *[]){"XLEN", ro_queue_key(q, "groups", k[4], sizeof(k[4]))});
	if (!r && (r = ro_queue_backlog(q, NULL, &s->samples, &s->lag)))
		r = skip_key(q, s, r, "samples", "stream");
	if (r) {
		ro_queue_stats_clear(s);
		return r;
	}
	{
		redisReply *rep = NULL;

		r = cmd(q, &rep, 3,
			(const char *[]){"XINFO", "GROUPS",
					 ro_queue_key(q, "samples", k[5], sizeof(k[5]))});
		if (!r) {
			s->n_groups = (uint32_t)rep->elements;
			freeReplyObject(rep);
		}
		r = 0;
	}
	r = stats_workers(q, s);
	if (r)
		ro_queue_stats_clear(s);
	return r;
}

/* One stream entry as a JSON object: fields that hold JSON (tokens, logprobs, meta) are
 * embedded as values, numbers as numbers, the rest as strings. */
static char *entry_json(const redisReply *e)
{
	struct json_object *o = json_object_new_object();
	const redisReply *f = e->element[1];
	char *s;

	json_object_object_add(o, "id", json_object_new_string(e->element[0]->str));
	for (size_t i = 0; i + 1 < f->elements; i += 2) {
		const char *k = f->element[i]->str, *v = f->element[i + 1]->str;
		struct json_object *val = NULL;

		if (!strcmp(k, "tokens") || !strcmp(k, "logprobs") || !strcmp(k, "meta") ||
		    !strcmp(k, "policy_versions"))
			val = json_tokener_parse(v);
		else if (!strcmp(k, "idx") || !strcmp(k, "attempt") ||
			 !strcmp(k, "policy_version") || !strcmp(k, "resumed_from") ||
			 !strcmp(k, "gen_ms") || !strcmp(k, "n"))
			val = json_object_new_int64(strtoll(v, NULL, 10));
		if (!val)
			val = json_object_new_string(v);
		json_object_object_add(o, k, val);
	}
	s = strdup(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN));
	json_object_put(o);
	return s;
}

int ro_queue_read_samples(struct ro_queue *q, char cursor[48], uint32_t count, uint32_t block_ms,
			  void (*emit)(void *arg, const char *json), void *arg)
{
	char key[300], cnt[16], blk[16], from[64];
	redisReply *rep = NULL;
	const redisReply *entries;
	int r, n = 0;

	(void)snprintf(cnt, sizeof(cnt), "%u", count ? count : 100);
	ro_queue_key(q, "samples", key, sizeof(key));
	if (block_ms) {
		if (block_ms + 500 > q->o.timeout_ms)
			block_ms = q->o.timeout_ms > 600 ? q->o.timeout_ms - 500 : 100;
		(void)snprintf(blk, sizeof(blk), "%u", block_ms);
		r = cmd(
		    q, &rep, 8,
		    (const char *[]){"XREAD", "COUNT", cnt, "BLOCK", blk, "STREAMS", key, cursor});
		if (r)
			return r;
		if (rep->type != REDIS_REPLY_ARRAY) { /* nil: nothing new in time */
			freeReplyObject(rep);
			return 0;
		}
		entries = rep->element[0]->element[1];
	} else {
		if (!strcmp(cursor, "$"))
			return 0;
		if (!strcmp(cursor, "0"))
			(void)snprintf(from, sizeof(from), "-");
		else
			(void)snprintf(from, sizeof(from), "(%s", cursor);
		r = cmd(q, &rep, 6, (const char *[]){"XRANGE", key, from, "+", "COUNT", cnt});
		if (r)
			return r;
		entries = rep;
	}
	for (size_t i = 0; i < entries->elements; i++) {
		char *s = entry_json(entries->element[i]);

		if (s) {
			emit(arg, s);
			free(s);
		}
		(void)snprintf(cursor, 48, "%s", entries->element[i]->element[0]->str);
		n++;
	}
	freeReplyObject(rep);
	return n;
}

/* ---- expert-parallel rendezvous ------------------------------------------------------ */

/* Each rank of group publishes its card (its fabric address and region key) as field
 * <rank> of ro:{q}:ep:<group>, then polls until all world fields are there. A card left by
 * a rank that died is overwritten when that rank restarts; until then a peer that read it
 * fails its first group step by timeout and is restarted too, so a group converges. */
int ro_queue_ep_rendezvous(struct ro_queue *q, const char *group, uint32_t rank, uint32_t world,
			   const void *card, size_t len, uint32_t timeout_ms, void **ret_cards,
			   size_t *ret_lens)
{
	char key[256], sub[160], field[16];
	const int64_t deadline = mono_ms() + timeout_ms;
	struct args a = {0};
	redisReply *rep = NULL;
	int r;

	if (!group || !*group || strlen(group) > 120 || rank >= world)
		return fail(q, -EINVAL, "ep rendezvous: group '%s', rank %u of %u", group ? group : "",
			    rank, world);
	(void)snprintf(sub, sizeof(sub), "ep:%s", group);
	ro_queue_key(q, sub, key, sizeof(key));
	(void)snprintf(field, sizeof(field), "%u", rank);
	args_str(&a, "HSET");
	args_str(&a, key);
	args_str(&a, field);
	args_add(&a, card, len);
	r = call(q, &a, &rep);
	args_clear(&a);
	if (r)
		return r;
	freeReplyObject(rep);
	{
		const char *argv[] = {"PEXPIRE", key, "86400000"};

		(void)cmd_int(q, &r, 3, argv);
		if (r)
			return r;
	}
	for (;;) {
		uint32_t have = 0;

		/* the ranks' fields by name: nothing else in the hash is read */
		args_str(&a, "HMGET");
		args_str(&a, key);
		for (uint32_t k = 0; k < world; k++)
			args_fmt(&a, "%u", k);
		r = call(q, &a, &rep);
		args_clear(&a);
		if (r)
			return r;
		memset(ret_cards, 0, world * sizeof(*ret_cards));
		for (size_t k = 0; rep->type == REDIS_REPLY_ARRAY && k < rep->elements && k < world;
		     k++) {
			const redisReply *v = rep->element[k];

			if (!is_str(v))
				continue;
			ret_cards[k] = malloc(v->len ? v->len : 1);
			if (!ret_cards[k]) {
				r = -ENOMEM;
				break;
			}
			memcpy(ret_cards[k], v->str, v->len);
			ret_lens[k] = v->len;
			have++;
		}
		freeReplyObject(rep);
		if (!r && have == world)
			return 0;
		for (uint32_t k = 0; k < world; k++) {
			free(ret_cards[k]);
			ret_cards[k] = NULL;
		}
		if (r)
			return r;
		if (mono_ms() > deadline)
			return fail(q, -ETIMEDOUT,
				    "ep rendezvous: %u of %u ranks of group %s after %u ms", have,
				    world, group, timeout_ms);
		sleep_ms(20);
	}
}

int ro_queue_ep_leave(struct ro_queue *q, const char *group, uint32_t rank)
{
	char key[256], sub[160], field[16];
	const char *argv[] = {"HDEL", key, field};
	int r = 0;

	(void)snprintf(sub, sizeof(sub), "ep:%s", group);
	ro_queue_key(q, sub, key, sizeof(key));
	(void)snprintf(field, sizeof(field), "%u", rank);
	(void)cmd_int(q, &r, 3, argv);
	return r;
}

int ro_queue_init_library(struct ro_queue *q)
{
	struct args a = {0};
	redisReply *rep = NULL;
	int r;

	args_str(&a, "FUNCTION");
	args_str(&a, "LOAD");
	args_str(&a, "REPLACE");
	args_str(&a, ro_queue_scripts_lua);
	r = call(q, &a, &rep);
	args_clear(&a);
	if (r)
		return r;
	freeReplyObject(rep);
	return 1;
}

/* ---- the policy ------------------------------------------------------------------------ */

int ro_queue_policy_publish(struct ro_queue *q, int64_t version, const char *uri,
			    const char *manifest_json, const char *by)
{
	struct args a = {0};
	struct ro_queue_result res = {0};
	int r;

	fcall_start(q, &a, "ro_policy_publish");
	args_fmt(&a, "%lld", (long long)version);
	args_str(&a, uri);
	args_str(&a, manifest_json ? manifest_json : "{\"files\":[]}");
	args_str(&a, by ? by : "");
	r = run(q, &a, parse_int, 0, &res);
	result_clear(&res);
	return r;
}

/* The policy's fields by name (HMGET, not HGETALL: whatever else someone wrote into the
 * hash, however many fields, is never read). */
static const char *const policy_fields[] = {"version", "published_ms", "uri", "manifest", "by"};
#define N_POLICY_FIELDS (sizeof(policy_fields) / sizeof(policy_fields[0]))

static void args_policy(struct ro_queue *q, struct args *a)
{
	char key[300];

	args_str(a, "HMGET");
	args_fmt(a, "%s", ro_queue_key(q, "policy", key, sizeof(key)));
	for (size_t i = 0; i < N_POLICY_FIELDS; i++)
		args_str(a, policy_fields[i]);
}

static int parse_policy(struct op *op, redisReply *rep)
{
	struct ro_policy_info *p = calloc(1, sizeof(*p));
	const redisReply *const *v;

	if (!p || rep->type != REDIS_REPLY_ARRAY || rep->elements != N_POLICY_FIELDS) {
		free(p);
		return bad_reply(op->q, rep, "the policy");
	}
	v = (const redisReply *const *)rep->element;
	if (is_str(v[0]))
		p->version = strtoll(v[0]->str, NULL, 10);
	if (is_str(v[1]))
		p->published_ms = strtoll(v[1]->str, NULL, 10);
	p->uri = is_str(v[2]) ? strdup(v[2]->str) : NULL;
	p->manifest = is_str(v[3]) ? strdup(v[3]->str) : NULL;
	p->by = is_str(v[4]) ? strdup(v[4]->str) : NULL;
	freeReplyObject(rep);
	op->res.policy = p;
	return 0;
}

int ro_queue_policy_get_async(struct ro_queue *q, const struct ro_queue_cb *cb)
{
	struct args a = {0};
	int r;

	args_policy(q, &a);
	r = submit(q, &a, parse_policy, 0, cb, NULL);
	args_clear(&a);
	return r;
}

int ro_queue_policy_get(struct ro_queue *q, struct ro_policy_info *ret)
{
	struct args a = {0};
	struct ro_queue_result res = {0};
	char key[300];
	int r;

	memset(ret, 0, sizeof(*ret));
	args_policy(q, &a);
	r = run(q, &a, parse_policy, 0, &res);
	if (r == -EPROTO) { /* say which key: another type than a hash, say */
		char m[200];

		(void)snprintf(m, sizeof(m), "%.199s", q->err);
		(void)fail(q, r, "%s: %s", ro_queue_key(q, "policy", key, sizeof(key)), m);
	}
	if (!r && res.policy) {
		*ret = *res.policy;
		free(res.policy);
		res.policy = NULL;
	}
	result_clear(&res);
	return r;
}
