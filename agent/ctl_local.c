/* rolloutctl drain and status --local: talk to the daemon on this node through its control
 * socket (a line in, a JSON line out). They are the DaemonSet's preStop hook and probes:
 * `drain --wait` returns once the daemon has drained and exited; `status --local --ready`
 * fails once it drains; `--live` fails when its main loop stopped making progress. */
#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "agent/ctl.h"

static const char *default_socket(void)
{
	const char *s = getenv("ROLLOUTD_CONTROL_SOCKET");

	return s && *s ? s : "/run/rolloutd/control.sock";
}

static int64_t mono_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One request; the reply in buf. -errno when the daemon cannot be reached. The whole
 * exchange (connect, request, reply) ends within ASK_MS, the bound the probes' timeouts
 * are set against (the DaemonSet's timeoutSeconds: 15): the daemon answers between decode
 * steps, so allow for a long one, but never more. */
#define ASK_MS 10000
static int ask(const char *path, const char *req, char *buf, size_t len)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int64_t until = mono_ms() + ASK_MS;
	size_t got = 0, sent = 0, rl = strlen(req);
	int fd, r = 0;

	buf[0] = '\0';
	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	(void)strcpy(sa.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return -errno;
	/* a full backlog (a stuck daemon) answers EAGAIN: try again until the deadline */
	while (connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
		if (errno != EAGAIN || mono_ms() >= until) {
			r = errno == EAGAIN ? -ETIMEDOUT : -errno;
			(void)close(fd);
			return r;
		}
		(void)poll(NULL, 0, 10);
	}
	while (got + 1 < len) {
		struct pollfd p = {.fd = fd, .events = sent < rl ? POLLOUT : POLLIN};
		int64_t left = until - mono_ms();
		ssize_t n;

		if (left <= 0 || poll(&p, 1, (int)left) != 1)
			break;
		if (sent < rl) {
			n = write(fd, req + sent, rl - sent);
			if (n < 0 && errno != EAGAIN && errno != EINTR)
				break;
			sent += n > 0 ? (size_t)n : 0;
			continue;
		}
		n = read(fd, buf + got, len - got - 1);
		if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
			break;
		got += n > 0 ? (size_t)n : 0;
		buf[got] = '\0';
		if (memchr(buf, '\n', got))
			break;
	}
	buf[got] = '\0';
	(void)close(fd);
	if (sent < rl && !got)
		return -EIO;
	return got ? 0 : -ETIMEDOUT;
}

static double field_num(const char *json, const char *key)
{
	char pat[64];
	const char *p;

	(void)snprintf(pat, sizeof(pat), "\"%s\":", key);
	p = strstr(json, pat);
	return p ? strtod(p + strlen(pat), NULL) : -1;
}

static bool field_is(const char *json, const char *key, const char *val)
{
	char pat[96];

	(void)snprintf(pat, sizeof(pat), "\"%s\":\"%s\"", key, val);
	return strstr(json, pat) != NULL;
}

int ro_ctl_drain(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"deadline", required_argument, NULL, 'd'},
	    {"wait", no_argument, NULL, 'w'},
	    {"socket", required_argument, NULL, 's'},
	    {"json", no_argument, NULL, 'j'},
	    {"help", no_argument, NULL, 'h'},
	    {0},
	};
	const char *path = default_socket();
	double deadline = -1;
	bool wait = false;
	char req[64], rep[2048];
	int ch, r;

	optind = 1;
	while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		char *end;

		switch (ch) {
		case 'd':
			deadline = strtod(optarg, &end);
			if (*end || !(deadline >= 0) || deadline > 86400) {
				(void)fprintf(stderr, "rolloutctl: --deadline wants seconds >= 0\n");
				return EXIT_USAGE;
			}
			break;
		case 'w': wait = true; break;
		case 's': path = optarg; break;
		case 'j': break;
		case 'h':
			(void)puts("usage: rolloutctl drain [--deadline S] [--wait] [--socket PATH]");
			return 0;
		default:
			return EXIT_USAGE;
		}
	}
	if (optind != argc)
		return EXIT_USAGE;
	if (deadline >= 0)
		(void)snprintf(req, sizeof(req), "drain %.3f\n", deadline);
	else
		(void)snprintf(req, sizeof(req), "drain\n");
	r = ask(path, req, rep, sizeof(rep));
	if (r) {
		(void)fprintf(stderr, "rolloutctl: %s: %s (is rolloutd running?)\n", path,
			      strerror(-r));
		return 1;
	}
	(void)fputs(rep, stdout);
	if (!wait)
		return 0;
	/* until the daemon is gone (or says drained); bounded by its deadline plus a minute */
	{
		double limit = field_num(rep, "deadline_in_s") + 60;
		struct timespec t0, t;

		(void)clock_gettime(CLOCK_MONOTONIC, &t0);
		for (;;) {
			(void)usleep(200000);
			(void)clock_gettime(CLOCK_MONOTONIC, &t);
			if (ask(path, "status\n", rep, sizeof(rep)) || field_is(rep, "state", "drained"))
				return 0;
			if ((double)(t.tv_sec - t0.tv_sec) > limit) {
				(void)fprintf(stderr, "rolloutctl: still draining after %.0f s\n", limit);
				return 1;
			}
		}
	}
}

int ro_ctl_status_local(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"local", no_argument, NULL, 'l'},
	    {"ready", no_argument, NULL, 'r'},
	    {"live", no_argument, NULL, 'v'},
	    {"max-loop-age-ms", required_argument, NULL, 'm'},
	    {"socket", required_argument, NULL, 's'},
	    {"json", no_argument, NULL, 'j'},
	    {0},
	};
	const char *path = default_socket();
	bool ready = false, live = false;
	double max_age = 60000;
	char rep[8192];
	int ch, r;

	optind = 1;
	while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (ch) {
		case 'l': case 'j': break;
		case 'r': ready = true; break;
		case 'v': live = true; break;
		case 'm': max_age = strtod(optarg, NULL); break;
		case 's': path = optarg; break;
		default: return EXIT_USAGE;
		}
	}
	r = ask(path, "status\n", rep, sizeof(rep));
	if (r) {
		(void)fprintf(stderr, "rolloutctl: %s: %s (is rolloutd running?)\n", path,
			      strerror(-r));
		return 1;
	}
	(void)fputs(rep, stdout);
	if (ready && !(field_is(rep, "state", "running") && strstr(rep, "\"ready\":true")))
		return 1;
	if (live && !(field_num(rep, "loop_age_ms") >= 0 && field_num(rep, "loop_age_ms") < max_age))
		return 1;
	return 0;
}
