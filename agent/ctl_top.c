/* rolloutctl top: a live view of one queue, refreshed like top(1): pending, leased, done and
 * dead, a sparkline of sample throughput, the trainer's lag, one line per worker, and the
 * workers' state changes (drains) as they happen. When stdout is not a terminal it prints
 * plain lines instead: one summary a refresh and one line per state change. */
#include "config.h"

#include <errno.h>
#include <json-c/json.h>
#include <langinfo.h>
#include <locale.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "agent/ctl.h"
#include "queue/queue.h"

#define SPARK_LEN 40
#define EVENTS 8
#define MAX_SEEN 256
#define HIST 64
#define RATE_WINDOW_MS 5000

struct seen {
	char id[136];
	char state[24];
};

struct top {
	double rate[SPARK_LEN]; /* samples/s of the last refreshes, oldest first */
	unsigned n_rate;
	/* (time, samples) of the last refreshes: the rate is taken over RATE_WINDOW_MS, since
	 * samples land a unit's worth at a time and a per-refresh rate would mostly read 0 */
	int64_t hist_ms[HIST], hist_samples[HIST];
	unsigned n_hist;
	struct seen seen[MAX_SEEN];
	unsigned n_seen;
	char events[EVENTS][200];
	unsigned n_events;
	bool utf8;
};

static int64_t wall_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void clock_text(char out[16], int64_t ms)
{
	time_t t = (time_t)(ms / 1000);
	struct tm tm;

	(void)localtime_r(&t, &tm);
	(void)strftime(out, 16, "%H:%M:%S", &tm);
}

static void spark(const struct top *t, char *out, size_t len)
{
	static const char *const bars[] = {"\u2581", "\u2582", "\u2583", "\u2584",
					   "\u2585", "\u2586", "\u2587", "\u2588"};
	static const char ascii[] = "_.-:=+*#";
	double mx = 0;
	size_t off = 0;

	for (unsigned i = 0; i < t->n_rate; i++)
		if (t->rate[i] > mx)
			mx = t->rate[i];
	out[0] = '\0';
	for (unsigned i = 0; i < t->n_rate && off + 4 < len; i++) {
		int k = mx > 0 ? (int)(t->rate[i] / mx * 7.0 + 0.5) : 0;

		if (k < 0)
			k = 0;
		if (k > 7)
			k = 7;
		if (t->utf8) {
			size_t bl = strlen(bars[k]);

			memcpy(out + off, bars[k], bl);
			off += bl;
		} else {
			out[off++] = ascii[k];
		}
		out[off] = '\0';
	}
}

static const char *field(struct json_object *o, const char *k, char *buf, size_t len)
{
	struct json_object *v;

	if (!o || !json_object_object_get_ex(o, k, &v))
		return "-";
	(void)snprintf(buf, len, "%s", json_object_get_string(v));
	return buf;
}

/* "HH:MM:SS  worker ID: what" (printed at once in plain mode, else kept for the screen) */
static void event(struct top *t, bool plain, const char *id, const char *what)
{
	char when[16], line[200];

	clock_text(when, wall_ms());
	(void)snprintf(line, sizeof(line), "%s  worker %.128s: %s", when, id, what);
	if (plain) {
		(void)printf("%s\n", line);
		return;
	}
	if (t->n_events == EVENTS) {
		memmove(t->events[0], t->events[1], sizeof(t->events[0]) * (EVENTS - 1));
		t->n_events--;
	}
	(void)snprintf(t->events[t->n_events++], sizeof(t->events[0]), "%s", line);
}

/* A worker's state against the last refresh's: a change (a drain starting, drained, back to
 * running) is an event; a worker first seen after the first refresh is one too. */
static void track(struct top *t, bool plain, bool first, const char *id, const char *state)
{
	for (unsigned i = 0; i < t->n_seen; i++) {
		if (strcmp(t->seen[i].id, id))
			continue;
		if (strcmp(t->seen[i].state, state)) {
			char what[64];

			(void)snprintf(what, sizeof(what), "%s -> %s", t->seen[i].state, state);
			event(t, plain, id, what);
		}
		(void)snprintf(t->seen[i].state, sizeof(t->seen[i].state), "%s", state);
		return;
	}
	if (t->n_seen == MAX_SEEN)
		return;
	(void)snprintf(t->seen[t->n_seen].id, sizeof(t->seen[0].id), "%s", id);
	(void)snprintf(t->seen[t->n_seen].state, sizeof(t->seen[0].state), "%s", state);
	t->n_seen++;
	if (!first) {
		char what[64];

		(void)snprintf(what, sizeof(what), "joined (%s)", state);
		event(t, plain, id, what);
	}
}

static int by_id(const void *a, const void *b)
{
	return strcmp(((const struct ro_worker_info *)a)->id, ((const struct ro_worker_info *)b)->id);
}

static void refresh(struct top *t, const char *queue, struct ro_queue *q, bool plain, bool first)
{
	struct ro_queue_stats s;
	int64_t now = wall_ms();
	char when[16], sp[SPARK_LEN * 4 + 1];
	double r = 0, tps_all = 0;
	int e = ro_queue_stats(q, &s);

	clock_text(when, now);
	if (e) {
		if (plain)
			(void)printf("%s queue %s: %s\n", when, queue, ro_queue_errmsg(q));
		else
			(void)printf("\033[H\033[2Jrolloutctl top  %s  queue %s\n\n  redis: %s\n",
				     when, queue, ro_queue_errmsg(q));
		(void)fflush(stdout);
		return;
	}
	if (t->n_hist == HIST) {
		memmove(t->hist_ms, t->hist_ms + 1, sizeof(t->hist_ms[0]) * (HIST - 1));
		memmove(t->hist_samples, t->hist_samples + 1, sizeof(t->hist_samples[0]) * (HIST - 1));
		t->n_hist--;
	}
	t->hist_ms[t->n_hist] = now;
	t->hist_samples[t->n_hist++] = s.samples;
	if (t->n_hist > 1) {
		unsigned k = 0;

		/* the oldest refresh within the window (or the one just outside it) */
		while (k + 1 < t->n_hist - 1 && now - t->hist_ms[k + 1] >= RATE_WINDOW_MS)
			k++;
		if (now > t->hist_ms[k])
			r = (double)(s.samples - t->hist_samples[k]) * 1000.0 /
			    (double)(now - t->hist_ms[k]);
		if (r < 0)
			r = 0;
		if (t->n_rate == SPARK_LEN) {
			memmove(t->rate, t->rate + 1, sizeof(t->rate[0]) * (SPARK_LEN - 1));
			t->n_rate--;
		}
		t->rate[t->n_rate++] = r;
	}
	qsort(s.workers, s.n_workers, sizeof(s.workers[0]), by_id);
	for (uint32_t i = 0; i < s.n_workers; i++) {
		struct json_object *o = json_tokener_parse(s.workers[i].fields), *v;

		/* a drained worker's last rate is history, not throughput */
		if (o && json_object_object_get_ex(o, "tokens_per_s", &v) &&
		    !strstr(s.workers[i].fields, "\"drained\""))
			tps_all += json_object_get_double(v);
		json_object_put(o);
	}
	spark(t, sp, sizeof(sp));
	if (plain)
		(void)printf("%s queue %s pending %lld leased %lld done %lld dead %lld samples %lld "
			     "(%.1f/s) lag %lld workers %u\n",
			     when, queue, (long long)s.pending, (long long)s.leased,
			     (long long)s.done, (long long)s.dead, (long long)s.samples, r,
			     (long long)s.lag, s.n_workers);
	else
		(void)printf("\033[H\033[2Jrolloutctl top  %s  queue %s on %s %s  (q quits)\n\n"
			     "  pending %-8lld leased %-8lld done %-8lld dead %lld\n"
			     "  samples %-8lld %.1f/s  %s  (%.0f tokens/s)\n"
			     "  trainer lag %lld (%u consumer group%s)\n\n"
			     "  %-24s %-10s %6s %9s %9s %7s %9s\n",
			     when, queue, ro_queue_mode(q), ro_queue_node(q), (long long)s.pending,
			     (long long)s.leased, (long long)s.done, (long long)s.dead,
			     (long long)s.samples, r, sp, tps_all, (long long)s.lag, s.n_groups,
			     s.n_groups == 1 ? "" : "s", "WORKER", "STATE", "UNITS", "IN-FLIGHT",
			     "TOKENS/S", "POLICY", "SEEN");
	for (uint32_t i = 0; i < s.n_workers; i++) {
		struct json_object *o = json_tokener_parse(s.workers[i].fields);
		char st[24], un[16], fl[16], tps[24], pv[24];

		if (o && !json_object_is_type(o, json_type_object)) {
			json_object_put(o);
			o = NULL;
		}
		(void)field(o, "state", st, sizeof(st));
		track(t, plain, first, s.workers[i].id, st);
		if (!plain)
			(void)printf("  %-24.24s %-10s %6s %9s %9s %7s %8.1fs\n", s.workers[i].id,
				     field(o, "state", st, sizeof(st)),
				     field(o, "units", un, sizeof(un)),
				     field(o, "in_flight", fl, sizeof(fl)),
				     field(o, "tokens_per_s", tps, sizeof(tps)),
				     field(o, "policy_version", pv, sizeof(pv)),
				     (double)s.workers[i].age_ms / 1000.0);
		json_object_put(o);
	}
	if (!plain) {
		if (t->n_events)
			(void)printf("\n  events\n");
		for (unsigned i = 0; i < t->n_events; i++)
			(void)printf("  %s\n", t->events[i]);
		for (uint32_t i = 0; i < s.n_warnings; i++)
			(void)printf("  ! %s\n", s.warnings[i]);
	}
	(void)fflush(stdout);
	ro_queue_stats_clear(&s);
}

int ro_ctl_top(struct ro_queue *q, const char *queue, long interval, long iterations, bool plain,
	       volatile sig_atomic_t *stop)
{
	struct termios old, raw;
	bool tty_in = false;
	struct top *t;
	int rc = 0;

	if (interval < 100 || interval > 3600000) {
		(void)fprintf(stderr, "rolloutctl: top: --interval is 100 to 3600000 ms\n");
		return EXIT_USAGE;
	}
	plain = plain || !isatty(STDOUT_FILENO);
	t = calloc(1, sizeof(*t));
	if (!t)
		return EXIT_FAILURE;
	(void)setlocale(LC_CTYPE, "");
	t->utf8 = !strcmp(nl_langinfo(CODESET), "UTF-8");
	/* keys without Enter, no echo: 'q' quits; restored on the way out */
	if (!plain && isatty(STDIN_FILENO) && tcgetattr(STDIN_FILENO, &old) == 0) {
		raw = old;
		raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
		raw.c_cc[VMIN] = 0;
		raw.c_cc[VTIME] = 0;
		tty_in = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
	}
	if (!plain)
		(void)printf("\033[?25l"); /* hide the cursor */
	for (long n = 0; !*stop && (iterations < 0 || n < iterations); n++) {
		struct pollfd p = {.fd = STDIN_FILENO, .events = POLLIN};
		int64_t until;

		refresh(t, queue, q, plain, n == 0);
		if (iterations >= 0 && n + 1 >= iterations)
			break;
		until = wall_ms() + interval;
		for (int64_t left = interval; left > 0 && !*stop; left = until - wall_ms()) {
			char ch;

			if (poll(&p, tty_in ? 1 : 0, (int)left) > 0 &&
			    read(STDIN_FILENO, &ch, 1) == 1 && (ch == 'q' || ch == 'Q'))
				*stop = 1;
		}
	}
	if (!plain)
		(void)printf("\033[?25h\n");
	if (tty_in)
		(void)tcsetattr(STDIN_FILENO, TCSANOW, &old);
	free(t);
	return rc;
}
