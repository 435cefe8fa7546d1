/* The interruption watcher: polls IMDS at an interval and turns what it reads into typed
 * events, each reported once however many polls see it (a notice whose time moves between
 * polls, a notice that flaps away and back, a maintenance event listed on every poll).
 * An unreadable service is reported as such, never taken for an all clear. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "imds/imds.h"
#include "imds/internal.h"

#define QUEUE_MAX 32
#define MAINT_MAX 64
#define NOTICE_LEAD_MS 120000 /* EC2's two-minute warning */

struct ro_imds_watch {
	struct ro_imds *m;
	struct ro_imds_watch_opts o;
	struct ro_imds_event q[QUEUE_MAX];
	size_t q_head, q_len;
	uint64_t polls;
	int64_t next_poll_ms; /* monotonic */
	int64_t next_slow_ms, next_maint_ms;
	bool interrupted, rebalanced, unreachable, maint_known;
	uint32_t fail_streak;
	char lifecycle[32];
	size_t n_maint;
	struct ro_imds_maintenance maint[MAINT_MAX];
};

void ro_imds_watch_opts_default(struct ro_imds_watch_opts *o)
{
	o->interval_ms = 1000;
	o->slow_interval_ms = 5000;
	o->maint_interval_ms = 60000;
	o->unreachable_after = 2;
	o->lifecycle = true;
	o->maintenance = true;
}

int ro_imds_watch_new(struct ro_imds *m, const struct ro_imds_watch_opts *o,
		      struct ro_imds_watch **ret)
{
	struct ro_imds_watch *w = calloc(1, sizeof(*w));

	if (!w)
		return -ENOMEM;
	w->m = m;
	ro_imds_watch_opts_default(&w->o);
	if (o)
		w->o = *o;
	if (!w->o.interval_ms)
		w->o.interval_ms = 1000;
	if (!w->o.unreachable_after)
		w->o.unreachable_after = 1;
	w->next_poll_ms = ro_imds_mono_ms();
	w->next_slow_ms = w->next_poll_ms;
	w->next_maint_ms = w->next_poll_ms;
	*ret = w;
	return 0;
}

struct ro_imds_watch *ro_imds_watch_free(struct ro_imds_watch *w)
{
	free(w);
	return NULL;
}

uint64_t ro_imds_watch_polls(const struct ro_imds_watch *w)
{
	return w->polls;
}

static struct ro_imds_event *push(struct ro_imds_watch *w, enum ro_imds_event_kind k)
{
	struct ro_imds_event *e;

	if (w->q_len == QUEUE_MAX) { /* a consumer this far behind loses the oldest */
		w->q_head = (w->q_head + 1) % QUEUE_MAX;
		w->q_len--;
	}
	e = &w->q[(w->q_head + w->q_len++) % QUEUE_MAX];
	memset(e, 0, sizeof(*e));
	e->kind = k;
	e->at_ms = ro_imds_wall_ms();
	return e;
}

/* A 200 on instance-action that cannot be read still says a notice is posted: acting on
 * it costs a drain, ignoring it can cost the work. Transport errors say nothing. */
static bool notice_unreadable(int r)
{
	return r == -EBADMSG || r == -EPROTO || r == -EFBIG;
}

static int poll_spot(struct ro_imds_watch *w)
{
	struct ro_imds_notice n;
	struct ro_imds_event *e;
	int r = ro_imds_spot_action(w->m, &n);

	if (r == -ENOENT)
		return 0; /* none, or withdrawn: a reported notice stays reported */
	if (r && !notice_unreadable(r))
		return r;
	if (w->interrupted)
		return 0;
	w->interrupted = true;
	e = push(w, RO_IMDS_EV_INTERRUPTION);
	if (r) {
		e->assumed = true;
		e->action = RO_IMDS_TERMINATE;
		e->deadline_ms = e->at_ms + NOTICE_LEAD_MS;
		(void)snprintf(e->detail, sizeof(e->detail), "%s", ro_imds_errmsg(w->m));
	} else {
		e->action = n.action;
		e->deadline_ms = n.time_ms;
		if (n.time_ms <= e->at_ms)
			(void)snprintf(e->detail, sizeof(e->detail), "notice time already past");
	}
	return 0;
}

static int poll_rebalance(struct ro_imds_watch *w)
{
	int64_t t;
	int r = ro_imds_rebalance(w->m, &t);

	if (r == -ENOENT)
		return 0;
	if (r)
		return r;
	if (!w->rebalanced) {
		w->rebalanced = true;
		push(w, RO_IMDS_EV_REBALANCE)->deadline_ms = t;
	}
	return 0;
}

static int poll_lifecycle(struct ro_imds_watch *w)
{
	char state[32];
	int r = ro_imds_lifecycle(w->m, state, sizeof(state));

	if (r == -ENOENT)
		return 0; /* not in an Auto Scaling group */
	if (r)
		return r;
	if (strcmp(state, w->lifecycle)) {
		struct ro_imds_event *e = push(w, RO_IMDS_EV_LIFECYCLE);

		(void)snprintf(e->state, sizeof(e->state), "%s", state);
		(void)snprintf(e->detail, sizeof(e->detail), "%s",
			       w->lifecycle[0] ? w->lifecycle : "(first read)");
		memcpy(w->lifecycle, state, sizeof(state));
	}
	return 0;
}

static const struct ro_imds_maintenance *find_maint(const struct ro_imds_maintenance *v,
						    size_t n, const char *id)
{
	for (size_t i = 0; i < n; i++)
		if (!strcmp(v[i].id, id))
			return &v[i];
	return NULL;
}

static bool maint_live(const struct ro_imds_maintenance *e)
{
	return e && strcmp(e->state, "canceled") && strcmp(e->state, "cancelled") &&
	       strcmp(e->state, "completed");
}

static int poll_maintenance(struct ro_imds_watch *w)
{
	struct ro_imds_maintenance *cur = NULL;
	size_t n = 0;
	int r = ro_imds_maintenance(w->m, &cur, &n);

	if (r == -ENOENT) {
		r = 0;
		n = 0;
	}
	if (r)
		return r;
	if (n > MAINT_MAX)
		n = MAINT_MAX;
	for (size_t i = 0; i < n; i++) {
		const struct ro_imds_maintenance *old = find_maint(w->maint, w->n_maint, cur[i].id);

		if (maint_live(&cur[i]) && !maint_live(old)) {
			struct ro_imds_event *e = push(w, RO_IMDS_EV_MAINTENANCE);

			(void)snprintf(e->id, sizeof(e->id), "%s", cur[i].id);
			(void)snprintf(e->state, sizeof(e->state), "%.31s", cur[i].code);
			e->deadline_ms = cur[i].not_before_ms;
		}
	}
	for (size_t i = 0; i < w->n_maint; i++) {
		const struct ro_imds_maintenance *now = find_maint(cur, n, w->maint[i].id);

		if (maint_live(&w->maint[i]) && !maint_live(now)) {
			struct ro_imds_event *e = push(w, RO_IMDS_EV_MAINTENANCE_CANCELLED);

			(void)snprintf(e->id, sizeof(e->id), "%s", w->maint[i].id);
			(void)snprintf(e->state, sizeof(e->state), "%.31s", w->maint[i].code);
		}
	}
	if (n)
		memcpy(w->maint, cur, n * sizeof(*cur));
	w->n_maint = n;
	free(cur);
	return 0;
}

int ro_imds_watch_poll(struct ro_imds_watch *w)
{
	size_t before = w->q_len;
	int64_t now = ro_imds_mono_ms();
	int r;

	w->polls++;
	/* the notice first, every round: it is the one with a deadline. The others carry
	 * none (a rebalance is advice, a lifecycle hook waits for us) and are read at their
	 * own, slower pace: each read costs CPU on every node of the fleet, every second.
	 * When the notice cannot be read the rest would only spend the same timeout again. */
	r = poll_spot(w);
	if (!r && now >= w->next_slow_ms) {
		r = poll_rebalance(w);
		if (!r && w->o.lifecycle)
			r = poll_lifecycle(w);
		if (!r)
			w->next_slow_ms = now + w->o.slow_interval_ms;
	}
	if (!r && w->o.maintenance && (now >= w->next_maint_ms || !w->maint_known)) {
		r = poll_maintenance(w);
		w->maint_known = !r;
		if (!r)
			w->next_maint_ms = now + w->o.maint_interval_ms;
	}
	if (r) {
		if (++w->fail_streak >= w->o.unreachable_after && !w->unreachable) {
			struct ro_imds_event *e = push(w, RO_IMDS_EV_UNREACHABLE);

			w->unreachable = true;
			e->error = r;
			(void)snprintf(e->detail, sizeof(e->detail), "%s", ro_imds_errmsg(w->m));
		}
	} else {
		w->fail_streak = 0;
		if (w->unreachable) {
			w->unreachable = false;
			push(w, RO_IMDS_EV_RECOVERED);
		}
	}
	return (int)(w->q_len - before);
}

int ro_imds_watch_next(struct ro_imds_watch *w, uint32_t timeout_ms, struct ro_imds_event *ret)
{
	int64_t end = ro_imds_mono_ms() + timeout_ms;
	bool polled = false;

	for (;;) {
		int64_t now;

		if (w->q_len) {
			*ret = w->q[w->q_head];
			w->q_head = (w->q_head + 1) % QUEUE_MAX;
			w->q_len--;
			return 0;
		}
		now = ro_imds_mono_ms();
		/* a round slower than the interval must not keep a short wait polling */
		if (now >= w->next_poll_ms && (now < end || !polled)) {
			/* the next round is due an interval after this one began, so a slow
			 * round does not shift the schedule; one far behind starts afresh */
			w->next_poll_ms += w->o.interval_ms;
			if (w->next_poll_ms <= now)
				w->next_poll_ms = now + w->o.interval_ms;
			(void)ro_imds_watch_poll(w);
			polled = true;
			continue;
		}
		if (now >= end)
			return -EAGAIN;
		ro_imds_sleep_ms((w->next_poll_ms < end ? w->next_poll_ms : end) - now);
	}
}

const char *ro_imds_event_name(enum ro_imds_event_kind k)
{
	static const char *const names[] = {
	    [RO_IMDS_EV_INTERRUPTION] = "interruption",
	    [RO_IMDS_EV_REBALANCE] = "rebalance",
	    [RO_IMDS_EV_LIFECYCLE] = "lifecycle",
	    [RO_IMDS_EV_MAINTENANCE] = "maintenance",
	    [RO_IMDS_EV_MAINTENANCE_CANCELLED] = "maintenance-cancelled",
	    [RO_IMDS_EV_UNREACHABLE] = "unreachable",
	    [RO_IMDS_EV_RECOVERED] = "recovered",
	};

	return (unsigned)k < sizeof(names) / sizeof(names[0]) ? names[k] : "unknown";
}

static void fmt_time(int64_t ms, char *buf, size_t len)
{
	time_t s = (time_t)(ms / 1000);
	struct tm tm;

	(void)gmtime_r(&s, &tm);
	(void)snprintf(buf, len, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
		       tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
		       (int)(ms % 1000));
}

/* JSON string body. Every text field is escaped: a maintenance event's id and code are
 * whatever the reply held (any JSON string), and an error message may quote a reply. */
static void esc(const char *s, char *buf, size_t len)
{
	size_t o = 0;

	for (; *s && o + 7 < len; s++) {
		unsigned char c = (unsigned char)*s;

		if (c == '"' || c == '\\') {
			buf[o++] = '\\';
			buf[o++] = (char)c;
		} else if (c < 0x20 || c >= 0x7f) {
			o += (size_t)snprintf(buf + o, len - o, "\\u%04x", c);
		} else {
			buf[o++] = (char)c;
		}
	}
	buf[o] = '\0';
}

int ro_imds_event_json(const struct ro_imds_event *e, char *buf, size_t len)
{
	char at[64], dl[64], detail[sizeof(e->detail) * 6 + 1];
	char state[sizeof(e->state) * 6 + 1], id[sizeof(e->id) * 6 + 1];
	int n;

	fmt_time(e->at_ms, at, sizeof(at));
	esc(e->detail, detail, sizeof(detail));
	esc(e->state, state, sizeof(state));
	esc(e->id, id, sizeof(id));
	n = snprintf(buf, len, "{\"event\":\"%s\",\"at\":\"%s\"", ro_imds_event_name(e->kind), at);
	switch (e->kind) {
	case RO_IMDS_EV_INTERRUPTION:
		fmt_time(e->deadline_ms, dl, sizeof(dl));
		n += snprintf(buf + n, len - (size_t)n,
			      ",\"action\":\"%s\",\"deadline\":\"%s\",\"in_s\":%.3f,\"assumed\":%s",
			      ro_imds_action_name(e->action), dl,
			      (double)(e->deadline_ms - e->at_ms) / 1000.0,
			      e->assumed ? "true" : "false");
		break;
	case RO_IMDS_EV_REBALANCE:
		fmt_time(e->deadline_ms, dl, sizeof(dl));
		n += snprintf(buf + n, len - (size_t)n, ",\"notice_time\":\"%s\"", dl);
		break;
	case RO_IMDS_EV_LIFECYCLE:
		n += snprintf(buf + n, len - (size_t)n, ",\"state\":\"%s\"", state);
		break;
	case RO_IMDS_EV_MAINTENANCE:
	case RO_IMDS_EV_MAINTENANCE_CANCELLED:
		n += snprintf(buf + n, len - (size_t)n, ",\"id\":\"%s\",\"code\":\"%s\"", id, state);
		if (e->kind == RO_IMDS_EV_MAINTENANCE && e->deadline_ms > 0) {
			fmt_time(e->deadline_ms, dl, sizeof(dl));
			n += snprintf(buf + n, len - (size_t)n, ",\"not_before\":\"%s\"", dl);
		}
		break;
	case RO_IMDS_EV_UNREACHABLE:
		n += snprintf(buf + n, len - (size_t)n, ",\"error\":\"%s\"", strerrorname_np(-e->error)
							? strerrorname_np(-e->error)
							: "unknown");
		break;
	default:
		break;
	}
	if (e->detail[0])
		n += snprintf(buf + n, len - (size_t)n, ",\"detail\":\"%s\"", detail);
	n += snprintf(buf + n, len - (size_t)n, "}");
	return n < (int)len ? 0 : -ENOSPC;
}
