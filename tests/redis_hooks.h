/* The PRE_ALL/POST_ALL hooks that start and stop a test binary's own redis-server.
 * Include once per test binary: the tests then find it through ro_test_redis_url(). */
#pragma once

#include <criterion/criterion.h>
#include <criterion/hooks.h>
#include <stdlib.h>

#include "tests/redis_fixture.h"

static struct ro_test_redis ro_test_shared_redis;

ReportHook(PRE_ALL)(struct criterion_test_set *set)
{
	(void)set;
	if (ro_test_redis_start(&ro_test_shared_redis, false))
		abort();
	(void)setenv("RO_TEST_REDIS_URL", ro_test_shared_redis.url, 1);
	(void)setenv("RO_TEST_REDIS_SOCK", ro_test_shared_redis.sock, 1);
}

ReportHook(POST_ALL)(struct criterion_global_stats *stats)
{
	(void)stats;
	ro_test_redis_stop(&ro_test_shared_redis);
}
