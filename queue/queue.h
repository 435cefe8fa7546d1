/* The rolloutd work queue: units of work (prompts) in Redis, claimed under a lease with a
 * fencing token, published sample by sample, checkpointed, requeued and reaped so that
 * nothing is lost and nothing is published twice. This header is the whole face of queue/.
 *
 * Every function returns 0 (or a count) on success and -errno on failure:
 *   -ESTALE  the lease token is not (or no longer) the holder's: nothing was written
 *   -EINVAL  a bad argument or a unit that breaks a bound (reason in the message)
 *   -EEXIST  the unit id exists with a different body
 *   -ENOENT  no such unit
 *   -EBUSY   complete() before every sample was published
 *   -EBADMSG the unit's own record in Redis is inconsistent (BADUNIT): it cannot be run
 *   -EIO / -ETIMEDOUT  Redis unreachable after the retry budget; safe to call again
 * ro_queue_errmsg() gives the human message of the last failure. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct ro_queue;

/* A claim (and a rescan of held units) enforces these on the server, before anything
 * crosses the wire: a unit whose body or meta is over max_body, or whose record has more
 * fields than max_n allows, is dead-lettered there with the reason and never sent; a
 * checkpoint longer than ro_progress_max_bytes(max_new_tokens) is not sent (its sample
 * starts over). The connection refuses any reply value longer than the largest of these
 * plus 8 MiB. */
struct ro_unit_bounds {
	uint32_t max_prompt;	 /* tokens in the prompt */
	uint32_t max_n;		 /* samples per unit */
	uint32_t max_new_tokens; /* generated tokens per sample */
	uint32_t max_body;	 /* bytes of the unit's JSON */
};

/* Defaults: prompt 32768 tokens, n 64, max_new_tokens 32768, body 1 MiB. */
void ro_unit_bounds_default(struct ro_unit_bounds *b);

/* Redis Cluster routing: auto detects a cluster (CLUSTER SLOTS) on the first connect. */
enum ro_redis_cluster { RO_REDIS_CLUSTER_AUTO, RO_REDIS_CLUSTER_YES, RO_REDIS_CLUSTER_NO };

struct ro_queue_opts {
	/* redis://[user[:password]@]host[:port][/db], rediss://... (TLS), unix:///path[?db=N],
	 * redis+sentinel://[user[:password]@]h1[:26379],h2.../MASTER[/db] (rediss+sentinel:
	 * TLS), every part percent-decoded */
	const char *url;
	const char *queue;   /* queue name, the {q} of the key schema */
	const char *prefix;  /* key prefix, default "ro" */
	const char *worker;  /* this client's worker id (claimers only) */
	uint32_t timeout_ms; /* connect and reply timeout of one attempt, default 5000 */
	uint32_t retry_ms;   /* total time one operation keeps reconnecting, default 10000 */
	uint32_t max_attempts;	/* failed leases before a unit is dead-lettered, default 3 */
	uint32_t worker_ttl_ms; /* heartbeat key lifetime, default 30000 */
	struct ro_unit_bounds bounds;
	/* Managed Redis. password beats the URL's; sentinel_password is the sentinels' own. */
	const char *password, *sentinel_password;
	/* TLS: CA file or directory (default: the system store), client cert + key (mTLS),
	 * the name to send (SNI) and verify (default: the host of the URL or the node). */
	const char *tls_ca, *tls_cert, *tls_key, *tls_server_name;
	enum ro_redis_cluster cluster;
	/* WAIT wait_replicas wait_timeout_ms after publish, complete and requeue: they are
	 * only confirmed once that many replicas have them (0: off). */
	uint32_t wait_replicas, wait_timeout_ms;
	/* Test hook: called after a command was written, before its reply is read, with the
	 * name of the function (or command) and the connection's socket. */
	void (*after_send)(void *arg, const char *fn, int fd);
	void *after_send_arg;
};

/* url with its password shown as *** (for logs, --print-config and status). */
void ro_redis_url_redact(const char *url, char *out, size_t len);

/* A unit as enqueued, after validation. Owned by the caller of ro_unit_parse(). */
struct ro_unit {
	char *id;
	char *body; /* normalized JSON */
	char *meta; /* JSON of "meta", or NULL */
	int32_t *prompt;
	uint32_t prompt_len;
	uint32_t n;
	uint32_t max_new_tokens;
	double temperature, top_p;
	uint32_t top_k;
	uint64_t seed;
	int32_t *stop;
	uint32_t stop_len;
	int64_t min_policy_version;
};

/* Which policy made which tokens of a sample: tokens from start on (up to the next
 * segment's start, or the end) came from version. A sample whose weights were swapped
 * while it ran has several. */
struct ro_pv {
	uint32_t start;
	int64_t version;
};
#define RO_MAX_PV 16

/* Progress of an unfinished sample: the generated prefix and where the sampler stands. */
struct ro_progress {
	uint32_t idx;
	uint32_t len;
	int32_t *tokens;
	float *logprobs;
	uint64_t sampler_pos;
	int64_t policy_version;
	/* the prefix's versions ("pvs"); none: all of it policy_version */
	struct ro_pv pv[RO_MAX_PV];
	uint32_t n_pv;
};

/* A unit as claimed. */
struct ro_claim {
	char *id;
	char *body;
	char token[48]; /* "<counter>-<claim request id>" */
	uint32_t attempt;
	uint32_t n;
	uint32_t n_published;
	uint32_t *published_idx; /* indexes already in the samples stream */
	char **published_ids;	 /* their stream entry ids */
	uint32_t n_progress;
	struct ro_progress *progress;
	/* checkpoints left out, over the bound (or unreadable): those samples start over */
	uint32_t n_progress_dropped;
	char *meta; /* the unit's meta JSON ("" when none), copied into each sample */
};

struct ro_sample {
	uint32_t idx;
	const int32_t *tokens;
	const float *logprobs;
	uint32_t len;
	const char *finish; /* "stop" | "length" */
	int64_t policy_version;
	uint32_t resumed_from;
	uint64_t gen_ms;
	/* the "policy_versions" field, [[start, end, version], ...]; none: one segment of
	 * policy_version */
	const struct ro_pv *pv;
	uint32_t n_pv;
};

struct ro_queue_stats {
	int64_t pending, leased, done, dead, samples, groups;
	int64_t lag;	   /* the most behind trainer group's lag, or samples when no group */
	uint32_t n_groups; /* consumer groups on the samples stream */
	uint32_t n_workers;
	struct ro_worker_info {
		char *id;
		int64_t age_ms; /* since its last heartbeat */
		char *fields;	/* its heartbeat hash as a JSON object */
	} * workers;
	/* keys that could not be read (another type than the schema's, a value too long):
	 * each skipped, its count left at 0, and said here ("worker:w1: not a hash (list),
	 * skipped") */
	char **warnings;
	uint32_t n_warnings;
};

/* Parse and check one unit (JSON text of len bytes) against bounds. On -EINVAL, ret_why
 * (if given, size why_len) says which field broke which rule. */
int ro_unit_parse(const char *json, size_t len, const struct ro_unit_bounds *b, struct ro_unit *ret,
		  char *ret_why, size_t why_len);
void ro_unit_clear(struct ro_unit *u);
bool ro_unit_id_valid(const char *id);

int ro_queue_new(const struct ro_queue_opts *o, struct ro_queue **ret);
struct ro_queue *ro_queue_free(struct ro_queue *q);
/* The message of q's last failure; with NULL, why this thread's last ro_queue_new() failed. */
const char *ro_queue_errmsg(const struct ro_queue *q);
/* Times the connection was (re)established; a caller that holds leases rescans after one. */
uint64_t ro_queue_connects(const struct ro_queue *q);
/* Connect (bounded by timeout_ms): 0 once a command went through; -ETIMEDOUT or -EIO when
 * Redis is merely unreachable (a retry may fix it); a permanent cause (wrong credentials or
 * permissions -EACCES, TLS trust or a bad setting -EINVAL, no FUNCTION -ENOTSUP) otherwise,
 * named by ro_queue_errmsg(). */
int ro_queue_check(struct ro_queue *q, uint32_t timeout_ms);
/* The last connection failure was permanent (see ro_queue_check): its -errno, else 0. */
int ro_queue_fatal(const struct ro_queue *q);
/* "standalone" | "cluster" | "sentinel" | "unknown", and the node in use (host:port). */
const char *ro_queue_mode(const struct ro_queue *q);
const char *ro_queue_node(const struct ro_queue *q);
/* Redirections followed (MOVED, a new primary from the sentinels). */
uint64_t ro_queue_redirects(const struct ro_queue *q);
/* Load the function library (an admin's FUNCTION LOAD) on the queue's node: workers
 * then need no right to load it. In a cluster, on every primary. Returns the nodes. */
int ro_queue_init_library(struct ro_queue *q);

/* Enqueue count units; ret_status[i] is 1 queued, 0 already queued with the same body,
 * -EEXIST the id exists with another body. */
int ro_queue_enqueue(struct ro_queue *q, const struct ro_unit *units, size_t count,
		     int *ret_status);

/* Claim up to k units under a lease of lease_ms. Returns how many (0: none pending). */
int ro_queue_claim(struct ro_queue *q, uint32_t k, uint32_t lease_ms, struct ro_claim **ret,
		   size_t *ret_count);
/* The request id of a claim that was sent and never answered (a timeout, a lost
 * connection), 0 when there is none: that claim may have run, leasing units to this worker
 * that it never heard of. The next claim sends the same id and gets exactly those back
 * (their leases made new); ro_queue_held lists them too. */
uint64_t ro_queue_claim_unsure(const struct ro_queue *q);
/* Every unit this worker holds now (after a reconnect). */
int ro_queue_held(struct ro_queue *q, struct ro_claim **ret, size_t *ret_count);
void ro_claims_free(struct ro_claim *c, size_t count);
/* Free what one claim owns (a caller that moved a claim out of the array zeroes it). */
void ro_claim_clear(struct ro_claim *c);

/* Renew the leases of count units; ret_ok[i] false: that lease is lost. */
int ro_queue_renew(struct ro_queue *q, const struct ro_claim *const *c, size_t count,
		   uint32_t lease_ms, bool *ret_ok);
/* Publish samples of one unit; ret_ids[i] (size 24) gets each entry id (the first one on a
 * duplicate). With complete, the unit is completed in the same step when all n are in;
 * *ret_completed then says whether it was. */
int ro_queue_publish(struct ro_queue *q, const struct ro_claim *c, const struct ro_sample *s,
		     size_t count, bool complete, char (*ret_ids)[24], bool *ret_completed);
int ro_queue_checkpoint(struct ro_queue *q, const struct ro_claim *c, const struct ro_progress *p,
			size_t count);
int ro_queue_complete(struct ro_queue *q, const struct ro_claim *c, char ret_group_id[24]);
/* Back to the head of pending with the given checkpoints written in the same step. */
int ro_queue_requeue(struct ro_queue *q, const struct ro_claim *c, const struct ro_progress *p,
		     size_t count);
/* Back to the tail of pending, progress kept, attempt not charged. */
int ro_queue_release(struct ro_queue *q, const struct ro_claim *c);
/* The holder found the unit unusable: to the dead-letter list with reason. */
int ro_queue_dead_letter(struct ro_queue *q, const struct ro_claim *c, const char *reason);
/* The holder could not run the unit (a bad checkpoint, no memory for it, a forward that
 * failed): an attempt is charged, the checkpoints p written, and the unit goes to the tail
 * of pending, or past max_attempts to the dead-letter list with reason. Returns 2 when
 * dead-lettered, 1 when back in pending (0: an earlier identical call did it). */
int ro_queue_fail(struct ro_queue *q, const struct ro_claim *c, const char *reason,
		  const struct ro_progress *p, size_t count);

/* Expired leases back to pending or, past max_attempts, to dead. */
int ro_queue_reap(struct ro_queue *q, uint32_t *ret_requeued, uint32_t *ret_dead);

struct ro_dead {
	char *id, *reason, *history;
	uint32_t attempt;
};
int ro_queue_dead_list(struct ro_queue *q, uint32_t start, uint32_t count, struct ro_dead **ret,
		       size_t *ret_count);
void ro_dead_free(struct ro_dead *d, size_t count);
int ro_queue_dead_retry(struct ro_queue *q, const char *id);
/* One unit for operators, as a JSON object (ro_unit_info in scripts.lua): state, owner,
 * attempt, lease, history, each sample's stream entry and checkpoint. -ENOENT: no such
 * unit. *ret_json is malloc'd. */
int ro_queue_unit_info(struct ro_queue *q, const char *id, char **ret_json);
/* The queue names that have keys under o->prefix ("<prefix>:{NAME}:..."), sorted, from
 * every primary of a Cluster (o->queue only routes the first connection). *ret is an array
 * of *ret_count malloc'd strings; on failure err says why. */
int ro_queue_list_queues(const struct ro_queue_opts *o, char ***ret, size_t *ret_count,
			 char *err, size_t errlen);
/* Deletes every dead unit; returns how many. */
int ro_queue_dead_purge(struct ro_queue *q);

/* Worker heartbeat with (field, value) pairs. */
int ro_queue_heartbeat(struct ro_queue *q, const char *const *kv, size_t n_kv);

/* Block up to timeout_ms (< the socket timeout) for a wake-up marker. true: work may be
 * pending. */
int ro_queue_wait(struct ro_queue *q, uint32_t timeout_ms, bool *ret_woken);

/* Length of the samples stream and the lag of trainer group (NULL: the most behind one;
 * the stream length when no group exists). The agent never trims; it backs off on this. */
int ro_queue_backlog(struct ro_queue *q, const char *group, int64_t *ret_len, int64_t *ret_lag);
int ro_queue_stats(struct ro_queue *q, struct ro_queue_stats *ret);
/* The current policy version (ro:{q}:policy field "version"; 0 when unset). */
int ro_queue_policy_version(struct ro_queue *q, int64_t *ret);

/* The queue's policy (ro:{q}:policy): the weights workers should generate with. */
struct ro_policy_info {
	int64_t version; /* 0: none published */
	int64_t published_ms;
	char *uri;	/* file:///dir/, s3://bucket/prefix/, https://... */
	char *manifest; /* JSON: {"files":[{"name","size","sha256"},...]} */
	char *by;
};
void ro_policy_info_clear(struct ro_policy_info *p);
/* Record version (refused, -EINVAL, unless above the current one) and wake idle workers. */
int ro_queue_policy_publish(struct ro_queue *q, int64_t version, const char *uri,
			    const char *manifest_json, const char *by);
int ro_queue_policy_get(struct ro_queue *q, struct ro_policy_info *ret);
void ro_queue_stats_clear(struct ro_queue_stats *s);

/* Samples stream as JSON lines: entries after *cursor ("0" or "$" to start), up to count;
 * block_ms > 0 waits for new ones. *cursor advances. Each line goes to emit. */
int ro_queue_read_samples(struct ro_queue *q, char cursor[48], uint32_t count, uint32_t block_ms,
			  void (*emit)(void *arg, const char *json), void *arg);

/* The key of a suffix under this queue's prefix ("pending" -> "ro:{q}:pending"). */
const char *ro_queue_key(struct ro_queue *q, const char *suffix, char *buf, size_t len);

/* Expert-parallel rendezvous: publish this rank's card under ro:{q}:ep:<group> and wait
 * (up to timeout_ms) for every rank's; ret_cards[world] (malloc'd, free each) and
 * ret_lens[world] by rank. ro_queue_ep_leave removes this rank's card (on a clean exit). */
int ro_queue_ep_rendezvous(struct ro_queue *q, const char *group, uint32_t rank, uint32_t world,
			   const void *card, size_t len, uint32_t timeout_ms, void **ret_cards,
			   size_t *ret_lens);
int ro_queue_ep_leave(struct ro_queue *q, const char *group, uint32_t rank);

/* ---- the asynchronous face: for an event loop that must never block ----------------- *
 * Every operation the daemon runs has an _async form: it is queued on the connection at
 * once and answered through cb->fn within cb->timeout_ms (0: retry_ms), with 0 or -errno
 * as the synchronous form returns, from inside ro_queue_process(). Nothing waits: the
 * caller watches ro_queue_fd() for ro_queue_events() (POLLIN/POLLOUT; the descriptor
 * changes across reconnects and is -1 while there is none) and calls ro_queue_process()
 * when it is ready or when ro_queue_next_ms() (CLOCK_MONOTONIC ms; -1: no timer) comes.
 * A connection lost before a reply is re-established and the command sent again (every
 * function is idempotent) until the operation's time is up. A callback may submit more
 * operations; it must not free the queue. ro_queue_free() answers the pending ones with
 * -ECANCELED. Sync and async calls may share one queue; the sync one then also runs the
 * callbacks of the async ones that complete meanwhile. */
struct ro_queue_result {
	int r;		 /* 0 (or a count) or -errno */
	const char *msg; /* the failure's message */
	/* claim, held: the callback may take them (set claims NULL) */
	struct ro_claim *claims;
	size_t n_claims;
	/* claim, held: units the server dead-lettered instead of sending them (over a bound
	 * of ro_unit_bounds), each "<id>: <reason>" */
	char **refused;
	size_t n_refused;
	bool *ok;	  /* renew: per unit, false when that lease is lost */
	char (*ids)[24];  /* publish: each sample's entry id; complete: the group entry id */
	int *status;	  /* reserved */
	bool completed;	  /* publish: the unit completed in the same call */
	bool woken;	  /* wait: a wake-up marker was taken */
	int64_t len, lag; /* backlog */
	int64_t value;	  /* checkpoint: samples written; fail: 2 dead-lettered, 1 back */
	struct ro_policy_info *policy; /* policy_get: the callback may take it (set NULL) */
	/* When (CLOCK_MONOTONIC ms) the command was last written: the server ran it after
	 * that, so a lease it granted or renewed lasts at least until sent_ms + lease. */
	int64_t sent_ms;
};
typedef void (*ro_queue_done_fn)(void *arg, struct ro_queue_result *res);
struct ro_queue_cb {
	ro_queue_done_fn fn;
	void *arg;
	uint32_t timeout_ms;
};

int ro_queue_fd(const struct ro_queue *q);
short ro_queue_events(const struct ro_queue *q);
int64_t ro_queue_next_ms(const struct ro_queue *q);
void ro_queue_process(struct ro_queue *q, short revents);
/* Changes whenever ro_queue_fd() is a new socket (the number may be reused). */
uint64_t ro_queue_socket_gen(const struct ro_queue *q);
/* Operations not yet answered, and whether the connection is up now. */
size_t ro_queue_pending(const struct ro_queue *q);
bool ro_queue_connected(const struct ro_queue *q);
/* Why the connection last failed ("" when it has not). */
const char *ro_queue_conn_errmsg(const struct ro_queue *q);

int ro_queue_claim_async(struct ro_queue *q, uint32_t k, uint32_t lease_ms,
			 const struct ro_queue_cb *cb);
int ro_queue_held_async(struct ro_queue *q, const struct ro_queue_cb *cb);
int ro_queue_renew_async(struct ro_queue *q, const struct ro_claim *const *c, size_t count,
			 uint32_t lease_ms, const struct ro_queue_cb *cb);
int ro_queue_publish_async(struct ro_queue *q, const struct ro_claim *c, const struct ro_sample *s,
			   size_t count, bool complete, const struct ro_queue_cb *cb);
int ro_queue_checkpoint_async(struct ro_queue *q, const struct ro_claim *c,
			      const struct ro_progress *p, size_t count, const struct ro_queue_cb *cb);
int ro_queue_complete_async(struct ro_queue *q, const struct ro_claim *c,
			    const struct ro_queue_cb *cb);
int ro_queue_requeue_async(struct ro_queue *q, const struct ro_claim *c,
			   const struct ro_progress *p, size_t count, const struct ro_queue_cb *cb);
int ro_queue_release_async(struct ro_queue *q, const struct ro_claim *c,
			   const struct ro_queue_cb *cb);
int ro_queue_dead_letter_async(struct ro_queue *q, const struct ro_claim *c, const char *reason,
			       const struct ro_queue_cb *cb);
int ro_queue_fail_async(struct ro_queue *q, const struct ro_claim *c, const char *reason,
			const struct ro_progress *p, size_t count, const struct ro_queue_cb *cb);
int ro_queue_heartbeat_async(struct ro_queue *q, const char *const *kv, size_t n_kv,
			     const struct ro_queue_cb *cb);
int ro_queue_wait_async(struct ro_queue *q, uint32_t timeout_ms, const struct ro_queue_cb *cb);
int ro_queue_backlog_async(struct ro_queue *q, const char *group, const struct ro_queue_cb *cb);
int ro_queue_policy_get_async(struct ro_queue *q, const struct ro_queue_cb *cb);

/* Progress encoding (the checkpoint format stored in the unit hash). */
char *ro_progress_encode(const struct ro_progress *p);
/* The longest checkpoint ro_progress_encode() writes for a sample this worker can resume
 * (a prefix shorter than max_new_tokens): a claim is not sent a longer one. */
size_t ro_progress_max_bytes(uint32_t max_new_tokens);
int ro_progress_decode(const char *s, uint32_t idx, struct ro_progress *ret);
void ro_progress_clear(struct ro_progress *p);
