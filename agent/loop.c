/* The control plane: one sd-event loop on the main thread that owns signals, timers (the
 * housekeeping tick: lease renewal, checkpoints by time, retries, heartbeat, metrics,
 * backpressure; the drain deadline and the hard deadline; the watchdog through
 * sd_event_set_watchdog), the control socket, the IMDS watcher's pipe, the engine's
 * eventfd, and both Redis connections' I/O. No handler blocks: Redis operations are queued
 * on non-blocking connections and answered in callbacks within their own deadlines; after
 * each iteration one post handler does what became due (publish, checkpoint, claim, drain
 * triage, exit) and re-arms the connections' sources. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/log.h"

#define TICK_MS 50

/* A queue's connection as the loop sees it: an io source for its current socket and a
 * timer for its deadlines. */
struct qsrc {
	struct ro_agent *a;
	struct ro_queue *q;
	sd_event_source *io, *timer;
	uint64_t gen;
};

static struct qsrc qs[2];

static uint32_t to_epoll(short ev)
{
	return (ev & POLLIN ? EPOLLIN : 0) | (ev & POLLOUT ? EPOLLOUT : 0);
}

static int on_queue_io(sd_event_source *s, int fd, uint32_t revents, void *userdata)
{
	struct qsrc *x = userdata;
	short ev = (short)((revents & EPOLLIN ? POLLIN : 0) | (revents & EPOLLOUT ? POLLOUT : 0) |
			   (revents & EPOLLERR ? POLLERR : 0) | (revents & EPOLLHUP ? POLLHUP : 0));

	(void)s;
	(void)fd;
	ro_queue_process(x->q, ev);
	return 0;
}

static int on_queue_timer(sd_event_source *s, uint64_t usec, void *userdata)
{
	struct qsrc *x = userdata;

	(void)s;
	(void)usec;
	ro_queue_process(x->q, 0);
	return 0;
}

/* After handlers ran: the connection may have a new socket, want other events, or have
 * new deadlines. */
static void qsrc_sync(struct qsrc *x)
{
	int fd = ro_queue_fd(x->q);
	uint64_t gen = ro_queue_socket_gen(x->q);
	int64_t next = ro_queue_next_ms(x->q);

	if (x->io && (gen != x->gen || fd < 0))
		x->io = sd_event_source_disable_unref(x->io);
	if (!x->io && fd >= 0) {
		if (sd_event_add_io(x->a->ev, &x->io, fd, to_epoll(ro_queue_events(x->q)),
				    on_queue_io, x) < 0)
			x->io = NULL;
		x->gen = gen;
	}
	if (x->io) {
		uint32_t ev = to_epoll(ro_queue_events(x->q));

		(void)sd_event_source_set_io_events(x->io, ev);
		(void)sd_event_source_set_enabled(x->io, SD_EVENT_ON);
	}
	if (next >= 0) {
		(void)sd_event_source_set_time(x->timer, (uint64_t)next * 1000);
		(void)sd_event_source_set_enabled(x->timer, SD_EVENT_ONESHOT);
	} else {
		(void)sd_event_source_set_enabled(x->timer, SD_EVENT_OFF);
	}
}

void ro_loop_queue_changed(struct ro_agent *a)
{
	(void)a;
	for (int i = 0; i < 2; i++)
		if (qs[i].q)
			qsrc_sync(&qs[i]);
}

int64_t ro_mono_ms(void)
{
	return ro_now_ms();
}

/* ---- events ------------------------------------------------------------------------------- */

static int on_signal(sd_event_source *s, const struct signalfd_siginfo *si, void *userdata)
{
	struct ro_agent *a = userdata;

	(void)s;
	/* the first SIGTERM drains within the grace; a second, or SIGINT, cuts the drain
	 * short, still requeueing everything */
	if (si->ssi_signo == SIGTERM && a->sigterms++ == 0)
		ro_drain_begin(a, ro_wall_ms() + (int64_t)a->cfg.sigterm_grace_s * 1000, "SIGTERM");
	else
		ro_drain_begin(a, ro_wall_ms(),
			       si->ssi_signo == SIGTERM ? "second SIGTERM" : "SIGINT");
	return 0;
}

static void on_imds_event(struct ro_agent *a, const struct ro_imds_event *e)
{
	char line[1024] = "";
	int64_t lead = (int64_t)a->cfg.notice_s * 1000;

	(void)ro_imds_event_json(e, line, sizeof(line));
	ro_log(e->kind == RO_IMDS_EV_UNREACHABLE ? LOG_WARNING : LOG_NOTICE, "imds: %s", line);
	switch (e->kind) {
	case RO_IMDS_EV_INTERRUPTION:
		ro_drain_begin(a, e->deadline_ms - a->cfg.drain_margin_ms, "spot interruption");
		break;
	case RO_IMDS_EV_LIFECYCLE:
		if (strcmp(e->state, "InService") && strncmp(e->state, "Pending", 7))
			ro_drain_begin(a, e->at_ms + lead - a->cfg.drain_margin_ms,
				       "auto scaling lifecycle");
		break;
	case RO_IMDS_EV_REBALANCE:
		if (a->cfg.rebalance == RO_REBALANCE_DRAIN)
			ro_drain_begin(a, e->at_ms + lead - a->cfg.drain_margin_ms,
				       "rebalance recommendation");
		else if (a->cfg.rebalance == RO_REBALANCE_STOP_CLAIMING && !a->stop_claiming) {
			a->stop_claiming = true;
			ro_log(LOG_NOTICE, "rebalance recommendation: no new claims");
		}
		break;
	case RO_IMDS_EV_UNREACHABLE:
		a->n.imds_errors++;
		break;
	default:
		break;
	}
}

static int on_imds(sd_event_source *s, int fd, uint32_t revents, void *userdata)
{
	struct ro_agent *a = userdata;
	struct ro_imds_event e;

	(void)s;
	(void)revents;
	while (read(fd, &e, sizeof(e)) == (ssize_t)sizeof(e))
		on_imds_event(a, &e);
	return 0;
}

/* The engine finished a step (or let go of a unit): the post handler does the rest. */
static int on_engine(sd_event_source *s, int fd, uint32_t revents, void *userdata)
{
	struct ro_agent *a = userdata;
	uint64_t v;
	bool gd;
	int64_t gdl = 0;
	uint32_t first = 0;

	(void)s;
	(void)revents;
	(void)!read(fd, &v, sizeof(v));
	pthread_mutex_lock(&a->mu);
	gd = a->group_drain;
	if (gd) {
		gdl = a->group_deadline_ms;
		first = a->group_first;
		a->group_drain = false;
	}
	pthread_mutex_unlock(&a->mu);
	if (gd) {
		char why[64];

		(void)snprintf(why, sizeof(why), "group drain from rank %u", first);
		ro_drain_begin(a, gdl, why);
	}
	if (a->ep_failed && !a->rc) {
		/* a peer is gone or late: everything we hold goes back to the queue with its
		 * checkpoints, and the supervisor restarts us */
		a->rc = 3;
		ro_drain_begin(a, ro_wall_ms(), "expert-parallel group failed");
	}
	return 0;
}

static int on_deadline(sd_event_source *s, uint64_t usec, void *userdata)
{
	struct ro_agent *a = userdata;

	(void)s;
	(void)usec;
	ro_drain_triage(a);
	return 0;
}

static int on_hard_deadline(sd_event_source *s, uint64_t usec, void *userdata)
{
	struct ro_agent *a = userdata;
	uint32_t left = 0;

	(void)s;
	(void)usec;
	if (a->state != RO_DRAINING)
		return 0;
	pthread_mutex_lock(&a->mu);
	for (const struct unit_rt *u = a->units; u; u = u->next)
		left += u->cp != CP_GONE;
	a->state = RO_DRAINED;
	pthread_mutex_unlock(&a->mu);
	ro_log(LOG_ERR,
	       "drain: hard deadline passed with %u units not requeued (Redis %s): their leases "
	       "expire and they are reaped with their last checkpoints",
	       left, ro_queue_connected(a->q) ? "slow" : "unreachable");
	a->last_drain_s = (double)(ro_now_ms() - a->drain_start_ms) / 1000.0;
	a->hard_exit = true;
	(void)sd_event_exit(a->ev, a->rc);
	return 0;
}

static sd_event_source *deadline_src, *hard_src;

void ro_loop_arm_deadlines(struct ro_agent *a)
{
	/* the exit itself (joining the engine's step, closing) must fit before the hard
	 * deadline: keep a quarter second of the margin for it */
	int64_t reserve = a->cfg.drain_margin_ms / 2 < 250 ? a->cfg.drain_margin_ms / 2 : 250;
	uint64_t d = a->deadline_wall_ms > 0 ? (uint64_t)a->deadline_wall_ms * 1000 : 1;
	uint64_t h =
	    a->hard_wall_ms - reserve > 0 ? (uint64_t)(a->hard_wall_ms - reserve) * 1000 : 1;

	if (!a->ev)
		return;
	if (!deadline_src)
		(void)sd_event_add_time(a->ev, &deadline_src, CLOCK_REALTIME, d, 1000, on_deadline,
					a);
	if (!hard_src)
		(void)sd_event_add_time(a->ev, &hard_src, CLOCK_REALTIME, h, 1000, on_hard_deadline,
					a);
	(void)sd_event_source_set_time(deadline_src, d);
	(void)sd_event_source_set_enabled(deadline_src, SD_EVENT_ONESHOT);
	(void)sd_event_source_set_time(hard_src, h);
	(void)sd_event_source_set_enabled(hard_src, SD_EVENT_ONESHOT);
}

/* Housekeeping: leases, renewals, heartbeat, metrics, backpressure, STATUS=. */
static int on_tick(sd_event_source *s, uint64_t usec, void *userdata)
{
	struct ro_agent *a = userdata;
	int64_t now = ro_now_ms();

	if (!a->held_done)
		ro_units_held(a);
	{
		/* say it once when Redis goes away and once when it is back; and once more
		 * during an outage when its cause turns out to be one no retry fixes (a
		 * rotated password, a revoked ACL): a connection killed by the server is
		 * said first, and the refused AUTH of its reconnect comes after the tick
		 * that said it, so without this line the cause would never be said */
		bool up = ro_queue_connected(a->q);

		if (up != a->redis_was_up && (up || ro_queue_pending(a->q))) {
			if (up)
				ro_log(LOG_NOTICE, "redis: connected");
			else
				ro_log(LOG_WARNING,
				       "redis: unreachable (%s); operations wait for it",
				       ro_queue_conn_errmsg(a->q));
			a->redis_was_up = up;
			a->redis_fatal_said = !up && ro_queue_fatal(a->q);
		} else if (!up && !a->redis_was_up && !a->redis_fatal_said &&
			   ro_queue_fatal(a->q)) {
			ro_log(LOG_WARNING,
			       "redis: still unreachable: %s; retried about once a second",
			       ro_queue_conn_errmsg(a->q));
			a->redis_fatal_said = true;
		}
	}
	if (now >= a->next_renew_ms) {
		ro_units_renew(a);
		a->next_renew_ms = now + a->cfg.lease_ms / 3;
	}
	ro_policy_tick(a);
	if (now >= a->next_backlog_ms && !a->backlog_busy) {
		ro_units_backlog(a);
		a->next_backlog_ms = now + 1000;
	}
	if (now >= a->next_status_ms) {
		ro_notify_status(a);
		ro_heartbeat(a);
		a->next_status_ms = now + a->cfg.status_interval_ms;
	}
	if (now >= a->next_metrics_ms) {
		ro_metrics_write(a);
		a->next_metrics_ms = now + a->cfg.metrics_interval_ms;
	}
	if (a->state == RO_DRAINING && now >= a->next_extend_ms) {
		ro_drain_notify(a);
		a->next_extend_ms = now + 1000;
	}
	(void)sd_event_source_set_time(s, usec + TICK_MS * 1000);
	return 0;
}

/* After every iteration: do what became due, then re-arm the connections. */
static int on_post(sd_event_source *s, void *userdata)
{
	struct ro_agent *a = userdata;

	(void)s;
	ro_units_service(a);
	ro_drain_triage(a);
	ro_units_claim(a);
	/* a rank of a group leaves with the group: until every rank is done, it still owes
	 * its part of their forwards */
	if (a->state == RO_DRAINED && (!a->ep || a->ep_failed || a->group_done))
		(void)sd_event_exit(a->ev, a->rc);
	ro_loop_queue_changed(a);
	return 0;
}

/* Give queued writes (the last publishes, requeues, the final heartbeat) a bounded moment
 * to reach Redis: never past the hard deadline. */
static void flush(struct ro_agent *a, int64_t until_ms)
{
	for (int i = 0; i < 10000 && ro_now_ms() < until_ms; i++) {
		struct pollfd p[2];
		int n = 0;
		int64_t left = until_ms - ro_now_ms();

		if (!ro_queue_pending(a->q) && !ro_queue_pending(a->qw))
			return;
		for (int k = 0; k < 2; k++) {
			struct ro_queue *q = k ? a->qw : a->q;

			if (ro_queue_fd(q) >= 0)
				p[n++] = (struct pollfd){ro_queue_fd(q), ro_queue_events(q), 0};
		}
		if (n)
			(void)poll(p, (nfds_t)n, left > 20 ? 20 : (int)left);
		else
			usleep(20000);
		for (int k = 0, j = 0; k < 2; k++) {
			struct ro_queue *q = k ? a->qw : a->q;
			short rev = 0;

			if (ro_queue_fd(q) >= 0 && j < n)
				rev = p[j++].revents;
			ro_queue_process(q, rev);
		}
	}
}

int ro_loop_run(struct ro_agent *a)
{
	sd_event_source *sig_term = NULL, *sig_int = NULL, *imds = NULL, *tick = NULL, *post = NULL;
	uint64_t now;
	int r;

	r = sd_event_new(&a->ev);
	if (r < 0)
		return ro_log_errno(r, "sd-event: %s", strerror(-r));
	a->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (a->efd < 0) {
		r = -errno;
		goto out;
	}
	(void)sd_event_now(a->ev, CLOCK_MONOTONIC, &now);
	if ((r = sd_event_add_signal(a->ev, &sig_term, SIGTERM, on_signal, a)) < 0 ||
	    (r = sd_event_add_signal(a->ev, &sig_int, SIGINT, on_signal, a)) < 0 ||
	    (r = sd_event_add_io(a->ev, &a->efd_src, a->efd, EPOLLIN, on_engine, a)) < 0 ||
	    (r = sd_event_add_time(a->ev, &tick, CLOCK_MONOTONIC, now, TICK_MS * 100, on_tick, a)) <
		0 ||
	    (r = sd_event_add_post(a->ev, &post, on_post, a)) < 0) {
		ro_log(LOG_ERR, "sd-event: %s", strerror(-r));
		goto out;
	}
	(void)sd_event_source_set_enabled(tick, SD_EVENT_ON);
	if (a->imds_fd >= 0 &&
	    (r = sd_event_add_io(a->ev, &imds, a->imds_fd, EPOLLIN, on_imds, a)) < 0)
		ro_log(LOG_WARNING, "imds events: %s", strerror(-r));
	for (int i = 0; i < 2; i++) {
		qs[i] = (struct qsrc){.a = a, .q = i ? a->qw : a->q};
		r = sd_event_add_time(a->ev, &qs[i].timer, CLOCK_MONOTONIC, 0, 1000, on_queue_timer,
				      &qs[i]);
		if (r < 0)
			goto out;
		(void)sd_event_source_set_enabled(qs[i].timer, SD_EVENT_OFF);
	}
	if (a->cfg.control_socket && *a->cfg.control_socket) {
		r = ro_control_open(a, a->cfg.control_socket);
		if (r < 0)
			ro_log(LOG_WARNING, "control socket %s: %s", a->cfg.control_socket,
			       strerror(-r));
	}
	r = ro_engine_start(a);
	if (r) {
		ro_log(LOG_ERR, "engine thread: %s", strerror(-r));
		goto out;
	}
	ro_units_held(a);
	ro_loop_queue_changed(a);
	(void)sd_notify(0, "READY=1\nSTATUS=running");
	/* the watchdog is fed by the loop itself: a wedged loop stops feeding it */
	(void)sd_event_set_watchdog(a->ev, true);
	r = sd_event_loop(a->ev);
	if (r < 0)
		ro_log(LOG_ERR, "event loop: %s", strerror(-r));
	a->exiting = true;
	/* from here nobody answers: a probe is refused rather than left hanging */
	ro_control_close(a);
	(void)sd_notify(0, "STOPPING=1\nSTATUS=drained");
	ro_metrics_write(a);
	if (a->hard_exit) {
		/* on time matters more than tidy: the engine may be inside a step, Redis is
		 * away; the socket goes, the process exits now (its leases expire) */
		if (a->cfg.control_socket && *a->cfg.control_socket)
			(void)unlink(a->cfg.control_socket);
		ro_log(LOG_INFO,
		       "exiting at the hard deadline: %llu units completed, %llu requeued",
		       (unsigned long long)a->n.completed, (unsigned long long)a->n.requeued);
		_exit(a->rc);
	}
	ro_heartbeat(a);
	{
		/* a drain that ended in time has a moment for the last writes (the heartbeat),
		 * never past the hard deadline less the exit's reserve */
		int64_t left = a->hard_wall_ms ? a->hard_wall_ms - ro_wall_ms() - 250 : 1000;

		if (left > 0)
			flush(a, ro_now_ms() + (left > 1000 ? 1000 : left));
	}
	r = r < 0 ? 1 : a->rc;
out:
	ro_engine_stop(a);
	ro_policy_stop(a);
	ro_control_close(a);
	sd_event_source_disable_unref(sig_term);
	sd_event_source_disable_unref(sig_int);
	sd_event_source_disable_unref(imds);
	sd_event_source_disable_unref(tick);
	sd_event_source_disable_unref(post);
	sd_event_source_disable_unref(a->efd_src);
	deadline_src = sd_event_source_disable_unref(deadline_src);
	hard_src = sd_event_source_disable_unref(hard_src);
	for (int i = 0; i < 2; i++) {
		sd_event_source_disable_unref(qs[i].io);
		sd_event_source_disable_unref(qs[i].timer);
		qs[i] = (struct qsrc){0};
	}
	if (a->efd >= 0)
		(void)close(a->efd);
	a->ev = sd_event_unref(a->ev);
	return r;
}
