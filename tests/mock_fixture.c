/* The mock IMDS as a child process of a test: python3 on imds/mock_imds.py, port handed
 * back through a file in a mkdtemp directory, stopped with SIGTERM then SIGKILL. */
#include "tests/mock_fixture.h"
#include "tests/testutil.h"

#include <curl/curl.h>
#include <errno.h>
#include <ftw.h>
#include <json-c/json.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "config.h"

static const char *script(void)
{
	const char *src = getenv("RO_SRCDIR");
	static char buf[1024];

	(void)snprintf(buf, sizeof(buf), "%s/imds/mock_imds.py", src && *src ? src : RO_SRCDIR);
	return buf;
}

static int spawn(struct ro_test_mock *mk, const char *const *args)
{
	char port[16], pf[128];
	const char *av[64];
	size_t n = 0;
	pid_t parent = getpid();

	(void)snprintf(port, sizeof(port), "%d", mk->port);
	(void)snprintf(pf, sizeof(pf), "%s/port", mk->dir);
	(void)unlink(pf);
	av[n++] = "python3";
	av[n++] = script();
	av[n++] = "--port";
	av[n++] = port;
	av[n++] = "--port-file";
	av[n++] = pf;
	for (size_t i = 0; args && args[i] && n < 62; i++)
		av[n++] = args[i];
	av[n] = NULL;
	mk->pid = fork();
	if (mk->pid < 0)
		return -errno;
	if (mk->pid == 0) {
		(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(1);
		if (!freopen("/dev/null", "w", stdout))
			_exit(1);
		execvp("python3", (char *const *)av);
		_exit(127);
	}
	for (int i = 0; i < 1000; i++) {
		FILE *f = fopen(pf, "r");
		int st;

		if (f) {
			int p = 0;

			if (fscanf(f, "%d", &p) == 1 && p > 0) {
				(void)fclose(f);
				mk->port = p;
				(void)snprintf(mk->url, sizeof(mk->url), "http://127.0.0.1:%d", p);
				return 0;
			}
			(void)fclose(f);
		}
		if (waitpid(mk->pid, &st, WNOHANG) == mk->pid) {
			mk->pid = 0;
			return -EADDRINUSE;
		}
		ro_test_msleep(10);
	}
	return -ETIMEDOUT;
}

int ro_test_mock_start(struct ro_test_mock *mk, int port, const char *const *args)
{
	int r;

	if (!mk->dir[0]) {
		(void)snprintf(mk->dir, sizeof(mk->dir), "/tmp/ro-mock-XXXXXX");
		if (!mkdtemp(mk->dir))
			return -errno;
	}
	mk->port = port;
	/* a port freed a moment ago may still be held: try again briefly */
	for (int i = 0; i < 50; i++) {
		r = spawn(mk, args);
		if (r != -EADDRINUSE || !port)
			break;
		ro_test_msleep(100);
	}
	if (r)
		(void)fprintf(stderr, "fixture: mock IMDS did not start: %s\n", strerror(-r));
	return r;
}

void ro_test_mock_kill(struct ro_test_mock *mk)
{
	if (mk->pid > 0) {
		(void)kill(mk->pid, SIGKILL);
		(void)waitpid(mk->pid, NULL, 0);
	}
	mk->pid = 0;
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(p);
}

void ro_test_mock_stop(struct ro_test_mock *mk)
{
	if (mk->pid > 0) {
		(void)kill(mk->pid, SIGTERM);
		for (int i = 0; i < 100; i++) {
			if (waitpid(mk->pid, NULL, WNOHANG) == mk->pid) {
				mk->pid = 0;
				break;
			}
			ro_test_msleep(10);
		}
	}
	ro_test_mock_kill(mk);
	if (mk->dir[0])
		(void)nftw(mk->dir, rm_one, 8, FTW_DEPTH | FTW_PHYS);
	mk->dir[0] = '\0';
}

struct buf {
	char *p;
	size_t n;
};

static size_t on_data(char *d, size_t s, size_t nm, void *arg)
{
	struct buf *b = arg;
	char *p = realloc(b->p, b->n + s * nm + 1);

	if (!p)
		return 0;
	memcpy(p + b->n, d, s * nm);
	b->n += s * nm;
	p[b->n] = '\0';
	b->p = p;
	return s * nm;
}

static char *http(const struct ro_test_mock *mk, const char *path, bool post)
{
	char url[512];
	struct buf b = {0};
	CURL *c = curl_easy_init();
	long status = 0;
	CURLcode rc;

	if (!c)
		return NULL;
	(void)snprintf(url, sizeof(url), "%s%s", mk->url, path);
	(void)curl_easy_setopt(c, CURLOPT_URL, url);
	(void)curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
	(void)curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 5000L);
	(void)curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
	(void)curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
	if (post)
		(void)curl_easy_setopt(c, CURLOPT_POSTFIELDS, "");
	rc = curl_easy_perform(c);
	(void)curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
	curl_easy_cleanup(c);
	if (rc != CURLE_OK || status != 200) {
		(void)fprintf(stderr, "fixture: %s: %s, HTTP %ld\n", url, curl_easy_strerror(rc),
			      status);
		free(b.p);
		return NULL;
	}
	return b.p;
}

char *ro_test_mock_ctl(const struct ro_test_mock *mk, const char *what)
{
	char path[400];

	(void)snprintf(path, sizeof(path), "/_mock/%s", what);
	return http(mk, path, true);
}

static struct json_object *state_get(const struct ro_test_mock *mk, const char *a, const char *b)
{
	char *s = http(mk, "/_mock/state", false);
	struct json_object *root, *x, *y, *out = NULL;

	if (!s)
		return NULL;
	root = json_tokener_parse(s);
	free(s);
	if (root && json_object_object_get_ex(root, a, &x) && json_object_object_get_ex(x, b, &y))
		out = json_object_get(y);
	json_object_put(root);
	return out;
}

/* state a.b as an integer, or none if it is not there */
static long state_long(const struct ro_test_mock *mk, const char *a, const char *b, long none)
{
	struct json_object *v = state_get(mk, a, b);
	long n = v ? (long)json_object_get_int64(v) : none;

	json_object_put(v);
	return n;
}

long ro_test_mock_count(const struct ro_test_mock *mk, const char *name)
{
	return state_long(mk, "counts", name, -1);
}

long ro_test_mock_path_count(const struct ro_test_mock *mk, const char *path)
{
	return state_long(mk, "paths", path, 0); /* never asked: not in the map */
}

double ro_test_mock_number(const struct ro_test_mock *mk, const char *a, const char *b)
{
	struct json_object *v = state_get(mk, a, b);
	double d = v ? json_object_get_double(v) : NAN;

	json_object_put(v);
	return d;
}
