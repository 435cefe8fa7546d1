/* Small helpers every test file wants: sleeping, reading the clocks, counting a JSON array. */
#pragma once

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static inline void ro_test_msleep(long ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};

	(void)nanosleep(&ts, NULL);
}

/* Wall-clock ms since the epoch (notice times, deadlines as the daemon sees them). */
static inline int64_t ro_test_wall_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Monotonic ms, for measuring waits. */
static inline int64_t ro_test_mono_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Elements of the JSON array after "key": in json, or of its first array with key NULL
 * (0 when absent or empty): the tokens of a checkpoint or a sample. */
static inline long ro_test_json_array_len(const char *json, const char *key)
{
	char pat[64];
	const char *p = json;
	long n = 1;

	if (p && key) {
		(void)snprintf(pat, sizeof(pat), "\"%s\":", key);
		p = strstr(p, pat);
	}
	if (!p || !(p = strchr(p, '[')) || p[1] == ']')
		return 0;
	for (; *p && *p != ']'; p++)
		n += *p == ',';
	return n;
}
