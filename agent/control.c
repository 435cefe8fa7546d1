/* The control socket: the daemon's face for rolloutctl drain, status --local and the
 * Kubernetes probes. A unix stream socket (0600) on the loop: non-blocking, many clients,
 * each line-buffered (a command may arrive in pieces), one JSON line answered per command.
 * Commands are exact words: "status", "drain" or "drain <seconds>". An answer never waits
 * for Redis or the engine: it is made from what the control plane knows now. A client that
 * sends nothing for a while, or more than a line's worth, is dropped; past the client limit
 * new connections are closed at once, so a flood cannot starve the loop or the probes. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/control.h"
#include "agent/log.h"

#define CLIENTS_MAX 256
#define IDLE_MS 30000

struct client {
	struct ro_control *ctl;
	struct client *next;
	int fd;
	sd_event_source *src;
	char in[RO_CONTROL_LINE_MAX];
	size_t in_len;
	char *out;
	size_t out_len, out_off;
	int64_t last_ms;
};

struct ro_control {
	struct ro_agent *a;
	int lfd;
	char *path;
	sd_event_source *lsrc, *sweep;
	struct client *clients;
	unsigned n_clients;
	uint64_t served, dropped;
};

bool ro_ready(const struct ro_agent *a)
{
	return a->state == RO_RUNNING && a->last_redis_ok_ms &&
	       ro_now_ms() - a->last_redis_ok_ms <= (int64_t)a->cfg.redis_unready_ms;
}

void ro_status_json(struct ro_agent *a, char *buf, size_t len)
{
	int64_t now = ro_wall_ms(), mono = ro_now_ms();
	uint32_t held = 0, unckpt, active;
	double tps, step, pps, swap_median, swap_max;
	int64_t engine_age, swap_at, swap_first;
	bool swap_watch;
	uint64_t kv_bytes, kv_tokens;
	size_t n;

	pthread_mutex_lock(&a->mu);
	for (const struct unit_rt *u = a->units; u; u = u->next)
		held += u->cp != CP_GONE;
	active = ro_units_active(a);
	unckpt = ro_units_unckpt(a);
	tps = a->tokens_per_s;
	step = a->step_ms;
	pps = a->prefill_tokens_per_s;
	/* the engine's age counts only while it has work: an idle engine is not stuck */
	engine_age = a->engine_working ? mono - a->engine_beat_ms : 0;
	swap_median = a->swap_median_ms;
	swap_max = a->swap_max_ms;
	swap_watch = a->swap_watch != 0;
	swap_at = a->swap_at_ms;
	swap_first = a->swap_first_token_ms;
	kv_bytes = a->kv_bytes;
	kv_tokens = a->kv_tokens;
	pthread_mutex_unlock(&a->mu);
	(void)snprintf(buf, len,
		       "{\"state\":\"%s\",\"ready\":%s,\"worker\":\"%s\",\"units\":%u,\"in_flight\":%u,"
		       "\"tokens_per_s\":%.1f,\"step_ms\":%.2f,\"prefill_tokens_per_s\":%.1f,"
		       "\"backpressure\":%s,\"lag\":%lld,"
		       "\"stop_claiming\":%s,\"deadline_in_s\":%.3f,\"drain_reason\":\"%s\","
		       "\"loop_age_ms\":%lld,\"redis\":\"%s\",\"redis_mode\":\"%s\","
		       "\"redis_node\":\"%s\",\"redis_redirects\":%llu,\"redis_pending\":%zu,"
		       "\"redis_ok_age_ms\":%lld,\"claimed\":%llu,\"completed\":%llu,"
		       "\"requeued\":%llu,\"published\":%llu,\"failed\":%llu,\"lease_losses\":%llu,"
		       "\"uncheckpointed_max\":%u,\"policy_version\":%lld,"
		       "\"policy_published\":%lld,\"policy_lagging\":%s,\"policy_loading\":%s,"
		       "\"policy_swaps\":%llu,"
		       "\"policy_errors\":%llu,\"policy_bytes_done\":%llu,"
		       "\"policy_bytes_total\":%llu,\"swap_median_step_ms\":%.2f,"
		       "\"swap_max_step_ms\":%.2f,\"swap_watching\":%s,\"swap_at_ms\":%lld,"
		       "\"swap_first_token_ms\":%lld",
		       ro_state_name(a->state), ro_ready(a) ? "true" : "false", a->worker, held, active, tps, step, pps,
		       a->backpressure ? "true" : "false", (long long)a->lag,
		       a->stop_claiming ? "true" : "false",
		       a->state == RO_RUNNING ? -1.0 : (double)(a->deadline_wall_ms - now) / 1000.0,
		       a->drain_reason, (long long)(engine_age < 0 ? 0 : engine_age),
		       ro_queue_connected(a->q) ? "up" : "down", ro_queue_mode(a->q),
		       ro_queue_node(a->q), (unsigned long long)ro_queue_redirects(a->q),
		       ro_queue_pending(a->q),
		       (long long)(a->last_redis_ok_ms ? mono - a->last_redis_ok_ms : -1),
		       (unsigned long long)a->n.claimed, (unsigned long long)a->n.completed,
		       (unsigned long long)a->n.requeued, (unsigned long long)a->n.published,
		       (unsigned long long)a->n.failed, (unsigned long long)a->n.lease_losses,
		       unckpt, (long long)a->policy_version, (long long)a->published_version,
		       a->cfg.max_policy_lag &&
			       a->published_version - a->policy_version > (int64_t)a->cfg.max_policy_lag
			   ? "true"
			   : "false",
		       a->policy_loading ? "true" : "false",
		       (unsigned long long)a->n.policy_swaps, (unsigned long long)a->n.policy_errors,
		       (unsigned long long)a->policy_bytes_done,
		       (unsigned long long)a->policy_bytes_total, swap_median, swap_max,
		       swap_watch ? "true" : "false", (long long)swap_at, (long long)swap_first);
	n = strlen(buf);
	(void)snprintf(buf + n, len - n,
		       ",\"kv_bytes\":%llu,\"kv_positions\":%llu,\"kv_bytes_per_position\":%.0f",
		       (unsigned long long)kv_bytes, (unsigned long long)kv_tokens,
		       kv_tokens ? (double)kv_bytes / (double)kv_tokens : 0.0);
	if (a->ep) {
		struct ro_ep_stats st;

		n = strlen(buf);
		ro_ep_stats(a->ep, &st);
		(void)snprintf(
		    buf + n, len - n,
		    ",\"ep\":{\"group\":\"%s\",\"rank\":%u,\"size\":%u,\"provider\":\"%s\","
		    "\"failed\":%s,\"exchanges\":%llu,\"low_latency\":%llu,"
		    "\"dispatch_bytes\":%llu,\"combine_bytes\":%llu,\"dispatch_ms\":%.1f,"
		    "\"combine_ms\":%.1f,\"sync_ms\":%.1f}",
		    a->cfg.ep_group, ro_ep_rank(a->ep), ro_ep_world(a->ep), ro_ep_provider(a->ep),
		    a->ep_failed ? "true" : "false", (unsigned long long)st.exchanges,
		    (unsigned long long)st.ll_exchanges, (unsigned long long)st.dispatch_bytes,
		    (unsigned long long)st.combine_bytes, st.dispatch_ms, st.combine_ms,
		    st.sync_ms);
	}
	n = strlen(buf);
	(void)snprintf(buf + n, len - n, "}\n");
}

static void client_free(struct client *c)
{
	struct ro_control *ctl = c->ctl;

	for (struct client **p = &ctl->clients; *p; p = &(*p)->next)
		if (*p == c) {
			*p = c->next;
			break;
		}
	ctl->n_clients--;
	sd_event_source_disable_unref(c->src);
	(void)close(c->fd);
	free(c->out);
	free(c);
}

/* One command, answered into the client's output. */
static void command(struct client *c, const char *line)
{
	struct ro_agent *a = c->ctl->a;
	struct ro_control_req q;
	char rep[8192];
	size_t n;

	ro_control_parse(line, &q);
	switch (q.cmd) {
	case RO_CONTROL_STATUS:
		ro_status_json(a, rep, sizeof(rep));
		break;
	case RO_CONTROL_DRAIN: {
		double s = q.has_seconds ? q.seconds : a->cfg.sigterm_grace_s;

		ro_drain_begin(a, ro_wall_ms() + (int64_t)(s * 1000), "rolloutctl drain");
		ro_status_json(a, rep, sizeof(rep));
		break;
	}
	case RO_CONTROL_BAD_DRAIN:
		(void)snprintf(rep, sizeof(rep),
			       "{\"error\":\"drain wants seconds from 0 to 86400\"}\n");
		break;
	default:
		(void)snprintf(rep, sizeof(rep), "{\"error\":\"unknown command\"}\n");
		break;
	}
	n = strlen(rep);
	{
		char *o = realloc(c->out, c->out_len + n);

		if (!o)
			return;
		memcpy(o + c->out_len, rep, n);
		c->out = o;
		c->out_len += n;
	}
	c->ctl->served++;
}

static void on_line(void *arg, const char *line)
{
	command(arg, line);
}

static int client_flush(struct client *c)
{
	while (c->out_off < c->out_len) {
		ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);

		if (n < 0)
			return errno == EAGAIN ? 0 : -errno;
		c->out_off += (size_t)n;
	}
	c->out_off = c->out_len = 0;
	return 0;
}

static int on_client(sd_event_source *s, int fd, uint32_t revents, void *userdata)
{
	struct client *c = userdata;
	bool eof = false;

	(void)s;
	if (revents & EPOLLIN) {
		for (;;) {
			ssize_t n = read(fd, c->in + c->in_len, sizeof(c->in) - 1 - c->in_len);

			if (n == 0) {
				eof = true;
				break;
			}
			if (n < 0) {
				if (errno != EAGAIN && errno != EINTR)
					eof = true;
				break;
			}
			c->in_len += (size_t)n;
			c->last_ms = ro_now_ms();
			if (!ro_control_lines(c->in, &c->in_len, sizeof(c->in), on_line, c)) {
				eof = true; /* a line too long: not a client */
				break;
			}
		}
	}
	if (eof && c->in_len) { /* the last line needs no newline */
		c->in[c->in_len] = '\0';
		c->in_len = 0;
		command(c, c->in);
	}
	if (client_flush(c) || ((revents & (EPOLLHUP | EPOLLERR)) && !(revents & EPOLLIN)) ||
	    (eof && !c->out_len)) {
		client_free(c);
		return 0;
	}
	(void)sd_event_source_set_io_events(c->src, EPOLLIN | (c->out_len ? EPOLLOUT : 0));
	return 0;
}

static int on_accept(sd_event_source *s, int fd, uint32_t revents, void *userdata)
{
	struct ro_control *ctl = userdata;

	(void)s;
	(void)revents;
	for (int i = 0; i < 64; i++) {
		int cfd = accept4(fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
		struct client *c;

		if (cfd < 0)
			return 0;
		if (ctl->n_clients >= CLIENTS_MAX) {
			ctl->dropped++;
			(void)close(cfd);
			continue;
		}
		c = calloc(1, sizeof(*c));
		if (!c || sd_event_add_io(ctl->a->ev, &c->src, cfd, EPOLLIN, on_client, c) < 0) {
			free(c);
			(void)close(cfd);
			continue;
		}
		c->ctl = ctl;
		c->fd = cfd;
		c->last_ms = ro_now_ms();
		c->next = ctl->clients;
		ctl->clients = c;
		ctl->n_clients++;
	}
	return 0;
}

/* Drop clients silent for IDLE_MS: a probe that never sends its line holds nothing long. */
static int on_sweep(sd_event_source *s, uint64_t usec, void *userdata)
{
	struct ro_control *ctl = userdata;
	int64_t now = ro_now_ms();

	for (struct client *c = ctl->clients, *next; c; c = next) {
		next = c->next;
		if (now - c->last_ms > IDLE_MS)
			client_free(c);
	}
	(void)sd_event_source_set_time(s, usec + 1000000);
	return 0;
}

int ro_control_open(struct ro_agent *a, const char *path)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct ro_control *ctl;
	uint64_t now;
	mode_t old;
	int fd, r;

	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	(void)strcpy(sa.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return -errno;
	(void)unlink(path);
	old = umask(0177); /* 0600: the socket drains the node */
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) || listen(fd, 128)) {
		r = -errno;
		(void)umask(old);
		(void)close(fd);
		return r;
	}
	(void)umask(old);
	ctl = calloc(1, sizeof(*ctl));
	if (!ctl || !(ctl->path = strdup(path))) {
		free(ctl);
		(void)close(fd);
		return -ENOMEM;
	}
	ctl->a = a;
	ctl->lfd = fd;
	(void)sd_event_now(a->ev, CLOCK_MONOTONIC, &now);
	r = sd_event_add_io(a->ev, &ctl->lsrc, fd, EPOLLIN, on_accept, ctl);
	if (r >= 0)
		r = sd_event_add_time(a->ev, &ctl->sweep, CLOCK_MONOTONIC, now + 1000000, 100000,
				      on_sweep, ctl);
	if (r >= 0)
		r = sd_event_source_set_enabled(ctl->sweep, SD_EVENT_ON);
	a->ctl = ctl;
	if (r < 0) {
		ro_control_close(a);
		return r;
	}
	return 0;
}

void ro_control_close(struct ro_agent *a)
{
	struct ro_control *ctl = a->ctl;

	if (!ctl)
		return;
	while (ctl->clients)
		client_free(ctl->clients);
	sd_event_source_disable_unref(ctl->lsrc);
	sd_event_source_disable_unref(ctl->sweep);
	(void)close(ctl->lfd);
	(void)unlink(ctl->path);
	free(ctl->path);
	free(ctl);
	a->ctl = NULL;
}
