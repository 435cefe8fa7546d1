/* Test fixture: a real rolloutd process (fork/exec, its stderr in a log file, killed with
 * the test by PR_SET_PDEATHSIG) and its control socket. Shared by the tests that run the
 * daemon: test_agent and test_managed. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

struct ro_test_agent {
	pid_t pid;
	char name[32], sock[160], log[160], metrics[160];
};

/* The binary named by env (RO_ROLLOUTD, RO_ROLLOUTCTL), else ./name. */
const char *ro_test_bin(const char *env, const char *name);

/* Start rolloutd as worker `name` on queue q of url, with the model, its socket, log and
 * metrics file in dir, one model thread, debug logs, IMDS at a loopback port nobody serves
 * (tests touch loopback only); extra flags after (they win), env
 * pairs (NAME, VALUE, ..., NULL) set in the child. */
void ro_test_agent_start(struct ro_test_agent *ag, const char *dir, const char *model,
			 const char *url, const char *name, const char *q,
			 const char *const *extra, const char *const *env);
/* SIGTERM, sent once the agent catches it (never into its start-up). */
void ro_test_agent_term(const struct ro_test_agent *ag);
/* Exit status (or -1 if still running after ms, then killed). */
int ro_test_agent_wait_exit(struct ro_test_agent *ag, long ms);
void ro_test_agent_dump_log(const struct ro_test_agent *ag);
/* The daemon's answer to req through its control socket ("" when unreachable). */
const char *ro_test_agent_status(const struct ro_test_agent *ag, const char *req);
/* A line of the log matches what (a basic regular expression, as grep takes). */
bool ro_test_agent_log_has(const struct ro_test_agent *ag, const char *what);

/* A number field of a flat JSON object (-1 when absent; true is 1, false 0). */
double ro_test_json_field(const char *json, const char *key);
/* ro_test_json_field of the daemon's status. */
double ro_test_agent_field(const struct ro_test_agent *ag, const char *key);

/* rolloutctl with the arguments (NULL-terminated): its exit status; its stdout and stderr
 * in out. */
int ro_test_ctl(char *out, size_t len, ...) __attribute__((sentinel));

/* Sanitized builds decode ~10x slower: tests scale their work down, not their checks. */
unsigned ro_test_scaled(unsigned tokens);
