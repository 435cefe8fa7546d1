/* Test fixture: a private redis-server on a free loopback port in a temporary directory,
 * started per test binary (or per test, for tests that kill and restart it) and always
 * stopped: by the POST_ALL hook, and by PR_SET_PDEATHSIG if the runner itself dies. The
 * same spawner runs TLS, ACL and password-protected servers, cluster nodes, replicas and
 * sentinels, and builds a Redis Cluster and a sentinel group out of them; redis-cli (as a
 * bounded child process) talks to the ones hiredis 0.14 cannot (TLS). */
#pragma once

#include <hiredis/hiredis.h>
#include <stdbool.h>
#include <sys/types.h>

#include "queue/queue.h"

struct ro_test_redis {
	pid_t pid;
	int port; /* the TLS port when tls (the plain port is 0 then) */
	bool aof;
	bool everysec;	  /* appendfsync everysec (else always) */
	bool growing_aof; /* no AOF rewrites, a truncated AOF loaded: a test may cut it back */
	bool keep_dir;	  /* the caller's directory: left in place by stop */
	bool tls, tls_auth_clients, cluster, sentinel;
	bool acl;     /* users.acl in dir, passed as --aclfile */
	int bus_port; /* cluster: the cluster bus port (--cluster-port) */
	int n_extra;  /* extra arguments, NUL-separated in extra[] */
	char extra[512];
	char replicaof[64]; /* "127.0.0.1 PORT", or empty */
	char user[64];	    /* what the fixture authenticates as ("" with a password: default) */
	char password[128];
	char dir[200];
	char url[96];	/* redis://127.0.0.1:P/0 (cluster, sentinel: no /0), rediss://127.0.0.1:P */
	char sock[256]; /* a plain unix socket, also for TLS servers */
	char log[240];
	char certdir[200]; /* tls: where ca.crt, server.*, client.* are */
	char ca[240];	   /* tls: the CA file ro_test_redis_cli verifies the server with */
	char cert[240];	   /* tls: the client certificate ro_test_redis_cli presents ("": none) */
	char key[240];
};

struct ro_test_redis_opts {
	bool aof, everysec, growing_aof;
	const char *dir; /* created if missing and kept; NULL: a new temporary one, removed */
	/* TLS only (--port 0 --tls-port P); the certificates are ro_test_tls_certs' in certdir,
	 * or, with certdir NULL, made in the server's own directory. tls_auth_clients: mTLS. */
	bool tls, tls_auth_clients;
	const char *certdir;
	/* written to users.acl in the server's directory and passed as --aclfile; the fixture
	 * then authenticates as user/password (user NULL: default) */
	const char *acl_file_text;
	const char *user;
	/* requirepass for the default user when there is no ACL file (also masterauth, so
	 * replicas and promoted primaries can sync); every wait and ro_test_redis_cli
	 * authenticate with it */
	const char *password;
	/* NULL-terminated, appended to the redis-server command line (at most 512 bytes) */
	const char *const *extra_args;
	/* --cluster-enabled yes, nodes.conf in the directory, node timeout 1000 ms, announce
	 * 127.0.0.1, a free bus port (--cluster-port) */
	bool cluster;
	/* "127.0.0.1 PORT": --replicaof, --replica-announce-ip 127.0.0.1 */
	const char *replicaof;
	/* a sentinel: sentinel.conf written in the directory, monitoring master_name
	 * (NULL: "mymaster") at monitor ("127.0.0.1 PORT") with quorum 2, down-after 1000 ms,
	 * failover-timeout 5000 ms; monitor_user/monitor_pass: the data nodes' credentials
	 * (sentinel auth-user/auth-pass). With tls, it talks TLS to them (tls-replication). */
	bool sentinel;
	const char *monitor, *master_name, *monitor_user, *monitor_pass;
};

int ro_test_redis_start(struct ro_test_redis *r, bool aof);
int ro_test_redis_start_opts(struct ro_test_redis *r, const struct ro_test_redis_opts *o);
/* SIGKILL (a stopped server is continued first), keeping the data directory. */
void ro_test_redis_kill(struct ro_test_redis *r);
/* Start again (killing it first if it runs) on the same port and directory (AOF
 * replayed); waits, bounded, until it answers PING. */
int ro_test_redis_restart(struct ro_test_redis *r);
/* SIGTERM (then SIGKILL), and the directory removed unless it is the caller's. */
void ro_test_redis_stop(struct ro_test_redis *r);

/* Runs redis-cli against r (TLS, client certificate, user and password as r says; -e, so
 * an error reply exits 1) with the NULL-terminated arguments, killed after 20 s. Its stdout
 * lands in out (NUL-terminated, truncated to outlen), followed by its stderr when the exit
 * status is not 0. Returns the exit status, or -errno (-ETIMEDOUT: killed). */
int ro_test_redis_cli(const struct ro_test_redis *r, char *out, size_t outlen, const char *arg, ...)
    __attribute__((sentinel));
/* The same with an argument vector and a time limit. */
int ro_test_redis_cliv(const struct ro_test_redis *r, int timeout_ms, char *out, size_t outlen,
		       const char *const *argv);
/* Waits (bounded by timeout_ms) until INFO replication on r says master_link_status:up. */
int ro_test_redis_wait_link(const struct ro_test_redis *r, int timeout_ms);
/* The value of "field:" in INFO section on r, into buf; 0, or -ENOENT / the cli's error. */
int ro_test_redis_info(const struct ro_test_redis *r, const char *section, const char *field,
		       char *buf, size_t len);

/* With the openssl CLI, in dir (created if missing): ca.crt/ca.key, server.crt/server.key
 * (CN localhost, subjectAltName IP:127.0.0.1, DNS:localhost, signed by ca), client.crt/
 * client.key (signed by ca, for mTLS), other-ca.crt/other-ca.key (an unrelated CA). EC
 * P-256, valid 2 days. 0 or -errno. */
int ro_test_tls_certs(const char *dir);

/* The Redis Cluster hash slot of key (CRC16-XMODEM of the key or its {hashtag}, mod 16384). */
int ro_test_slot(const char *key);

/* A Redis Cluster on 127.0.0.1: primaries (at least 3) each with replicas_per_primary
 * replicas, every node in its own directory under dir, node[i].url = redis://127.0.0.1:P
 * (rediss:// with TLS). seeds: "127.0.0.1:P1,127.0.0.1:P2,...". id[i]: node i's cluster
 * node id. */
struct ro_test_cluster {
	int n;
	struct ro_test_redis node[8];
	char dir[200];
	char seeds[512];
	char id[8][48];
};

/* Starts the nodes, redis-cli --cluster create, and waits (bounded) until every node says
 * cluster_state:ok, knows every node, agrees on the owner of every slot, and every replica's
 * link is up. 0 or -errno; on failure nothing is left running. */
int ro_test_cluster_start(struct ro_test_cluster *c, int primaries, int replicas_per_primary);
/* The same with options for every node (tls, tls_auth_clients, password, acl_file_text and
 * user, extra_args; dir, certdir, cluster, replicaof and sentinel are the fixture's own). */
int ro_test_cluster_start_opts(struct ro_test_cluster *c, int primaries, int replicas_per_primary,
			       const struct ro_test_redis_opts *o);
/* Waits (bounded by timeout_ms) until the cluster is settled as _start leaves it (every live
 * node ok, agreed, replicas linked): after ro_test_redis_restart of a node, say. */
int ro_test_cluster_wait(struct ro_test_cluster *c, int timeout_ms);
/* Index of the primary that serves the slot of "{hashtag_name}" (as a live node sees it),
 * or -1. */
int ro_test_cluster_owner(struct ro_test_cluster *c, const char *hashtag_name);
/* Index of the primary serving slot, or -1. */
int ro_test_cluster_slot_owner(struct ro_test_cluster *c, int slot);
/* Index of a live replica of primary, or -1. */
int ro_test_cluster_replica_of(struct ro_test_cluster *c, int primary);
/* SIGKILL primary idx and wait (bounded, 30 s) until another node owns its slots, says
 * role:master, and the cluster is ok again on every remaining node; *promoted = its index.
 * The killed node can come back with ro_test_redis_restart (it rejoins as a replica).
 * -EINVAL when idx is not a live primary with slots and a live replica. */
int ro_test_cluster_kill_primary(struct ro_test_cluster *c, int idx, int *promoted);
/* CLUSTER FAILOVER on replica, and wait (bounded) until it is a primary with its old
 * primary's slots and the cluster is ok and agreed on every live node. */
int ro_test_cluster_manual_failover(struct ro_test_cluster *c, int replica);
/* Slot migration in steps, so that traffic can run while the slot is half-migrated:
 * begin: SETSLOT IMPORTING on to, MIGRATING on from; some: MIGRATE up to max_keys keys of
 * slot from from to to, returning how many moved (0: none left) or -errno; end: moves the
 * rest, SETSLOT NODE on to, from and every other primary, and waits (bounded) until every
 * live node says to owns it. */
int ro_test_cluster_migrate_begin(struct ro_test_cluster *c, int slot, int from, int to);
int ro_test_cluster_migrate_some(struct ro_test_cluster *c, int slot, int from, int to,
				 int max_keys);
int ro_test_cluster_migrate_end(struct ro_test_cluster *c, int slot, int from, int to);
/* Stops every node and removes dir. */
void ro_test_cluster_stop(struct ro_test_cluster *c);

/* A primary, one replica and three sentinels monitoring it as master "mymaster" (quorum 2,
 * down-after 1000 ms, failover-timeout 5000 ms). url = redis+sentinel://127.0.0.1:S1,
 * 127.0.0.1:S2,127.0.0.1:S3/mymaster. */
struct ro_test_sentinel {
	struct ro_test_redis primary, replica, sentinel[3];
	char master[32];
	char url[300];
};

/* data_opts (may be NULL): the data nodes' options (tls, tls_auth_clients, password,
 * acl_file_text and user, extra_args, aof; the sentinels share tls and certificates).
 * Waits (bounded) until the replica's link is up and every sentinel knows the replica and
 * the two other sentinels. 0 or -errno; on failure nothing is left running. */
int ro_test_sentinel_start(struct ro_test_sentinel *s, const struct ro_test_redis_opts *data_opts);
/* SIGKILL the current primary and wait (bounded, 30 s) until every sentinel reports the
 * replica as the master and it says role:master; *new_port = its port. Then primary and
 * replica are swapped: s->primary is the promoted node, s->replica the killed one (which
 * ro_test_redis_restart brings back; the sentinels then make it a replica). */
int ro_test_sentinel_kill_primary(struct ro_test_sentinel *s, int *new_port);
void ro_test_sentinel_stop(struct ro_test_sentinel *s);

/* A TCP port on 127.0.0.1 free a moment ago (0 bound, then released). */
int ro_test_free_port(void);

redisContext *ro_test_redis_connect(const char *url);
/* The binary's shared server (RO_TEST_REDIS_URL set by the hooks). */
const char *ro_test_redis_url(void);

/* A queue client for tests; queue names are made unique per process. */
struct ro_queue *ro_test_queue(const char *url, const char *queue, const char *worker,
			       uint32_t max_attempts);
/* "name-<pid>-<counter>" */
const char *ro_test_name(const char *base, char *buf, size_t len);

/* Run a command on a context, abort the test on error; returns the integer or length. */
long long ro_test_int(redisContext *c, const char *fmt, ...);

/* Include tests/redis_hooks.h (once, in a test file) to start the binary's redis-server
 * before the tests and stop it after them. */

/* A test worker: claims, publishes every missing sample one by one (tokens {idx, attempt}),
 * completes; retries what Redis could not confirm. Stops when done + dead reaches total or
 * after seconds. With die_on_poison, a unit whose meta has "poison" kills the process (a
 * worker that dies on that unit every time). Returns the units it completed. */
long ro_test_worker_run(const char *url, const char *queue, const char *worker, long total,
			int seconds, uint32_t lease_ms, bool die_on_poison);

/* Enqueue units "<prefix>-<i>" with n samples each (plus, with poison, their meta marks
 * them so die_on_poison workers die on them). */
void ro_test_enqueue(struct ro_queue *q, const char *prefix, int first, int count, unsigned n,
		     bool poison);

/* Every (unit, idx) of the samples stream exactly once, units*n entries in all, and one
 * groups entry per completed unit; aborts the test with a message otherwise. Returns the
 * number of samples that say they were resumed from a prefix. */
long ro_test_verify_exactly_once(redisContext *c, const char *queue, long units, unsigned n);
