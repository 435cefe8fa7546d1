/* imds_bench: how soon the watcher sees a Spot notice and what polling costs. Against the
 * mock IMDS on loopback: detection latency (the instant the mock makes a notice visible ->
 * the watcher's event) over many notices fired at random phases of the poll cycle, p50/p99,
 * at poll intervals 1 s (our default) and 0.2 s, beside aws-node-termination-handler's 2 s
 * interval measured the same way in the same run; and the CPU time the watcher spends per
 * hour of polling, measured over a window and extrapolated.
 *
 *   imds_bench [--notices N] [--baseline-notices N] [--cpu-seconds S] */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "imds/imds.h"
#include "tests/mock_fixture.h"
#include "tests/testutil.h"

static double cpu_s(void)
{
	struct rusage ru;

	(void)getrusage(RUSAGE_SELF, &ru);
	return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
	       ru.ru_stime.tv_usec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static double pct(const double *v, int n, double p)
{
	int i = (int)ceil(p * n) - 1;

	return v[i < 0 ? 0 : (i >= n ? n - 1 : i)];
}

struct row {
	uint32_t interval_ms;
	int notices;
	double p50, p99, max, cpu_per_hour;
};

static struct ro_imds *client(const struct ro_test_mock *mk)
{
	struct ro_imds_opts o;
	struct ro_imds *m = NULL;

	ro_imds_opts_default(&o);
	o.endpoint = mk->url;
	if (ro_imds_new(&o, &m))
		abort();
	return m;
}

static struct ro_imds_watch *watcher(struct ro_imds *m, uint32_t interval_ms)
{
	struct ro_imds_watch_opts o;
	struct ro_imds_watch *w = NULL;

	ro_imds_watch_opts_default(&o);
	o.interval_ms = interval_ms;
	if (ro_imds_watch_new(m, &o, &w))
		abort();
	return w;
}

static int latency(const struct ro_test_mock *mk, struct ro_imds *m, uint32_t interval_ms,
		   int notices, struct row *row)
{
	double *lat = calloc((size_t)notices, sizeof(*lat));
	int got = 0;

	if (!lat)
		return -ENOMEM;
	for (int i = 0; i < notices; i++) {
		struct ro_imds_watch *w = watcher(m, interval_ms);
		struct ro_imds_event e;
		char *rep;
		double appear;

		/* settle, then fire at a random phase of the poll cycle */
		while (ro_imds_watch_next(w, 0, &e) == 0)
			;
		(void)ro_imds_watch_next(w, (uint32_t)(rand() % (int)interval_ms), &e);
		rep = ro_test_mock_ctl(mk, "spot?in=0");
		if (!rep || !strstr(rep, "appear_epoch")) {
			free(rep);
			ro_imds_watch_free(w);
			continue;
		}
		appear = strtod(strstr(rep, "appear_epoch") + 15, NULL);
		free(rep);
		/* bounded: one notice never waits more than ten intervals */
		for (int k = 0; k < 10; k++) {
			if (ro_imds_watch_next(w, interval_ms, &e) == 0 &&
			    e.kind == RO_IMDS_EV_INTERRUPTION) {
				lat[got++] = (double)e.at_ms - appear * 1000.0;
				break;
			}
		}
		free(ro_test_mock_ctl(mk, "clear"));
		ro_imds_watch_free(w);
	}
	qsort(lat, (size_t)got, sizeof(*lat), cmp_d);
	row->interval_ms = interval_ms;
	row->notices = got;
	row->p50 = got ? pct(lat, got, 0.50) : NAN;
	row->p99 = got ? pct(lat, got, 0.99) : NAN;
	row->max = got ? lat[got - 1] : NAN;
	free(lat);
	return got == notices ? 0 : -EIO;
}

static double cpu_per_hour(struct ro_imds *m, uint32_t interval_ms, double seconds)
{
	struct ro_imds_watch *w = watcher(m, interval_ms);
	struct ro_imds_event e;
	int64_t end = ro_test_wall_ms() + (int64_t)(seconds * 1000);
	double c0 = cpu_s();
	uint64_t polls;

	while (ro_test_wall_ms() < end)
		(void)ro_imds_watch_next(w, (uint32_t)(end - ro_test_wall_ms()), &e);
	polls = ro_imds_watch_polls(w);
	ro_imds_watch_free(w);
	(void)polls;
	return (cpu_s() - c0) * 3600.0 / seconds;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"notices", required_argument, NULL, 'n'},
	    {"baseline-notices", required_argument, NULL, 'b'},
	    {"cpu-seconds", required_argument, NULL, 'c'},
	    {0},
	};
	struct ro_test_mock mk = {0};
	struct ro_imds *m;
	struct row rows[3];
	const uint32_t intervals[3] = {2000, 1000, 200};
	int notices = 50, base_notices = 20, ch, rc = 0;
	double cpu_seconds = 30;

	while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (ch == 'n')
			notices = atoi(optarg);
		else if (ch == 'b')
			base_notices = atoi(optarg);
		else if (ch == 'c')
			cpu_seconds = atof(optarg);
		else
			return 2;
	}
	if (notices < 1 || base_notices < 1 || !(cpu_seconds > 0) || cpu_seconds > 3600)
		return 2;
	srand((unsigned)ro_test_wall_ms());
	if (ro_test_mock_start(&mk, 0, (const char *const[]){"--imdsv2", NULL}))
		return 1;
	m = client(&mk);
	for (int i = 0; i < 3; i++) {
		(void)fprintf(stderr, "imds_bench: interval %u ms ...\n", intervals[i]);
		if (latency(&mk, m, intervals[i], i == 0 ? base_notices : notices, &rows[i]))
			rc = 1;
		rows[i].cpu_per_hour = cpu_per_hour(m, intervals[i], cpu_seconds);
	}
	(void)printf("\nSpot notice detection latency (mock makes it visible -> watcher event), "
		     "ms\n\n");
	(void)printf("%-34s %8s %8s %8s %8s %14s %12s\n", "watcher", "notices", "p50", "p99",
		     "max", "CPU s / hour", "p99 ratio");
	for (int i = 0; i < 3; i++) {
		char name[64];

		(void)snprintf(name, sizeof(name), "%s, interval %.1f s",
			       i == 0 ? "baseline (NTH's 2 s)" : "rolloutd",
			       intervals[i] / 1000.0);
		(void)printf("%-34s %8d %8.0f %8.0f %8.0f %14.3f %12.2f\n", name, rows[i].notices,
			     rows[i].p50, rows[i].p99, rows[i].max, rows[i].cpu_per_hour,
			     rows[i].p99 / rows[0].p99);
	}
	(void)printf("\np99 ratio = p99 / the 2 s baseline's p99 (lower is better). CPU is this "
		     "process's user+system time over %.0f s of polling, times 3600/%.0f.\n"
		     "Goal: p99 < 1200 ms at 1 s with < 1 s CPU per hour: %s.\n",
		     cpu_seconds, cpu_seconds,
		     rows[1].p99 < 1200 && rows[1].cpu_per_hour < 1.0 ? "met" : "NOT met");
	ro_imds_free(m);
	ro_test_mock_stop(&mk);
	return rc;
}
