/* Logging for agent/ only: one line per event to stderr with sd-daemon's "<N>" priority
 * prefix, which journald and `kubectl logs` both read. Libraries never log. */
#pragma once

#include <stdint.h>
#include <syslog.h> /* LOG_ERR (3) ... LOG_DEBUG (7): the numbers sd-daemon prefixes carry */

/* LOG_ERR ... LOG_DEBUG; default LOG_INFO */
extern int ro_log_level;

void ro_log(int prio, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Log and return r (a -errno) in one step. */
int ro_log_errno(int r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* At most one line per interval_ms for a given *last (monotonic ms): for what repeats. */
void ro_log_limited(int64_t *last, int64_t interval_ms, int prio, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int64_t ro_now_ms(void);  /* monotonic */
double ro_now_ms_f(void); /* monotonic, at the clock's resolution (a step's time) */
int64_t ro_wall_ms(void); /* since the epoch */
