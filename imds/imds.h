/* The EC2 instance-metadata (IMDS) client and interruption watcher: IMDSv2 session tokens,
 * the Spot instance-action, rebalance recommendation, Auto Scaling target lifecycle state,
 * scheduled maintenance and identity reads, and a poller that turns them into typed events,
 * each reported once. This header is the whole face of imds/.
 *
 * Every function returns 0 on success and -errno on failure; each failure is typed:
 *   -ENOENT        404: nothing there (no notice, not in an Auto Scaling group)
 *   -EACCES        token refused (PUT 400/403: IMDS disabled or v2 refused), or 401 twice
 *   -ETIMEDOUT     connect or total timeout (a PUT dropped by hop limit 1 in a pod, a hang)
 *   -ECONNREFUSED  nothing listens at the endpoint
 *   -ECONNRESET    connection dropped, empty or truncated reply
 *   -EAGAIN        HTTP 429 after the retries
 *   -EIO           HTTP 5xx (or another unexpected status) after the retries
 *   -EFBIG         reply body larger than max_body
 *   -EBADMSG       reply is not what the path serves (not JSON, not text, binary)
 *   -EPROTO        well-formed reply with wrong types, an unknown action, an unparsable time
 * ro_imds_errmsg() gives the human message of the last failure. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct ro_imds;

struct ro_imds_opts {
	const char *endpoint;	     /* default http://169.254.169.254 ([fd00:ec2::254] for IPv6) */
	uint32_t connect_timeout_ms; /* default 300 */
	uint32_t timeout_ms;	     /* whole request, default 1000 */
	uint32_t token_ttl_s;	     /* session token lifetime asked for, default 21600 */
	uint32_t retries;	     /* extra tries on 429/5xx/transport errors, default 2 */
	uint32_t backoff_ms;	     /* first backoff, jittered and doubled, default 100 */
	uint32_t max_body;	     /* bytes, default 65536 */
	bool v1_fallback; /* use IMDSv1 (no token) when the token PUT fails; off by default */
};

enum ro_imds_action {
	RO_IMDS_TERMINATE,
	RO_IMDS_STOP,
	RO_IMDS_HIBERNATE,
};

struct ro_imds_notice {
	enum ro_imds_action action;
	int64_t time_ms; /* when EC2 takes the instance (ms since the epoch) */
};

struct ro_imds_maintenance {
	char id[80];	 /* EventId */
	char code[40];	 /* system-reboot, instance-stop, ... */
	char state[24];	 /* active, canceled, completed */
	int64_t not_before_ms;
};

struct ro_imds_identity {
	char instance_id[32];
	char instance_type[40];
	char az[40];
	char life_cycle[16]; /* spot | on-demand | scheduled */
};

void ro_imds_opts_default(struct ro_imds_opts *o);
int ro_imds_new(const struct ro_imds_opts *o, struct ro_imds **ret);
struct ro_imds *ro_imds_free(struct ro_imds *m);
const char *ro_imds_errmsg(const struct ro_imds *m);
/* Token PUTs made so far (a client reuses one token for many GETs). */
uint64_t ro_imds_token_fetches(const struct ro_imds *m);
/* true once the client fell back to IMDSv1 (v1_fallback only). */
bool ro_imds_using_v1(const struct ro_imds *m);

/* GET a metadata path ("meta-data/instance-id", "dynamic/...") below /latest/. The body
 * (NUL-terminated, owned by the caller) in *ret_body. */
int ro_imds_get(struct ro_imds *m, const char *path, char **ret_body, size_t *ret_len);

/* spot/instance-action: 0 and the notice, or -ENOENT when none is posted. */
int ro_imds_spot_action(struct ro_imds *m, struct ro_imds_notice *ret);
/* events/recommendations/rebalance: 0 and the notice time, or -ENOENT. */
int ro_imds_rebalance(struct ro_imds *m, int64_t *ret_notice_ms);
/* autoscaling/target-lifecycle-state ("InService", "Terminated", ...), or -ENOENT. */
int ro_imds_lifecycle(struct ro_imds *m, char *buf, size_t len);
/* events/maintenance/scheduled: the events (caller frees *ret), possibly none. */
int ro_imds_maintenance(struct ro_imds *m, struct ro_imds_maintenance **ret, size_t *ret_count);
/* instance-id, instance-type, placement/availability-zone, instance-life-cycle. */
int ro_imds_identity(struct ro_imds *m, struct ro_imds_identity *ret);

const char *ro_imds_action_name(enum ro_imds_action a);
/* RFC 3339 ("2026-12-03T07:11:33Z", fractions and offsets too) to ms since the epoch. */
int ro_imds_parse_time(const char *s, int64_t *ret_ms);

/* ---- the watcher ---------------------------------------------------------------------- */

enum ro_imds_event_kind {
	RO_IMDS_EV_INTERRUPTION,	   /* spot instance-action: drain by deadline_ms */
	RO_IMDS_EV_REBALANCE,		   /* rebalance recommendation */
	RO_IMDS_EV_LIFECYCLE,		   /* target lifecycle state changed (state) */
	RO_IMDS_EV_MAINTENANCE,		   /* a scheduled event appeared (id, code) */
	RO_IMDS_EV_MAINTENANCE_CANCELLED, /* it was cancelled or withdrawn */
	RO_IMDS_EV_UNREACHABLE,		   /* IMDS could not be read (error, detail) */
	RO_IMDS_EV_RECOVERED,		   /* readable again */
};

struct ro_imds_event {
	enum ro_imds_event_kind kind;
	int64_t at_ms;	     /* when the watcher saw it */
	int64_t deadline_ms; /* interruption: EC2's time; rebalance: noticeTime */
	enum ro_imds_action action;
	bool assumed; /* interruption from a notice that could not be read: deadline assumed
			 to be two minutes after it was first seen */
	int error;    /* unreachable: the -errno */
	char state[32];
	char id[80];
	char detail[160];
};

struct ro_imds_watch_opts {
	uint32_t interval_ms;	    /* spot instance-action, default 1000 */
	uint32_t slow_interval_ms;  /* rebalance and ASG lifecycle state, default 5000 */
	uint32_t maint_interval_ms; /* scheduled maintenance, default 60000 */
	uint32_t unreachable_after; /* failed polls in a row before UNREACHABLE, default 2 */
	bool lifecycle;		    /* poll the ASG state, default true */
	bool maintenance;	    /* poll scheduled events, default true */
};

struct ro_imds_watch;

void ro_imds_watch_opts_default(struct ro_imds_watch_opts *o);
/* The watcher uses (does not own) m. */
int ro_imds_watch_new(struct ro_imds *m, const struct ro_imds_watch_opts *o,
		      struct ro_imds_watch **ret);
struct ro_imds_watch *ro_imds_watch_free(struct ro_imds_watch *w);
/* One poll round now; new events are queued. Returns how many were queued. */
int ro_imds_watch_poll(struct ro_imds_watch *w);
/* The next event: a queued one at once, else polls at the interval until one comes or
 * timeout_ms passes (-EAGAIN). */
int ro_imds_watch_next(struct ro_imds_watch *w, uint32_t timeout_ms, struct ro_imds_event *ret);
uint64_t ro_imds_watch_polls(const struct ro_imds_watch *w);
const char *ro_imds_event_name(enum ro_imds_event_kind k);
/* The event as one JSON object (no newline) in buf. */
int ro_imds_event_json(const struct ro_imds_event *e, char *buf, size_t len);
