/* imds/: every read, token caching, expiry and 401 recovery, every hostile reply with its
 * typed result, and the watcher's events (once each, never an all clear while the service
 * cannot be read), all against the project's mock IMDS on loopback. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "imds/imds.h"
#include "tests/mock_fixture.h"
#include "tests/testutil.h"

static struct ro_test_mock mk;

static void start_plain(void)
{
	memset(&mk, 0, sizeof(mk));
	cr_assert_eq(ro_test_mock_start(&mk, 0, NULL), 0);
}

static void start_v2_only(void)
{
	static const char *const a[] = {"--imdsv2", NULL};

	memset(&mk, 0, sizeof(mk));
	cr_assert_eq(ro_test_mock_start(&mk, 0, a), 0);
}

static void stop(void)
{
	ro_test_mock_stop(&mk);
}

static struct ro_imds *client(uint32_t ttl_s, bool v1)
{
	struct ro_imds_opts o;
	struct ro_imds *m = NULL;

	ro_imds_opts_default(&o);
	o.endpoint = mk.url;
	o.timeout_ms = 500;
	o.connect_timeout_ms = 300;
	o.backoff_ms = 20;
	if (ttl_s)
		o.token_ttl_s = ttl_s;
	o.v1_fallback = v1;
	cr_assert_eq(ro_imds_new(&o, &m), 0);
	return m;
}

static void ctl(const char *what)
{
	char *r = ro_test_mock_ctl(&mk, what);

	cr_assert_not_null(r, "control %s failed", what);
	free(r);
}

/* ---- reads ------------------------------------------------------------------------ */

TestSuite(reads, .init = start_v2_only, .fini = stop, .timeout = 30);

Test(reads, identity)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_identity id;

	cr_assert_eq(ro_imds_identity(m, &id), 0, "%s", ro_imds_errmsg(m));
	cr_expect_str_eq(id.instance_id, "i-0123456789abcdef0");
	cr_expect_str_eq(id.instance_type, "p5en.48xlarge");
	cr_expect_str_eq(id.az, "us-east-1a");
	cr_expect_str_eq(id.life_cycle, "spot");
	ro_imds_free(m);
}

Test(reads, spot_action)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_notice n;
	double appear;

	cr_assert_eq(ro_imds_spot_action(m, &n), -ENOENT, "no notice is 404 -> -ENOENT");
	ctl("spot?in=0&action=stop");
	appear = ro_test_mock_number(&mk, "spot", "appear_epoch");
	cr_assert_eq(ro_imds_spot_action(m, &n), 0, "%s", ro_imds_errmsg(m));
	cr_expect_eq(n.action, RO_IMDS_STOP);
	/* the mock posts time = appearance + 120 s, to the second */
	cr_expect_leq(llabs(n.time_ms - ((int64_t)(appear * 1000) + 120000)), 1000, "time %lld",
		      (long long)n.time_ms);
	ro_imds_free(m);
}

Test(reads, rebalance)
{
	struct ro_imds *m = client(0, false);
	int64_t t = 0;

	cr_assert_eq(ro_imds_rebalance(m, &t), -ENOENT);
	ctl("rebalance?in=0");
	cr_assert_eq(ro_imds_rebalance(m, &t), 0, "%s", ro_imds_errmsg(m));
	cr_expect_leq(llabs(t - ro_test_wall_ms()), 2000);
	ro_imds_free(m);
}

Test(reads, lifecycle)
{
	struct ro_imds *m = client(0, false);
	char st[32];

	cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0);
	cr_expect_str_eq(st, "InService");
	ctl("lifecycle?state=Terminated");
	cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0);
	cr_expect_str_eq(st, "Terminated");
	ctl("lifecycle?state=none");
	cr_expect_eq(ro_imds_lifecycle(m, st, sizeof(st)), -ENOENT, "not in an ASG");
	ro_imds_free(m);
}

Test(reads, maintenance)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_maintenance *ev = NULL;
	size_t n = 9;

	cr_assert_eq(ro_imds_maintenance(m, &ev, &n), 0);
	cr_expect_eq(n, 0);
	free(ev);
	ctl("maintenance?code=system-reboot&in=3600");
	cr_assert_eq(ro_imds_maintenance(m, &ev, &n), 0, "%s", ro_imds_errmsg(m));
	cr_assert_eq(n, 1);
	cr_expect_str_eq(ev[0].code, "system-reboot");
	cr_expect_str_eq(ev[0].state, "active");
	cr_expect_eq(strncmp(ev[0].id, "instance-event-", 15), 0);
	cr_expect_leq(llabs(ev[0].not_before_ms - (ro_test_wall_ms() + 3600000)), 2000);
	free(ev);
	ro_imds_free(m);
}

Test(reads, time_formats)
{
	int64_t t;

	cr_assert_eq(ro_imds_parse_time("2026-12-03T07:11:33Z", &t), 0);
	cr_expect_eq(t, 1796281893000LL);
	cr_assert_eq(ro_imds_parse_time("2026-12-03T07:11:33.25Z", &t), 0);
	cr_expect_eq(t, 1796281893250LL);
	cr_assert_eq(ro_imds_parse_time("2026-12-03T09:11:33+02:00", &t), 0);
	cr_expect_eq(t, 1796281893000LL);
	cr_expect_neq(ro_imds_parse_time("tomorrow", &t), 0);
	cr_expect_neq(ro_imds_parse_time("2026-13-03T07:11:33Z", &t), 0);
	cr_expect_neq(ro_imds_parse_time("2026-12-03T07:11:33", &t), 0, "no zone");
	cr_expect_neq(ro_imds_parse_time("2026-12-03T07:11:33Zjunk", &t), 0);
	cr_expect_neq(ro_imds_parse_time("", &t), 0);
}

/* ---- tokens ----------------------------------------------------------------------- */

Test(reads, one_token_for_many_gets)
{
	struct ro_imds *m = client(0, false);
	char st[32];

	for (int i = 0; i < 25; i++)
		cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0);
	cr_expect_eq(ro_test_mock_count(&mk, "put"), 1);
	cr_expect_eq(ro_test_mock_count(&mk, "get"), 25);
	cr_expect_eq(ro_imds_token_fetches(m), 1);
	ro_imds_free(m);
}

Test(reads, token_renewed_before_expiry)
{
	/* a 2 s token is renewed after 1.5 s: reads for 3.5 s never meet a 401 */
	struct ro_imds *m = client(2, false);
	char st[32];
	int64_t t0 = ro_test_mono_ms(), took;

	for (int i = 0; i < 18; i++) {
		cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0, "%s", ro_imds_errmsg(m));
		ro_test_msleep(200);
	}
	took = ro_test_mono_ms() - t0;
	cr_expect_eq(ro_test_mock_count(&mk, "401"), 0);
	cr_expect_geq(ro_test_mock_count(&mk, "put"), 2);
	/* renewed no sooner than 1.5 s after the last PUT: on a busy box the loop takes longer
	 * than 18 x 200 ms, and more renewals are due (a fixed 3 failed past ~4.6 s) */
	cr_expect_leq(ro_test_mock_count(&mk, "put"), 1 + took / 1500, "%ld PUTs in %lld ms",
		      ro_test_mock_count(&mk, "put"), (long long)took);
	ro_imds_free(m);
}

Test(reads, granted_ttl_is_honoured)
{
	/* the service may grant less than asked: the client follows its reply header */
	struct ro_imds *m = client(0, false);
	char st[32];

	ctl("token?max_ttl=1");
	for (int i = 0; i < 10; i++) {
		cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0, "%s", ro_imds_errmsg(m));
		ro_test_msleep(200);
	}
	/* renewed ahead of the granted 1 s, not only after a 401 (a client that kept the asked
	 * TTL renews on 401s only: PUTs = 1 + 401s). The renewal is 250 ms early: a request that
	 * a loaded box delays past that meets a 401, which the client recovers from, so the
	 * count of 401s is not zero on every run (a mock stopped for 0.45 s at a time) */
	cr_expect_gt(ro_test_mock_count(&mk, "put"), 1 + ro_test_mock_count(&mk, "401"),
		     "%ld PUTs, %ld 401s", ro_test_mock_count(&mk, "put"),
		     ro_test_mock_count(&mk, "401"));
	cr_expect_geq(ro_test_mock_count(&mk, "put"), 2);
	ro_imds_free(m);
}

Test(reads, recovers_from_401)
{
	struct ro_imds *m = client(0, false);
	char st[32];

	cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0);
	ctl("revoke");
	cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0, "%s", ro_imds_errmsg(m));
	cr_expect_eq(ro_test_mock_count(&mk, "401"), 1);
	cr_expect_eq(ro_test_mock_count(&mk, "put"), 2);
	ro_imds_free(m);
}

Test(reads, v2_refused_is_eacces_without_fallback)
{
	struct ro_imds *m = client(0, false);
	char st[32];

	ctl("fault?kind=notoken&for=30");
	cr_expect_eq(ro_imds_lifecycle(m, st, sizeof(st)), -EACCES);
	cr_expect_not(ro_imds_using_v1(m));
	ro_imds_free(m);
}

TestSuite(v1, .init = start_plain, .fini = stop, .timeout = 30);

Test(v1, fallback_when_token_refused)
{
	struct ro_imds *m = client(0, true);
	char st[32];

	ctl("fault?kind=notoken&for=30");
	cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0, "%s", ro_imds_errmsg(m));
	cr_expect(ro_imds_using_v1(m));
	cr_expect_str_eq(st, "InService");
	ro_imds_free(m);
}

Test(v1, fallback_when_token_put_hangs)
{
	/* hop limit 1 in a pod: the PUT's reply never comes back */
	struct ro_imds *m = client(0, true);
	char st[32];

	ctl("fault?kind=tokenhang&for=30&ms=2000");
	cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0, "%s", ro_imds_errmsg(m));
	cr_expect(ro_imds_using_v1(m));
	ro_imds_free(m);
}

/* ---- hostile replies -------------------------------------------------------------- */

struct hostile {
	const char *fault; /* control query */
	int want;	   /* ro_imds_spot_action's result while it lasts */
};

static void expect_hostile(const struct hostile *h)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_notice n;
	char st[32];
	int r;

	ctl("spot?in=0");
	ctl(h->fault);
	r = ro_imds_spot_action(m, &n);
	cr_expect_eq(r, h->want, "%s: got %d (%s), want %d", h->fault, r, ro_imds_errmsg(m),
		     h->want);
	cr_expect_str_neq(ro_imds_errmsg(m), "", "a message names the failure");
	ctl("clear");
	ctl("spot?in=0");
	/* the same client works again once the service does */
	cr_expect_eq(ro_imds_spot_action(m, &n), 0, "%s: after: %s", h->fault, ro_imds_errmsg(m));
	cr_expect_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0);
	ro_imds_free(m);
}

Test(reads, hostile_replies)
{
	static const struct hostile cases[] = {
	    {"fault?kind=badbody&for=30", -EBADMSG},
	    {"fault?kind=wrongtypes&for=30", -EPROTO},
	    {"fault?kind=huge&for=30", -EFBIG},
	    {"fault?kind=truncated&for=30", -ECONNRESET},
	    {"fault?kind=500&for=30", -EIO},
	    {"fault?kind=503&for=30", -EIO},
	    {"fault?kind=429&for=30", -EAGAIN},
	    {"fault?kind=drop&for=30", -ECONNRESET},
	    {"fault?kind=delay&for=30&ms=1500", -ETIMEDOUT},
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		expect_hostile(&cases[i]);
}

Test(reads, retries_are_bounded)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_notice n;
	long before;

	cr_assert_eq(ro_imds_spot_action(m, &n), -ENOENT);
	before = ro_test_mock_count(&mk, "get");
	ctl("fault?kind=500&for=30");
	cr_expect_eq(ro_imds_spot_action(m, &n), -EIO);
	/* one try and retries = 2 more, no storm */
	cr_expect_eq(ro_test_mock_count(&mk, "get") - before, 3);
	ro_imds_free(m);
}

Test(reads, slow_reply_within_timeout_is_fine)
{
	struct ro_imds *m = client(0, false);
	char st[32];

	cr_assert_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0);
	ctl("fault?kind=delay&for=30&ms=200");
	cr_expect_eq(ro_imds_lifecycle(m, st, sizeof(st)), 0, "%s", ro_imds_errmsg(m));
	ro_imds_free(m);
}

Test(reads, unknown_action_and_bad_time)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_notice n;

	ctl("spot?in=0&action=reboot");
	cr_expect_eq(ro_imds_spot_action(m, &n), -EPROTO);
	cr_expect(strstr(ro_imds_errmsg(m), "reboot") != NULL, "%s", ro_imds_errmsg(m));
	ctl("spot?in=0&rawtime=tomorrow");
	cr_expect_eq(ro_imds_spot_action(m, &n), -EPROTO);
	cr_expect(strstr(ro_imds_errmsg(m), "tomorrow") != NULL, "%s", ro_imds_errmsg(m));
	ro_imds_free(m);
}

Test(reads, token_put_refused_or_hanging)
{
	struct ro_imds *m;
	char st[32];

	ctl("fault?kind=token400&for=30");
	m = client(0, false);
	cr_expect_eq(ro_imds_lifecycle(m, st, sizeof(st)), -EACCES);
	ro_imds_free(m);
	ctl("fault?kind=tokenhang&for=30&ms=1500");
	m = client(0, false);
	cr_expect_eq(ro_imds_lifecycle(m, st, sizeof(st)), -ETIMEDOUT);
	ro_imds_free(m);
}

Test(reads, connection_refused)
{
	struct ro_imds *m = client(0, false);
	char st[32];

	ro_test_mock_kill(&mk);
	cr_expect_eq(ro_imds_lifecycle(m, st, sizeof(st)), -ECONNREFUSED);
	ro_imds_free(m);
}

/* ---- the watcher ------------------------------------------------------------------ */

TestSuite(watch, .init = start_v2_only, .fini = stop, .timeout = 90);

static struct ro_imds_watch *watcher(struct ro_imds *m, uint32_t interval_ms)
{
	struct ro_imds_watch_opts o;
	struct ro_imds_watch *w = NULL;

	ro_imds_watch_opts_default(&o);
	o.interval_ms = interval_ms;
	o.slow_interval_ms = 0; /* every round, so each test counts rounds, not seconds */
	o.maint_interval_ms = 0;
	cr_assert_eq(ro_imds_watch_new(m, &o, &w), 0);
	return w;
}

/* Poll rounds until none is left to report; the events in order. */
static size_t drain_events(struct ro_imds_watch *w, int rounds, struct ro_imds_event *ev,
			   size_t max)
{
	size_t n = 0;

	for (int i = 0; i < rounds; i++) {
		ro_imds_watch_poll(w);
		while (n < max && ro_imds_watch_next(w, 0, &ev[n]) == 0)
			n++;
	}
	return n;
}

static size_t count_kind(const struct ro_imds_event *ev, size_t n, enum ro_imds_event_kind k)
{
	size_t c = 0;

	for (size_t i = 0; i < n; i++)
		c += ev[i].kind == k;
	return c;
}

Test(watch, first_round_reports_lifecycle_only)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_watch *w = watcher(m, 1000);
	struct ro_imds_event ev[8];
	size_t n = drain_events(w, 3, ev, 8);

	cr_assert_eq(n, 1);
	cr_expect_eq(ev[0].kind, RO_IMDS_EV_LIFECYCLE);
	cr_expect_str_eq(ev[0].state, "InService");
	ro_imds_watch_free(w);
	ro_imds_free(m);
}

Test(watch, notice_reported_on_the_next_poll_once)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_watch *w = watcher(m, 200);
	struct ro_imds_event e, ev[8];
	uint64_t polls;
	int64_t fired;
	char line[1024];

	drain_events(w, 1, ev, 8);
	ctl("spot?in=0&action=terminate");
	fired = ro_test_wall_ms();
	polls = ro_imds_watch_polls(w);
	/* watch_next polls on its own schedule; the notice must come from the first poll
	 * after it was posted (the latency itself is measured by tests/bench/imds_bench) */
	cr_assert_eq(ro_imds_watch_next(w, 2000, &e), 0);
	cr_expect_eq(ro_imds_watch_polls(w), polls + 1);
	cr_expect_eq(e.kind, RO_IMDS_EV_INTERRUPTION);
	cr_expect_eq(e.action, RO_IMDS_TERMINATE);
	cr_expect_not(e.assumed);
	cr_expect_geq(e.deadline_ms, fired + 118000);
	cr_expect_leq(e.deadline_ms, fired + 121000);
	cr_assert_eq(ro_imds_event_json(&e, line, sizeof(line)), 0);
	cr_expect(strstr(line, "\"event\":\"interruption\"") && strstr(line, "\"action\":"
									    "\"terminate\""),
		  "%s", line);
	cr_expect_eq(drain_events(w, 5, ev, 8), 0, "fired once, reported once");
	ro_imds_watch_free(w);
	ro_imds_free(m);
}

Test(watch, moving_time_is_one_notice)
{
	/* amazon-ec2-metadata-mock moves the time with every request */
	struct ro_imds *m = client(0, false);
	struct ro_imds_watch *w = watcher(m, 100);
	struct ro_imds_event ev[8];
	size_t n;

	drain_events(w, 1, ev, 8);
	ctl("spot?in=0&moving=1");
	n = 0;
	for (int i = 0; i < 4; i++) {
		n += drain_events(w, 1, ev + n, 8 - n);
		ro_test_msleep(1100); /* the served time moves by a second */
	}
	cr_expect_eq(n, 1);
	cr_expect_eq(ev[0].kind, RO_IMDS_EV_INTERRUPTION);
	ro_imds_watch_free(w);
	ro_imds_free(m);
}

Test(watch, flapping_notice_is_one_notice)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_watch *w = watcher(m, 100);
	struct ro_imds_event ev[8];

	drain_events(w, 1, ev, 8);
	ctl("spot?in=0");
	cr_expect_eq(drain_events(w, 1, ev, 8), 1);
	ctl("clear");
	cr_expect_eq(drain_events(w, 2, ev, 8), 0, "404 after 200 does not cancel, nor repeat");
	ctl("spot?in=0");
	cr_expect_eq(drain_events(w, 2, ev, 8), 0, "200 again is the same notice");
	ro_imds_watch_free(w);
	ro_imds_free(m);
}

Test(watch, past_time_and_hibernate_now)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_watch *w = watcher(m, 100);
	struct ro_imds_event ev[8];
	char q[128];

	drain_events(w, 1, ev, 8);
	(void)snprintf(q, sizeof(q), "spot?in=0&action=hibernate&time=%lld",
		       (long long)(ro_test_wall_ms() / 1000 - 30));
	ctl(q);
	cr_assert_eq(drain_events(w, 1, ev, 8), 1);
	cr_expect_eq(ev[0].kind, RO_IMDS_EV_INTERRUPTION);
	cr_expect_eq(ev[0].action, RO_IMDS_HIBERNATE);
	cr_expect_lt(ev[0].deadline_ms, ev[0].at_ms, "a past time means drain now");
	cr_expect_str_eq(ev[0].detail, "notice time already past");
	ro_imds_watch_free(w);
	ro_imds_free(m);
}

Test(watch, unreadable_notice_is_assumed_interruption)
{
	static const char *const faults[] = {
	    "fault?kind=badbody&for=30&path=/latest/meta-data/spot/",
	    "fault?kind=wrongtypes&for=30&path=/latest/meta-data/spot/",
	    "fault?kind=huge&for=30&path=/latest/meta-data/spot/",
	};

	for (size_t i = 0; i < 3; i++) {
		struct ro_imds *m = client(0, false);
		struct ro_imds_watch *w = watcher(m, 100);
		struct ro_imds_event ev[8];

		size_t n;

		ctl("clear");
		ctl("spot?in=0");
		ctl(faults[i]);
		n = drain_events(w, 2, ev, 8);
		cr_assert_eq(n, 2, "%s: %zu events, first %s", faults[i], n,
			     n ? ro_imds_event_name(ev[0].kind) : "-"); /* + lifecycle */
		cr_expect_eq(ev[0].kind, RO_IMDS_EV_INTERRUPTION);
		cr_expect(ev[0].assumed);
		cr_expect_eq(ev[0].deadline_ms, ev[0].at_ms + 120000);
		cr_expect_eq(count_kind(ev, 2, RO_IMDS_EV_UNREACHABLE), 0);
		ro_imds_watch_free(w);
		ro_imds_free(m);
	}
}

Test(watch, rebalance_lifecycle_maintenance)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_watch *w = watcher(m, 100);
	struct ro_imds_event ev[16];
	char q[160];
	size_t n;

	drain_events(w, 1, ev, 16);
	ctl("rebalance?in=0");
	ctl("lifecycle?state=Terminated");
	n = drain_events(w, 3, ev, 16);
	cr_assert_eq(n, 2);
	cr_expect_eq(ev[0].kind, RO_IMDS_EV_REBALANCE);
	cr_expect_eq(ev[1].kind, RO_IMDS_EV_LIFECYCLE);
	cr_expect_str_eq(ev[1].state, "Terminated");
	cr_expect_str_eq(ev[1].detail, "InService");
	{
		char *r = ro_test_mock_ctl(&mk, "maintenance?code=instance-stop&in=7200");
		const char *id;

		cr_assert_not_null(r);
		id = strstr(r, "instance-event-");
		cr_assert_not_null(id);
		(void)snprintf(q, sizeof(q), "maintenance?cancel=%.31s", id);
		free(r);
	}
	n = drain_events(w, 2, ev, 16);
	cr_assert_eq(n, 1);
	cr_expect_eq(ev[0].kind, RO_IMDS_EV_MAINTENANCE);
	cr_expect_str_eq(ev[0].state, "instance-stop");
	ctl(q);
	n = drain_events(w, 2, ev, 16);
	cr_assert_eq(n, 1);
	cr_expect_eq(ev[0].kind, RO_IMDS_EV_MAINTENANCE_CANCELLED);
	ro_imds_watch_free(w);
	ro_imds_free(m);
}

Test(watch, slow_reads_at_their_own_pace)
{
	/* rebalance and lifecycle every slow_interval, the notice every round */
	struct ro_imds *m = client(0, false);
	struct ro_imds_watch_opts o;
	struct ro_imds_watch *w = NULL;
	struct ro_imds_event ev[8];
	static const char *const paths[] = {
	    "/latest/meta-data/spot/instance-action",
	    "/latest/meta-data/events/recommendations/rebalance",
	    "/latest/meta-data/autoscaling/target-lifecycle-state",
	    "/latest/meta-data/events/maintenance/scheduled",
	};
	long before[4], after[4];

	ro_imds_watch_opts_default(&o);
	o.interval_ms = 50;
	o.slow_interval_ms = 60000;
	o.maint_interval_ms = 60000;
	cr_assert_eq(ro_imds_watch_new(m, &o, &w), 0);
	cr_assert_eq(drain_events(w, 1, ev, 8), 1); /* first round reads everything */
	for (size_t i = 0; i < 4; i++)
		before[i] = ro_test_mock_path_count(&mk, paths[i]);
	cr_assert_gt(before[1], 0, "the first round read the rebalance");
	cr_expect_eq(drain_events(w, 10, ev, 8), 0);
	for (size_t i = 0; i < 4; i++)
		after[i] = ro_test_mock_path_count(&mk, paths[i]);
	/* the notice every round (a request the client retried counts twice: >=) */
	cr_expect_geq(after[0] - before[0], 10, "the notice read %ld times in 10 rounds",
		      after[0] - before[0]);
	for (size_t i = 1; i < 4; i++)
		cr_expect_eq(after[i], before[i], "%s read %ld times in 10 rounds", paths[i],
			     after[i] - before[i]);
	ro_imds_watch_free(w);
	ro_imds_free(m);
}

Test(watch, failures_reported_once_then_recovered)
{
	static const char *const faults[] = {
	    "fault?kind=500&for=30", "fault?kind=503&for=30",	  "fault?kind=429&for=30",
	    "fault?kind=drop&for=30", "fault?kind=truncated&for=30", "fault?kind=delay&for=30&ms=900",
	};

	for (size_t i = 0; i < sizeof(faults) / sizeof(faults[0]); i++) {
		struct ro_imds *m = client(0, false);
		struct ro_imds_watch *w = watcher(m, 50);
		struct ro_imds_event ev[8];
		size_t n;

		drain_events(w, 1, ev, 8);
		ctl(faults[i]);
		n = drain_events(w, 4, ev, 8);
		cr_assert_eq(n, 1, "%s: %zu events", faults[i], n);
		cr_expect_eq(ev[0].kind, RO_IMDS_EV_UNREACHABLE, "%s", faults[i]);
		cr_expect_lt(ev[0].error, 0);
		cr_expect_neq(ev[0].detail[0], '\0');
		ctl("clear");
		n = drain_events(w, 3, ev, 8);
		cr_assert_eq(n, 1, "%s", faults[i]);
		cr_expect_eq(ev[0].kind, RO_IMDS_EV_RECOVERED);
		ro_imds_watch_free(w);
		ro_imds_free(m);
	}
}

Test(watch, down_30s_then_back)
{
	struct ro_imds *m = client(0, false);
	struct ro_imds_watch *w = watcher(m, 1000);
	struct ro_imds_event e;
	size_t unreachable = 0, recovered = 0, other = 0;
	int port = mk.port;
	int64_t t0;

	cr_assert_eq(ro_imds_watch_next(w, 2000, &e), 0);
	cr_assert_eq(e.kind, RO_IMDS_EV_LIFECYCLE);
	ro_test_mock_kill(&mk);
	t0 = ro_test_wall_ms();
	while (ro_test_wall_ms() - t0 < 30000) {
		if (ro_imds_watch_next(w, 500, &e))
			continue;
		if (e.kind == RO_IMDS_EV_UNREACHABLE) {
			unreachable++;
			cr_expect_eq(e.error, -ECONNREFUSED);
		} else {
			other++;
		}
	}
	cr_expect_eq(unreachable, 1, "reported once, not once per poll");
	cr_assert_eq(ro_test_mock_start(&mk, port, (const char *const[]){"--imdsv2", NULL}), 0);
	t0 = ro_test_wall_ms();
	while (ro_test_wall_ms() - t0 < 3000) {
		if (ro_imds_watch_next(w, 500, &e))
			continue;
		if (e.kind == RO_IMDS_EV_RECOVERED)
			recovered++;
		else
			other++;
	}
	cr_expect_eq(recovered, 1);
	cr_expect_eq(other, 0);
	ro_imds_watch_free(w);
	ro_imds_free(m);
}
