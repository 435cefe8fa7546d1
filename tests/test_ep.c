/* kernels/ep: dispatch and combine between real processes over libfabric's tcp provider
 * (bound to lo) and shm, rendezvous through a real redis-server. Random, skewed, one-rank
 * and empty routings for W = 2, 3, 4 in both modes, received rows and returned outputs
 * checked exactly; the EP forward bitwise equal to the single-rank forward; a dead rank
 * named by the others within the timeout; forged and badly signed rendezvous cards
 * refused without a byte written where they point. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/ep/internal.h" /* the card, to forge one */
#include "kernels/model.h"
#include "queue/queue.h"
#include "tests/bench/ep_routing.h"
#include "tests/redis_fixture.h"
#include "tests/redis_hooks.h"

#define H 48
#define K 4
#define E 32
#define CAP 96
#define LL 24
#define SECRET "test-ep-secret-0123456789abcdef"

static void setup(void)
{
	setenv("FI_TCP_IFACE", "lo", 1);
	setenv("FI_SOCKETS_IFACE", "lo", 1);
}

TestSuite(ep, .init = setup, .timeout = 240);

/* What rank 0 makes of rank 1's card before it connects (hostile_connect). */
enum forge {
	F_NONE,
	F_FILE,		  /* fd: an ordinary file, open in another process (the test's) */
	F_MEMFD_SIZE,	  /* fd: a sealed memfd of the right name, the wrong size */
	F_MEMFD_UNSEALED, /* fd: a memfd of the right name and size, not sealed */
	F_MEMFD_NAME,	  /* fd: a sealed memfd of the right size, another name */
	F_TAMPER,	  /* one byte of the card changed, the signature left as it was */
};

struct group {
	const char *provider;
	uint32_t world;
	char name[64];
	enum ro_ep_dtype dtype;
	uint32_t timeout_ms;
	bool sum;	  /* combine_sum */
	bool fabric_only; /* shm without the direct stores */
	const char *secret;  /* every rank's EP secret (NULL: unsigned cards) */
	const char *secret0; /* rank 0's, when it differs ("": none) */
	enum forge forge;
	int file_fd;	     /* F_FILE: the test's file, open in the test process */
	const char *want[2]; /* per rank: connect fails with -EPERM saying this */
	const char *why;     /* and rank 0's message also says this */
};

static const char *secret_of(const struct group *g, uint32_t rank)
{
	const char *s = rank == 0 && g->secret0 ? g->secret0 : g->secret;

	return s && *s ? s : NULL;
}

/* In a child: print why and exit 1. */
static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	(void)vfprintf(stderr, fmt, ap);
	va_end(ap);
	(void)fputc('\n', stderr);
	_exit(1);
}

/* This rank's endpoint and every rank's card, through Redis (not yet connected). */
static struct ro_ep *meet(const struct group *g, uint32_t rank, uint32_t max_tokens, uint32_t ll,
			  uint32_t hidden, uint32_t top_k, uint32_t experts, void **cards,
			  size_t *lens)
{
	struct ro_queue_opts qo = {.url = ro_test_redis_url(), .queue = "ep-test"};
	struct ro_ep_opts o;
	struct ro_queue *q = NULL;
	struct ro_ep *ep = NULL;
	uint8_t card[RO_EP_CARD_MAX];
	const char *secret = secret_of(g, rank);
	size_t len;
	char err[256];
	int r;

	ro_ep_opts_default(&o);
	o.provider = g->provider;
	o.rank = rank;
	o.world = g->world;
	o.hidden = hidden;
	o.top_k = top_k;
	o.experts = experts;
	o.max_tokens = max_tokens;
	o.ll_tokens = ll;
	o.dispatch_dtype = o.combine_dtype = g->dtype;
	o.timeout_ms = g->timeout_ms ? g->timeout_ms : 20000;
	o.combine_sum = g->sum;
	o.fabric_only = g->fabric_only;
	o.group = g->name;
	o.secret = (const uint8_t *)secret;
	o.secret_len = secret ? strlen(secret) : 0;
	r = ro_ep_new(&o, &ep, err, sizeof(err));
	if (r)
		die("rank %u: ro_ep_new: %s", rank, err);
	if (ro_ep_card(ep, card, &len))
		die("rank %u: card: %s", rank, ro_ep_errmsg(ep));
	if (ro_queue_new(&qo, &q))
		die("rank %u: redis: %s", rank, ro_queue_errmsg(NULL));
	r = ro_queue_ep_rendezvous(q, g->name, rank, g->world, card, len, 20000, cards, lens);
	if (r)
		die("rank %u: rendezvous: %s", rank, ro_queue_errmsg(q));
	(void)ro_queue_free(q);
	return ep;
}

/* This rank's endpoint, connected to the group through Redis. */
static struct ro_ep *join(const struct group *g, uint32_t rank, uint32_t max_tokens, uint32_t ll,
			  uint32_t hidden, uint32_t top_k, uint32_t experts)
{
	void *cards[64];
	size_t lens[64];
	struct ro_ep *ep = meet(g, rank, max_tokens, ll, hidden, top_k, experts, cards, lens);

	if (ro_ep_connect(ep, (const void *const *)cards, lens))
		die("rank %u: connect: %s", rank, ro_ep_errmsg(ep));
	for (uint32_t i = 0; i < g->world; i++)
		free(cards[i]);
	return ep;
}

/* Fork world ranks running fn; every one must exit 0 within the time limit. */
static void run_group(struct group *g, void (*fn)(const struct group *, uint32_t))
{
	pid_t pid[8];
	static int seq;
	time_t t0 = time(NULL);

	(void)snprintf(g->name, sizeof(g->name), "g%d-%d", (int)getpid(), seq++);
	for (uint32_t r = 0; r < g->world; r++) {
		pid[r] = fork();
		cr_assert_geq(pid[r], 0);
		if (!pid[r]) {
			(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
			fn(g, r);
			_exit(0);
		}
	}
	for (uint32_t r = 0; r < g->world; r++) {
		int st = 0;

		for (;;) {
			pid_t w = waitpid(pid[r], &st, WNOHANG);

			if (w == pid[r])
				break;
			if (time(NULL) - t0 > 150) {
				for (uint32_t k = 0; k < g->world; k++)
					(void)kill(pid[k], SIGKILL);
				cr_assert_fail("%s W=%u: rank %u still running after 150 s",
					       g->provider, g->world, r);
			}
			usleep(10000);
		}
		cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0,
			  "%s W=%u: rank %u failed (status %d)", g->provider, g->world, r, st);
	}
}

/* ---- dispatch / combine with synthetic experts ------------------------------------- */

enum routing { UNIFORM, HOT, ONE_RANK, SOME_EMPTY, N_ROUTING };
static const char *const routing_name[] = {"uniform", "hot expert", "all to rank 0",
					   "some ranks empty"};

static uint64_t mix(uint64_t x)
{
	return epb_mix(x);
}

static uint32_t tokens_of(enum routing rt, uint32_t rank, uint32_t round, uint32_t cap)
{
	if (rt == SOME_EMPTY && rank % 2 == 1)
		return 0;
	return 1 + (uint32_t)(mix(rank * 977 + round * 31 + rt) % cap);
}

/* The routing rank `rank` uses in round `round`: any rank can recompute it. Top-k ids are
 * distinct and sorted, as the model's router gives them. */
static void routing(enum routing rt, uint32_t rank, uint32_t round, uint32_t world, uint32_t T,
		    int32_t *ids)
{
	for (uint32_t t = 0; t < T; t++) {
		int32_t *row = ids + (size_t)t * K;
		uint32_t n = 0;
		uint64_t s =
		    mix(((uint64_t)rank << 40) ^ ((uint64_t)round << 20) ^ t ^ (uint64_t)rt << 56);

		if (rt == HOT)
			row[n++] = 5;
		while (n < K) {
			int32_t e;
			bool dup = false;

			s = mix(s);
			e = rt == ONE_RANK ? (int32_t)((s % (E / world)) * world)
					   : (int32_t)(s % E);
			for (uint32_t i = 0; i < n; i++)
				dup |= row[i] == e;
			if (!dup)
				row[n++] = e;
		}
		epb_sort_ids(row, K);
	}
}

/* Values exact in bf16 too: small multiples of 1/4. */
static float xval(uint32_t rank, uint32_t round, uint32_t t, uint32_t d)
{
	return (float)((int)(mix(rank * 7919 + round * 104729 + t * 131 + d) % 64) - 32) * 0.25f;
}

/* The synthetic expert: exact in bf16 (power-of-two scale) and expert-specific in f32. */
static float expert_fn(float x, int32_t e, bool bf16)
{
	return bf16 ? x * (float)(1 << (e % 8)) : x * (float)(e + 1) + (float)e * 0.5f;
}

static void exchange_rounds(const struct group *g, uint32_t rank)
{
	struct ro_ep *ep = join(g, rank, CAP, LL, H, K, E);
	const bool bf16 = g->dtype == RO_EP_BF16;
	float *x = malloc(CAP * H * sizeof(float)), *out = malloc(CAP * K * H * sizeof(float));
	int32_t *ids = malloc(CAP * K * sizeof(int32_t)), *sids = malloc(CAP * K * sizeof(int32_t));
	float *w = malloc(CAP * K * sizeof(float));
	uint32_t round = 0;
	struct ro_ep_stats st;

	/* shm stores straight into the peers' regions unless told not to; tcp never does */
	ro_ep_stats(ep, &st);
	if (st.direct_peers != (!strcmp(g->provider, "shm") && !g->fabric_only ? g->world - 1 : 0))
		die("rank %u: %u peers stored into directly over %s%s", rank, st.direct_peers,
		    g->provider, g->fabric_only ? " (fabric only)" : "");
	for (int mode = 0; mode < 2; mode++) {
		enum ro_ep_mode m = mode ? RO_EP_THROUGHPUT : RO_EP_LOW_LATENCY;
		uint32_t cap = mode ? CAP : LL;

		ro_ep_set_mode(ep, m);
		for (uint32_t rt = 0; rt < N_ROUTING; rt++) {
			for (uint32_t rep = 0; rep < 2; rep++, round++) {
				const struct ro_ep_batch *b;
				uint32_t T = tokens_of(rt, rank, round, cap), row = 0;
				size_t pair = 0;
				float *y;

				for (uint32_t t = 0; t < T; t++)
					for (uint32_t d = 0; d < H; d++)
						x[t * H + d] = xval(rank, round, t, d);
				routing(rt, rank, round, g->world, T, ids);
				for (uint32_t i = 0; i < T * K; i++)
					w[i] = 0.125f * (float)(1 + (i * 7 + round) % 8);
				if (ro_ep_dispatch(ep, round % 7, x, ids, g->sum ? w : NULL, T, &b))
					die("rank %u %s %s: dispatch: %s", rank,
					    mode ? "throughput" : "low-latency", routing_name[rt],
					    ro_ep_errmsg(ep));
				if (ro_ep_decode(ep) || !b->x || !b->pair_x)
					die("rank %u: decode", rank);
				/* what arrived: every source's tokens that picked one of our
				 * experts, in its order, with exactly those experts */
				for (uint32_t s = 0; s < g->world; s++) {
					uint32_t Ts = tokens_of(rt, s, round, cap);

					routing(rt, s, round, g->world, Ts, sids);
					for (uint32_t t = 0; t < Ts; t++) {
						bool mine = false;

						for (uint32_t j = 0; j < K; j++)
							mine |= sids[t * K + j] % g->world == rank;
						if (!mine)
							continue;
						if (row >= b->rows || b->row_src[row] != s)
							die("rank %u: row %u should come from rank "
							    "%u",
							    rank, row, s);
						for (uint32_t d = 0; d < H; d++)
							if (b->x[row][d] != xval(s, round, t, d))
								die("rank %u %s: row %u (rank %u "
								    "token "
								    "%u) element %u is %g, want %g",
								    rank, routing_name[rt], row, s,
								    t, d, b->x[row][d],
								    xval(s, round, t, d));
						for (uint32_t j = 0; j < K; j++) {
							if (sids[t * K + j] % g->world != rank)
								continue;
							if (pair >= b->pairs ||
							    b->pair_row[pair] != row ||
							    b->pair_expert[pair] !=
								sids[t * K + j] ||
							    b->pair_x[pair] != b->x[row])
								die("rank %u: pair %zu wrong", rank,
								    pair);
							pair++;
						}
						row++;
					}
				}
				if (row != b->rows || pair != b->pairs)
					die("rank %u %s: %u rows %zu pairs, want %u %zu", rank,
					    routing_name[rt], b->rows, b->pairs, row, pair);
				y = ro_ep_combine_buffer(ep);
				for (size_t p = 0; p < b->pairs; p++)
					for (uint32_t d = 0; d < H; d++)
						y[p * H + d] = expert_fn(b->pair_x[p][d],
									 b->pair_expert[p], bf16);
				memset(out, 0xff, (size_t)CAP * K * H * sizeof(float));
				if (ro_ep_combine(ep, out))
					die("rank %u: combine: %s", rank, ro_ep_errmsg(ep));
				/* combine_sum: per owner rank the weighted sum in expert order,
				 * then summed at home in rank order */
				for (uint32_t t = 0; g->sum && t < T; t++)
					for (uint32_t d = 0; d < H; d++) {
						float want = 0, got = out[(size_t)t * H + d];

						for (uint32_t o = 0; o < g->world; o++) {
							float part = 0;

							for (uint32_t j = 0; j < K; j++)
								if ((uint32_t)ids[t * K + j] %
									g->world ==
								    o)
									part =
									    part +
									    w[t * K + j] *
										expert_fn(
										    x[t * H + d],
										    ids[t * K + j],
										    bf16);
							want = want + part;
						}
						if (memcmp(&got, &want, sizeof(got)))
							die("rank %u %s: token %u element %u: sum "
							    "%g, "
							    "want %g",
							    rank, routing_name[rt], t, d, got,
							    want);
					}
				for (uint32_t t = 0; !g->sum && t < T; t++)
					for (uint32_t j = 0; j < K; j++)
						for (uint32_t d = 0; d < H; d++) {
							float want = expert_fn(
							    x[t * H + d], ids[t * K + j], bf16);
							float got =
							    out[((size_t)t * K + j) * H + d];

							if (memcmp(&got, &want, sizeof(got)))
								die("rank %u %s %s: token %u "
								    "expert %d "
								    "element %u: %g, want %g",
								    rank,
								    mode ? "throughput"
									 : "low-latency",
								    routing_name[rt], t,
								    ids[t * K + j], d, got, want);
						}
			}
		}
	}
	free(x);
	free(out);
	free(ids);
	free(sids);
	free(w);
	(void)ro_ep_free(ep);
}

static void exchanges(const char *provider, enum ro_ep_dtype dtype)
{
	for (uint32_t w = 2; w <= 4; w++) {
		/* W = 3 with signed cards: the direct path still taken once they verify */
		struct group g = {.provider = provider,
				  .world = w,
				  .dtype = dtype,
				  .secret = w == 3 ? SECRET : NULL};

		run_group(&g, exchange_rounds);
	}
}

Test(ep, dispatch_combine_tcp)
{
	exchanges("tcp", RO_EP_F32);
}

Test(ep, dispatch_combine_shm)
{
	exchanges("shm", RO_EP_F32);
}

Test(ep, dispatch_combine_sum_tcp_shm)
{
	for (uint32_t w = 2; w <= 4; w += 2) {
		struct group g = {.provider = w == 2 ? "tcp" : "shm", .world = w, .sum = true};

		run_group(&g, exchange_rounds);
	}
}

Test(ep, dispatch_combine_bf16_shm)
{
	struct group g = {.provider = "shm", .world = 3, .dtype = RO_EP_BF16};

	run_group(&g, exchange_rounds);
}

/* shm with every byte through libfabric (RMA writes) instead of the direct stores */
Test(ep, dispatch_combine_shm_fabric_only)
{
	for (int sum = 0; sum < 2; sum++) {
		struct group g = {.provider = "shm", .world = 3, .sum = sum, .fabric_only = true};

		run_group(&g, exchange_rounds);
	}
}

/* ---- a rank that dies ------------------------------------------------------------------ */

static void dies_after_connect(const struct group *g, uint32_t rank)
{
	struct ro_ep *ep = join(g, rank, CAP, LL, H, K, E);
	const struct ro_ep_batch *b;
	float x[H] = {0};
	int32_t ids[K] = {0, 1, 2, 3};
	int r;

	if (rank == 2)
		(void)raise(SIGKILL);
	ro_ep_set_mode(ep, RO_EP_LOW_LATENCY);
	/* give the dead rank's process time to be gone */
	usleep(200000);
	r = ro_ep_dispatch(ep, 0, x, ids, NULL, 1, &b);
	if (!r) {
		float *y = ro_ep_combine_buffer(ep), out[K * H];

		memset(y, 0, b->pairs * H * sizeof(float));
		r = ro_ep_combine(ep, out);
	}
	if (r == 0)
		die("rank %u: an exchange with a dead rank succeeded", rank);
	if (!strstr(ro_ep_errmsg(ep), "rank 2"))
		die("rank %u: error does not name rank 2: %s", rank, ro_ep_errmsg(ep));
	/* and everything after fails at once */
	if (ro_ep_dispatch(ep, 1, x, ids, NULL, 1, &b) != -EPIPE)
		die("rank %u: a broken group accepted another exchange", rank);
	(void)ro_ep_free(ep);
	_exit(0);
}

static void dead_rank(const char *provider)
{
	/* long enough that ranks 0 and 1 reach their exchange within it on a loaded box: with
	 * 1.5 s, rank 1 held back 2.5 s before its exchange made rank 0 name rank 1, not 2 */
	struct group g = {.provider = provider, .world = 3, .timeout_ms = 6000};
	pid_t pid[3];
	static int seq;

	(void)snprintf(g.name, sizeof(g.name), "dead%d-%d", (int)getpid(), seq++);
	for (uint32_t r = 0; r < 3; r++) {
		pid[r] = fork();
		if (!pid[r]) {
			(void)prctl(PR_SET_PDEATHSIG, SIGKILL);
			dies_after_connect(&g, r);
		}
	}
	for (uint32_t r = 0; r < 3; r++) {
		int st;

		cr_assert_eq(waitpid(pid[r], &st, 0), pid[r]);
		if (r == 2) {
			char cmd[96];

			cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
			/* what libfabric shm could not remove for the killed rank */
			(void)snprintf(cmd, sizeof(cmd), "rm -f /dev/shm/rolloutd-ep-%d-*",
				       (int)pid[r]);
			(void)system(cmd);
		} else
			cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0,
				  "%s: rank %u did not report the dead rank (status %d)", provider,
				  r, st);
	}
}

Test(ep, dead_rank_named_tcp)
{
	dead_rank("tcp");
}

Test(ep, dead_rank_named_shm)
{
	dead_rank("shm");
}

/* ---- forged and badly signed cards ------------------------------------------------------ */

/* What rank 0 points rank 1's card at: a descriptor it (or the test) holds. */
static int forged_fd(const struct group *g, const struct ro_fab_card *c, pid_t *ret_pid)
{
	uint64_t tag = ro_fab_group_tag(g->name);
	char name[80];
	off_t size = (off_t)c->len;
	unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING;
	int fd;

	*ret_pid = getpid();
	switch (g->forge) {
	case F_FILE:
		*ret_pid = getppid();
		return g->file_fd;
	case F_MEMFD_SIZE:
		size = (off_t)c->len / 2;
		/* fall through */
	case F_MEMFD_UNSEALED:
		if (g->forge == F_MEMFD_UNSEALED)
			flags = MFD_CLOEXEC;
		ro_fab_region_name(name, sizeof(name), 1, g->world, tag, c->nonce);
		break;
	case F_MEMFD_NAME:
		ro_fab_region_name(name, sizeof(name), 1, g->world, tag, c->nonce + 1);
		break;
	default:
		return -1;
	}
	fd = memfd_create(name, flags);
	if (fd < 0 || ftruncate(fd, size))
		die("memfd: %s", strerror(errno));
	if ((flags & MFD_ALLOW_SEALING) && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW))
		die("seals: %s", strerror(errno));
	return fd;
}

/* Rank 0 forges rank 1's card as g->forge says (re-signed with its secret when it has
 * one, except F_TAMPER) and connects: each rank's connect must fail as g->want says. */
static void hostile_connect(const struct group *g, uint32_t rank)
{
	void *cards[64];
	size_t lens[64];
	struct ro_ep *ep = meet(g, rank, CAP, LL, H, K, E, cards, lens);
	const char *secret = secret_of(g, rank), *want = g->want[rank];
	int fd = -1, r;

	if (rank == 0 && g->forge != F_NONE) {
		struct ro_fab_card c;
		pid_t pid;

		if (lens[1] != sizeof(c))
			die("rank 1's card has %zu bytes", lens[1]);
		memcpy(&c, cards[1], sizeof(c));
		if (g->forge == F_TAMPER) {
			c.key ^= 1;
		} else {
			fd = forged_fd(g, &c, &pid);
			c.pid = (int32_t)pid;
			c.fd = fd;
			if (ro_fab_card_sign(&c, (const uint8_t *)secret,
					     secret ? strlen(secret) : 0))
				die("sign");
		}
		memcpy(cards[1], &c, sizeof(c));
	}
	r = ro_ep_connect(ep, (const void *const *)cards, lens);
	if (want && r != -EPERM)
		die("rank %u: connect returned %d, want -EPERM (%s): %s", rank, r, want,
		    r ? ro_ep_errmsg(ep) : "connected");
	if (want && !strstr(ro_ep_errmsg(ep), want))
		die("rank %u: connect says \"%s\", want \"%s\"", rank, ro_ep_errmsg(ep), want);
	if (want && rank == 0 && g->why && !strstr(ro_ep_errmsg(ep), g->why))
		die("rank %u: connect says \"%s\", want the reason \"%s\"", rank, ro_ep_errmsg(ep),
		    g->why);
	if (!want && r)
		die("rank %u: connect: %s", rank, ro_ep_errmsg(ep));
	if (fd >= 0 && g->forge != F_FILE)
		(void)close(fd);
	for (uint32_t i = 0; i < g->world; i++)
		free(cards[i]);
	(void)ro_ep_free(ep);
}

static uint8_t file_byte(size_t i)
{
	return (uint8_t)(i * 131 + 7);
}

/* A card whose fd is an ordinary file of another process (here: the test's own, which it
 * could write) is refused, signed or not, and not a byte of the file changes. */
Test(ep, card_fd_ordinary_file_refused)
{
	enum { N = 1 << 20 };
	char path[] = "/tmp/ro-ep-victim-XXXXXX";
	uint8_t *buf = malloc(N);
	int fd = mkstemp(path);

	cr_assert_geq(fd, 0);
	cr_assert_not_null(buf);
	for (size_t i = 0; i < N; i++)
		buf[i] = file_byte(i);
	cr_assert_eq(write(fd, buf, N), N);
	for (int signed_ = 0; signed_ < 2; signed_++) {
		struct group g = {.provider = "shm",
				  .world = 2,
				  .secret = signed_ ? SECRET : NULL,
				  .forge = F_FILE,
				  .file_fd = fd,
				  .want = {"rank 1's card: /proc/"},
				  .why = "not the memfd"};
		struct stat st;

		run_group(&g, hostile_connect);
		cr_assert_eq(fstat(fd, &st), 0);
		cr_assert_eq(st.st_size, N, "the file's size changed");
		memset(buf, 0, N);
		cr_assert_eq(pread(fd, buf, N, 0), N);
		for (size_t i = 0; i < N; i++)
			cr_assert_eq(buf[i], file_byte(i), "byte %zu of the file changed", i);
	}
	(void)close(fd);
	(void)unlink(path);
	free(buf);
}

/* A memfd that is not that rank's region: wrong size, not sealed, another name. */
Test(ep, card_fd_wrong_memfd_refused)
{
	static const struct {
		enum forge forge;
		const char *why;
	} cases[] = {
	    {F_MEMFD_SIZE, "bytes, not the region's"},
	    {F_MEMFD_UNSEALED, "is not sealed against shrinking and growing"},
	    {F_MEMFD_NAME, "not the memfd \"/memfd:ro-ep-1-of-2-"},
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		for (int signed_ = 0; signed_ < 2; signed_++) {
			struct group g = {.provider = "shm",
					  .world = 2,
					  .secret = signed_ ? SECRET : NULL,
					  .forge = cases[i].forge,
					  .want = {"rank 1's card: /proc/"},
					  .why = cases[i].why};

			run_group(&g, hostile_connect);
		}
}

/* With a secret, a card that is not signed with it refuses the connect, naming the rank:
 * a changed byte, another secret, no secret at all. */
Test(ep, card_bad_signature_refused)
{
	struct group tamper = {.provider = "shm",
			       .world = 2,
			       .secret = SECRET,
			       .forge = F_TAMPER,
			       .want = {"rank 1's card is not signed with this group's secret"}};
	struct group other = {.provider = "tcp",
			      .world = 2,
			      .secret = SECRET,
			      .secret0 = "another-secret-0123456789abcdef",
			      .want = {"rank 1's card is not signed with this group's secret",
				       "rank 0's card is not signed with this group's secret"}};
	struct group none = {.provider = "shm",
			     .world = 2,
			     .secret = SECRET,
			     .secret0 = "",
			     .want = {"rank 1's card is signed but this rank has no EP secret",
				      "rank 0's card is not signed with this group's secret"}};

	run_group(&tamper, hostile_connect);
	run_group(&other, hostile_connect);
	run_group(&none, hostile_connect);
}

/* The checks that need no peer (ro_fab_card_check, the fuzz target's function). */
Test(ep, card_check)
{
	const uint8_t *key = (const uint8_t *)SECRET;
	const size_t klen = strlen(SECRET), rlen = 1 << 16;
	struct ro_fab_card c, bad;
	char err[256];
	uint32_t old[2] = {RO_FAB_CARD_OLD_MAGIC, 16};

	memset(&c, 0, sizeof(c));
	c.magic = RO_FAB_CARD_MAGIC;
	c.version = RO_FAB_CARD_VERSION;
	c.rank = 1;
	c.world = 2;
	c.name_len = 16;
	c.len = rlen;
	c.pid = 1;
	c.fd = 3;
	(void)snprintf(c.host, sizeof(c.host), "boot:pid:[1]");
	cr_assert_eq(ro_fab_card_check(&c, sizeof(c), NULL, 0, rlen, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(ro_fab_card_check(&c, sizeof(c), key, klen, rlen, err, sizeof(err)), -EPERM);
	cr_assert(strstr(err, "not signed with this group's secret"), "%s", err);
	cr_assert_eq(ro_fab_card_sign(&c, key, klen), 0);
	cr_assert_eq(ro_fab_card_check(&c, sizeof(c), key, klen, rlen, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(ro_fab_card_check(&c, sizeof(c), NULL, 0, rlen, err, sizeof(err)), -EPERM);
	cr_assert_eq(ro_fab_card_check(&c, sizeof(c), key, klen - 1, rlen, err, sizeof(err)),
		     -EPERM);
	/* every byte is signed */
	for (size_t i = 0; i < offsetof(struct ro_fab_card, mac); i += 7) {
		bad = c;
		((uint8_t *)&bad)[i] ^= 0x10;
		cr_assert_neq(
		    ro_fab_card_check(&bad, sizeof(bad), key, klen, rlen, err, sizeof(err)), 0,
		    "byte %zu changed, still accepted", i);
	}
	/* an older build's card, another version, short, other sizes, unterminated host */
	cr_assert_eq(ro_fab_card_check(old, sizeof(old), key, klen, rlen, err, sizeof(err)),
		     -EPROTO);
	cr_assert(strstr(err, "older rolloutd"), "%s", err);
	bad = c;
	bad.version = 3;
	cr_assert_eq(ro_fab_card_check(&bad, sizeof(bad), key, klen, rlen, err, sizeof(err)),
		     -EPROTO);
	cr_assert(strstr(err, "format version 3"), "%s", err);
	cr_assert_eq(ro_fab_card_check(&c, sizeof(c) - 1, key, klen, rlen, err, sizeof(err)),
		     -EPROTO);
	cr_assert_eq(ro_fab_card_check(&c, 3, key, klen, rlen, err, sizeof(err)), -EPROTO);
	cr_assert_eq(ro_fab_card_check(&c, sizeof(c), key, klen, rlen * 2, err, sizeof(err)),
		     -EPROTO);
	bad = c;
	memset(bad.host, 'x', sizeof(bad.host));
	cr_assert_eq(ro_fab_card_sign(&bad, key, klen), 0);
	cr_assert_eq(ro_fab_card_check(&bad, sizeof(bad), key, klen, rlen, err, sizeof(err)),
		     -EPROTO);
	bad = c;
	bad.name_len = sizeof(bad.name) + 1;
	cr_assert_eq(ro_fab_card_sign(&bad, key, klen), 0);
	cr_assert_eq(ro_fab_card_check(&bad, sizeof(bad), key, klen, rlen, err, sizeof(err)),
		     -EPROTO);
}

/* ---- the EP forward equals the single-rank forward -------------------------------------- */

static char model_dir[96];

static void make_model_once(void)
{
	struct ro_make_model_opts o;
	char err[256];

	if (model_dir[0])
		return;
	(void)snprintf(model_dir, sizeof(model_dir), "/tmp/ro-ep-model-%d", (int)getpid());
	ro_make_model_defaults(&o);
	o.layers = 3;
	o.dense_layers = 1u << 1; /* a dense layer between two MoE layers */
	o.experts = 12;
	o.top_k = 3;
	o.seed = 11;
	cr_assert_eq(ro_make_model(&o, model_dir, err, sizeof(err)), 0, "%s", err);
}

static void rm_model(void)
{
	char cmd[160];

	if (!model_dir[0])
		return;
	(void)snprintf(cmd, sizeof(cmd), "rm -rf %s", model_dir);
	(void)system(cmd);
	model_dir[0] = 0;
}

/* Rank r's sequences: r + 1 of them, prompts of different lengths; rank 1 sits the first
 * forward out (it only ends its round) and rank 0's first prompt is longer than the
 * low-latency slot and than max_tokens, so the group runs throughput mode in two passes. */
static void forward_equal(const struct group *g, uint32_t rank)
{
	struct ro_model *ref = NULL, *m = NULL;
	struct ro_model_opts mo = {.threads = 1};
	struct ro_ep *ep;
	const struct ro_model_config *c;
	struct ro_seq *sr[4], *se[4];
	float *lr[4], *le[4];
	int32_t prompt[4][48], next[4];
	uint32_t n = rank + 1, plen[4];
	struct ro_ep_group grp;
	char err[256];

	if (ro_model_load(model_dir, &mo, &ref, err, sizeof(err)) ||
	    ro_model_load(model_dir, &mo, &m, err, sizeof(err)))
		die("rank %u: load: %s", rank, err);
	c = ro_model_config(m);
	ep = join(g, rank, 32, 8, c->hidden, c->top_k, c->experts);
	{
		struct ro_ep_stats st;

		ro_ep_stats(ep, &st);
		if (st.direct_peers != (!strcmp(g->provider, "shm") ? g->world - 1 : 0))
			die("rank %u: %u peers stored into directly over %s", rank, st.direct_peers,
			    g->provider);
	}
	ro_ep_attach(ep, m);
	for (uint32_t i = 0; i < n; i++) {
		plen[i] = rank == 0 && i == 0 ? 45 : 3 + 2 * i + rank;
		for (uint32_t t = 0; t < plen[i]; t++)
			prompt[i][t] = (int32_t)(mix(rank * 1000 + i * 100 + t) % c->vocab);
		if (ro_seq_new(ref, 64, &sr[i]) || ro_seq_new(m, 64, &se[i]))
			die("seq");
		lr[i] = malloc(c->vocab * sizeof(float));
		le[i] = malloc(c->vocab * sizeof(float));
	}
	for (uint32_t step = 0, started = 0; step < 5; step++) {
		struct ro_fwd_item ir[4], ie[4];
		uint32_t k = 0;

		if (!(rank == 1 && step == 0)) {
			for (uint32_t i = 0; i < n; i++, k++) {
				const int32_t *tok = started ? &next[i] : prompt[i];
				uint32_t len = started ? 1 : plen[i];

				ir[k] = (struct ro_fwd_item){sr[i], tok, len, lr[i], false};
				ie[k] = (struct ro_fwd_item){se[i], tok, len, le[i], false};
			}
			if (ro_model_forward(ref, ir, k))
				die("rank %u: reference forward failed", rank);
			if (ro_ep_forward(ep, ie, k, NULL))
				die("rank %u step %u: ep forward: %s", rank, step,
				    ro_ep_errmsg(ep));
			for (uint32_t i = 0; i < n; i++) {
				uint32_t best = 0;

				for (uint32_t v = 0; g->sum && v < c->vocab; v++)
					if (fabsf(lr[i][v] - le[i][v]) >
					    1e-4f * (1 + fabsf(lr[i][v])))
						die("rank %u step %u seq %u: combine_sum logit %u "
						    "is "
						    "%g, single rank %g",
						    rank, step, i, v, le[i][v], lr[i][v]);
				if (!g->sum && memcmp(lr[i], le[i], c->vocab * sizeof(float)))
					die("rank %u step %u seq %u: EP logits differ from the "
					    "single-rank forward",
					    rank, step, i);
				for (uint32_t v = 1; v < c->vocab; v++)
					if (lr[i][v] > lr[i][best])
						best = v;
				next[i] = (int32_t)best;
			}
			started = 1;
		}
		if (ro_ep_round_end(ep, NULL, &grp))
			die("rank %u step %u: round end: %s", rank, step, ro_ep_errmsg(ep));
		if (grp.draining)
			die("rank %u: a drain nobody asked for", rank);
	}
	/* rank 0 ran the throughput mode (its 45-token prefill) and the low-latency one */
	{
		struct ro_ep_stats st;

		ro_ep_stats(ep, &st);
		if (!st.ll_exchanges || st.ll_exchanges == st.exchanges)
			die("rank %u: %llu of %llu exchanges low-latency: want both modes", rank,
			    (unsigned long long)st.ll_exchanges, (unsigned long long)st.exchanges);
	}
	(void)ro_ep_free(ep);
	for (uint32_t i = 0; i < n; i++) {
		ro_seq_free(sr[i]);
		ro_seq_free(se[i]);
		free(lr[i]);
		free(le[i]);
	}
	(void)ro_model_free(ref);
	(void)ro_model_free(m);
}

/* In-band group drain: one rank's note reaches every rank, with the earliest deadline. */
static void drain_note(const struct group *g, uint32_t rank)
{
	struct ro_model *m = NULL;
	struct ro_model_opts mo = {.threads = 1};
	struct ro_ep_note note = {0};
	struct ro_ep_group grp;
	struct ro_ep *ep;
	char err[256];

	if (ro_model_load(model_dir, &mo, &m, err, sizeof(err)))
		die("load: %s", err);
	ep = join(g, rank, 32, 8, ro_model_config(m)->hidden, ro_model_config(m)->top_k,
		  ro_model_config(m)->experts);
	ro_ep_attach(ep, m);
	if (ro_ep_round_end(ep, &note, &grp) || grp.draining)
		die("rank %u: first round: %s", rank, ro_ep_errmsg(ep));
	if (rank == g->world - 1) {
		note.draining = true;
		note.deadline_ms = 5000;
	}
	if (rank == 0) {
		note.draining = true;
		note.deadline_ms = 9000;
	}
	if (ro_ep_round_end(ep, &note, &grp))
		die("rank %u: %s", rank, ro_ep_errmsg(ep));
	if (!grp.draining || grp.deadline_ms != 5000 || grp.first_draining != 0 || grp.all_done)
		die("rank %u: group says draining %d deadline %lld first %u", rank, grp.draining,
		    (long long)grp.deadline_ms, grp.first_draining);
	note.done = true;
	if (ro_ep_round_end(ep, &note, &grp) || !grp.all_done)
		die("rank %u: all done not seen", rank);
	(void)ro_ep_free(ep);
	(void)ro_model_free(m);
}

Test(ep, forward_bitwise_equal, .fini = rm_model)
{
	make_model_once();
	for (uint32_t w = 2; w <= 4; w += 2) {
		/* shm with signed cards: the direct stores, the secret verified */
		struct group g = {.provider = w == 2 ? "tcp" : "shm",
				  .world = w,
				  .secret = w == 4 ? SECRET : NULL};

		run_group(&g, forward_equal);
	}
}

/* combine_sum regroups the additions: close to, not bitwise, the single-rank forward */
Test(ep, forward_combine_sum_close, .fini = rm_model)
{
	struct group g = {.provider = "shm", .world = 3, .sum = true};

	make_model_once();
	run_group(&g, forward_equal);
}

Test(ep, group_drain_in_band, .fini = rm_model)
{
	struct group g = {.provider = "shm", .world = 3};

	make_model_once();
	run_group(&g, drain_note);
}
