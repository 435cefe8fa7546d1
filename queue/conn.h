/* Private to queue/: one Redis connection that the project owns. A non-blocking socket
 * (TCP or unix), hiredis only as the RESP codec (redisFormatCommandArgv, redisReader), a
 * FIFO of commands each with its own deadline, reconnection with jittered backoff and the
 * connection handshake (AUTH, SELECT, CLIENT SETNAME, the function library) done on the
 * wire like any other command. Nothing here blocks: the caller polls ro_conn_fd() for
 * ro_conn_events(), calls ro_conn_process() when it is ready or when ro_conn_next_ms()
 * comes, and replies arrive through each command's callback from inside that call.
 * The synchronous queue API is this same connection driven by poll() until its reply. */
#pragma once

#include <hiredis/hiredis.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct ro_conn;

struct ro_conn_opts {
	const char *host; /* TCP, or */
	int port;
	const char *path; /* a unix socket */
	const char *user, *password;
	int db;
	const char *client_name;
	uint32_t timeout_ms; /* connect, and each command's wait for its reply on one attempt */
	/* The function library (FUNCTION LOAD REPLACE text) and its version, checked with
	 * FCALL ro_version at every connect. */
	const char *library, *library_version;
	void (*after_send)(void *arg, const char *fn, int fd);
	void *after_send_arg;
};

/* A reply (the callback owns it: freeReplyObject) or, with rep NULL, r < 0 and why. Error
 * replies (REDIS_REPLY_ERROR) that are not transient come as replies. sent_ms: when the
 * command was last written (monotonic; 0 if never): the server ran it after that. */
typedef void (*ro_conn_reply_fn)(void *arg, int r, redisReply *rep, const char *why,
				 int64_t sent_ms);

int ro_conn_new(const struct ro_conn_opts *o, struct ro_conn **ret);
/* Pending callbacks run with -ECANCELED. */
struct ro_conn *ro_conn_free(struct ro_conn *c);

/* Queue a command. It is sent in order behind the ones before it; if the connection is lost
 * before its reply, it is sent again after the reconnect (every queue function is
 * idempotent), until deadline_ms (CLOCK_MONOTONIC ms), when its callback runs with the last
 * connection error. block_ms lengthens the wait for its reply (a blocking command). */
int ro_conn_send(struct ro_conn *c, int argc, const char **argv, const size_t *lens,
		 int64_t deadline_ms, uint32_t block_ms, ro_conn_reply_fn fn, void *arg);

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
