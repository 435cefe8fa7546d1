/* Test fixture: the project's mock IMDS (imds/mock_imds.py) on a free loopback port,
 * started by a test or a benchmark and always stopped (PR_SET_PDEATHSIG covers a crashed
 * runner), with helpers to drive its /_mock control API. */
#pragma once

#include <stdbool.h>
#include <sys/types.h>

struct ro_test_mock {
	pid_t pid;
	int port;
	char dir[64];
	char url[64];
};

/* Start with extra mock options (NULL-terminated list, may be NULL). port 0: any. */
int ro_test_mock_start(struct ro_test_mock *mk, int port, const char *const *args);
void ro_test_mock_kill(struct ro_test_mock *mk); /* SIGKILL; port kept for a restart */
void ro_test_mock_stop(struct ro_test_mock *mk);
/* POST /_mock/<what>; the JSON reply (caller frees), NULL on failure. */
char *ro_test_mock_ctl(const struct ro_test_mock *mk, const char *what);
/* A counter of GET /_mock/state ("put", "get", "401", "control"); -1 on failure. */
long ro_test_mock_count(const struct ro_test_mock *mk, const char *name);
/* GETs of one path ("/latest/meta-data/..."), retries included; 0 if never asked. */
long ro_test_mock_path_count(const struct ro_test_mock *mk, const char *path);
/* A number of the state ("spot.appear_epoch"); NAN on failure. */
double ro_test_mock_number(const struct ro_test_mock *mk, const char *a, const char *b);
