/* rolloutd as a test starts it (see agent_fixture.h). */
#include "tests/agent_fixture.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <regex.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/testutil.h"

const char *ro_test_bin(const char *env, const char *name)
{
	static char buf[2][512];
	static int i;
	const char *p = getenv(env);

	i ^= 1;
	if (p && *p)
		return p;
	(void)snprintf(buf[i], sizeof(buf[i]), "./%s", name);
	return buf[i];
}

void ro_test_agent_start(struct ro_test_agent *ag, const char *dir, const char *model,
			 const char *url, const char *name, const char *q,
			 const char *const *extra, const char *const *env)
{
	const char *av[80];
	size_t n = 0;
	pid_t parent = getpid();

	memset(ag, 0, sizeof(*ag));
	(void)snprintf(ag->name, sizeof(ag->name), "%s", name);
	(void)snprintf(ag->sock, sizeof(ag->sock), "%s/%s.sock", dir, name);
	(void)snprintf(ag->log, sizeof(ag->log), "%s/%s.log", dir, name);
	(void)snprintf(ag->metrics, sizeof(ag->metrics), "%s/%s.prom", dir, name);
	av[n++] = ro_test_bin("RO_ROLLOUTD", "rolloutd");
	av[n++] = "--redis";
	av[n++] = url;
	av[n++] = "--queue";
	av[n++] = q;
	av[n++] = "--model";
	av[n++] = model;
	av[n++] = "--worker-id";
	av[n++] = name;
	av[n++] = "--control-socket";
	av[n++] = ag->sock;
	av[n++] = "--metrics-file";
	av[n++] = ag->metrics;
	av[n++] = "--metrics-interval-ms";
	av[n++] = "200";
	av[n++] = "--status-interval-ms";
	av[n++] = "200";
	av[n++] = "--threads";
	av[n++] = "1";
	av[n++] = "--max-inflight";
	av[n++] = "16";
	av[n++] = "--log-level";
	av[n++] = "debug";
	/* tests touch loopback only: the metadata service is a port nobody serves unless the
	 * test names its mock (a later flag wins) */
	av[n++] = "--imds-endpoint";
	av[n++] = "http://127.0.0.1:1";
	for (size_t i = 0; extra && extra[i] && n < 78; i++)
		av[n++] = extra[i];
	av[n] = NULL;
	ag->pid = fork();
	cr_assert_geq(ag->pid, 0);
	if (ag->pid == 0) {
		int fd = open(ag->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);

		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(1);
		for (size_t i = 0; env && env[i]; i += 2)
			(void)setenv(env[i], env[i + 1], 1);
		(void)dup2(fd, 2);
		(void)dup2(fd, 1);
		execv(av[0], (char *const *)av);
		_exit(127);
	}
}

/* SIGTERM once the agent handles it: wait, bounded, until it has logged its first line
 * (main installs its handler before anything else, and the log is written only by
 * rolloutd), or the process is gone. What /proc shows of its handlers does not say it:
 * between fork and exec the child is still this test process, with Criterion's handlers,
 * and before main libinfinipath (loaded with Debian's libfabric) catches SIGTERM with a
 * handler that exits 1. A SIGTERM in either window exited 1, died or hung (seen when the
 * units were all done before the second agent started); one before main would kill it
 * outright (a sanitized start under load takes a while). */
void ro_test_agent_term(const struct ro_test_agent *ag)
{
	char path[64], line[256];

	if (ag->pid <= 0)
		return;
	(void)snprintf(path, sizeof(path), "/proc/%d/status", (int)ag->pid);
	for (int i = 0; i < 3000; i++) {
		FILE *f = fopen(path, "r");
		bool zombie = !f;
		struct stat st;

		while (f && fgets(line, sizeof(line), f))
			if (!strncmp(line, "State:", 6) && strchr(line, 'Z'))
				zombie = true;
		if (f)
			fclose(f);
		if (zombie || (!stat(ag->log, &st) && st.st_size > 0))
			break;
		ro_test_msleep(20);
	}
	(void)kill(ag->pid, SIGTERM);
}

int ro_test_agent_wait_exit(struct ro_test_agent *ag, long ms)
{
	int st;

	for (long t = 0; t <= ms; t += 20) {
		if (waitpid(ag->pid, &st, WNOHANG) == ag->pid) {
			ag->pid = 0;
			return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
		}
		ro_test_msleep(20);
	}
	(void)kill(ag->pid, SIGKILL);
	(void)waitpid(ag->pid, &st, 0);
	ag->pid = 0;
	return -1;
}

void ro_test_agent_dump_log(const struct ro_test_agent *ag)
{
	char cmd[2 * sizeof(ag->log) + 64];

	(void)snprintf(cmd, sizeof(cmd), "echo '--- %s (last 30 lines):' >&2; tail -n 30 %s >&2",
		       ag->log, ag->log);
	(void)system(cmd);
}

const char *ro_test_agent_status(const struct ro_test_agent *ag, const char *req)
{
	static char buf[8192];
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM, 0);
	ssize_t n;

	buf[0] = '\0';
	strcpy(sa.sun_path, ag->sock);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
	    write(fd, req, strlen(req)) == (ssize_t)strlen(req) &&
	    (n = read(fd, buf, sizeof(buf) - 1)) > 0)
		buf[n] = '\0';
	close(fd);
	return buf;
}

bool ro_test_agent_log_has(const struct ro_test_agent *ag, const char *what)
{
	FILE *f = fopen(ag->log, "r");
	char line[4096];
	bool found = false;
	regex_t re;

	cr_assert_eq(regcomp(&re, what, REG_NOSUB), 0, "bad pattern %s", what);
	while (f && !found && fgets(line, sizeof(line), f))
		found = regexec(&re, line, 0, NULL, 0) == 0;
	if (f)
		(void)fclose(f);
	regfree(&re);
	return found;
}

double ro_test_json_field(const char *json, const char *key)
{
	char pat[64];
	const char *p;

	(void)snprintf(pat, sizeof(pat), "\"%s\":", key);
	p = strstr(json, pat);
	if (!p)
		return -1;
	p += strlen(pat);
	if (!strncmp(p, "true", 4))
		return 1;
	if (!strncmp(p, "false", 5))
		return 0;
	return strtod(p, NULL);
}

double ro_test_agent_field(const struct ro_test_agent *ag, const char *key)
{
	return ro_test_json_field(ro_test_agent_status(ag, "status\n"), key);
}

int ro_test_ctl(char *out, size_t len, ...)
{
	const char *av[48];
	size_t n = 0, got = 0;
	int pfd[2], st;
	va_list ap;
	pid_t pid;

	av[n++] = ro_test_bin("RO_ROLLOUTCTL", "rolloutctl");
	va_start(ap, len);
	for (const char *a; n < 47 && (a = va_arg(ap, const char *));)
		av[n++] = a;
	va_end(ap);
	av[n] = NULL;
	cr_assert_eq(pipe(pfd), 0);
	pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		(void)dup2(pfd[1], 1);
		(void)dup2(pfd[1], 2);
		close(pfd[0]);
		execv(av[0], (char *const *)av);
		_exit(127);
	}
	close(pfd[1]);
	for (ssize_t r; got + 1 < len && (r = read(pfd[0], out + got, len - 1 - got)) > 0;)
		got += (size_t)r;
	out[got] = '\0';
	close(pfd[0]);
	(void)waitpid(pid, &st, 0);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

unsigned ro_test_scaled(unsigned tokens)
{
	const char *s = getenv("RO_SANITIZED");

	return s && *s == '1' ? tokens / 8 + 8 : tokens;
}
