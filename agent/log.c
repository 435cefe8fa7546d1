/* ro_log: checks the level before formatting, saves errno, writes one line at a time. */
#include "agent/log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

int ro_log_level = LOG_INFO;

int64_t ro_now_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

double ro_now_ms_f(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int64_t ro_wall_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void vlog(int prio, const char *fmt, va_list ap)
{
	char line[1024];
	int n;
	int saved = errno;

	/* the "<N>" of sd-daemon.h: journald takes it as the priority */
	n = snprintf(line, sizeof(line), "<%d>", prio);
	(void)vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
	(void)strcat(line, "\n");
	(void)fputs(line, stderr);
	errno = saved;
}

void ro_log(int prio, const char *fmt, ...)
{
	va_list ap;

	if (prio > ro_log_level)
		return;
	va_start(ap, fmt);
	vlog(prio, fmt, ap);
	va_end(ap);
}

int ro_log_errno(int r, const char *fmt, ...)
{
	va_list ap;

	if (LOG_ERR <= ro_log_level) {
		va_start(ap, fmt);
		vlog(LOG_ERR, fmt, ap);
		va_end(ap);
	}
	return r;
}

void ro_log_limited(int64_t *last, int64_t interval_ms, int prio, const char *fmt, ...)
{
	va_list ap;
	int64_t now = ro_now_ms();

	if (prio > ro_log_level || (*last && now - *last < interval_ms))
		return;
	*last = now;
	va_start(ap, fmt);
	vlog(prio, fmt, ap);
	va_end(ap);
}
