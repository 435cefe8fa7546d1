/* Small helpers every test file wants: sleeping and reading the clocks. */
#pragma once

#include <stdint.h>
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
