/* Private to queue/: one logical Redis connection that the project owns. A non-blocking
 * socket (TCP, unix, or TLS through OpenSSL), hiredis only as the RESP codec
 * (redisFormatCommandArgv, redisReader), a FIFO of commands each with its own deadline,
 * reconnection with jittered backoff, and the routing of managed Redis: a queue's keys
 * share one Cluster slot, so the connection goes to the node that owns that slot (found
 * from any seed with CLUSTER SLOTS, followed on MOVED, rediscovered when its node is gone)
 * or to the primary the sentinels name (asked again on READONLY or a lost connection).
 * The handshake (AUTH, ROLE, SELECT, CLIENT SETNAME, the function library) is done on the
 * wire like any other command. Nothing here blocks: the caller polls ro_conn_fd() for
 * ro_conn_events(), calls ro_conn_process() when it is ready or when ro_conn_next_ms()
 * comes, and replies arrive through each command's callback from inside that call.
 * The synchronous queue API is this same connection driven by poll() until its reply. */
#pragma once

#include <hiredis/hiredis.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "queue/queue.h"

struct ro_conn;

#define RO_URL_MAX_HOSTS 16

/* A parsed Redis URL (ro_redis_url_parse): every string percent-decoded and owned. */
struct ro_redis_url {
	bool tls, sentinel;
	char *path; /* unix socket */
	char *user, *password;
	char *master; /* sentinel: the primary's name */
	int db;
	size_t n_hosts;
	struct ro_hostport {
		char host[256];
		int port;
	} hosts[RO_URL_MAX_HOSTS];
};

int ro_redis_url_parse(const char *url, struct ro_redis_url *u, char *err, size_t errlen);
void ro_redis_url_clear(struct ro_redis_url *u);

struct ro_conn_opts {
	const struct ro_redis_url *url; /* copied */
	const char *password;		/* beats the URL's */
	const char *sentinel_password;	/* the sentinels' own (default: none) */
	const char *tls_ca, *tls_cert, *tls_key, *tls_server_name;
	enum ro_redis_cluster cluster;
	const char *slot_key; /* every command goes to this key's slot (Cluster) */
	const char *client_name;
	uint32_t timeout_ms; /* connect, and each command's wait for its reply on one attempt */
	/* The function library (FUNCTION LOAD REPLACE text) and its version, checked with
	 * FCALL ro_version at every connect. */
	const char *library, *library_version;
	/* A reply that keeps more than max_reply bytes buffered (one value longer than
	 * anything the caller reads) is refused: its command is answered -EMSGSIZE and not
	 * sent again, the socket is dropped unread. 0: no bound. */
	size_t max_reply;
	void (*after_send)(void *arg, const char *fn, int fd);
	void *after_send_arg;
};

/* A reply (the callback owns it: freeReplyObject) or, with rep NULL, r < 0 and why. Error
 * replies (REDIS_REPLY_ERROR) that are not transient come as replies. sent_ms: when the
 * command was last written (monotonic; 0 if never): the server ran it after that. With no
 * reply, non-zero means it was written, to this connection or an earlier one, and may
 * have run. */
typedef void (*ro_conn_reply_fn)(void *arg, int r, redisReply *rep, const char *why,
				 int64_t sent_ms);

/* -EINVAL with err filled for a TLS file that cannot be loaded. */
int ro_conn_new(const struct ro_conn_opts *o, struct ro_conn **ret, char *err, size_t errlen);
/* Pending callbacks run with -ECANCELED. */
struct ro_conn *ro_conn_free(struct ro_conn *c);

/* Queue a command. It is sent in order behind the ones before it; if the connection is lost
 * before its reply, it is sent again after the reconnect (every queue function is
 * idempotent), until deadline_ms (CLOCK_MONOTONIC ms), when its callback runs with the last
 * connection error. block_ms lengthens the wait for its reply (a blocking command). With
 * wait_n, WAIT wait_n wait_ms follows it on the wire and its reply is only delivered once
 * that many replicas acknowledged it; a shortfall answers -ETIMEDOUT (not confirmed: the
 * caller sends it again). */
int ro_conn_send(struct ro_conn *c, int argc, const char **argv, const size_t *lens,
		 int64_t deadline_ms, uint32_t block_ms, uint32_t wait_n, uint32_t wait_ms,
		 ro_conn_reply_fn fn, void *arg);

/* The socket (-1 while there is none: then only the timer matters) and POLLIN/POLLOUT. */
int ro_conn_fd(const struct ro_conn *c);
short ro_conn_events(const struct ro_conn *c);
/* When (monotonic ms) ro_conn_process must be called even without I/O; -1: no need. */
int64_t ro_conn_next_ms(const struct ro_conn *c);
/* Do what is due: connect, write, read, time out, retry. Callbacks run from here. */
void ro_conn_process(struct ro_conn *c, short revents);
/* Commands not yet answered. */
size_t ro_conn_pending(const struct ro_conn *c);
/* Times a connection was established (handshake done). */
uint64_t ro_conn_connects(const struct ro_conn *c);
bool ro_conn_ready(const struct ro_conn *c);
/* Sockets created so far: a new number means ro_conn_fd() is a new socket (even when the
 * descriptor's number is the same), which an epoll user must register again. */
uint64_t ro_conn_sockets(const struct ro_conn *c);
/* The last connection failure's message ("" when none). */
const char *ro_conn_errmsg(const struct ro_conn *c);
/* The last failure was one no retry fixes without a change of configuration or server
 * (credentials, permissions, TLS trust, db in a cluster, a server without FUNCTION): its
 * -errno (-EACCES, -EINVAL, -ENOTSUP), else 0. */
int ro_conn_fatal(const struct ro_conn *c);
/* "standalone", "cluster", "sentinel" or "unknown" (not yet connected), and the node
 * (host:port or the socket path) the connection is on or going to. */
const char *ro_conn_mode(const struct ro_conn *c);
const char *ro_conn_node(const struct ro_conn *c);
/* Redirections followed (MOVED, a new primary) and failovers seen. */
uint64_t ro_conn_redirects(const struct ro_conn *c);
/* The Cluster hash slot of a key (hash tags honoured). */
unsigned ro_key_slot(const char *key, size_t len);
