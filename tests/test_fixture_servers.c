/* The test fixtures themselves: TLS (and mTLS) servers, passwords and ACL files, a Redis
 * Cluster (slot owners, failover by kill and by CLUSTER FAILOVER, a slot migrated in steps)
 * and a sentinel group whose primary is killed. Everything through redis-cli, which (unlike
 * the project's hiredis 0.14) speaks TLS. Each test stops what it started in .fini, also
 * when an assertion ends it early. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/redis_fixture.h"
#include "tests/testutil.h"

static struct ro_test_redis R1, R2;
static struct ro_test_cluster C;
static struct ro_test_sentinel S;

static void stop_all(void)
{
	ro_test_redis_stop(&R2);
	ro_test_redis_stop(&R1);
	ro_test_cluster_stop(&C);
	ro_test_sentinel_stop(&S);
}

TestSuite(fixture, .fini = stop_all, .timeout = 120);

static char OUT[65536];

/* redis-cli on r; the exit status must be want, and stdout begin with prefix */
#define CLI(r, want, prefix, ...)                                                               \
	do {                                                                                    \
		int rc_ = ro_test_redis_cli((r), OUT, sizeof(OUT), __VA_ARGS__, (char *)NULL);  \
		cr_assert_eq(rc_, (want), "redis-cli %s: exit %d: %s", #__VA_ARGS__, rc_, OUT); \
		cr_assert(!strncmp(OUT, (prefix), strlen(prefix)),                              \
			  "redis-cli %s: '%s', want '%s...'", #__VA_ARGS__, OUT, (prefix));     \
	} while (0)

static bool exists(const char *dir, const char *name)
{
	char p[512];

	(void)snprintf(p, sizeof(p), "%s/%s", dir, name);
	return access(p, R_OK) == 0;
}

Test(fixture, tls_server)
{
	const char *files[] = {"ca.crt",     "ca.key",	   "server.crt",   "server.key",
			       "client.crt", "client.key", "other-ca.crt", "other-ca.key"};
	struct ro_test_redis bad;
	char dir[200], want[64];

	cr_assert_eq(ro_test_redis_start_opts(&R1, &(struct ro_test_redis_opts){.tls = true}), 0);
	(void)snprintf(want, sizeof(want), "rediss://127.0.0.1:%d", R1.port);
	cr_assert_str_eq(R1.url, want);
	for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++)
		cr_assert(exists(R1.certdir, files[i]), "%s/%s missing", R1.certdir, files[i]);
	cr_assert(strstr(R1.ca, "/ca.crt"));
	CLI(&R1, 0, "PONG\n", "PING");
	CLI(&R1, 0, "OK", "SET", "k", "v1");
	CLI(&R1, 0, "v1\n", "GET", "k");
	CLI(&R1, 0, "port\n0\n", "CONFIG", "GET", "port");
	CLI(&R1, 1, "", "NOSUCHCOMMAND"); /* an error reply is an exit status */

	/* the server's certificate does not verify against an unrelated CA */
	bad = R1;
	(void)snprintf(bad.ca, sizeof(bad.ca), "%s/other-ca.crt", R1.certdir);
	cr_assert_neq(ro_test_redis_cli(&bad, OUT, sizeof(OUT), "PING", (char *)NULL), 0);
	cr_assert_null(strstr(OUT, "PONG"), "%s", OUT);
	/* and the TLS port speaks no plain text */
	bad = R1;
	bad.tls = false;
	cr_assert_neq(ro_test_redis_cli(&bad, OUT, sizeof(OUT), "PING", (char *)NULL), 0);
	cr_assert_null(strstr(OUT, "PONG"), "%s", OUT);

	/* restart keeps port, TLS and data directory */
	cr_assert_eq(ro_test_redis_restart(&R1), 0);
	CLI(&R1, 0, "PONG\n", "PING");
	(void)snprintf(dir, sizeof(dir), "%s", R1.dir);
	ro_test_redis_stop(&R1);
	cr_assert_neq(access(dir, F_OK), 0, "%s left behind", dir);
}

Test(fixture, mtls_and_tls_replica)
{
	struct ro_test_redis bad;
	char rof[64];

	cr_assert_eq(ro_test_redis_start_opts(
			 &R1, &(struct ro_test_redis_opts){.tls = true, .tls_auth_clients = true}),
		     0);
	CLI(&R1, 0, "PONG\n", "PING");
	CLI(&R1, 0, "tls-auth-clients\nyes\n", "CONFIG", "GET", "tls-auth-clients");
	bad = R1;
	bad.cert[0] = bad.key[0] = '\0'; /* no client certificate: refused */
	cr_assert_neq(ro_test_redis_cli(&bad, OUT, sizeof(OUT), "PING", (char *)NULL), 0);
	cr_assert_null(strstr(OUT, "PONG"), "%s", OUT);

	/* a replica over TLS, presenting the client certificate, with the first one's CA */
	(void)snprintf(rof, sizeof(rof), "127.0.0.1 %d", R1.port);
	cr_assert_eq(ro_test_redis_start_opts(&R2,
					      &(struct ro_test_redis_opts){
						  .tls = true,
						  .tls_auth_clients = true,
						  .certdir = R1.certdir,
						  .replicaof = rof,
					      }),
		     0);
	cr_assert_eq(ro_test_redis_wait_link(&R2, 20000), 0);
	CLI(&R1, 0, "OK", "SET", "rk", "rv");
	CLI(&R1, 0, "1\n", "WAIT", "1", "5000");
	CLI(&R2, 0, "rv\n", "GET", "rk");
}

Test(fixture, password_acl_extra_args)
{
	const char *extra[] = {"--maxmemory", "10mb", "--save", "", NULL};
	struct ro_test_redis bad;

	/* requirepass: hiredis's readiness PING authenticates, and so does redis-cli */
	cr_assert_eq(
	    ro_test_redis_start_opts(
		&R1, &(struct ro_test_redis_opts){.password = "pw-1", .extra_args = extra}),
	    0);
	CLI(&R1, 0, "PONG\n", "PING");
	CLI(&R1, 0, "maxmemory\n10485760\n", "CONFIG", "GET", "maxmemory");
	bad = R1;
	bad.password[0] = '\0';
	CLI(&bad, 1, "NOAUTH", "PING");
	cr_assert_eq(ro_test_redis_restart(&R1), 0);
	CLI(&R1, 0, "default\n", "ACL", "WHOAMI");

	/* an ACL file: the default user off, the fixture authenticates as alice */
	cr_assert_eq(
	    ro_test_redis_start_opts(&R2,
				     &(struct ro_test_redis_opts){
					 .acl_file_text = "user default off\n"
							  "user alice on >s3cret ~* &* +@all\n",
					 .user = "alice",
					 .password = "s3cret",
				     }),
	    0);
	cr_assert(exists(R2.dir, "users.acl"));
	CLI(&R2, 0, "alice\n", "ACL", "WHOAMI");
	bad = R2;
	bad.user[0] = bad.password[0] = '\0';
	CLI(&bad, 1, "NOAUTH", "PING");
}

Test(fixture, slot)
{
	/* CRC16-XMODEM("123456789") is 0x31c3; the rest are CLUSTER KEYSLOT's answers */
	cr_assert_eq(ro_test_slot("123456789"), 0x31c3);
	cr_assert_eq(ro_test_slot("foo"), 12182);
	cr_assert_eq(ro_test_slot("{user1000}.following"), ro_test_slot("user1000"));
	cr_assert_eq(ro_test_slot("{user1000}.followers"), ro_test_slot("user1000"));
	cr_assert_eq(ro_test_slot("foo{}{bar}"), 8363); /* empty tag: the whole key */
	cr_assert_eq(ro_test_slot("foo{{bar}}zap"), ro_test_slot("{bar"));
	cr_assert_eq(ro_test_slot("foo{bar}{zap}"), ro_test_slot("bar"));
	cr_assert_eq(ro_test_slot(""), 0);
}

/* the primaries, by the owners of the slots */
static int primaries(int *p)
{
	int n = 0;

	for (int s = 0; s < 16384; s += 64) {
		int o = ro_test_cluster_slot_owner(&C, s), k;

		cr_assert_geq(o, 0, "slot %d has no owner", s);
		for (k = 0; k < n && p[k] != o; k++)
			;
		if (k == n)
			p[n++] = o;
	}
	return n;
}

Test(fixture, cluster_owner_and_migration)
{
	const char *keys[] = {"foo", "123456789", "{ro}:x", "foo{}{bar}", "a{b}c", "q-17"};
	char want[128], slot_s[16];
	int p[8], n, o, to = -1, rep, slot, moved;

	int64_t t0 = ro_test_mono_ms();

	cr_assert_eq(
	    ro_test_cluster_start_opts(&C, 3, 1, &(struct ro_test_redis_opts){.password = "cpw"}),
	    0);
	cr_log_info("cluster: 3+3 nodes up in %lld ms", (long long)(ro_test_mono_ms() - t0));
	cr_assert_eq(C.n, 6);
	for (int i = 0; i < C.n; i++) {
		(void)snprintf(want, sizeof(want), "redis://127.0.0.1:%d", C.node[i].port);
		cr_assert_str_eq(C.node[i].url, want);
		cr_assert_eq(strlen(C.id[i]), 40);
		CLI(&C.node[i], 0, "cluster_state:ok", "CLUSTER", "INFO");
	}
	n = primaries(p);
	cr_assert_eq(n, 3);
	for (int i = 0; i < n; i++) {
		rep = ro_test_cluster_replica_of(&C, p[i]);
		cr_assert_geq(rep, 0, "primary %d has no replica", p[i]);
		(void)snprintf(want, sizeof(want), "%d", C.node[p[i]].port);
		char port[16];

		cr_assert_eq(ro_test_redis_info(&C.node[rep], "replication", "master_port", port,
						sizeof(port)),
			     0);
		cr_assert_str_eq(port, want);
	}
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		(void)snprintf(want, sizeof(want), "%d\n", ro_test_slot(keys[i]));
		CLI(&C.node[i % 6], 0, want, "CLUSTER", "KEYSLOT", keys[i]);
	}

	/* the owner serves the hash tag; any other primary redirects to it */
	o = ro_test_cluster_owner(&C, "fixture-q");
	cr_assert_geq(o, 0);
	slot = ro_test_slot("{fixture-q}");
	CLI(&C.node[o], 0, "OK", "SET", "{fixture-q}:a", "1");
	for (int i = 0; i < n; i++) {
		if (p[i] != o && to < 0)
			to = p[i];
	}
	(void)snprintf(want, sizeof(want), "MOVED %d 127.0.0.1:%d", slot, C.node[o].port);
	CLI(&C.node[to], 1, want, "GET", "{fixture-q}:a");

	/* half-migrated: the moved keys answer ASK on the old owner, the rest stay */
	for (int i = 0; i < 5; i++) {
		char k[32];

		(void)snprintf(k, sizeof(k), "{fixture-q}:k%d", i);
		CLI(&C.node[o], 0, "OK", "SET", k, "v");
	}
	cr_assert_eq(ro_test_cluster_migrate_begin(&C, slot, o, to), 0);
	moved = ro_test_cluster_migrate_some(&C, slot, o, to, 2);
	cr_assert_eq(moved, 2);
	(void)snprintf(slot_s, sizeof(slot_s), "%d", slot);
	CLI(&C.node[o], 0, "4\n", "CLUSTER", "COUNTKEYSINSLOT", slot_s);
	CLI(&C.node[to], 0, "2\n", "CLUSTER", "COUNTKEYSINSLOT", slot_s);
	cr_assert_eq(ro_test_cluster_replica_of(&C, o) >= 0, true);
	(void)snprintf(want, sizeof(want), "ASK %d 127.0.0.1:%d", slot, C.node[to].port);
	{
		/* one of the keys that went is asked for at the new owner */
		bool asked = false;

		for (int i = 0; i < 5; i++) {
			char k[32];
			int rc;

			(void)snprintf(k, sizeof(k), "{fixture-q}:k%d", i);
			rc =
			    ro_test_redis_cli(&C.node[o], OUT, sizeof(OUT), "GET", k, (char *)NULL);
			if (rc == 0) {
				cr_assert_str_eq(OUT, "v\n");
			} else {
				asked = true;
				cr_assert(!strncmp(OUT, want, strlen(want)), "%s", OUT);
			}
		}
		cr_assert(asked);
	}
	cr_assert_eq(ro_test_cluster_migrate_end(&C, slot, o, to), 0);
	cr_assert_eq(ro_test_cluster_owner(&C, "fixture-q"), to);
	CLI(&C.node[to], 0, "6\n", "CLUSTER", "COUNTKEYSINSLOT", slot_s);
	CLI(&C.node[o], 0, "0\n", "CLUSTER", "COUNTKEYSINSLOT", slot_s);
	CLI(&C.node[to], 0, "v\n", "GET", "{fixture-q}:k4");
	(void)snprintf(want, sizeof(want), "MOVED %d 127.0.0.1:%d", slot, C.node[to].port);
	CLI(&C.node[o], 1, want, "GET", "{fixture-q}:k4");
	/* nothing is left on the old owner */
	cr_assert_eq(ro_test_cluster_migrate_some(&C, slot, o, to, 10), 0);
}

Test(fixture, cluster_failover)
{
	int o, rep, promoted = -1, q = -1, qrep = -1, qslot = -1;

	int64_t t0 = ro_test_mono_ms();

	cr_assert_eq(ro_test_cluster_start(&C, 3, 1), 0);
	cr_log_info("cluster: 3+3 nodes up in %lld ms", (long long)(ro_test_mono_ms() - t0));
	o = ro_test_cluster_owner(&C, "fo");
	cr_assert_geq(o, 0);
	rep = ro_test_cluster_replica_of(&C, o);
	cr_assert_geq(rep, 0);
	CLI(&C.node[o], 0, "OK", "SET", "{fo}:k", "kept");
	CLI(&C.node[o], 0, "1\n", "WAIT", "1", "5000");

	/* SIGKILL: the replica takes over its slots */
	t0 = ro_test_mono_ms();
	cr_assert_eq(ro_test_cluster_kill_primary(&C, o, &promoted), 0);
	cr_log_info("cluster: failover after SIGKILL in %lld ms",
		    (long long)(ro_test_mono_ms() - t0));
	cr_assert_eq(promoted, rep);
	cr_assert_eq(C.node[o].pid, 0);
	cr_assert_eq(ro_test_cluster_owner(&C, "fo"), rep);
	CLI(&C.node[rep], 0, "master\n", "ROLE");
	CLI(&C.node[rep], 0, "kept\n", "GET", "{fo}:k");
	CLI(&C.node[rep], 0, "OK", "SET", "{fo}:k2", "new");

	/* the killed node comes back as the new primary's replica */
	t0 = ro_test_mono_ms();
	cr_assert_eq(ro_test_redis_restart(&C.node[o]), 0);
	cr_assert_eq(ro_test_cluster_wait(&C, 30000), 0);
	cr_log_info("cluster: the killed node rejoined in %lld ms",
		    (long long)(ro_test_mono_ms() - t0));
	cr_assert_eq(ro_test_cluster_replica_of(&C, rep), o);
	CLI(&C.node[o], 0, "slave\n", "ROLE");

	/* CLUSTER FAILOVER on another primary's replica: the two swap */
	for (int s = 0; s < 16384 && q < 0; s += 97) {
		int p = ro_test_cluster_slot_owner(&C, s);

		if (p != rep && p != o && p >= 0) {
			q = p;
			qslot = s;
		}
	}
	cr_assert_geq(q, 0);
	qrep = ro_test_cluster_replica_of(&C, q);
	cr_assert_geq(qrep, 0);
	t0 = ro_test_mono_ms();
	cr_assert_eq(ro_test_cluster_manual_failover(&C, qrep), 0);
	cr_log_info("cluster: manual failover in %lld ms", (long long)(ro_test_mono_ms() - t0));
	cr_assert_eq(ro_test_cluster_slot_owner(&C, qslot), qrep);
	cr_assert_eq(ro_test_cluster_replica_of(&C, qrep), q);
	CLI(&C.node[q], 0, "slave\n", "ROLE");
}

Test(fixture, sentinel_failover)
{
	char want[300], port[16];
	int old_primary, old_replica, np = -1;

	int64_t t0 = ro_test_mono_ms();

	cr_assert_eq(ro_test_sentinel_start(&S, &(struct ro_test_redis_opts){.password = "spw"}),
		     0);
	cr_log_info("sentinel: group up in %lld ms", (long long)(ro_test_mono_ms() - t0));
	(void)snprintf(want, sizeof(want),
		       "redis+sentinel://127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d/mymaster",
		       S.sentinel[0].port, S.sentinel[1].port, S.sentinel[2].port);
	cr_assert_str_eq(S.url, want);
	cr_assert_str_eq(S.master, "mymaster");
	old_primary = S.primary.port;
	old_replica = S.replica.port;
	(void)snprintf(want, sizeof(want), "127.0.0.1\n%d\n", old_primary);
	for (int i = 0; i < 3; i++)
		CLI(&S.sentinel[i], 0, want, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster");
	CLI(&S.primary, 0, "OK", "SET", "sk", "sv");
	CLI(&S.primary, 0, "1\n", "WAIT", "1", "5000");

	t0 = ro_test_mono_ms();
	cr_assert_eq(ro_test_sentinel_kill_primary(&S, &np), 0);
	cr_log_info("sentinel: failover after SIGKILL in %lld ms",
		    (long long)(ro_test_mono_ms() - t0));
	cr_assert_eq(np, old_replica);
	cr_assert_eq(S.primary.port, old_replica);
	cr_assert_eq(S.replica.port, old_primary);
	cr_assert_eq(S.replica.pid, 0);
	(void)snprintf(want, sizeof(want), "127.0.0.1\n%d\n", np);
	for (int i = 0; i < 3; i++)
		CLI(&S.sentinel[i], 0, want, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster");
	cr_assert_eq(ro_test_redis_info(&S.primary, "replication", "role", port, sizeof(port)), 0);
	cr_assert_str_eq(port, "master");
	CLI(&S.primary, 0, "sv\n", "GET", "sk");
	CLI(&S.primary, 0, "OK", "SET", "sk2", "after");
}

Test(fixture, cluster_tls)
{
	int o, to = -1, slot;
	char slot_s[16];

	cr_assert_eq(
	    ro_test_cluster_start_opts(
		&C, 3, 0, &(struct ro_test_redis_opts){.tls = true, .tls_auth_clients = true}),
	    0);
	cr_assert_eq(C.n, 3);
	for (int i = 0; i < C.n; i++)
		cr_assert(!strncmp(C.node[i].url, "rediss://127.0.0.1:", 19), "%s", C.node[i].url);
	o = ro_test_cluster_owner(&C, "tq");
	cr_assert_geq(o, 0);
	to = (o + 1) % C.n;
	slot = ro_test_slot("{tq}");
	(void)snprintf(slot_s, sizeof(slot_s), "%d", slot);
	CLI(&C.node[o], 0, "OK", "SET", "{tq}:a", "1");
	CLI(&C.node[o], 0, "OK", "SET", "{tq}:b", "2");
	/* MIGRATE between the nodes goes over TLS with the client certificate */
	cr_assert_eq(ro_test_cluster_migrate_begin(&C, slot, o, to), 0);
	cr_assert_eq(ro_test_cluster_migrate_end(&C, slot, o, to), 0);
	cr_assert_eq(ro_test_cluster_owner(&C, "tq"), to);
	CLI(&C.node[to], 0, "2\n", "CLUSTER", "COUNTKEYSINSLOT", slot_s);
	CLI(&C.node[to], 0, "2\n", "GET", "{tq}:b");
}

Test(fixture, sentinel_tls)
{
	int old_replica, np = -1;

	cr_assert_eq(ro_test_sentinel_start(
			 &S, &(struct ro_test_redis_opts){.tls = true, .tls_auth_clients = true}),
		     0);
	cr_assert(S.sentinel[0].tls && S.primary.tls);
	cr_assert_str_eq(S.replica.certdir, S.primary.certdir);
	old_replica = S.replica.port;
	CLI(&S.primary, 0, "OK", "SET", "tk", "tv");
	CLI(&S.primary, 0, "1\n", "WAIT", "1", "5000");
	CLI(&S.replica, 0, "tv\n", "GET", "tk");
	cr_assert_eq(ro_test_sentinel_kill_primary(&S, &np), 0);
	cr_assert_eq(np, old_replica);
	CLI(&S.primary, 0, "tv\n", "GET", "tk");
}
