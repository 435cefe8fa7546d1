/* One Redis connection the project owns (see conn.h): non-blocking connect, the handshake
 * pipelined on the wire, a FIFO of commands with deadlines, and reconnection with jittered
 * backoff that sends unanswered commands again. hiredis is only the RESP codec here. */
#include "queue/conn.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

enum kind { K_USER, K_AUTH, K_SELECT, K_NAME, K_VERSION, K_LOAD };
enum state { S_IDLE, S_CONNECTING, S_HANDSHAKE, S_READY };

struct cmd {
	struct cmd *next;
	char *buf;
	size_t len;
	char name[40]; /* the FCALL function or the command, for after_send */
	enum kind kind;
	int64_t deadline, sent_at;
	uint32_t block_ms;
	ro_conn_reply_fn fn; /* NULL: its caller was already answered (deadline) */
	void *arg;
	bool reloaded; /* sent again once after "Function not found" */
};

struct ro_conn {
	struct ro_conn_opts o;
	char *host, *path, *user, *password, *name, *library, *library_version;
	enum state st;
	int fd;
	redisReader *rd;
	struct cmd *head, *tail; /* every unanswered command, in the order sent */
	struct cmd *unsent;	 /* the first not completely written */
	size_t woff;		 /* bytes of unsent already written */
	int64_t next_try, backoff, connect_at;
	bool need_load;
	int last_err;
	char err[256];
	uint64_t connects, rng, sockets;
	size_t n_user;
};

static int64_t mono_ms(void)
{
	struct timespec ts;

	(void)clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t rng_next(struct ro_conn *c)
{
	c->rng ^= c->rng >> 12;
	c->rng ^= c->rng << 25;
	c->rng ^= c->rng >> 27;
	return c->rng * 2685821657736338717ull;
}

static char *dup_or_null(const char *s)
{
	return s && *s ? strdup(s) : NULL;
}

int ro_conn_new(const struct ro_conn_opts *o, struct ro_conn **ret)
{
	struct ro_conn *c = calloc(1, sizeof(*c));

	if (!c)
		return -ENOMEM;
	c->o = *o;
	c->fd = -1;
	c->host = dup_or_null(o->host);
	c->path = dup_or_null(o->path);
	c->user = dup_or_null(o->user);
	c->password = dup_or_null(o->password);
	c->name = dup_or_null(o->client_name);
	c->library = dup_or_null(o->library);
	c->library_version = dup_or_null(o->library_version);
	if (!c->o.timeout_ms)
		c->o.timeout_ms = 5000;
	c->backoff = 25;
	c->last_err = -EIO;
	c->rng = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)mono_ms() ^ (uintptr_t)c;
	if (!c->rng)
		c->rng = 1;
	if ((o->host && !c->host) || (o->path && !c->path)) {
		(void)ro_conn_free(c);
		return -ENOMEM;
	}
	*ret = c;
	return 0;
}

static void cmd_free(struct cmd *m)
{
	free(m->buf);
	free(m);
}

static void close_socket(struct ro_conn *c)
{
	if (c->fd >= 0)
		(void)close(c->fd);
	c->fd = -1;
	if (c->rd)
		redisReaderFree(c->rd);
	c->rd = NULL;
}

struct ro_conn *ro_conn_free(struct ro_conn *c)
{
	if (!c)
		return NULL;
	close_socket(c);
	while (c->head) {
		struct cmd *m = c->head;

		c->head = m->next;
		if (m->fn)
			m->fn(m->arg, -ECANCELED, NULL, "connection closed", m->sent_at);
		cmd_free(m);
	}
	free(c->host);
	free(c->path);
	free(c->user);
	free(c->password);
	free(c->name);
	free(c->library);
	free(c->library_version);
	free(c);
	return NULL;
}

/* ---- the command list --------------------------------------------------------------- */

static struct cmd *cmd_new(int argc, const char **argv, const size_t *lens, enum kind k)
{
	struct cmd *m = calloc(1, sizeof(*m));
	long long n;

	if (!m)
		return NULL;
	n = redisFormatCommandArgv(&m->buf, argc, argv, lens);
	if (n < 0) {
		free(m);
		return NULL;
	}
	m->len = (size_t)n;
	m->kind = k;
	{
		/* FCALL's function name, else the command's */
		int i = argc > 1 && lens[0] == 5 && !strncasecmp(argv[0], "FCALL", 5) ? 1 : 0;
		size_t l = lens[i] < sizeof(m->name) - 1 ? lens[i] : sizeof(m->name) - 1;

		memcpy(m->name, argv[i], l);
		m->name[l] = '\0';
	}
	return m;
}

static void append(struct ro_conn *c, struct cmd *m)
{
	if (c->tail)
		c->tail->next = m;
	else
		c->head = m;
	c->tail = m;
	if (!c->unsent)
		c->unsent = m;
}

int ro_conn_send(struct ro_conn *c, int argc, const char **argv, const size_t *lens,
		 int64_t deadline_ms, uint32_t block_ms, ro_conn_reply_fn fn, void *arg)
{
	struct cmd *m = cmd_new(argc, argv, lens, K_USER);

	if (!m)
		return -ENOMEM;
	m->deadline = deadline_ms;
	m->block_ms = block_ms;
	m->fn = fn;
	m->arg = arg;
	append(c, m);
	c->n_user++;
	return 0;
}

/* Unlink m (which must be the head, or unsent and never written). */
static void unlink_cmd(struct ro_conn *c, struct cmd *m)
{
	struct cmd **p = &c->head, *prev = NULL;

	while (*p && *p != m) {
		prev = *p;
		p = &(*p)->next;
	}
	if (!*p)
		return;
	*p = m->next;
	if (c->tail == m)
		c->tail = prev;
	if (c->unsent == m)
		c->unsent = m->next;
	if (m->kind == K_USER)
		c->n_user--;
}

/* ---- failure and reconnection --------------------------------------------------------- */

/* The connection is gone: internal and abandoned commands go, the rest wait (in order) to
 * be sent again on the next connection. */
__attribute__((format(printf, 4, 5))) static void conn_fail(struct ro_conn *c, int r, bool at_once,
							    const char *fmt, ...)
{
	int64_t now = mono_ms();
	va_list ap;

	va_start(ap, fmt);
	(void)vsnprintf(c->err, sizeof(c->err), fmt, ap);
	va_end(ap);
	c->last_err = r;
	close_socket(c);
	c->st = S_IDLE;
	for (struct cmd **p = &c->head; *p;) {
		struct cmd *m = *p;

		if (m->kind != K_USER || !m->fn) {
			*p = m->next;
			if (m->kind == K_USER)
				c->n_user--;
			cmd_free(m);
			continue;
		}
		m->sent_at = 0;
		p = &m->next;
	}
	c->tail = NULL;
	for (struct cmd *m = c->head; m; m = m->next)
		c->tail = m;
	c->unsent = c->head;
	c->woff = 0;
	if (at_once) {
		c->next_try = now;
	} else {
		/* full jitter in [backoff/2, backoff*3/2) keeps a fleet from reconnecting in step
		 */
		c->next_try = now + c->backoff / 2 + (int64_t)(rng_next(c) % (uint64_t)c->backoff);
		if (c->backoff < 1000)
			c->backoff *= 2;
	}
}

static void push_internal(struct ro_conn *c, struct cmd **tail, enum kind k, int argc,
			  const char **argv)
{
	size_t lens[8];
	struct cmd *m;

	for (int i = 0; i < argc; i++)
		lens[i] = strlen(argv[i]);
	m = cmd_new(argc, argv, lens, k);
	if (!m)
		return; /* the handshake then fails on the missing reply's timeout */
	/* internal commands go before every user command, in the order pushed */
	if (!*tail) {
		m->next = c->head;
		c->head = m;
	} else {
		m->next = (*tail)->next;
		(*tail)->next = m;
	}
	if (c->tail == *tail)
		c->tail = m;
	*tail = m;
	c->unsent = c->head;
}

static void start_handshake(struct ro_conn *c)
{
	struct cmd *t = NULL;
	char db[16];

	c->st = S_HANDSHAKE;
	c->rd = redisReaderCreate();
	if (!c->rd) {
		conn_fail(c, -ENOMEM, false, "redis: %s", "out of memory");
		return;
	}
	if (c->password) {
		const char *auth[] = {"AUTH", c->user ? c->user : c->password, c->password};

		if (c->user)
			push_internal(c, &t, K_AUTH, 3, auth);
		else
			push_internal(c, &t, K_AUTH, 2, (const char *[]){"AUTH", c->password});
	}
	if (c->o.db) {
		(void)snprintf(db, sizeof(db), "%d", c->o.db);
		push_internal(c, &t, K_SELECT, 2, (const char *[]){"SELECT", db});
	}
	if (c->name)
		push_internal(c, &t, K_NAME, 3, (const char *[]){"CLIENT", "SETNAME", c->name});
	if (c->library) {
		if (c->need_load)
			push_internal(c, &t, K_LOAD, 4,
				      (const char *[]){"FUNCTION", "LOAD", "REPLACE", c->library});
		else
			push_internal(c, &t, K_VERSION, 3,
				      (const char *[]){"FCALL", "ro_version", "0"});
	}
	if (!t)
		c->st = S_READY;
}

static void start_connect(struct ro_conn *c)
{
	int r;

	c->connect_at = mono_ms();
	c->sockets++;
	if (c->path) {
		struct sockaddr_un sa = {.sun_family = AF_UNIX};

		if (strlen(c->path) >= sizeof(sa.sun_path)) {
			conn_fail(c, -EIO, false, "redis connect: %s", "socket path too long");
			return;
		}
		(void)strcpy(sa.sun_path, c->path);
		c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (c->fd < 0) {
			conn_fail(c, -EIO, false, "redis connect: %s", strerror(errno));
			return;
		}
		r = connect(c->fd, (struct sockaddr *)&sa, sizeof(sa));
	} else {
		struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
		char port[8];
		int one = 1;

		(void)snprintf(port, sizeof(port), "%d", c->o.port);
		/* numeric addresses never block; a name is looked up (a local resolver's
		 * answer: /etc/hosts or nscd) */
		hints.ai_flags = AI_NUMERICHOST;
		r = getaddrinfo(c->host, port, &hints, &ai);
		if (r == EAI_NONAME) {
			hints.ai_flags = 0;
			r = getaddrinfo(c->host, port, &hints, &ai);
		}
		if (r) {
			conn_fail(c, -EIO, false, "redis connect: %s", gai_strerror(r));
			return;
		}
		c->fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (c->fd < 0) {
			freeaddrinfo(ai);
			conn_fail(c, -EIO, false, "redis connect: %s", strerror(errno));
			return;
		}
		(void)setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		(void)setsockopt(c->fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
		r = connect(c->fd, ai->ai_addr, ai->ai_addrlen);
		freeaddrinfo(ai);
	}
	if (r == 0) {
		start_handshake(c);
	} else if (errno == EINPROGRESS || errno == EAGAIN) {
		c->st = S_CONNECTING;
	} else {
		conn_fail(c, errno == ETIMEDOUT ? -ETIMEDOUT : -EIO, false, "redis connect: %s",
			  strerror(errno));
	}
}

/* ---- replies ------------------------------------------------------------------------ */

static bool transient(const char *s)
{
	return !strncmp(s, "LOADING", 7) || !strncmp(s, "BUSY", 4) || !strncmp(s, "READONLY", 8) ||
	       !strncmp(s, "MASTERDOWN", 10) || !strncmp(s, "TRYAGAIN", 8);
}

static void handshake_reply(struct ro_conn *c, struct cmd *m, redisReply *rep)
{
	bool is_err = rep->type == REDIS_REPLY_ERROR;

	if (m->kind == K_VERSION && (is_err || rep->type != REDIS_REPLY_STRING ||
				     !c->library_version || strcmp(rep->str, c->library_version))) {
		struct cmd *t = NULL;

		if (is_err && transient(rep->str)) {
			conn_fail(c, -EAGAIN, false, "redis: %s", rep->str);
			return;
		}
		/* the server lacks this exact library: load it before anything else */
		push_internal(c, &t, K_LOAD, 4,
			      (const char *[]){"FUNCTION", "LOAD", "REPLACE", c->library});
		return;
	}
	if (is_err && m->kind != K_VERSION) {
		char what[200];

		(void)snprintf(what, sizeof(what), "%s: %s",
			       m->kind == K_AUTH     ? "AUTH"
			       : m->kind == K_SELECT ? "SELECT"
			       : m->kind == K_LOAD   ? "FUNCTION LOAD"
						     : "CLIENT SETNAME",
			       rep->str);
		conn_fail(c, transient(rep->str) ? -EAGAIN : -EIO, false, "redis %s", what);
		return;
	}
	if (m->kind == K_LOAD)
		c->need_load = false;
	if (!c->head || c->head->kind == K_USER) {
		c->st = S_READY;
		c->connects++;
		c->backoff = 25;
		c->err[0] = '\0';
	}
}

/* One reply for the head of the list. */
static void dispatch(struct ro_conn *c, redisReply *rep)
{
	struct cmd *m = c->head;

	if (!m) {
		freeReplyObject(rep);
		conn_fail(c, -EPROTO, false, "redis: %s", "a reply nobody asked for");
		return;
	}
	if (m->kind != K_USER) {
		unlink_cmd(c, m);
		handshake_reply(c, m, rep);
		freeReplyObject(rep);
		cmd_free(m);
		return;
	}
	if (m->fn && rep->type == REDIS_REPLY_ERROR) {
		if (transient(rep->str)) {
			/* a server loading its data, busy, or a replica: try again later */
			conn_fail(c, -EAGAIN, false, "redis: %s", rep->str);
			freeReplyObject(rep);
			return;
		}
		if (!m->reloaded && strstr(rep->str, "Function not found")) {
			/* the server lost our library (flushed, or a new primary) */
			m->reloaded = true;
			c->need_load = true;
			conn_fail(c, -EAGAIN, true, "redis: %s", rep->str);
			freeReplyObject(rep);
			return;
		}
	}
	unlink_cmd(c, m);
	if (m->fn)
		m->fn(m->arg, 0, rep, NULL, m->sent_at);
	else
		freeReplyObject(rep);
	cmd_free(m);
}

static void do_read(struct ro_conn *c)
{
	char buf[16384];

	for (int rounds = 0; rounds < 64 && c->fd >= 0; rounds++) {
		ssize_t n = read(c->fd, buf, sizeof(buf));

		if (n == 0) {
			conn_fail(c, -EIO, false, "redis: %s", "connection closed by the server");
			return;
		}
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno != EAGAIN)
				conn_fail(c, -EIO, false, "redis reply: %s", strerror(errno));
			return;
		}
		if (redisReaderFeed(c->rd, buf, (size_t)n) != REDIS_OK) {
			conn_fail(c, -EPROTO, false, "redis: %s", "bad reply");
			return;
		}
		for (;;) {
			void *rep = NULL;

			if (redisReaderGetReply(c->rd, &rep) != REDIS_OK) {
				conn_fail(c, -EPROTO, false, "redis: protocol error: %s",
					  c->rd ? c->rd->errstr : "");
				return;
			}
			if (!rep)
				break;
			dispatch(c, rep);
			if (c->fd < 0)
				return;
		}
		if ((size_t)n < sizeof(buf))
			return;
	}
}

static bool can_write(const struct ro_conn *c)
{
	return c->unsent && (c->st == S_READY || c->unsent->kind != K_USER);
}

static void do_write(struct ro_conn *c)
{
	while (c->fd >= 0 && can_write(c)) {
		struct cmd *m = c->unsent;
		ssize_t n = send(c->fd, m->buf + c->woff, m->len - c->woff, MSG_NOSIGNAL);

		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno != EAGAIN)
				conn_fail(c, -EIO, false, "redis send: %s", strerror(errno));
			return;
		}
		c->woff += (size_t)n;
		if (c->woff < m->len)
			return;
		c->woff = 0;
		c->unsent = m->next;
		m->sent_at = mono_ms();
		if (c->o.after_send && m->kind == K_USER)
			c->o.after_send(c->o.after_send_arg, m->name, c->fd);
	}
}

/* Answer every command past its deadline with the connection's last error. One already
 * written stays in the list without a caller, so the next reply still finds its owner. */
static void expire(struct ro_conn *c, int64_t now)
{
	for (struct cmd *m = c->head, *next; m; m = next) {
		bool down = c->st != S_READY && c->err[0];
		ro_conn_reply_fn fn = m->fn;
		void *arg = m->arg;
		char why[300];
		int64_t sent;
		int r;

		next = m->next;
		if (m->kind != K_USER || !fn || m->deadline > now)
			continue;
		r = !down					       ? -ETIMEDOUT
		    : c->last_err == -EAGAIN || c->last_err == -EPROTO ? -EIO
								       : c->last_err;
		(void)snprintf(why, sizeof(why), "%s", down ? c->err : "redis: no reply in time");
		m->fn = NULL;
		sent = m->sent_at;
		if (!m->sent_at && !(m == c->unsent && c->woff)) {
			unlink_cmd(c, m);
			cmd_free(m);
		}
		fn(arg, r, NULL, why, sent);
	}
}

static bool has_user_work(const struct ro_conn *c)
{
	for (const struct cmd *m = c->head; m; m = m->next)
		if (m->kind == K_USER && m->fn)
			return true;
	return false;
}

/* The oldest written command still waiting for its reply: its wait is bounded. */
static int64_t reply_due(const struct ro_conn *c)
{
	for (const struct cmd *m = c->head; m && m != c->unsent; m = m->next)
		if (m->sent_at)
			return m->sent_at + c->o.timeout_ms + m->block_ms;
	return -1;
}

int ro_conn_fd(const struct ro_conn *c)
{
	return c->fd;
}

short ro_conn_events(const struct ro_conn *c)
{
	if (c->fd < 0)
		return 0;
	if (c->st == S_CONNECTING)
		return POLLOUT;
	return (short)(POLLIN | (can_write(c) ? POLLOUT : 0));
}

static int64_t min_t(int64_t a, int64_t b)
{
	return a < 0 ? b : b < 0 ? a : a < b ? a : b;
}

int64_t ro_conn_next_ms(const struct ro_conn *c)
{
	int64_t t = -1;

	for (const struct cmd *m = c->head; m; m = m->next)
		if (m->kind == K_USER && m->fn)
			t = min_t(t, m->deadline);
	if (c->st == S_IDLE && has_user_work(c))
		t = min_t(t, c->next_try);
	if (c->st == S_CONNECTING || c->st == S_HANDSHAKE)
		t = min_t(t, c->connect_at + c->o.timeout_ms);
	return min_t(t, reply_due(c));
}

void ro_conn_process(struct ro_conn *c, short revents)
{
	int64_t now = mono_ms(), due;

	if (c->st == S_CONNECTING && (revents & (POLLOUT | POLLERR | POLLHUP))) {
		int err = 0;
		socklen_t l = sizeof(err);

		if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &l) || err)
			conn_fail(c, err == ETIMEDOUT ? -ETIMEDOUT : -EIO, false,
				  "redis connect: %s", strerror(err ? err : errno));
		else
			start_handshake(c);
	}
	if (c->fd >= 0 && c->st >= S_HANDSHAKE && (revents & (POLLIN | POLLHUP | POLLERR)))
		do_read(c);
	if (c->fd >= 0 && c->st >= S_HANDSHAKE)
		do_write(c);
	now = mono_ms();
	if ((c->st == S_CONNECTING || c->st == S_HANDSHAKE) &&
	    now >= c->connect_at + c->o.timeout_ms)
		conn_fail(c, -ETIMEDOUT, false, "redis connect: %s", "timed out");
	due = reply_due(c);
	if (c->fd >= 0 && due >= 0 && now >= due)
		conn_fail(c, -ETIMEDOUT, false, "redis reply: %s", "timed out");
	expire(c, now);
	if (c->st == S_IDLE && has_user_work(c) && now >= c->next_try) {
		start_connect(c);
		if (c->fd >= 0 && c->st >= S_HANDSHAKE)
			do_write(c);
	}
}

size_t ro_conn_pending(const struct ro_conn *c)
{
	size_t n = 0;

	for (const struct cmd *m = c->head; m; m = m->next)
		if (m->kind == K_USER && m->fn)
			n++;
	return n;
}

uint64_t ro_conn_connects(const struct ro_conn *c)
{
	return c->connects;
}

bool ro_conn_ready(const struct ro_conn *c)
{
	return c->st == S_READY;
}

const char *ro_conn_errmsg(const struct ro_conn *c)
{
	return c->err;
}

uint64_t ro_conn_sockets(const struct ro_conn *c)
{
	return c->sockets;
}
