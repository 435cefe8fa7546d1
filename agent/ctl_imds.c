/* rolloutctl imds: `imds watch` prints the interruption watcher's events as JSON lines
 * (on an instance or against the mock), `imds mock` starts the mock IMDS, `imds get PATH`
 * reads one metadata path through the same client the daemon uses. */
#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "agent/ctl.h"
#include "imds/imds.h"

static void imds_usage(FILE *f)
{
	(void)fputs(
	    "usage: rolloutctl imds watch [--endpoint URL] [--interval S] [--count N]\n"
	    "                             [--timeout S] [--v1-fallback]\n"
	    "       rolloutctl imds get PATH [--endpoint URL]   (PATH below /latest/)\n"
	    "       rolloutctl imds mock [mock options]         (--help for the mock's)\n"
	    "\n"
	    "watch prints one JSON line per event: interruption, rebalance, lifecycle,\n"
	    "maintenance, maintenance-cancelled, unreachable, recovered. The endpoint defaults\n"
	    "to ROLLOUTD_IMDS_ENDPOINT or http://169.254.169.254.\n",
	    f);
}

/* The mock ships as a Python script installed in pkgdatadir. An installed rolloutctl
 * names nothing of the tree it was built in: run from a build directory, point
 * ROLLOUTCTL_IMDS_MOCK at the source tree's imds/mock_imds.py. */
static const char *mock_path(void)
{
	const char *env = getenv("ROLLOUTCTL_IMDS_MOCK");

	return env && *env ? env : RO_PKGDATADIR "/mock_imds.py";
}

static int cmd_mock(int argc, char **argv)
{
	char **av = calloc((size_t)argc + 3, sizeof(*av));

	if (!av)
		return EXIT_FAILURE;
	av[0] = "python3";
	av[1] = (char *)mock_path();
	for (int i = 0; i < argc; i++)
		av[i + 2] = argv[i];
	(void)execvp("python3", av);
	(void)fprintf(stderr, "rolloutctl: cannot run python3 %s: %s\n", av[1], strerror(errno));
	free(av);
	return EXIT_FAILURE;
}

static volatile sig_atomic_t watch_stop;

static void on_stop(int sig)
{
	(void)sig;
	watch_stop = 1;
}

int ro_ctl_imds(int argc, char **argv)
{
	enum { O_ENDPOINT = 256, O_INTERVAL, O_COUNT, O_TIMEOUT, O_V1 };
	static const struct option opts[] = {
	    {"endpoint", required_argument, NULL, O_ENDPOINT},
	    {"interval", required_argument, NULL, O_INTERVAL},
	    {"count", required_argument, NULL, O_COUNT},
	    {"timeout", required_argument, NULL, O_TIMEOUT},
	    {"v1-fallback", no_argument, NULL, O_V1},
	    {"help", no_argument, NULL, 'h'},
	    {0},
	};
	struct ro_imds_opts io;
	struct ro_imds_watch_opts wo;
	struct ro_imds *m = NULL;
	struct ro_imds_watch *w = NULL;
	double interval = 1.0, timeout = 0;
	long count = 0, seen = 0;
	const char *sub;
	int ch, r, rc = EXIT_FAILURE;

	if (argc < 1) {
		imds_usage(stderr);
		return EXIT_USAGE;
	}
	sub = argv[0];
	if (!strcmp(sub, "mock"))
		return cmd_mock(argc - 1, argv + 1);
	ro_imds_opts_default(&io);
	ro_imds_watch_opts_default(&wo);
	if (getenv("ROLLOUTD_IMDS_ENDPOINT") && *getenv("ROLLOUTD_IMDS_ENDPOINT"))
		io.endpoint = getenv("ROLLOUTD_IMDS_ENDPOINT");
	optind = 1;
	while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		char *end = NULL;

		switch (ch) {
		case O_ENDPOINT:
			io.endpoint = optarg;
			break;
		case O_INTERVAL:
		case O_TIMEOUT: {
			double v = strtod(optarg, &end);

			if (!end || *end || !(v > 0) || v > 86400) {
				(void)fprintf(stderr, "rolloutctl: --%s wants seconds > 0, got \"%s\"\n",
					      ch == O_INTERVAL ? "interval" : "timeout", optarg);
				return EXIT_USAGE;
			}
			if (ch == O_INTERVAL)
				interval = v;
			else
				timeout = v;
			break;
		}
		case O_COUNT:
			count = strtol(optarg, &end, 10);
			if (!end || *end || count < 1) {
				(void)fprintf(stderr, "rolloutctl: --count wants N >= 1\n");
				return EXIT_USAGE;
			}
			break;
		case O_V1:
			io.v1_fallback = true;
			break;
		case 'h':
			imds_usage(stdout);
			return EXIT_SUCCESS;
		default:
			imds_usage(stderr);
			return EXIT_USAGE;
		}
	}
	if (strcmp(sub, "watch") && strcmp(sub, "get")) {
		(void)fprintf(stderr, "rolloutctl: unknown imds command \"%s\"\n", sub);
		imds_usage(stderr);
		return EXIT_USAGE;
	}
	if (!strcmp(sub, "get") && optind != argc - 1) {
		imds_usage(stderr);
		return EXIT_USAGE;
	}
	r = ro_imds_new(&io, &m);
	if (r) {
		(void)fprintf(stderr, "rolloutctl: imds endpoint \"%s\": %s\n", io.endpoint,
			      strerror(-r));
		return EXIT_USAGE;
	}
	if (!strcmp(sub, "get")) {
		char *body = NULL;

		r = ro_imds_get(m, argv[optind], &body, NULL);
		if (r) {
			(void)fprintf(stderr, "rolloutctl: %s\n", ro_imds_errmsg(m));
		} else {
			(void)printf("%s\n", body);
			rc = EXIT_SUCCESS;
		}
		free(body);
		goto out;
	}
	wo.interval_ms = (uint32_t)(interval * 1000);
	r = ro_imds_watch_new(m, &wo, &w);
	if (r)
		goto out;
	{
		struct sigaction sa = {.sa_handler = on_stop};

		(void)sigaction(SIGINT, &sa, NULL);
		(void)sigaction(SIGTERM, &sa, NULL);
	}
	{
		uint64_t start = (uint64_t)time(NULL);

		rc = EXIT_SUCCESS;
		while (!watch_stop && (!count || seen < count)) {
			struct ro_imds_event e;
			char line[1024];

			if (timeout > 0 && (double)((uint64_t)time(NULL) - start) >= timeout)
				break;
			/* short waits keep SIGINT prompt */
			if (ro_imds_watch_next(w, 200, &e))
				continue;
			if (!ro_imds_event_json(&e, line, sizeof(line))) {
				(void)printf("%s\n", line);
				(void)fflush(stdout);
			}
			seen++;
		}
	}
out:
	ro_imds_watch_free(w);
	ro_imds_free(m);
	return rc;
}
