/* A private redis-server for tests, as hiredis's own test.sh does it: a mkdtemp
 * directory, a free port on 127.0.0.1, no persistence unless a test asks for AOF, and a
 * death signal tied to the parent so a crashed runner leaves no server behind. The same
 * spawner runs TLS, ACL and password servers, cluster nodes, replicas and sentinels; the
 * cluster and sentinel fixtures below are built from it, and every wait polls the servers'
 * own state (redis-cli, bounded child processes) under a deadline. */
#include "tests/redis_fixture.h"
#include "tests/testutil.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "config.h"

int ro_test_free_port(void)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t len = sizeof(a);
	int fd = socket(AF_INET, SOCK_STREAM, 0), port = -1;

	if (fd < 0)
		return -1;
	if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
	    getsockname(fd, (struct sockaddr *)&a, &len) == 0)
		port = ntohs(a.sin_port);
	(void)close(fd);
	return port;
}

static const char *server_bin(void)
{
	const char *server = getenv("RO_REDIS_SERVER");

	if (!server || !*server)
		server = RO_REDIS_SERVER[0] ? RO_REDIS_SERVER : "redis-server";
	return server;
}

/* RO_REDIS_CLI, else the redis-cli next to the configured redis-server, else $PATH's */
static const char *cli_bin(void)
{
	static char path[512];
	const char *cli = getenv("RO_REDIS_CLI");
	const char *slash;

	if (cli && *cli)
		return cli;
	if (path[0])
		return path;
	slash = strrchr(RO_REDIS_SERVER, '/');
	if (slash) {
		(void)snprintf(path, sizeof(path), "%.*s/redis-cli", (int)(slash - RO_REDIS_SERVER),
			       RO_REDIS_SERVER);
		if (access(path, X_OK) == 0)
			return path;
	}
	(void)snprintf(path, sizeof(path), "redis-cli");
	return path;
}

static const char *openssl_bin(void)
{
	const char *o = getenv("RO_OPENSSL");

	return o && *o ? o : "openssl";
}

struct sink {
	char *buf;
	size_t len, cap;
};

static void sink_add(struct sink *s, const char *p, size_t n)
{
	size_t room;

	if (!s->buf || !s->cap)
		return;
	room = s->cap - 1 - s->len;
	if (n > room)
		n = room;
	memcpy(s->buf + s->len, p, n);
	s->len += n;
	s->buf[s->len] = '\0';
}

/* Runs argv (a $PATH lookup for argv[0]) with stdin /dev/null, stdout into out and stderr
 * into err (either may be NULL), tied to us by PR_SET_PDEATHSIG and SIGKILLed when
 * timeout_ms is up. Returns its exit status (128 + signal when killed by one), or -errno:
 * -ETIMEDOUT when we killed it. */
static int run_child(const char *const *argv, int timeout_ms, char *out, size_t outlen, char *err,
		     size_t errlen)
{
	struct sink so = {out, 0, outlen}, se = {err, 0, errlen};
	int64_t end = ro_test_mono_ms() + timeout_ms;
	pid_t parent = getpid(), pid;
	int po[2], pe[2], st = 0, open_fds = 2;
	bool killed = false;
	struct pollfd fds[2];

	if (out && outlen)
		out[0] = '\0';
	if (err && errlen)
		err[0] = '\0';
	if (pipe2(po, O_CLOEXEC))
		return -errno;
	if (pipe2(pe, O_CLOEXEC)) {
		int e = -errno;

		(void)close(po[0]);
		(void)close(po[1]);
		return e;
	}
	pid = fork();
	if (pid < 0) {
		int e = -errno;

		(void)close(po[0]);
		(void)close(po[1]);
		(void)close(pe[0]);
		(void)close(pe[1]);
		return e;
	}
	if (pid == 0) {
		int devnull = open("/dev/null", O_RDONLY);

		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(126);
		if (devnull >= 0)
			(void)dup2(devnull, 0);
		(void)dup2(po[1], 1);
		(void)dup2(pe[1], 2);
		execvp(argv[0], (char *const *)argv);
		_exit(127);
	}
	(void)close(po[1]);
	(void)close(pe[1]);
	fds[0] = (struct pollfd){.fd = po[0], .events = POLLIN};
	fds[1] = (struct pollfd){.fd = pe[0], .events = POLLIN};
	while (open_fds > 0) {
		int64_t left = end - ro_test_mono_ms();
		int n;

		if (left <= 0) {
			(void)kill(pid, SIGKILL);
			killed = true;
			break;
		}
		n = poll(fds, 2, (int)left);
		if (n < 0 && errno != EINTR) {
			(void)kill(pid, SIGKILL);
			killed = true;
			break;
		}
		for (int i = 0; i < 2 && n > 0; i++) {
			char buf[4096];
			ssize_t k;

			if (fds[i].fd < 0 || !fds[i].revents)
				continue;
			k = read(fds[i].fd, buf, sizeof(buf));
			if (k > 0) {
				sink_add(i ? &se : &so, buf, (size_t)k);
			} else if (k == 0 || (errno != EINTR && errno != EAGAIN)) {
				(void)close(fds[i].fd);
				fds[i].fd = -1;
				open_fds--;
			}
		}
	}
	for (int i = 0; i < 2; i++) {
		if (fds[i].fd >= 0)
			(void)close(fds[i].fd);
	}
	/* both pipes closed: it is exiting; still bounded by the same deadline */
	for (;;) {
		pid_t w = waitpid(pid, &st, killed ? 0 : WNOHANG);

		if (w == pid)
			break;
		if (w < 0 && errno != EINTR)
			return -ECHILD;
		if (!killed && ro_test_mono_ms() >= end) {
			(void)kill(pid, SIGKILL);
			killed = true;
			continue;
		}
		if (!killed)
			ro_test_msleep(1);
	}
	if (killed)
		return -ETIMEDOUT;
	if (WIFEXITED(st))
		return WEXITSTATUS(st);
	return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -EIO;
}

#define MAX_ARGS 1040

/* redis-cli's connection arguments for r, into av; returns how many */
static int cli_base(const struct ro_test_redis *r, const char **av, char *port, size_t portlen)
{
	int n = 0;

	(void)snprintf(port, portlen, "%d", r->port);
	av[n++] = cli_bin();
	av[n++] = "-h";
	av[n++] = "127.0.0.1";
	av[n++] = "-p";
	av[n++] = port;
	if (r->tls) {
		av[n++] = "--tls";
		av[n++] = "--cacert";
		av[n++] = r->ca;
		if (r->cert[0]) {
			av[n++] = "--cert";
			av[n++] = r->cert;
			av[n++] = "--key";
			av[n++] = r->key;
		}
	}
	if (r->password[0]) {
		if (r->user[0]) {
			av[n++] = "--user";
			av[n++] = r->user;
			av[n++] = "--pass";
			av[n++] = r->password;
		} else {
			av[n++] = "-a";
			av[n++] = r->password;
		}
		av[n++] = "--no-auth-warning";
	}
	return n;
}

static int cli_run(const struct ro_test_redis *r, int timeout_ms, bool error_exit, char *out,
		   size_t outlen, const char *const *argv)
{
	const char *av[MAX_ARGS + 24];
	char port[16], err[1024];
	int n = cli_base(r, av, port, sizeof(port)), ret;

	if (error_exit)
		av[n++] = "-e";
	for (int i = 0; argv[i]; i++) {
		if (i >= MAX_ARGS)
			return -E2BIG;
		av[n++] = argv[i];
	}
	av[n] = NULL;
	ret = run_child(av, timeout_ms, out, outlen, err, sizeof(err));
	if (ret != 0 && out && outlen) {
		size_t l = strlen(out);

		(void)snprintf(out + l, outlen - l, "%s", err);
	}
	return ret;
}

int ro_test_redis_cliv(const struct ro_test_redis *r, int timeout_ms, char *out, size_t outlen,
		       const char *const *argv)
{
	return cli_run(r, timeout_ms, true, out, outlen, argv);
}

int ro_test_redis_cli(const struct ro_test_redis *r, char *out, size_t outlen, const char *arg, ...)
{
	const char *argv[MAX_ARGS + 1];
	va_list ap;
	int n = 0;

	va_start(ap, arg);
	for (const char *a = arg; a; a = va_arg(ap, const char *)) {
		if (n >= MAX_ARGS) {
			va_end(ap);
			return -E2BIG;
		}
		argv[n++] = a;
	}
	va_end(ap);
	argv[n] = NULL;
	return ro_test_redis_cliv(r, 20000, out, outlen, argv);
}

/* the value of "field:" in an INFO text */
static bool info_field(const char *info, const char *field, char *buf, size_t len)
{
	size_t fl = strlen(field);

	for (const char *p = info; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
		if (!strncmp(p, field, fl) && p[fl] == ':') {
			size_t vl = strcspn(p + fl + 1, "\r\n");

			(void)snprintf(buf, len, "%.*s", (int)vl, p + fl + 1);
			return true;
		}
	}
	return false;
}

int ro_test_redis_info(const struct ro_test_redis *r, const char *section, const char *field,
		       char *buf, size_t len)
{
	char out[16384];
	int ret = ro_test_redis_cliv(r, 5000, out, sizeof(out),
				     (const char *const[]){"INFO", section, NULL});

	if (len)
		buf[0] = '\0';
	if (ret)
		return ret > 0 ? -EIO : ret;
	return info_field(out, field, buf, len) ? 0 : -ENOENT;
}

int ro_test_redis_wait_link(const struct ro_test_redis *r, int timeout_ms)
{
	int64_t end = ro_test_mono_ms() + timeout_ms;

	for (int i = 0; i < 10000 && ro_test_mono_ms() < end; i++) {
		char v[32];

		if (ro_test_redis_info(r, "replication", "master_link_status", v, sizeof(v)) == 0 &&
		    !strcmp(v, "up"))
			return 0;
		ro_test_msleep(20);
	}
	(void)fprintf(stderr, "fixture: %d: the replication link did not come up\n", r->port);
	return -ETIMEDOUT;
}

/* hiredis for plain servers (as before), redis-cli for TLS ones */
static bool answers_ping(const struct ro_test_redis *r)
{
	redisContext *c;
	bool ok = false;

	if (r->tls) {
		char out[256];

		return cli_run(r, 3000, true, out, sizeof(out),
			       (const char *const[]){"PING", NULL}) == 0 &&
		       !strncmp(out, "PONG", 4);
	}
	c = redisConnectWithTimeout("127.0.0.1", r->port, (struct timeval){0, 200000});
	if (c && !c->err) {
		redisReply *rep = NULL;

		(void)redisSetTimeout(c, (struct timeval){0, 500000});
		if (r->password[0]) {
			rep = r->user[0] ? redisCommand(c, "AUTH %s %s", r->user, r->password)
					 : redisCommand(c, "AUTH %s", r->password);
			ok = rep && rep->type == REDIS_REPLY_STATUS;
			if (rep)
				freeReplyObject(rep);
			rep = NULL;
			if (!ok) {
				redisFree(c);
				return false;
			}
		}
		rep = redisCommand(c, "PING");
		ok = rep && rep->type == REDIS_REPLY_STATUS && !strcmp(rep->str, "PONG");
		if (rep)
			freeReplyObject(rep);
	}
	if (c)
		redisFree(c);
	return ok;
}

static int spawn(struct ro_test_redis *r)
{
	char port[16], bus[16], rhost[64], rport[16], aclfile[240], sconf[240];
	char tls_cert[240], tls_key[240], tls_ca[240], tls_ccert[240], tls_ckey[240];
	const char *av[MAX_ARGS];
	pid_t parent = getpid();
	const char *server = server_bin();
	int64_t end;
	int n = 0;
	pid_t pid;

	(void)snprintf(port, sizeof(port), "%d", r->port);
	(void)snprintf(bus, sizeof(bus), "%d", r->bus_port);
	av[n++] = server;
	if (r->sentinel) {
		(void)snprintf(sconf, sizeof(sconf), "%s/sentinel.conf", r->dir);
		av[n++] = sconf;
		av[n++] = "--sentinel";
	}
	if (r->tls) {
		(void)snprintf(tls_cert, sizeof(tls_cert), "%s/server.crt", r->certdir);
		(void)snprintf(tls_key, sizeof(tls_key), "%s/server.key", r->certdir);
		(void)snprintf(tls_ca, sizeof(tls_ca), "%s/ca.crt", r->certdir);
		(void)snprintf(tls_ccert, sizeof(tls_ccert), "%s/client.crt", r->certdir);
		(void)snprintf(tls_ckey, sizeof(tls_ckey), "%s/client.key", r->certdir);
		av[n++] = "--port";
		av[n++] = "0";
		av[n++] = "--tls-port";
		av[n++] = port;
		av[n++] = "--tls-cert-file";
		av[n++] = tls_cert;
		av[n++] = "--tls-key-file";
		av[n++] = tls_key;
		av[n++] = "--tls-ca-cert-file";
		av[n++] = tls_ca;
		/* what it presents when it is the client: replication, cluster bus, MIGRATE,
		 * a sentinel's links */
		av[n++] = "--tls-client-cert-file";
		av[n++] = tls_ccert;
		av[n++] = "--tls-client-key-file";
		av[n++] = tls_ckey;
		av[n++] = "--tls-auth-clients";
		av[n++] = r->tls_auth_clients ? "yes" : "no";
		av[n++] = "--tls-replication";
		av[n++] = "yes";
		/* 7.0: after a diskless (socket) sync over TLS a replica can leave what the
		 * primary sent next unread in the TLS layer, seconds behind (and WAIT still
		 * counts it): a full sync through an RDB file has no such gap */
		av[n++] = "--repl-diskless-sync";
		av[n++] = "no";
		if (r->cluster) {
			av[n++] = "--tls-cluster";
			av[n++] = "yes";
		}
	} else {
		av[n++] = "--port";
		av[n++] = port;
	}
	av[n++] = "--bind";
	av[n++] = "127.0.0.1";
	av[n++] = "--dir";
	av[n++] = r->dir;
	av[n++] = "--unixsocket";
	av[n++] = r->sock;
	av[n++] = "--unixsocketperm";
	av[n++] = "700";
	av[n++] = "--daemonize";
	av[n++] = "no";
	av[n++] = "--logfile";
	av[n++] = r->log;
	av[n++] = "--protected-mode";
	av[n++] = "yes";
	if (!r->sentinel) {
		/* growing_aof: no RDB snapshots and no AOF rewrites, so the append-only file
		 * only grows and a simulated power loss can cut it back to an earlier length */
		av[n++] = "--save";
		av[n++] = "";
		av[n++] = "--appendonly";
		av[n++] = r->aof ? "yes" : "no";
		av[n++] = "--appendfsync";
		av[n++] = r->everysec ? "everysec" : "always";
		av[n++] = "--auto-aof-rewrite-percentage";
		av[n++] = r->growing_aof ? "0" : "100";
		av[n++] = "--aof-load-truncated";
		av[n++] = "yes";
		av[n++] = "--databases";
		av[n++] = "4";
		av[n++] = "--replica-announce-ip";
		av[n++] = "127.0.0.1";
		/* a replica's full sync starts at once, not after 7.0's 5 s wait for others */
		av[n++] = "--repl-diskless-sync-delay";
		av[n++] = "0";
	}
	if (r->acl) {
		(void)snprintf(aclfile, sizeof(aclfile), "%s/users.acl", r->dir);
		av[n++] = "--aclfile";
		av[n++] = aclfile;
	} else if (r->password[0]) {
		av[n++] = "--requirepass";
		av[n++] = r->password;
	}
	if (r->password[0] && !r->sentinel) {
		av[n++] = "--masterauth";
		av[n++] = r->password;
		if (r->user[0]) {
			av[n++] = "--masteruser";
			av[n++] = r->user;
		}
	}
	if (r->cluster) {
		/* failure detection in about a second; a replica always fails over (no data
		 * age limit), and replicas stay where the test put them */
		av[n++] = "--cluster-enabled";
		av[n++] = "yes";
		av[n++] = "--cluster-config-file";
		av[n++] = "nodes.conf";
		av[n++] = "--cluster-node-timeout";
		av[n++] = "1000";
		av[n++] = "--cluster-announce-ip";
		av[n++] = "127.0.0.1";
		av[n++] = "--cluster-port";
		av[n++] = bus;
		av[n++] = "--cluster-replica-validity-factor";
		av[n++] = "0";
		av[n++] = "--cluster-allow-replica-migration";
		av[n++] = "no";
	}
	if (r->replicaof[0]) {
		/* redis-server quotes an argument with a space: host and port go separately */
		if (sscanf(r->replicaof, "%63s %15s", rhost, rport) != 2)
			return -EINVAL;
		av[n++] = "--replicaof";
		av[n++] = rhost;
		av[n++] = rport;
	}
	/* NUL-separated, and an argument may be empty ("--save" "") */
	for (size_t i = 0, off = 0; i < (size_t)r->n_extra && off < sizeof(r->extra); i++) {
		if (n >= MAX_ARGS - 1)
			return -E2BIG;
		av[n++] = r->extra + off;
		off += strlen(r->extra + off) + 1;
	}
	av[n] = NULL;

	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0) {
		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(1);
		execvp(server, (char *const *)av);
		_exit(127);
	}
	r->pid = pid;
	/* ready when it answers PING (not LOADING: an AOF replay may take a while); a taken
	 * port shows as an early exit */
	end = ro_test_mono_ms() + 60000;
	for (int i = 0; i < 1500 && ro_test_mono_ms() < end; i++) {
		int st;

		if (waitpid(pid, &st, WNOHANG) == pid) {
			r->pid = 0;
			return -EADDRINUSE;
		}
		if (answers_ping(r))
			return 0;
		ro_test_msleep(10);
	}
	return -ETIMEDOUT;
}

static int write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	int ret = 0;

	if (!f)
		return -errno;
	if (fputs(text, f) < 0)
		ret = -EIO;
	if (fclose(f) && !ret)
		ret = -errno;
	return ret;
}

static int write_sentinel_conf(const struct ro_test_redis *r, const struct ro_test_redis_opts *o)
{
	const char *name = o->master_name ? o->master_name : "mymaster";
	char path[240], text[2048];
	int l;

	if (!o->monitor)
		return -EINVAL;
	(void)snprintf(path, sizeof(path), "%s/sentinel.conf", r->dir);
	l = snprintf(text, sizeof(text),
		     "sentinel resolve-hostnames no\n"
		     "sentinel announce-hostnames no\n"
		     "sentinel announce-ip 127.0.0.1\n"
		     "sentinel monitor %s %s 2\n"
		     "sentinel down-after-milliseconds %s 1000\n"
		     "sentinel failover-timeout %s 5000\n"
		     "sentinel parallel-syncs %s 1\n",
		     name, o->monitor, name, name, name);
	if (o->monitor_user && l > 0 && (size_t)l < sizeof(text))
		l += snprintf(text + l, sizeof(text) - (size_t)l, "sentinel auth-user %s %s\n",
			      name, o->monitor_user);
	if (o->monitor_pass && l > 0 && (size_t)l < sizeof(text))
		l += snprintf(text + l, sizeof(text) - (size_t)l, "sentinel auth-pass %s %s\n",
			      name, o->monitor_pass);
	if (o->password && !o->acl_file_text && l > 0 && (size_t)l < sizeof(text))
		l += snprintf(text + l, sizeof(text) - (size_t)l, "sentinel sentinel-pass %s\n",
			      o->password);
	if (l < 0 || (size_t)l >= sizeof(text))
		return -E2BIG;
	return write_file(path, text);
}

static int copy_str(char *dst, size_t len, const char *src)
{
	if (!src) {
		dst[0] = '\0';
		return 0;
	}
	if (strlen(src) >= len)
		return -ENAMETOOLONG;
	(void)snprintf(dst, len, "%s", src);
	return 0;
}

int ro_test_redis_start_opts(struct ro_test_redis *r, const struct ro_test_redis_opts *o)
{
	int ret = -EADDRINUSE;

	memset(r, 0, sizeof(*r));
	r->aof = o->aof;
	r->everysec = o->everysec;
	r->growing_aof = o->growing_aof;
	r->tls = o->tls;
	r->tls_auth_clients = o->tls_auth_clients;
	r->cluster = o->cluster;
	r->sentinel = o->sentinel;
	if (copy_str(r->user, sizeof(r->user), o->user) ||
	    copy_str(r->password, sizeof(r->password), o->password) ||
	    copy_str(r->replicaof, sizeof(r->replicaof), o->replicaof))
		return -ENAMETOOLONG;
	if (o->extra_args) {
		size_t used = 0;

		for (int i = 0; o->extra_args[i]; i++) {
			size_t l = strlen(o->extra_args[i]) + 1;

			if (used + l > sizeof(r->extra) || i >= 64)
				return -E2BIG;
			memcpy(r->extra + used, o->extra_args[i], l);
			used += l;
			r->n_extra++;
		}
	}
	if (o->dir) {
		r->keep_dir = true;
		(void)snprintf(r->dir, sizeof(r->dir), "%s", o->dir);
		if (mkdir(r->dir, 0700) && errno != EEXIST)
			return -errno;
	} else {
		(void)snprintf(r->dir, sizeof(r->dir), "/tmp/ro-redis-XXXXXX");
		if (!mkdtemp(r->dir)) {
			(void)fprintf(stderr, "fixture: mkdtemp: %s\n", strerror(errno));
			return -errno;
		}
	}
	(void)snprintf(r->log, sizeof(r->log), "%s/redis.log", r->dir);
	if (strlen(r->dir) + sizeof("/redis.sock") > sizeof(((struct sockaddr_un *)0)->sun_path))
		ret = -ENAMETOOLONG; /* the unix socket's path would not fit */
	(void)snprintf(r->sock, sizeof(r->sock), "%s/redis.sock", r->dir);
	if (ret == -EADDRINUSE && r->tls) {
		(void)snprintf(r->certdir, sizeof(r->certdir), "%s",
			       o->certdir ? o->certdir : r->dir);
		(void)snprintf(r->ca, sizeof(r->ca), "%s/ca.crt", r->certdir);
		(void)snprintf(r->cert, sizeof(r->cert), "%s/client.crt", r->certdir);
		(void)snprintf(r->key, sizeof(r->key), "%s/client.key", r->certdir);
		if (!o->certdir) {
			int e = ro_test_tls_certs(r->dir);

			if (e)
				ret = e;
		}
	}
	if (ret == -EADDRINUSE && o->acl_file_text) {
		char path[240];
		int e;

		(void)snprintf(path, sizeof(path), "%s/users.acl", r->dir);
		e = write_file(path, o->acl_file_text);
		if (e)
			ret = e;
		r->acl = true;
	}
	if (ret == -EADDRINUSE && o->sentinel) {
		int e = write_sentinel_conf(r, o);

		if (e)
			ret = e;
	}
	for (int tries = 0; tries < 8 && ret == -EADDRINUSE; tries++) {
		r->port = ro_test_free_port();
		if (r->port < 0) {
			ret = -EADDRNOTAVAIL;
			break;
		}
		if (r->cluster) {
			do
				r->bus_port = ro_test_free_port();
			while (r->bus_port == r->port);
			if (r->bus_port < 0) {
				ret = -EADDRNOTAVAIL;
				break;
			}
		}
		ret = spawn(r);
	}
	if (ret) {
		(void)fprintf(stderr, "fixture: redis-server did not start: %s (log: %s)\n",
			      strerror(-ret), r->log);
		ro_test_redis_stop(r);
		return ret;
	}
	if (r->tls)
		(void)snprintf(r->url, sizeof(r->url), "rediss://127.0.0.1:%d", r->port);
	else if (r->cluster || r->sentinel)
		(void)snprintf(r->url, sizeof(r->url), "redis://127.0.0.1:%d", r->port);
	else
		(void)snprintf(r->url, sizeof(r->url), "redis://127.0.0.1:%d/0", r->port);
	return 0;
}

int ro_test_redis_start(struct ro_test_redis *r, bool aof)
{
	return ro_test_redis_start_opts(r, &(struct ro_test_redis_opts){.aof = aof});
}

static void reap_child(struct ro_test_redis *r, int sig)
{
	if (r->pid <= 0)
		return;
	(void)kill(r->pid, SIGCONT); /* a SIGSTOPped server cannot act on SIGTERM */
	(void)kill(r->pid, sig);
	for (int i = 0; i < 500; i++) {
		if (waitpid(r->pid, NULL, WNOHANG) == r->pid) {
			r->pid = 0;
			return;
		}
		ro_test_msleep(10);
	}
	(void)kill(r->pid, SIGKILL);
	(void)waitpid(r->pid, NULL, 0);
	r->pid = 0;
}

void ro_test_redis_kill(struct ro_test_redis *r)
{
	reap_child(r, SIGKILL);
}

int ro_test_redis_restart(struct ro_test_redis *r)
{
	reap_child(r, SIGKILL);
	return spawn(r);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(path);
}

void ro_test_redis_stop(struct ro_test_redis *r)
{
	reap_child(r, SIGTERM);
	if (r->dir[0] && !r->keep_dir)
		(void)nftw(r->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
	r->dir[0] = '\0';
}

/* ---- TLS certificates ---------------------------------------------------------------- */

static const char openssl_cnf[] = "[req]\n"
				  "distinguished_name = dn\n"
				  "prompt = no\n"
				  "[dn]\n"
				  "CN = ro-test\n"
				  "[v3_ca]\n"
				  "basicConstraints = critical,CA:TRUE\n"
				  "keyUsage = critical,keyCertSign,cRLSign\n"
				  "subjectKeyIdentifier = hash\n"
				  "[v3_server]\n"
				  "basicConstraints = CA:FALSE\n"
				  "keyUsage = critical,digitalSignature,keyEncipherment\n"
				  "extendedKeyUsage = serverAuth,clientAuth\n"
				  "subjectAltName = IP:127.0.0.1,DNS:localhost\n"
				  "subjectKeyIdentifier = hash\n"
				  "authorityKeyIdentifier = keyid\n"
				  "[v3_client]\n"
				  "basicConstraints = CA:FALSE\n"
				  "keyUsage = critical,digitalSignature\n"
				  "extendedKeyUsage = clientAuth\n"
				  "subjectKeyIdentifier = hash\n"
				  "authorityKeyIdentifier = keyid\n";

static int openssl_run(const char *const *av)
{
	char err[2048];
	int ret = run_child(av, 30000, NULL, 0, err, sizeof(err));

	if (ret) {
		(void)fprintf(stderr, "fixture: openssl %s: %s%s\n", av[1],
			      ret < 0 ? strerror(-ret) : "failed: ", err);
		return ret < 0 ? ret : -EIO;
	}
	return 0;
}

static int gen_key(const char *dir, const char *name)
{
	char key[256];

	(void)snprintf(key, sizeof(key), "%s/%s.key", dir, name);
	return openssl_run((const char *const[]){openssl_bin(), "genpkey", "-algorithm", "EC",
						 "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key,
						 NULL});
}

static int gen_ca(const char *dir, const char *cnf, const char *name, const char *cn)
{
	char key[256], crt[256], subj[128];
	int ret = gen_key(dir, name);

	if (ret)
		return ret;
	(void)snprintf(key, sizeof(key), "%s/%s.key", dir, name);
	(void)snprintf(crt, sizeof(crt), "%s/%s.crt", dir, name);
	(void)snprintf(subj, sizeof(subj), "/CN=%s", cn);
	return openssl_run((const char *const[]){openssl_bin(), "req", "-x509", "-new", "-config",
						 cnf, "-extensions", "v3_ca", "-key", key, "-subj",
						 subj, "-days", "2", "-sha256", "-out", crt, NULL});
}

static int gen_leaf(const char *dir, const char *cnf, const char *name, const char *cn,
		    const char *ext)
{
	static unsigned counter;
	char key[256], crt[256], csr[256], subj[128], ca[256], cakey[256], serial[48];
	int ret = gen_key(dir, name);

	if (ret)
		return ret;
	(void)snprintf(key, sizeof(key), "%s/%s.key", dir, name);
	(void)snprintf(crt, sizeof(crt), "%s/%s.crt", dir, name);
	(void)snprintf(csr, sizeof(csr), "%s/%s.csr", dir, name);
	(void)snprintf(ca, sizeof(ca), "%s/ca.crt", dir);
	(void)snprintf(cakey, sizeof(cakey), "%s/ca.key", dir);
	(void)snprintf(subj, sizeof(subj), "/CN=%s", cn);
	(void)snprintf(serial, sizeof(serial), "%lld%d%u", (long long)ro_test_wall_ms(),
		       (int)getpid(), counter++);
	ret = openssl_run((const char *const[]){openssl_bin(), "req", "-new", "-config", cnf,
						"-key", key, "-subj", subj, "-out", csr, NULL});
	if (!ret)
		ret = openssl_run((const char *const[]){
		    openssl_bin(), "x509", "-req",	  "-in",  csr,	   "-CA", ca,
		    "-CAkey",	   cakey,  "-set_serial", serial, "-days", "2",	  "-sha256",
		    "-extfile",	   cnf,	   "-extensions", ext,	  "-out",  crt,	  NULL});
	(void)unlink(csr);
	return ret;
}

int ro_test_tls_certs(const char *dir)
{
	char cnf[256];
	int ret;

	if (strlen(dir) > 200)
		return -ENAMETOOLONG;
	if (mkdir(dir, 0700) && errno != EEXIST)
		return -errno;
	(void)snprintf(cnf, sizeof(cnf), "%s/openssl.cnf", dir);
	ret = write_file(cnf, openssl_cnf);
	if (!ret)
		ret = gen_ca(dir, cnf, "ca", "ro-test-ca");
	if (!ret)
		ret = gen_leaf(dir, cnf, "server", "localhost", "v3_server");
	if (!ret)
		ret = gen_leaf(dir, cnf, "client", "ro-test-client", "v3_client");
	if (!ret)
		ret = gen_ca(dir, cnf, "other-ca", "ro-test-other-ca");
	return ret;
}

redisContext *ro_test_redis_connect(const char *url)
{
	int port = 6379;
	const char *p = strrchr(url, ':');

	if (p)
		port = atoi(p + 1);
	return redisConnect("127.0.0.1", port);
}

const char *ro_test_redis_url(void)
{
	const char *u = getenv("RO_TEST_REDIS_URL");

	if (!u) {
		(void)fprintf(stderr, "fixture: RO_TEST_REDIS_URL not set (no PRE_ALL hook?)\n");
		abort();
	}
	return u;
}

struct ro_queue *ro_test_queue(const char *url, const char *queue, const char *worker,
			       uint32_t max_attempts)
{
	struct ro_queue_opts o = {
	    .url = url,
	    .queue = queue,
	    .worker = worker,
	    .max_attempts = max_attempts,
	    .timeout_ms = 3000,
	    .retry_ms = 15000,
	};
	struct ro_queue *q = NULL;

	if (ro_queue_new(&o, &q))
		abort();
	return q;
}

const char *ro_test_name(const char *base, char *buf, size_t len)
{
	static unsigned counter;

	(void)snprintf(buf, len, "%s-%d-%u", base, (int)getpid(), counter++);
	return buf;
}

long long ro_test_int(redisContext *c, const char *fmt, ...)
{
	va_list ap;
	redisReply *rep;
	long long v = 0;

	va_start(ap, fmt);
	rep = redisvCommand(c, fmt, ap);
	va_end(ap);
	if (!rep || rep->type == REDIS_REPLY_ERROR) {
		(void)fprintf(stderr, "fixture: %s: %s\n", fmt, rep ? rep->str : c->errstr);
		abort();
	}
	if (rep->type == REDIS_REPLY_INTEGER)
		v = rep->integer;
	else if (rep->type == REDIS_REPLY_STRING)
		v = strtoll(rep->str, NULL, 10);
	else if (rep->type == REDIS_REPLY_ARRAY)
		v = (long long)rep->elements;
	freeReplyObject(rep);
	return v;
}

static bool transient(int r)
{
	return r == -EIO || r == -ETIMEDOUT || r == -EAGAIN;
}

void ro_test_enqueue(struct ro_queue *q, const char *prefix, int first, int count, unsigned n,
		     bool poison)
{
	struct ro_unit *u = calloc((size_t)count, sizeof(*u));
	struct ro_unit_bounds b;
	int *st = calloc((size_t)count, sizeof(*st));

	ro_unit_bounds_default(&b);
	for (int i = 0; i < count; i++) {
		char json[256];

		(void)snprintf(json, sizeof(json),
			       "{\"id\":\"%s-%d\",\"prompt\":[1,2,3],\"n\":%u,"
			       "\"max_new_tokens\":4%s}",
			       prefix, first + i, n, poison ? ",\"meta\":{\"poison\":true}" : "");
		if (ro_unit_parse(json, strlen(json), &b, &u[i], NULL, 0))
			abort();
	}
	if (ro_queue_enqueue(q, u, (size_t)count, st)) {
		(void)fprintf(stderr, "fixture: enqueue: %s\n", ro_queue_errmsg(q));
		abort();
	}
	for (int i = 0; i < count; i++)
		ro_unit_clear(&u[i]);
	free(u);
	free(st);
}

static bool finished(struct ro_queue *q, long total)
{
	struct ro_queue_stats s;
	bool done;

	if (ro_queue_stats(q, &s))
		return false;
	done = s.done + s.dead >= total;
	ro_queue_stats_clear(&s);
	return done;
}

static bool is_published(const struct ro_claim *c, uint32_t idx)
{
	for (uint32_t i = 0; i < c->n_published; i++) {
		if (c->published_idx[i] == idx)
			return true;
	}
	return false;
}

static const struct ro_progress *progress_of(const struct ro_claim *c, uint32_t idx)
{
	for (uint32_t i = 0; i < c->n_progress; i++) {
		if (c->progress[i].idx == idx)
			return &c->progress[i];
	}
	return NULL;
}

/* publish sample idx of c, retrying what could not be confirmed; -ESTALE: lease lost */
static int publish_one(struct ro_queue *q, const struct ro_claim *c, uint32_t idx, int64_t end)
{
	const struct ro_progress *p = progress_of(c, idx);
	int32_t tok[2] = {(int32_t)idx, (int32_t)c->attempt};
	float lp[2] = {-1.0f, -2.0f};
	struct ro_sample s = {.idx = idx,
			      .tokens = tok,
			      .logprobs = lp,
			      .len = 2,
			      .finish = "length",
			      .resumed_from = p ? p->len : 0};
	char ids[1][24];
	int r;

	do
		r = ro_queue_publish(q, c, &s, 1, false, ids, NULL);
	while (transient(r) && ro_test_mono_ms() < end);
	return r;
}

long ro_test_worker_run(const char *url, const char *queue, const char *worker, long total,
			int seconds, uint32_t lease_ms, bool die_on_poison)
{
	struct ro_queue *q = ro_test_queue(url, queue, worker, 3);
	int64_t end = ro_test_mono_ms() + seconds * 1000L;
	long completed = 0;

	while (ro_test_mono_ms() < end) {
		struct ro_claim *c = NULL;
		size_t n = 0;
		int r = ro_queue_claim(q, 4, lease_ms, &c, &n);

		if (transient(r))
			continue;
		if (r < 0) {
			(void)fprintf(stderr, "fixture: claim: %s\n", ro_queue_errmsg(q));
			abort();
		}
		if (n == 0) {
			bool woken;

			ro_claims_free(c, n);
			if (finished(q, total))
				break;
			(void)ro_queue_wait(q, 100, &woken);
			continue;
		}
		for (size_t i = 0; i < n; i++) {
			char gid[24];

			if (die_on_poison && strstr(c[i].body, "\"poison\""))
				(void)raise(SIGKILL);
			r = 0;
			for (uint32_t idx = 0; idx < c[i].n && !r; idx++) {
				if (!is_published(&c[i], idx))
					r = publish_one(q, &c[i], idx, end);
			}
			if (r)
				continue; /* lease lost (or time up): someone else finishes it */
			do
				r = ro_queue_complete(q, &c[i], gid);
			while (transient(r) && ro_test_mono_ms() < end);
			if (!r)
				completed++;
		}
		ro_claims_free(c, n);
	}
	ro_queue_free(q);
	return completed;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

static long scan_stream(redisContext *c, const char *queue, const char *which, char ***ret,
			long *ret_resumed)
{
	char from[64] = "-";
	char **keys = NULL;
	long n = 0, cap = 0, resumed = 0;

	for (;;) {
		redisReply *rep =
		    redisCommand(c, "XRANGE ro:{%s}:%s %s + COUNT 1000", queue, which, from);

		if (!rep || rep->type != REDIS_REPLY_ARRAY)
			abort();
		for (size_t i = 0; i < rep->elements; i++) {
			redisReply *f = rep->element[i]->element[1];
			const char *unit = "?", *idx = "";
			char *k;

			for (size_t j = 0; j + 1 < f->elements; j += 2) {
				if (!strcmp(f->element[j]->str, "unit"))
					unit = f->element[j + 1]->str;
				else if (!strcmp(f->element[j]->str, "idx"))
					idx = f->element[j + 1]->str;
				else if (!strcmp(f->element[j]->str, "resumed_from") &&
					 strcmp(f->element[j + 1]->str, "0"))
					resumed++;
			}
			if (n == cap) {
				cap = cap ? cap * 2 : 1024;
				keys = realloc(keys, (size_t)cap * sizeof(*keys));
			}
			if (asprintf(&k, "%s|%s", unit, idx) < 0)
				abort();
			keys[n++] = k;
			(void)snprintf(from, sizeof(from), "(%s", rep->element[i]->element[0]->str);
		}
		if (rep->elements < 1000) {
			freeReplyObject(rep);
			break;
		}
		freeReplyObject(rep);
	}
	qsort(keys, (size_t)n, sizeof(*keys), cmp_str);
	for (long i = 1; i < n; i++) {
		if (!strcmp(keys[i], keys[i - 1])) {
			(void)fprintf(stderr, "fixture: %s has %s twice\n", which, keys[i]);
			abort();
		}
	}
	*ret = keys;
	if (ret_resumed)
		*ret_resumed = resumed;
	return n;
}

long ro_test_verify_exactly_once(redisContext *c, const char *queue, long units, unsigned n)
{
	char **s = NULL, **g = NULL;
	long resumed = 0;
	long ns = scan_stream(c, queue, "samples", &s, &resumed);
	long ng = scan_stream(c, queue, "groups", &g, NULL);

	if (ns != units * (long)n || ng != units) {
		(void)fprintf(stderr, "fixture: %ld samples and %ld groups, want %ld and %ld\n", ns,
			      ng, units * (long)n, units);
		abort();
	}
	for (long i = 0; i < ns; i++)
		free(s[i]);
	for (long i = 0; i < ng; i++)
		free(g[i]);
	free(s);
	free(g);
	return resumed;
}

/* ---- Redis Cluster ------------------------------------------------------------------- */

#define NSLOTS 16384

int ro_test_slot(const char *key)
{
	size_t len = strlen(key), s, e;
	const char *p = key;
	uint16_t crc = 0;

	/* the first '{' and the first '}' after it, if something lies between them */
	for (s = 0; s < len && key[s] != '{'; s++)
		;
	if (s < len) {
		for (e = s + 1; e < len && key[e] != '}'; e++)
			;
		if (e < len && e != s + 1) {
			p = key + s + 1;
			len = e - s - 1;
		}
	}
	for (size_t i = 0; i < len; i++) {
		crc ^= (uint16_t)((unsigned)(unsigned char)p[i] << 8);
		for (int b = 0; b < 8; b++)
			crc =
			    (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
	}
	return crc & (NSLOTS - 1);
}

/* One node's CLUSTER NODES, by our node indexes. */
struct cview {
	int n;		/* our nodes it lists */
	int self;	/* the index of the node that answered */
	int role[8];	/* 0 not listed (or neither), 1 primary, 2 replica */
	bool failed[8]; /* flagged fail or fail? */
	int master[8];	/* a replica's primary, else -1 */
	int n_open;	/* the answering node's importing/migrating slots */
	int open[16];
	signed char owner[NSLOTS];
};

static bool live(const struct ro_test_cluster *c, int i)
{
	return i >= 0 && i < c->n && c->node[i].pid > 0;
}

static int node_by_port(const struct ro_test_cluster *c, int port)
{
	for (int i = 0; i < c->n; i++) {
		if (c->node[i].port == port)
			return i;
	}
	return -1;
}

static bool has_flag(const char *flags, const char *flag)
{
	size_t fl = strlen(flag);

	for (const char *p = flags; p && *p;) {
		size_t l = strcspn(p, ",");

		if (l == fl && !strncmp(p, flag, fl))
			return true;
		p += l;
		if (*p == ',')
			p++;
	}
	return false;
}

static int ccmd(struct ro_test_cluster *c, int i, char *out, size_t len, const char *const *argv)
{
	int ret = ro_test_redis_cliv(&c->node[i], 10000, out, len, argv);

	return ret > 0 ? -EIO : ret;
}

static int cluster_view(struct ro_test_cluster *c, int i, struct cview *v)
{
	char lid[8][48], mid[8][48];
	size_t cap = 1 << 16;
	char *out = malloc(cap), *save = NULL;
	int ret;

	if (!out)
		return -ENOMEM;
	memset(v, 0, sizeof(*v));
	memset(v->owner, -1, sizeof(v->owner));
	memset(lid, 0, sizeof(lid));
	memset(mid, 0, sizeof(mid));
	v->self = -1;
	for (int j = 0; j < 8; j++)
		v->master[j] = -1;
	ret = ccmd(c, i, out, cap, (const char *const[]){"CLUSTER", "NODES", NULL});
	if (ret) {
		free(out);
		return ret;
	}
	for (char *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char *ts = NULL, *id = strtok_r(line, " \r", &ts);
		char *addr = strtok_r(NULL, " \r", &ts), *flags = strtok_r(NULL, " \r", &ts);
		char *m = strtok_r(NULL, " \r", &ts), *colon, *t;
		bool master, myself;
		int j;

		for (int k = 0; k < 4; k++) /* ping-sent pong-recv config-epoch link-state */
			(void)strtok_r(NULL, " \r", &ts);
		if (!id || !addr || !flags || !m || !(colon = strchr(addr, ':')))
			continue;
		j = node_by_port(c, atoi(colon + 1));
		if (j < 0)
			continue;
		v->n++;
		(void)snprintf(lid[j], sizeof(lid[j]), "%s", id);
		if (!c->id[j][0] && strlen(id) == 40)
			(void)snprintf(c->id[j], sizeof(c->id[j]), "%s", id);
		master = has_flag(flags, "master");
		myself = has_flag(flags, "myself");
		v->role[j] = master ? 1 : has_flag(flags, "slave") ? 2 : 0;
		v->failed[j] = has_flag(flags, "fail") || has_flag(flags, "fail?");
		if (myself)
			v->self = j;
		if (v->role[j] == 2)
			(void)snprintf(mid[j], sizeof(mid[j]), "%s", m);
		while ((t = strtok_r(NULL, " \r", &ts))) {
			int a, b;

			if (t[0] == '[') { /* [slot->-id] migrating, [slot-<-id] importing */
				if (myself && v->n_open < 16)
					v->open[v->n_open++] = atoi(t + 1);
				continue;
			}
			if (sscanf(t, "%d-%d", &a, &b) != 2) {
				if (sscanf(t, "%d", &a) != 1)
					continue;
				b = a;
			}
			if (!master || a < 0 || b >= NSLOTS)
				continue;
			for (int s = a; s <= b; s++)
				v->owner[s] = (signed char)j;
		}
	}
	for (int j = 0; j < 8; j++) {
		for (int k = 0; mid[j][0] && k < 8; k++) {
			if (!strcmp(mid[j], lid[k]))
				v->master[j] = k;
		}
	}
	free(out);
	return 0;
}

/* Every live node: cluster_state:ok, every slot ok, all c->n nodes known, its self in the
 * view; all of them agree on every slot's owner (a live primary, not flagged failing) and
 * on the live nodes' roles; every live replica's link is up. With open_slot >= 0 no node
 * may still have that slot importing or migrating. *slot_owner: the owner of slot. */
static bool cluster_settled(struct ro_test_cluster *c, int slot, int open_slot, int *slot_owner,
			    char *why, size_t whylen)
{
	struct cview *ref = malloc(sizeof(*ref)), *v = malloc(sizeof(*v));
	bool have_ref = false, ok = false;
	char info[4096], val[64];
	int i;

	(void)snprintf(why, whylen, "no live node");
	if (!ref || !v)
		goto out;
	for (i = 0; i < c->n; i++) {
		if (!live(c, i))
			continue;
		if (ccmd(c, i, info, sizeof(info),
			 (const char *const[]){"CLUSTER", "INFO", NULL})) {
			(void)snprintf(why, whylen, "node %d: CLUSTER INFO: %.200s", i, info);
			goto out;
		}
		if (!info_field(info, "cluster_state", val, sizeof(val)) || strcmp(val, "ok")) {
			(void)snprintf(why, whylen, "node %d: cluster_state:%s", i, val);
			goto out;
		}
		if (!info_field(info, "cluster_slots_ok", val, sizeof(val)) ||
		    atoi(val) != NSLOTS) {
			(void)snprintf(why, whylen, "node %d: cluster_slots_ok:%s", i, val);
			goto out;
		}
		if (!info_field(info, "cluster_known_nodes", val, sizeof(val)) ||
		    atoi(val) != c->n) {
			(void)snprintf(why, whylen, "node %d: cluster_known_nodes:%s", i, val);
			goto out;
		}
		if (cluster_view(c, i, v) || v->self != i || v->n != c->n) {
			(void)snprintf(why, whylen, "node %d: CLUSTER NODES lists %d nodes", i,
				       v->n);
			goto out;
		}
		for (int k = 0; open_slot >= 0 && k < v->n_open; k++) {
			if (v->open[k] == open_slot) {
				(void)snprintf(why, whylen, "node %d: slot %d still open", i,
					       open_slot);
				goto out;
			}
		}
		if (v->role[i] == 2) {
			if (!live(c, v->master[i]) || v->role[v->master[i]] != 1) {
				(void)snprintf(why, whylen,
					       "node %d: replica of %d, not a live primary", i,
					       v->master[i]);
				goto out;
			}
			if (ro_test_redis_info(&c->node[i], "replication", "master_link_status",
					       val, sizeof(val)) ||
			    strcmp(val, "up")) {
				(void)snprintf(why, whylen, "node %d: master_link_status:%s", i,
					       val);
				goto out;
			}
		} else if (v->role[i] != 1) {
			(void)snprintf(why, whylen, "node %d: neither primary nor replica", i);
			goto out;
		}
		if (!have_ref) {
			for (int s = 0; s < NSLOTS; s++) {
				int o = v->owner[s];

				if (!live(c, o) || v->role[o] != 1 || v->failed[o]) {
					(void)snprintf(why, whylen, "node %d: slot %d on %d", i, s,
						       o);
					goto out;
				}
			}
			memcpy(ref, v, sizeof(*v));
			have_ref = true;
			continue;
		}
		if (memcmp(ref->owner, v->owner, sizeof(v->owner))) {
			(void)snprintf(why, whylen, "node %d disagrees on slot owners", i);
			goto out;
		}
		for (int j = 0; j < c->n; j++) {
			if (live(c, j) &&
			    (ref->role[j] != v->role[j] || ref->master[j] != v->master[j])) {
				(void)snprintf(why, whylen, "node %d disagrees on node %d's role",
					       i, j);
				goto out;
			}
		}
	}
	if (have_ref) {
		if (slot_owner && slot >= 0 && slot < NSLOTS)
			*slot_owner = ref->owner[slot];
		ok = true;
	}
out:
	free(ref);
	free(v);
	return ok;
}

/* Polls cluster_settled until the owner of slot is want (>= 0) or is not avoid (>= 0) and
 * says role:master itself; bounded by timeout_ms. */
static int cluster_wait(struct ro_test_cluster *c, int slot, int want, int avoid, int open_slot,
			int timeout_ms, const char *what, int *owner)
{
	int64_t start = ro_test_mono_ms(), end = start + timeout_ms;
	char why[512] = "";

	for (int i = 0; i < timeout_ms / 10 + 1 && ro_test_mono_ms() < end; i++) {
		int o = -1;
		char role[32];

		if (cluster_settled(c, slot, open_slot, &o, why, sizeof(why))) {
			if (slot < 0)
				return 0;
			if (want >= 0 && o != want) {
				(void)snprintf(why, sizeof(why), "slot %d on %d, not yet %d", slot,
					       o, want);
			} else if (avoid >= 0 && o == avoid) {
				(void)snprintf(why, sizeof(why), "slot %d still on %d", slot, o);
			} else if (ro_test_redis_info(&c->node[o], "replication", "role", role,
						      sizeof(role)) ||
				   strcmp(role, "master")) {
				(void)snprintf(why, sizeof(why), "node %d: role:%s", o, role);
			} else {
				if (owner)
					*owner = o;
				return 0;
			}
		}
		ro_test_msleep(50);
	}
	(void)fprintf(stderr, "fixture: cluster %s: not settled after %lld ms: %s\n", what,
		      (long long)(ro_test_mono_ms() - start), why);
	return -ETIMEDOUT;
}

int ro_test_cluster_wait(struct ro_test_cluster *c, int timeout_ms)
{
	return cluster_wait(c, -1, -1, -1, -1, timeout_ms, "wait", NULL);
}

int ro_test_cluster_start(struct ro_test_cluster *c, int primaries, int replicas_per_primary)
{
	return ro_test_cluster_start_opts(c, primaries, replicas_per_primary, NULL);
}

int ro_test_cluster_start_opts(struct ro_test_cluster *c, int primaries, int replicas_per_primary,
			       const struct ro_test_redis_opts *o)
{
	struct ro_test_redis_opts base = o ? *o : (struct ro_test_redis_opts){0};
	const char *av[8 + 8];
	char addr[8][32], reps[16], nd[240];
	size_t outcap = 1 << 16, l = 0;
	char *out = NULL;
	int n = primaries * (1 + replicas_per_primary), ret, k = 0;

	memset(c, 0, sizeof(*c));
	if (primaries < 3 || replicas_per_primary < 0 || n > 8)
		return -EINVAL;
	(void)snprintf(c->dir, sizeof(c->dir), "/tmp/ro-cluster-XXXXXX");
	if (!mkdtemp(c->dir)) {
		ret = -errno;
		c->dir[0] = '\0';
		return ret;
	}
	if (base.tls) {
		ret = ro_test_tls_certs(c->dir);
		if (ret)
			goto fail;
	}
	base.certdir = base.tls ? c->dir : NULL;
	base.cluster = true;
	base.replicaof = NULL;
	base.sentinel = false;
	for (int i = 0; i < n; i++) {
		(void)snprintf(nd, sizeof(nd), "%s/n%d", c->dir, i);
		base.dir = nd;
		ret = ro_test_redis_start_opts(&c->node[i], &base);
		if (ret)
			goto fail;
		c->n = i + 1;
		(void)snprintf(addr[i], sizeof(addr[i]), "127.0.0.1:%d", c->node[i].port);
		l += (size_t)snprintf(c->seeds + l, sizeof(c->seeds) - l, "%s%s", i ? "," : "",
				      addr[i]);
	}
	(void)snprintf(reps, sizeof(reps), "%d", replicas_per_primary);
	av[k++] = "--cluster";
	av[k++] = "create";
	for (int i = 0; i < n; i++)
		av[k++] = addr[i];
	av[k++] = "--cluster-replicas";
	av[k++] = reps;
	av[k++] = "--cluster-yes";
	av[k] = NULL;
	out = malloc(outcap);
	if (!out) {
		ret = -ENOMEM;
		goto fail;
	}
	ret = cli_run(&c->node[0], 60000, false, out, outcap, av);
	if (ret) {
		(void)fprintf(stderr, "fixture: redis-cli --cluster create: %d: %s\n", ret, out);
		ret = ret > 0 ? -EIO : ret;
		goto fail;
	}
	ret = cluster_wait(c, -1, -1, -1, -1, 30000, "create", NULL);
	if (ret)
		goto fail;
	for (int i = 0; i < n; i++) {
		if (!c->id[i][0]) {
			ret = -EPROTO;
			goto fail;
		}
	}
	free(out);
	return 0;
fail:
	free(out);
	ro_test_cluster_stop(c);
	return ret;
}

void ro_test_cluster_stop(struct ro_test_cluster *c)
{
	/* all told first, so they go down together */
	for (int i = 0; i < c->n; i++) {
		if (c->node[i].pid > 0) {
			(void)kill(c->node[i].pid, SIGCONT);
			(void)kill(c->node[i].pid, SIGTERM);
		}
	}
	for (int i = 0; i < c->n; i++)
		ro_test_redis_stop(&c->node[i]);
	if (c->dir[0])
		(void)nftw(c->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
	c->dir[0] = '\0';
	c->n = 0;
}

static int any_view(struct ro_test_cluster *c, struct cview *v)
{
	for (int i = 0; i < c->n; i++) {
		if (live(c, i) && cluster_view(c, i, v) == 0)
			return 0;
	}
	return -ENOTCONN;
}

int ro_test_cluster_slot_owner(struct ro_test_cluster *c, int slot)
{
	struct cview *v = malloc(sizeof(*v));
	int o = -1;

	if (v && slot >= 0 && slot < NSLOTS && any_view(c, v) == 0)
		o = v->owner[slot];
	free(v);
	return o;
}

int ro_test_cluster_owner(struct ro_test_cluster *c, const char *hashtag_name)
{
	char key[512];

	(void)snprintf(key, sizeof(key), "{%s}", hashtag_name);
	return ro_test_cluster_slot_owner(c, ro_test_slot(key));
}

int ro_test_cluster_replica_of(struct ro_test_cluster *c, int primary)
{
	struct cview *v = malloc(sizeof(*v));
	int r = -1;

	if (v && any_view(c, v) == 0) {
		for (int j = 0; j < c->n && r < 0; j++) {
			if (j != primary && live(c, j) && v->role[j] == 2 &&
			    v->master[j] == primary && !v->failed[j])
				r = j;
		}
	}
	free(v);
	return r;
}

/* a slot primary p serves, in v; -1 when none */
static int slot_of(const struct cview *v, int p)
{
	for (int s = 0; s < NSLOTS; s++) {
		if (v->owner[s] == p)
			return s;
	}
	return -1;
}

int ro_test_cluster_kill_primary(struct ro_test_cluster *c, int idx, int *promoted)
{
	struct cview *v = malloc(sizeof(*v));
	int slot = -1, ret, o = -1;

	if (!v)
		return -ENOMEM;
	if (live(c, idx) && cluster_view(c, idx, v) == 0 && v->role[idx] == 1)
		slot = slot_of(v, idx);
	free(v);
	/* a primary without slots, or without a replica to take them over */
	if (slot < 0 || ro_test_cluster_replica_of(c, idx) < 0)
		return -EINVAL;
	ro_test_redis_kill(&c->node[idx]);
	ret = cluster_wait(c, slot, -1, idx, -1, 30000, "kill_primary", &o);
	if (!ret && promoted)
		*promoted = o;
	return ret;
}

int ro_test_cluster_manual_failover(struct ro_test_cluster *c, int replica)
{
	struct cview *v = malloc(sizeof(*v));
	char out[512];
	int slot = -1, ret;

	if (!v)
		return -ENOMEM;
	if (live(c, replica) && cluster_view(c, replica, v) == 0 && v->role[replica] == 2 &&
	    live(c, v->master[replica]))
		slot = slot_of(v, v->master[replica]);
	free(v);
	if (slot < 0)
		return -EINVAL;
	ret =
	    ccmd(c, replica, out, sizeof(out), (const char *const[]){"CLUSTER", "FAILOVER", NULL});
	if (ret) {
		(void)fprintf(stderr, "fixture: CLUSTER FAILOVER: %s\n", out);
		return ret;
	}
	return cluster_wait(c, slot, replica, -1, -1, 30000, "manual_failover", NULL);
}

static int setslot(struct ro_test_cluster *c, int node, int slot, const char *how, int target)
{
	char s[16], out[512];
	int ret;

	(void)snprintf(s, sizeof(s), "%d", slot);
	ret = ccmd(c, node, out, sizeof(out),
		   (const char *const[]){"CLUSTER", "SETSLOT", s, how, c->id[target], NULL});
	if (ret)
		(void)fprintf(stderr, "fixture: node %d: CLUSTER SETSLOT %s %s %s: %s\n", node, s,
			      how, c->id[target], out);
	return ret;
}

static bool migrate_args_ok(struct ro_test_cluster *c, int slot, int from, int to)
{
	return slot >= 0 && slot < NSLOTS && live(c, from) && live(c, to) && from != to &&
	       c->id[from][0] && c->id[to][0];
}

int ro_test_cluster_migrate_begin(struct ro_test_cluster *c, int slot, int from, int to)
{
	int ret;

	if (!migrate_args_ok(c, slot, from, to))
		return -EINVAL;
	ret = setslot(c, to, slot, "IMPORTING", from);
	return ret ? ret : setslot(c, from, slot, "MIGRATING", to);
}

int ro_test_cluster_migrate_some(struct ro_test_cluster *c, int slot, int from, int to,
				 int max_keys)
{
	const struct ro_test_redis *t = &c->node[to];
	size_t cap = 1 << 20;
	char *keys = malloc(cap), *save = NULL, s[16], m[16], port[16], out[1024];
	const char **av = calloc(MAX_ARGS + 1, sizeof(*av));
	int n = 0, nk = 0, ret;

	if (!keys || !av) {
		ret = -ENOMEM;
		goto out;
	}
	if (!migrate_args_ok(c, slot, from, to) || max_keys < 1) {
		ret = -EINVAL;
		goto out;
	}
	if (max_keys > MAX_ARGS - 16)
		max_keys = MAX_ARGS - 16;
	(void)snprintf(s, sizeof(s), "%d", slot);
	(void)snprintf(m, sizeof(m), "%d", max_keys);
	(void)snprintf(port, sizeof(port), "%d", t->port);
	ret =
	    ccmd(c, from, keys, cap, (const char *const[]){"CLUSTER", "GETKEYSINSLOT", s, m, NULL});
	if (ret) {
		(void)fprintf(stderr, "fixture: CLUSTER GETKEYSINSLOT: %s\n", keys);
		goto out;
	}
	av[n++] = "MIGRATE";
	av[n++] = "127.0.0.1";
	av[n++] = port;
	av[n++] = "";
	av[n++] = "0";
	av[n++] = "5000";
	if (t->password[0]) {
		if (t->user[0]) {
			av[n++] = "AUTH2";
			av[n++] = t->user;
		} else {
			av[n++] = "AUTH";
		}
		av[n++] = t->password;
	}
	av[n++] = "KEYS";
	/* one key a line (keys with a newline in them are not supported) */
	for (char *k = strtok_r(keys, "\n", &save); k && nk < max_keys;
	     k = strtok_r(NULL, "\n", &save)) {
		av[n++] = k;
		nk++;
	}
	av[n] = NULL;
	if (nk == 0) {
		ret = 0;
		goto out;
	}
	ret = ccmd(c, from, out, sizeof(out), av);
	if (ret) {
		(void)fprintf(stderr, "fixture: MIGRATE: %s\n", out);
		goto out;
	}
	ret = nk; /* OK, or NOKEY: gone from from either way */
out:
	free(keys);
	free(av);
	return ret;
}

int ro_test_cluster_migrate_end(struct ro_test_cluster *c, int slot, int from, int to)
{
	int64_t end = ro_test_mono_ms() + 60000;
	struct cview *v;
	int ret = 0;

	if (!migrate_args_ok(c, slot, from, to))
		return -EINVAL;
	for (int i = 0; i < 100000; i++) {
		ret = ro_test_cluster_migrate_some(c, slot, from, to, 100);
		if (ret <= 0)
			break;
		if (ro_test_mono_ms() > end) {
			ret = -ETIMEDOUT;
			break;
		}
	}
	if (ret < 0)
		return ret;
	/* the importing node first, then the migrating one, then everyone else */
	ret = setslot(c, to, slot, "NODE", to);
	if (!ret)
		ret = setslot(c, from, slot, "NODE", to);
	v = malloc(sizeof(*v));
	if (!v)
		return -ENOMEM;
	if (!ret && cluster_view(c, to, v) == 0) {
		for (int j = 0; j < c->n && !ret; j++) {
			if (j != from && j != to && live(c, j) && v->role[j] == 1)
				ret = setslot(c, j, slot, "NODE", to);
		}
	}
	free(v);
	if (ret)
		return ret;
	return cluster_wait(c, slot, to, -1, slot, 30000, "migrate_end", NULL);
}

/* ---- Sentinel ------------------------------------------------------------------------- */

struct sentry {
	const char *name, *flags, *link;
};

/* The entries of a SENTINEL REPLICAS / SENTINELS reply as redis-cli prints it: a field
 * name and its value a line, each entry beginning with "name". Modifies out. */
static int sentinel_entries(char *out, struct sentry *e, int max)
{
	int n = -1;
	char *p = out;

	while (p && *p) {
		char *k = p, *val, *nl = strchr(k, '\n');

		if (!nl)
			break;
		*nl = '\0';
		val = nl + 1;
		nl = strchr(val, '\n');
		if (!nl)
			break;
		*nl = '\0';
		p = nl + 1;
		if (!strcmp(k, "name")) {
			if (n + 1 >= max)
				break;
			e[++n] = (struct sentry){val, "", ""};
		} else if (n >= 0 && !strcmp(k, "flags")) {
			e[n].flags = val;
		} else if (n >= 0 && !strcmp(k, "master-link-status")) {
			e[n].link = val;
		}
	}
	return n + 1;
}

/* does sentinel i know the replica (connected, link ok) and two other sentinels? */
static bool sentinel_ready(struct ro_test_sentinel *s, int i, char *why, size_t whylen)
{
	struct ro_test_redis *x = &s->sentinel[i];
	char out[16384], name[64];
	struct sentry e[8];
	int n, others = 0;
	bool replica = false;

	(void)snprintf(name, sizeof(name), "127.0.0.1:%d", s->replica.port);
	if (ro_test_redis_cliv(x, 5000, out, sizeof(out),
			       (const char *const[]){"SENTINEL", "REPLICAS", s->master, NULL})) {
		(void)snprintf(why, whylen, "sentinel %d: SENTINEL REPLICAS: %.200s", i, out);
		return false;
	}
	n = sentinel_entries(out, e, 8);
	for (int j = 0; j < n; j++)
		replica |= !strcmp(e[j].name, name) && !strcmp(e[j].flags, "slave") &&
			   !strcmp(e[j].link, "ok");
	if (!replica) {
		(void)snprintf(why, whylen, "sentinel %d: replica %s not known and up", i, name);
		return false;
	}
	if (ro_test_redis_cliv(x, 5000, out, sizeof(out),
			       (const char *const[]){"SENTINEL", "SENTINELS", s->master, NULL})) {
		(void)snprintf(why, whylen, "sentinel %d: SENTINEL SENTINELS: %.200s", i, out);
		return false;
	}
	n = sentinel_entries(out, e, 8);
	for (int j = 0; j < n; j++)
		others += !strcmp(e[j].flags, "sentinel");
	if (others != 2) {
		(void)snprintf(why, whylen, "sentinel %d: knows %d other sentinels", i, others);
		return false;
	}
	if (ro_test_redis_cliv(x, 5000, out, sizeof(out),
			       (const char *const[]){"SENTINEL", "CKQUORUM", s->master, NULL})) {
		(void)snprintf(why, whylen, "sentinel %d: SENTINEL CKQUORUM: %.200s", i, out);
		return false;
	}
	return true;
}

int ro_test_sentinel_start(struct ro_test_sentinel *s, const struct ro_test_redis_opts *data_opts)
{
	struct ro_test_redis_opts d = data_opts ? *data_opts : (struct ro_test_redis_opts){0};
	char rof[64], why[512] = "";
	int64_t start, end;
	int ret;

	memset(s, 0, sizeof(*s));
	(void)snprintf(s->master, sizeof(s->master), "mymaster");
	d.dir = NULL;
	d.cluster = false;
	d.sentinel = false;
	d.replicaof = NULL;
	d.monitor = d.master_name = d.monitor_user = d.monitor_pass = NULL;
	ret = ro_test_redis_start_opts(&s->primary, &d);
	if (ret)
		return ret;
	if (d.tls && !d.certdir)
		d.certdir = s->primary.certdir; /* one CA for the whole group */
	(void)snprintf(rof, sizeof(rof), "127.0.0.1 %d", s->primary.port);
	d.replicaof = rof;
	ret = ro_test_redis_start_opts(&s->replica, &d);
	if (!ret)
		ret = ro_test_redis_wait_link(&s->replica, 30000);
	for (int i = 0; i < 3 && !ret; i++) {
		struct ro_test_redis_opts so = {
		    .tls = d.tls,
		    .tls_auth_clients = d.tls_auth_clients,
		    .certdir = d.certdir,
		    .sentinel = true,
		    .monitor = rof,
		    .master_name = s->master,
		    .monitor_user = d.user,
		    .monitor_pass = d.password,
		};

		ret = ro_test_redis_start_opts(&s->sentinel[i], &so);
	}
	start = ro_test_mono_ms();
	end = start + 30000;
	for (int k = 0; !ret; k++) {
		bool ready = true;

		for (int i = 0; i < 3 && ready; i++)
			ready = sentinel_ready(s, i, why, sizeof(why));
		if (ready)
			break;
		if (k >= 3000 || ro_test_mono_ms() >= end) {
			(void)fprintf(stderr, "fixture: sentinels not ready after %lld ms: %s\n",
				      (long long)(ro_test_mono_ms() - start), why);
			ret = -ETIMEDOUT;
			break;
		}
		ro_test_msleep(50);
	}
	if (ret) {
		ro_test_sentinel_stop(s);
		return ret;
	}
	(void)snprintf(s->url, sizeof(s->url),
		       "redis+sentinel://127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d/%s",
		       s->sentinel[0].port, s->sentinel[1].port, s->sentinel[2].port, s->master);
	return 0;
}

/* the master's port sentinel x reports, or -1 */
static int sentinel_master_port(struct ro_test_sentinel *s, const struct ro_test_redis *x)
{
	char out[256], *nl;

	if (ro_test_redis_cliv(
		x, 5000, out, sizeof(out),
		(const char *const[]){"SENTINEL", "GET-MASTER-ADDR-BY-NAME", s->master, NULL}))
		return -1;
	nl = strchr(out, '\n');
	return nl && !strncmp(out, "127.0.0.1\n", 10) ? atoi(nl + 1) : -1;
}

int ro_test_sentinel_kill_primary(struct ro_test_sentinel *s, int *new_port)
{
	struct ro_test_redis tmp;
	int64_t start = ro_test_mono_ms(), end = start + 30000;
	char why[256] = "";

	if (s->primary.pid <= 0 || s->replica.pid <= 0)
		return -EINVAL;
	ro_test_redis_kill(&s->primary);
	for (int k = 0; k < 3000 && ro_test_mono_ms() < end; k++) {
		char role[32];
		bool all = true;

		for (int i = 0; i < 3 && all; i++) {
			int p;

			if (s->sentinel[i].pid <= 0)
				continue;
			p = sentinel_master_port(s, &s->sentinel[i]);
			all = p == s->replica.port;
			if (!all)
				(void)snprintf(why, sizeof(why),
					       "sentinel %d says the master is on %d", i, p);
		}
		if (all) {
			if (ro_test_redis_info(&s->replica, "replication", "role", role,
					       sizeof(role)) == 0 &&
			    !strcmp(role, "master")) {
				tmp = s->primary;
				s->primary = s->replica;
				s->replica = tmp;
				if (new_port)
					*new_port = s->primary.port;
				return 0;
			}
			(void)snprintf(why, sizeof(why), "the replica says role:%s", role);
		}
		ro_test_msleep(50);
	}
	(void)fprintf(stderr, "fixture: sentinel failover: not done after %lld ms: %s\n",
		      (long long)(ro_test_mono_ms() - start), why);
	return -ETIMEDOUT;
}

void ro_test_sentinel_stop(struct ro_test_sentinel *s)
{
	for (int i = 0; i < 3; i++)
		ro_test_redis_stop(&s->sentinel[i]);
	ro_test_redis_stop(&s->replica);
	ro_test_redis_stop(&s->primary);
}
