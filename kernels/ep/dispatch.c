/* Expert-parallel dispatch and combine over the libfabric transport, and the group step
 * rolloutd runs on top of them.
 *
 * Region of each rank (peers write it, nobody reads a peer's):
 *   ctl  [2 parities][W sources]            64-byte records of the group step
 *   cnt  [2 parities][W sources][W] x 8     rows and pairs each source sends each rank
 *   disp rows of [K int16 expert ids | combine_sum: K f32 weights | hidden payload],
 *        by source (this rank packs its own rows here directly)
 *   comb what this rank's tokens get back, by owner rank: each (token, expert) output,
 *        or with combine_sum each (token, owner) weighted sum (its own stay in the
 *        send area and are read there)
 * Low-latency mode puts source s's rows at the fixed slot s * ll_tokens (one write per
 * peer, no round trip); throughput mode first all-gathers the counts, then packs every
 * source's rows exactly. Every write carries 4 bytes of CQ data (kind, parity, source,
 * layer, rows) and a receiver counts chunks: arrival order never matters.
 *
 * Why one region is enough: a rank writes exchange x+1's dispatch to a peer only after
 * that peer's combine for x came back, which the peer sends only once it has consumed
 * x's dispatch; the same holds for combine, and for ctl/cnt one rank is never more than
 * one exchange ahead of another, hence the two parities. */
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/ep/internal.h"
#include "kernels/internal.h"
#include "kernels/model.h"

enum kind { K_DISP, K_COMB, K_CNT, K_CTL };
static const char *const kind_name[] = {"dispatch", "combine", "counts", "group step"};

#define CTL_BYTES 64
#define MAX_WORLD 64
#define MAX_N ((1u << 18) - 1)

enum { OP_FWD = 1, OP_DONE = 2 };

struct ctl_rec {
	uint32_t op, tokens;
	uint8_t draining, done, pad[6];
	int64_t deadline_ms;
	int64_t ready; /* the weights version the rank could serve */
};

struct arrival {
	bool seen;
	uint32_t n, layer, chunks, need;
};

struct ro_ep {
	struct ro_ep_opts o;
	struct ro_fab *f;
	char err[256];
	uint32_t W, me, H, K, E, Kl, ll, cap;
	size_t dmeta, drow, crow, desz, cesz, chunk;
	size_t off_ctl, off_cnt, off_disp, off_comb, region_len;
	size_t s_ctl, s_cnt, s_disp, s_comb, send_len;
	size_t dcap_rows, ccap_pairs, scomb_pairs;
	struct arrival arr[4][2][MAX_WORLD];
	uint32_t seq[4];
	bool broken;
	bool oversub;	      /* more ranks than cores (a group on one host is assumed) */
	enum ro_ep_mode mode; /* of the current exchange */
	uint32_t passes, fwd_calls, layer;
	/* home side of the current exchange */
	uint32_t T;
	uint32_t to_rows[MAX_WORLD], to_pairs[MAX_WORLD], to_off[MAX_WORLD + 1];
	uint32_t hp_off[MAX_WORLD + 1];
	uint32_t *hp;	     /* (token * K + j) of every pair sent, by destination */
	uint32_t *ht;	     /* the token of every row sent, by destination */
	uint32_t *pos;	     /* exact combine: where (token * K + j)'s output landed */
	const float *home_w; /* the routing weights of this exchange's tokens, or NULL */
	bool sum;	     /* combine_sum */
	uint32_t cnt[MAX_WORLD][MAX_WORLD][2];
	/* owner side */
	uint32_t from_rows[MAX_WORLD], from_pairs[MAX_WORLD];
	const float **xptr, **pair_x;
	const void **raw; /* each received row's payload, as it came */
	uint32_t *row_src, *pair_row;
	int32_t *pair_expert;
	float *pair_w, *xdec, *ybuf, *acc;
	struct ro_ep_batch b;
	struct ro_model *m;
	struct ro_ep_group grp;
	struct ro_ep_stats st;
};

/* The message of a failure, beside its code (the rank's errmsg). */
#define fail(ep, r, ...) ro_errf((ep)->err, sizeof((ep)->err), (r), __VA_ARGS__)

/* A failed exchange leaves the group out of step: refuse everything after it. */
static int broken(struct ro_ep *ep, int r)
{
	ep->broken = true;
	return r;
}

/* Where rows from rank src start in rank dst's dispatch area: a fixed slot in low-latency
 * mode, after the rows of the ranks before src in throughput mode (the counts every rank
 * has all-gathered). */
static uint32_t disp_base(const struct ro_ep *ep, bool ll, uint32_t src, uint32_t dst)
{
	uint32_t base = 0;

	if (ll)
		return src * ep->ll;
	for (uint32_t s = 0; s < src; s++)
		base += ep->cnt[s][dst][0];
	return base;
}

static size_t align64(size_t n)
{
	return (n + 63) & ~(size_t)63;
}

void ro_ep_opts_default(struct ro_ep_opts *o)
{
	*o = (struct ro_ep_opts){.world = 1,
				 .max_tokens = 1024,
				 .ll_tokens = 128,
				 .mode = RO_EP_AUTO,
				 .timeout_ms = 10000};
}

struct ro_ep *ro_ep_free(struct ro_ep *ep)
{
	if (!ep)
		return NULL;
	if (ep->m)
		ro_model_set_exchange(ep->m, NULL);
	/* a peer may still be reading our last writes (shm copies from our memory): they
	 * must complete before this process's memory goes away */
	if (ep->f && !ep->broken)
		(void)ro_fab_drain_tx(ep->f, ep->err, sizeof(ep->err));
	(void)ro_fab_close(ep->f);
	free(ep->hp);
	free(ep->ht);
	free(ep->pos);
	free(ep->pair_w);
	free(ep->acc);
	free(ep->xptr);
	free(ep->raw);
	free(ep->pair_x);
	free(ep->row_src);
	free(ep->pair_row);
	free(ep->pair_expert);
	free(ep->xdec);
	free(ep->ybuf);
	free(ep);
	return NULL;
}

int ro_ep_new(const struct ro_ep_opts *o, struct ro_ep **ret, char *err, size_t errlen)
{
	struct ro_ep *ep;
	size_t per;
	int r;

	*ret = NULL;
	if (!o->world || o->world > MAX_WORLD || o->rank >= o->world)
		return ro_errf(err, errlen, -EINVAL, "ep: rank %u of world %u (1..%u ranks)",
			       o->rank, o->world, MAX_WORLD);
	if (!o->hidden || !o->top_k || !o->experts || o->top_k > o->experts || o->experts > 32767 ||
	    o->experts < o->world)
		return ro_errf(err, errlen, -EINVAL,
			       "ep: hidden %u, top_k %u, experts %u do not fit %u ranks", o->hidden,
			       o->top_k, o->experts, o->world);
	if (!o->max_tokens || (uint64_t)o->max_tokens * o->top_k > MAX_N ||
	    o->ll_tokens > o->max_tokens)
		return ro_errf(err, errlen, -EINVAL,
			       "ep: max_tokens %u (x top_k <= %u) and ll_tokens %u (<= max_tokens)",
			       o->max_tokens, MAX_N, o->ll_tokens);
	ep = calloc(1, sizeof(*ep));
	if (!ep)
		return ro_errf(err, errlen, -ENOMEM, "out of memory");
	ep->o = *o;
	/* the caller's strings need not outlive this call: the fabric keeps its own copies */
	ep->o.provider = NULL;
	ep->o.group = NULL;
	ep->o.secret = NULL;
	ep->o.secret_len = 0;
	ep->W = o->world;
	ep->me = o->rank;
	ep->H = o->hidden;
	ep->K = o->top_k;
	ep->E = o->experts;
	ep->Kl = (o->experts + o->world - 1) / o->world;
	if (ep->Kl > ep->K)
		ep->Kl = ep->K;
	ep->ll = o->ll_tokens ? o->ll_tokens : 1;
	ep->cap = o->max_tokens;
	ep->desz = o->dispatch_dtype == RO_EP_BF16 ? 2 : 4;
	ep->cesz = o->combine_dtype == RO_EP_BF16 ? 2 : 4;
	ep->sum = o->combine_sum;
	ep->oversub = sysconf(_SC_NPROCESSORS_ONLN) < (long)o->world;
	/* meta: the K expert ids (int16, -1 padded), then with combine_sum their K weights */
	ep->dmeta = (ep->K * 2 + (ep->sum ? ep->K * 4 : 0) + 15) & ~(size_t)15;
	ep->drow = ep->dmeta + ((ep->H * ep->desz + 15) & ~(size_t)15);
	ep->crow = ep->H * ep->cesz;
	ep->dcap_rows = (size_t)ep->W * ep->cap;
	per = (size_t)ep->W * ep->ll * ep->Kl;
	ep->ccap_pairs = per > (size_t)ep->cap * ep->K ? per : (size_t)ep->cap * ep->K;
	ep->scomb_pairs = ep->dcap_rows * ep->Kl;
	ep->off_ctl = 0;
	ep->off_cnt = align64(2 * ep->W * CTL_BYTES);
	ep->off_disp = ep->off_cnt + align64(2 * (size_t)ep->W * ep->W * 8);
	ep->off_comb = ep->off_disp + align64(ep->dcap_rows * ep->drow);
	ep->region_len = ep->off_comb + align64(ep->ccap_pairs * ep->crow);
	ep->s_ctl = 0;
	ep->s_cnt = CTL_BYTES;
	ep->s_disp = align64(ep->s_cnt + (size_t)ep->W * 8);
	ep->s_comb =
	    ep->s_disp + align64((size_t)ep->cap * (ep->W < ep->K ? ep->W : ep->K) * ep->drow);
	ep->send_len = ep->s_comb + align64(ep->scomb_pairs * ep->H * 4);
	ep->hp = malloc((size_t)ep->cap * ep->K * sizeof(*ep->hp));
	ep->ht = malloc((size_t)ep->cap * ep->W * sizeof(*ep->ht));
	ep->pos = malloc((size_t)ep->cap * ep->K * sizeof(*ep->pos));
	ep->pair_w = malloc(ep->scomb_pairs * sizeof(*ep->pair_w));
	ep->xptr = malloc(ep->dcap_rows * sizeof(*ep->xptr));
	ep->raw = malloc(ep->dcap_rows * sizeof(*ep->raw));
	ep->row_src = malloc(ep->dcap_rows * sizeof(*ep->row_src));
	ep->pair_x = malloc(ep->scomb_pairs * sizeof(*ep->pair_x));
	ep->pair_row = malloc(ep->scomb_pairs * sizeof(*ep->pair_row));
	ep->pair_expert = malloc(ep->scomb_pairs * sizeof(*ep->pair_expert));
	if (!ep->hp || !ep->ht || !ep->pos || !ep->pair_w || !ep->xptr || !ep->raw ||
	    !ep->row_src || !ep->pair_x || !ep->pair_row || !ep->pair_expert) {
		r = ro_errf(err, errlen, -ENOMEM, "out of memory");
		goto fail;
	}
	r = ro_fab_open(o->provider, ep->region_len, ep->send_len, !o->fabric_only,
			&(struct ro_fab_id){.rank = o->rank,
					    .world = o->world,
					    .group = o->group,
					    .secret = o->secret,
					    .secret_len = o->secret ? o->secret_len : 0},
			&ep->f, err, errlen);
	if (r)
		goto fail;
	ep->chunk = ro_fab_chunk(ep->f);
	ro_fab_set_timeout(ep->f, o->timeout_ms ? o->timeout_ms : 10000);
	*ret = ep;
	return 0;
fail:
	(void)ro_ep_free(ep);
	return r;
}

const char *ro_ep_provider(const struct ro_ep *ep)
{
	return ro_fab_provider(ep->f);
}

const char *ro_ep_errmsg(const struct ro_ep *ep)
{
	return ep->err;
}

uint32_t ro_ep_rank(const struct ro_ep *ep)
{
	return ep->me;
}

bool ro_ep_broken(const struct ro_ep *ep)
{
	return ep->broken;
}

uint32_t ro_ep_world(const struct ro_ep *ep)
{
	return ep->W;
}

void ro_ep_stats(const struct ro_ep *ep, struct ro_ep_stats *ret)
{
	*ret = ep->st;
	ret->direct_peers = 0;
	for (uint32_t p = 0; p < ep->W; p++)
		ret->direct_peers += ro_fab_peer_region(ep->f, p) != NULL;
}

int ro_ep_card(struct ro_ep *ep, void *buf, size_t *ret_len)
{
	int r = ro_fab_card(ep->f, buf, ret_len);

	return r ? fail(ep, r, "fi_getname: %s", strerror(-r)) : 0;
}

int ro_ep_connect(struct ro_ep *ep, const void *const *cards, const size_t *lens)
{
	return ro_fab_connect(ep->f, cards, lens, ep->err, sizeof(ep->err));
}

void ro_ep_set_mode(struct ro_ep *ep, enum ro_ep_mode mode)
{
	ep->mode = mode == RO_EP_LOW_LATENCY ? RO_EP_LOW_LATENCY : RO_EP_THROUGHPUT;
}

/* ---- arrivals ----------------------------------------------------------------------- */

static uint32_t cq_data(enum kind k, uint32_t parity, uint32_t src, uint32_t layer, uint32_t n)
{
	return (uint32_t)k << 30 | (parity & 1) << 29 | (src & 63) << 23 | (layer & 31) << 18 |
	       (n & MAX_N);
}

static size_t msg_bytes(const struct ro_ep *ep, enum kind k, uint32_t n)
{
	switch (k) {
	case K_DISP:
		return (size_t)n * ep->drow;
	case K_COMB:
		return (size_t)n * ep->crow;
	case K_CNT:
		return (size_t)ep->W * 8;
	default:
		return CTL_BYTES;
	}
}

static void on_data(void *arg, uint32_t d)
{
	struct ro_ep *ep = arg;
	enum kind k = (enum kind)(d >> 30);
	uint32_t par = (d >> 29) & 1, src = (d >> 23) & 63;
	struct arrival *a;

	if (src >= ep->W)
		return; /* not one of ours: the wait reports the rank that stays missing */
	a = &ep->arr[k][par][src];
	if (!a->seen) {
		size_t bytes;

		a->seen = true;
		a->n = d & MAX_N;
		a->layer = (d >> 18) & 31;
		a->chunks = 0;
		bytes = msg_bytes(ep, k, a->n);
		a->need = bytes ? (uint32_t)((bytes + ep->chunk - 1) / ep->chunk) : 1;
	}
	a->chunks++;
}

static bool complete(const struct ro_ep *ep, enum kind k, uint32_t par)
{
	for (uint32_t s = 0; s < ep->W; s++)
		if (!ep->arr[k][par][s].seen || ep->arr[k][par][s].chunks < ep->arr[k][par][s].need)
			return false;
	return true;
}

/* Wait until every rank's message of this kind (current parity) is in, and every write we
 * Spins (not when ranks outnumber cores: the peer we wait for
 * may need this core), yields while things move, naps after 5 ms of silence. */
static int wait_all(struct ro_ep *ep, enum kind k, uint32_t layer)
{
	const uint32_t par = ep->seq[k] & 1;
	const int64_t deadline = ro_ep_mono_ms() + (ep->o.timeout_ms ? ep->o.timeout_ms : 10000);
	int64_t last = ro_ep_mono_ms();
	unsigned idle = 0;

	for (;;) {
		int r = ro_fab_poll(ep->f, on_data, ep, ep->err, sizeof(ep->err));

		if (r < 0)
			return broken(ep, r);
		if (complete(ep, k, par)) {
			/* what peers stored into our region (shm direct) before signalling */
			atomic_thread_fence(memory_order_acquire);
			break;
		}
		if (r > 0) {
			idle = 0;
			last = ro_ep_mono_ms();
			continue;
		}
		if (!ep->oversub && ++idle < 256)
			continue;
		if (ro_ep_mono_ms() > deadline) {
			char late[160] = "";
			size_t o = 0;

			for (uint32_t s = 0; s < ep->W && o + 8 < sizeof(late); s++)
				if (!ep->arr[k][par][s].seen ||
				    ep->arr[k][par][s].chunks < ep->arr[k][par][s].need)
					o += (size_t)snprintf(late + o, sizeof(late) - o, "%s%u",
							      o ? "," : "", s);
			if (!o)
				(void)snprintf(late, sizeof(late), "(own writes unfinished)");
			return broken(ep,
				      fail(ep, -ETIMEDOUT,
					   "ep rank %u: rank %s late: no %s for layer %u after "
					   "%u ms",
					   ep->me, late, kind_name[k], layer, ep->o.timeout_ms));
		}
		if (ep->oversub) {
			/* a sched_yield would keep the core for the rest of our slice; a short
			 * sleep gives it to the rank we are waiting for */
			struct timespec ts = {0, 1000};

			nanosleep(&ts, NULL);
		} else if (ro_ep_mono_ms() - last < 5) {
			sched_yield();
		} else {
			struct timespec ts = {0, 20000};

			nanosleep(&ts, NULL);
		}
	}
	for (uint32_t s = 0; s < ep->W; s++)
		if ((k == K_DISP || k == K_COMB) && ep->arr[k][par][s].layer != (layer & 31))
			return broken(ep,
				      fail(ep, -EPROTO,
					   "ep rank %u: rank %u sent %s for layer %u, we are at "
					   "layer %u: the group is out of step",
					   ep->me, s, kind_name[k], ep->arr[k][par][s].layer,
					   layer & 31));
	return 0;
}

/* Our earlier writes must have left the send area before we write into it again: checked
 * at the start of an exchange, not at its end, so the wait overlaps other work. */
static int drain_tx(struct ro_ep *ep)
{
	int r = ro_fab_drain_tx(ep->f, ep->err, sizeof(ep->err));

	return r ? broken(ep, r) : 0;
}

/* The arrivals are consumed: the next exchange of this kind uses the other parity. */
static void consumed(struct ro_ep *ep, enum kind k)
{
	memset(ep->arr[k][ep->seq[k] & 1], 0, sizeof(ep->arr[k][0]));
	ep->seq[k]++;
}

static int send_all(struct ro_ep *ep, enum kind k, uint32_t layer, size_t soff, size_t len,
		    size_t roff)
{
	const uint32_t d = cq_data(k, ep->seq[k] & 1, ep->me, layer, 0);

	/* start with the next rank, so W ranks do not all hit rank 0 first */
	for (uint32_t i = 1; i <= ep->W; i++) {
		uint32_t p = (ep->me + i) % ep->W;
		int r = ro_fab_write(ep->f, p, soff, len, roff, d, ep->err, sizeof(ep->err));

		if (r)
			return broken(ep, r);
	}
	return 0;
}

/* ---- dispatch and combine ------------------------------------------------------------- */

/* bf16 conversions, branch-free so the compiler vectorizes them (AVX2 where the CPU has
 * it): round to nearest even, NaN stays NaN, as ro_f32_to_bf16. */
__attribute__((target_clones("avx512f", "avx2", "default"),
	       optimize("O3", "fp-contract=off"))) static void
to_bf16(uint16_t *restrict dst, const float *restrict src, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint32_t u;

		memcpy(&u, &src[i], 4);
		dst[i] = (uint16_t)((u & 0x7fffffff) > 0x7f800000
					? (u >> 16) | 0x40
					: (u + 0x7fff + ((u >> 16) & 1)) >> 16);
	}
}

__attribute__((target_clones("avx512f", "avx2", "default"),
	       optimize("O3", "fp-contract=off"))) static void
from_bf16(float *restrict dst, const uint16_t *restrict src, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint32_t u = (uint32_t)src[i] << 16;

		memcpy(&dst[i], &u, 4);
	}
}

/* acc += w * y and dst += src, vectorized; still one rounding per multiply and per add
 * (-ffp-contract=off), so the sums are what the scalar loop gives. */
__attribute__((target_clones("avx512f", "avx2", "default"),
	       optimize("O3", "fp-contract=off"))) static void
axpy(float *restrict acc, float w, const float *restrict y, size_t n)
{
	for (size_t i = 0; i < n; i++)
		acc[i] = acc[i] + w * y[i];
}

__attribute__((target_clones("avx512f", "avx2", "default"),
	       optimize("O3", "fp-contract=off"))) static void
axpy_bf16(float *restrict acc, float w, const uint16_t *restrict y, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint32_t u = (uint32_t)y[i] << 16;
		float f;

		memcpy(&f, &u, 4);
		acc[i] = acc[i] + w * f;
	}
}

__attribute__((target_clones("avx512f", "avx2", "default"),
	       optimize("O3", "fp-contract=off"))) static void
add_to(float *restrict dst, const float *restrict src, size_t n)
{
	for (size_t i = 0; i < n; i++)
		dst[i] = dst[i] + src[i];
}

/* A token's payload: converted once, then copied to every other destination's row. */
static void put_row(const struct ro_ep *ep, uint8_t *row, const float *x, const uint8_t *first)
{
	if (first)
		memcpy(row + ep->dmeta, first + ep->dmeta, ep->drow - ep->dmeta);
	else if (ep->desz == 4)
		memcpy(row + ep->dmeta, x, ep->H * sizeof(float));
	else
		to_bf16((uint16_t *)(row + ep->dmeta), x, ep->H);
}

int ro_ep_dispatch(struct ro_ep *ep, uint32_t layer, const float *x, const int32_t *ids,
		   const float *w, uint32_t tokens, const struct ro_ep_batch **ret)
{
	const uint32_t W = ep->W, K = ep->K, me = ep->me;
	const bool ll = ep->mode == RO_EP_LOW_LATENCY;
	uint8_t *send = (uint8_t *)ro_fab_send(ep->f) + ep->s_disp;
	uint8_t *region = ro_fab_region(ep->f);
	uint32_t cur[MAX_WORLD] = {0}, pc[MAX_WORLD] = {0};
	double t0 = ro_ep_mono_msf(), t1;
	size_t rows = 0, pairs = 0;
	uint8_t *self, *dst[MAX_WORLD];
	uint32_t base[MAX_WORLD]; /* where our rows start in each rank's region */
	int r;

	if (ep->broken)
		return fail(ep, -EPIPE, "ep rank %u: the group is broken: %s", me, ep->err);
	if ((r = drain_tx(ep)))
		return r;
	if (ep->sum && tokens && !w)
		return fail(ep, -EINVAL, "ep: combine_sum needs the routing weights");
	if (tokens > (ll ? ep->ll : ep->cap))
		return fail(ep, -E2BIG, "ep: %u tokens, the %s slot holds %u", tokens,
			    ll ? "low-latency" : "throughput", ll ? ep->ll : ep->cap);
	/* layout: per destination, the rows (one per token that picked any of its experts)
	 * and the pairs (one per picked expert) */
	memset(ep->to_rows, 0, sizeof(ep->to_rows));
	memset(ep->to_pairs, 0, sizeof(ep->to_pairs));
	for (uint32_t t = 0; t < tokens; t++) {
		uint64_t mask = 0;

		for (uint32_t j = 0; j < K; j++) {
			int32_t e = ids[(size_t)t * K + j];

			if (e < 0 || (uint32_t)e >= ep->E)
				return fail(ep, -EINVAL, "ep: token %u picks expert %d of %u", t, e,
					    ep->E);
			ep->to_pairs[e % W]++;
			mask |= 1ull << (e % W);
		}
		for (uint32_t d = 0; d < W; d++)
			ep->to_rows[d] += (mask >> d) & 1;
	}
	ep->to_off[0] = ep->hp_off[0] = 0;
	for (uint32_t d = 0; d < W; d++) {
		ep->to_off[d + 1] = ep->to_off[d] + ep->to_rows[d];
		ep->hp_off[d + 1] = ep->hp_off[d] + ep->to_pairs[d];
	}
	if (!ll) {
		/* throughput: every rank learns every rank's counts, then offsets are exact */
		uint32_t *mine = (uint32_t *)((uint8_t *)ro_fab_send(ep->f) + ep->s_cnt);
		const uint32_t par = ep->seq[K_CNT] & 1;

		for (uint32_t d = 0; d < W; d++) {
			mine[2 * d] = ep->to_rows[d];
			mine[2 * d + 1] = ep->to_pairs[d];
		}
		r = send_all(ep, K_CNT, layer, ep->s_cnt, (size_t)W * 8,
			     ep->off_cnt + ((size_t)par * W + me) * W * 8);
		if (!r)
			r = wait_all(ep, K_CNT, layer);
		if (r)
			return r;
		for (uint32_t s = 0; s < W; s++)
			memcpy(ep->cnt[s], region + ep->off_cnt + ((size_t)par * W + s) * W * 8,
			       (size_t)W * 8);
		consumed(ep, K_CNT);
	}
	for (uint32_t d = 0; d < W; d++) {
		uint8_t *pm = d == me ? NULL : ro_fab_peer_region(ep->f, d);

		base[d] = disp_base(ep, ll, me, d);
		dst[d] = pm ? pm + ep->off_disp + (size_t)base[d] * ep->drow : NULL;
	}
	self = region + ep->off_disp + (size_t)base[me] * ep->drow;
	t1 = ro_ep_mono_msf();
	/* pack: each token once per destination, with the ids of that rank's experts */
	for (uint32_t t = 0; t < tokens; t++) {
		uint8_t *row[MAX_WORLD], *first = NULL;
		uint32_t nk[MAX_WORLD];
		uint64_t started = 0;

		for (uint32_t j = 0; j < K; j++) {
			int32_t e = ids[(size_t)t * K + j];
			uint32_t d = (uint32_t)e % W;

			if (!((started >> d) & 1)) {
				started |= 1ull << d;
				ep->ht[ep->to_off[d] + cur[d]] = t;
				/* rows for this rank go straight into its own region, rows for a
				 * rank of this host straight into its (shm direct path) */
				if (d == me)
					row[d] = self + (size_t)cur[d]++ * ep->drow;
				else if (dst[d])
					row[d] = dst[d] + (size_t)cur[d]++ * ep->drow;
				else
					row[d] =
					    send + (size_t)(ep->to_off[d] + cur[d]++) * ep->drow;
				memset(row[d], 0xff, ep->dmeta);
				nk[d] = 0;
				put_row(ep, row[d], x + (size_t)t * ep->H, first);
				first = row[d];
			}
			if (ep->sum)
				memcpy(row[d] + K * 2 + nk[d] * 4, &w[(size_t)t * K + j], 4);
			((int16_t *)row[d])[nk[d]++] = (int16_t)e;
			ep->hp[ep->hp_off[d] + pc[d]++] = t * K + j;
		}
	}
	ep->T = tokens;
	ep->layer = layer;
	ep->home_w = w;
	ep->st.pack_ms += ro_ep_mono_msf() - t1;
	{
		const uint32_t par = ep->seq[K_DISP] & 1;

		for (uint32_t i = 1; i <= W; i++) {
			uint32_t d = (me + i) % W;

			if (d == me) {
				r = ro_fab_signal_self(
				    ep->f, (size_t)ep->to_rows[d] * ep->drow,
				    cq_data(K_DISP, par, me, layer, ep->to_rows[d]));
				if (r)
					return broken(ep, r);
				continue;
			}
			if (dst[d]) {
				r = ro_fab_signal(ep->f, d, (size_t)ep->to_rows[d] * ep->drow,
						  cq_data(K_DISP, par, me, layer, ep->to_rows[d]),
						  ep->err, sizeof(ep->err));
				if (r)
					return broken(ep, r);
				continue;
			}
			r = ro_fab_write(ep->f, d, ep->s_disp + (size_t)ep->to_off[d] * ep->drow,
					 (size_t)ep->to_rows[d] * ep->drow,
					 ep->off_disp + (size_t)base[d] * ep->drow,
					 cq_data(K_DISP, par, me, layer, ep->to_rows[d]), ep->err,
					 sizeof(ep->err));
			if (r)
				return broken(ep, r);
		}
		r = wait_all(ep, K_DISP, layer);
		if (r)
			return r;
		/* what arrived, by source */
		for (uint32_t s = 0; s < W; s++) {
			const struct arrival *a = &ep->arr[K_DISP][par][s];
			const uint32_t from = disp_base(ep, ll, s, me);
			if ((ll && a->n > ep->ll) || (!ll && a->n != ep->cnt[s][me][0]))
				return broken(ep, fail(ep, -EPROTO,
						       "ep: rank %u sent %u rows, expected %u", s,
						       a->n, ll ? ep->ll : ep->cnt[s][me][0]));
			ep->from_rows[s] = a->n;
			ep->from_pairs[s] = 0;
			for (uint32_t i = 0; i < a->n; i++) {
				const uint8_t *row =
				    region + ep->off_disp + (size_t)(from + i) * ep->drow;
				const int16_t *meta = (const int16_t *)row;
				const float *xr = (const float *)(row + ep->dmeta);

				/* f32 rows are read in place; bf16 ones when ro_ep_decode asks */
				ep->raw[rows] = row + ep->dmeta;
				ep->xptr[rows] = ep->desz == 4 ? xr : NULL;
				ep->row_src[rows] = s;
				for (uint32_t k = 0; k < K && meta[k] >= 0; k++) {
					if ((uint32_t)meta[k] >= ep->E ||
					    (uint32_t)meta[k] % W != me ||
					    ep->from_pairs[s] >= ep->Kl * a->n)
						return broken(ep, fail(ep, -EPROTO,
								       "ep: rank %u sent a row for "
								       "expert %d, not ours",
								       s, meta[k]));
					ep->pair_row[pairs] = (uint32_t)rows;
					ep->pair_expert[pairs] = meta[k];
					if (ep->sum)
						memcpy(&ep->pair_w[pairs], row + K * 2 + k * 4, 4);
					ep->pair_x[pairs] = ep->desz == 4 ? xr : NULL;
					pairs++;
					ep->from_pairs[s]++;
				}
				rows++;
			}
		}
		consumed(ep, K_DISP);
	}
	ep->b = (struct ro_ep_batch){.rows = (uint32_t)rows,
				     .x = ep->desz == 4 ? ep->xptr : NULL,
				     .row_src = ep->row_src,
				     .pairs = pairs,
				     .pair_row = ep->pair_row,
				     .pair_expert = ep->pair_expert,
				     .pair_w = ep->pair_w,
				     .pair_x = ep->desz == 4 ? ep->pair_x : NULL};
	*ret = &ep->b;
	ep->st.exchanges++;
	ep->st.ll_exchanges += ll;
	ep->st.dispatch_bytes += (uint64_t)ep->to_off[W] * ep->H * ep->desz;
	ep->st.dispatch_ms += ro_ep_mono_msf() - t0;
	return 0;
}

int ro_ep_decode(struct ro_ep *ep)
{
	double t0 = ro_ep_mono_msf();

	if (ep->desz == 4 || ep->b.x)
		return 0;
	if (!ep->xdec && !(ep->xdec = malloc(ep->dcap_rows * ep->H * sizeof(float))))
		return -ENOMEM;
	for (uint32_t r = 0; r < ep->b.rows; r++) {
		from_bf16(ep->xdec + (size_t)r * ep->H, ep->raw[r], ep->H);
		ep->xptr[r] = ep->xdec + (size_t)r * ep->H;
	}
	for (size_t p = 0; p < ep->b.pairs; p++)
		ep->pair_x[p] = ep->xptr[ep->pair_row[p]];
	ep->b.x = ep->xptr;
	ep->b.pair_x = ep->pair_x;
	ep->st.decode_ms += ro_ep_mono_msf() - t0;
	return 0;
}

float *ro_ep_combine_buffer(struct ro_ep *ep)
{
	if (ep->cesz == 4)
		return (float *)((uint8_t *)ro_fab_send(ep->f) + ep->s_comb);
	if (!ep->ybuf)
		ep->ybuf = malloc(ep->scomb_pairs * ep->H * sizeof(float));
	return ep->ybuf;
}

/* With combine_sum, each received row's pairs (in expert order) become one weighted sum,
 * written where the row's outputs go: rows from each source stay contiguous. */
static int reduce_rows(struct ro_ep *ep, const float *y, uint32_t r_lo, uint32_t r_hi, size_t p,
		       uint8_t *dst)
{
	const uint32_t H = ep->H;

	if (!ep->acc && !(ep->acc = malloc(H * sizeof(float))))
		return -ENOMEM;
	/* y may be the send area and dst too: row r's sum goes to slot r only after its
	 * pairs (at slots >= r) were read, and later rows' pairs lie beyond them */
	for (uint32_t r = r_lo; r < r_hi; r++) {
		float *acc = ep->acc;
		uint8_t *o = dst + (size_t)(r - r_lo) * ep->crow;

		memset(acc, 0, H * sizeof(float));
		for (; p < ep->b.pairs && ep->pair_row[p] == r; p++)
			axpy(acc, ep->pair_w[p], y + p * H, H);
		if (ep->cesz == 2)
			to_bf16((uint16_t *)o, acc, H);
		else
			memcpy(o, acc, H * sizeof(float));
	}
	return 0;
}

int ro_ep_combine(struct ro_ep *ep, float *out)
{
	const uint32_t W = ep->W, me = ep->me, H = ep->H, layer = ep->layer;
	const bool ll = ep->mode == RO_EP_LOW_LATENCY;
	uint8_t *send = (uint8_t *)ro_fab_send(ep->f) + ep->s_comb;
	const uint8_t *region = ro_fab_region(ep->f);
	const uint32_t par = ep->seq[K_COMB] & 1;
	const uint32_t *from = ep->sum ? ep->from_rows : ep->from_pairs;
	const uint8_t *rbase[MAX_WORLD];
	double t0 = ro_ep_mono_msf();
	size_t sent = 0, self_off = 0, off_s[MAX_WORLD], roff_s[MAX_WORLD];
	bool direct[MAX_WORLD];
	int r = 0;

	if (ep->broken)
		return fail(ep, -EPIPE, "ep rank %u: the group is broken: %s", me, ep->err);
	{
		/* each source's results, where they go: a rank of this host gets them stored
		 * into its region (shm direct path), the others from our send area */
		const float *y = ro_ep_combine_buffer(ep);
		size_t roff = 0, poff = 0;

		if (!y)
			return broken(ep, -ENOMEM);
		for (uint32_t s = 0; s < W; s++) {
			uint8_t *pm = s == me ? NULL : ro_fab_peer_region(ep->f, s);
			size_t base = 0;
			uint8_t *to;

			if (ll)
				base = (size_t)me * ep->ll * ep->Kl;
			else
				for (uint32_t d = 0; d < me; d++)
					base += ep->cnt[s][d][ep->sum ? 0 : 1];
			off_s[s] = ep->sum ? roff : poff;
			to = pm ? pm + ep->off_comb + base * ep->crow : send + off_s[s] * ep->crow;
			direct[s] = pm != NULL;
			roff_s[s] = base;
			if (ep->sum)
				r = reduce_rows(ep, y, (uint32_t)roff,
						(uint32_t)(roff + ep->from_rows[s]), poff, to);
			else if (ep->cesz == 2)
				to_bf16((uint16_t *)to, y + poff * H,
					(size_t)ep->from_pairs[s] * H);
			else if (pm)
				memcpy(to, y + poff * H,
				       (size_t)ep->from_pairs[s] * H * sizeof(float));
			if (r)
				return broken(ep, r);
			roff += ep->from_rows[s];
			poff += ep->from_pairs[s];
		}
	}
	for (uint32_t i = 1; i <= W; i++) {
		uint32_t s = (me + i) % W;
		const uint32_t d = cq_data(K_COMB, par, me, layer, from[s]);
		const size_t bytes = (size_t)from[s] * ep->crow;

		if (s == me) /* ours stay where they are: home reads them from the send area */
			r = ro_fab_signal_self(ep->f, bytes, d);
		else if (direct[s])
			r = ro_fab_signal(ep->f, s, bytes, d, ep->err, sizeof(ep->err));
		else
			r = ro_fab_write(ep->f, s, ep->s_comb + off_s[s] * ep->crow, bytes,
					 ep->off_comb + roff_s[s] * ep->crow, d, ep->err,
					 sizeof(ep->err));
		if (r)
			return broken(ep, r);
		sent += from[s];
	}
	self_off = off_s[me];
	r = wait_all(ep, K_COMB, layer);
	if (r)
		return r;
	if ((ep->sum || ep->home_w) && ep->T)
		memset(out, 0, (size_t)ep->T * H * sizeof(float));
	/* back home, in rank order (sum) or to each (token, j) place (exact): either way the
	 * result does not depend on the order things arrived in */
	for (uint32_t d = 0; d < W; d++) {
		const struct arrival *a = &ep->arr[K_COMB][par][d];
		const uint32_t want = ep->sum ? ep->to_rows[d] : ep->to_pairs[d];
		size_t base =
		    ll ? (size_t)d * ep->ll * ep->Kl : (ep->sum ? ep->to_off[d] : ep->hp_off[d]);

		if (a->n != want)
			return broken(ep, fail(ep, -EPROTO,
					       "ep: rank %u returned %u results, we sent it %u", d,
					       a->n, want));
		rbase[d] =
		    d == me ? send + self_off * ep->crow : region + ep->off_comb + base * ep->crow;
		for (uint32_t i = 0; i < a->n; i++) {
			const uint8_t *src = rbase[d] + (size_t)i * ep->crow;

			if (ep->sum) {
				float *dst = out + (size_t)ep->ht[ep->to_off[d] + i] * H;

				if (ep->cesz == 2) {
					from_bf16(ep->acc, (const uint16_t *)src, H);
					src = (const uint8_t *)ep->acc;
				}
				add_to(dst, (const float *)src, H);
			} else if (ep->home_w) {
				ep->pos[ep->hp[ep->hp_off[d] + i]] = i << 6 | d; /* W <= 64 */
			} else {
				float *dst = out + (size_t)ep->hp[ep->hp_off[d] + i] * H;

				if (ep->cesz == 4)
					memcpy(dst, src, H * sizeof(float));
				else
					from_bf16(dst, (const uint16_t *)src, H);
			}
		}
	}
	if (!ep->sum && ep->home_w) {
		/* each token's outputs weighted and summed in expert order, the additions
		 * the single-rank forward makes, in its order: bitwise its result */
		for (uint32_t t = 0; t < ep->T; t++) {
			float *acc = out + (size_t)t * H;

			for (uint32_t j = 0; j < ep->K; j++) {
				const size_t tj = (size_t)t * ep->K + j;
				const uint8_t *src =
				    rbase[ep->pos[tj] & 63] + (size_t)(ep->pos[tj] >> 6) * ep->crow;

				if (ep->cesz == 4)
					axpy(acc, ep->home_w[tj], (const float *)src, H);
				else
					axpy_bf16(acc, ep->home_w[tj], (const uint16_t *)src, H);
			}
		}
	}
	consumed(ep, K_COMB);
	ep->st.combine_bytes += (uint64_t)sent * H * ep->cesz;
	ep->st.combine_ms += ro_ep_mono_msf() - t0;
	return 0;
}

/* ---- the group step ----------------------------------------------------------------- */

static int ctl_allgather(struct ro_ep *ep, const struct ctl_rec *mine, struct ctl_rec *all)
{
	const uint32_t par = ep->seq[K_CTL] & 1;
	const uint8_t *region = ro_fab_region(ep->f);
	double t0 = ro_ep_mono_msf();
	int r;

	if (ep->broken)
		return fail(ep, -EPIPE, "ep rank %u: the group is broken: %s", ep->me, ep->err);
	if ((r = drain_tx(ep)))
		return r;
	memcpy((uint8_t *)ro_fab_send(ep->f) + ep->s_ctl, mine, sizeof(*mine));
	r = send_all(ep, K_CTL, 0, ep->s_ctl, CTL_BYTES,
		     ep->off_ctl + ((size_t)par * ep->W + ep->me) * CTL_BYTES);
	if (!r)
		r = wait_all(ep, K_CTL, 0);
	if (r)
		return r;
	for (uint32_t s = 0; s < ep->W; s++)
		memcpy(&all[s], region + ep->off_ctl + ((size_t)par * ep->W + s) * CTL_BYTES,
		       sizeof(all[s]));
	consumed(ep, K_CTL);
	ep->st.syncs++;
	ep->st.sync_ms += ro_ep_mono_msf() - t0;
	return 0;
}

/* What the group said: who drains (the earliest deadline wins), who is done, and the
 * largest batch of this forward, which fixes its mode and pass count for every rank. */
static void take_group(struct ro_ep *ep, const struct ctl_rec *all)
{
	uint32_t max_t = 0;

	ep->grp = (struct ro_ep_group){.all_done = true, .ready = all[0].ready};
	for (uint32_t s = 0; s < ep->W; s++) {
		if (all[s].ready < ep->grp.ready)
			ep->grp.ready = all[s].ready;
		if (all[s].op == OP_FWD && all[s].tokens > max_t)
			max_t = all[s].tokens;
		if (all[s].draining) {
			if (!ep->grp.draining || all[s].deadline_ms < ep->grp.deadline_ms)
				ep->grp.deadline_ms = all[s].deadline_ms;
			if (!ep->grp.draining)
				ep->grp.first_draining = s;
			ep->grp.draining = true;
		}
		if (!all[s].done)
			ep->grp.all_done = false;
	}
	if (ep->o.mode == RO_EP_AUTO)
		ep->mode = max_t <= ep->ll ? RO_EP_LOW_LATENCY : RO_EP_THROUGHPUT;
	else
		ep->mode = ep->o.mode;
	if (ep->mode == RO_EP_LOW_LATENCY)
		ep->passes = max_t ? (max_t + ep->ll - 1) / ep->ll : 1;
	else
		ep->passes = max_t ? (max_t + ep->cap - 1) / ep->cap : 1;
}

static int exchange(void *ctx, uint32_t layer, const float *x, const int32_t *ids, const float *w,
		    uint32_t tokens, uint32_t top_k, uint32_t hidden, float *out)
{
	struct ro_ep *ep = ctx;
	const uint32_t cap = ep->mode == RO_EP_LOW_LATENCY ? ep->ll : ep->cap;

	if (top_k != ep->K || hidden != ep->H)
		return broken(ep, fail(ep, -EINVAL, "ep: model has top_k %u hidden %u, group %u/%u",
				       top_k, hidden, ep->K, ep->H));
	ep->fwd_calls++;
	for (uint32_t p = 0; p < ep->passes; p++) {
		uint32_t start = p * cap, n = tokens > start ? tokens - start : 0;
		const struct ro_ep_batch *b;
		int r;

		if (n > cap)
			n = cap;
		if (p + 1 == ep->passes && tokens > start + n)
			return broken(ep, fail(ep, -E2BIG, "ep: %u tokens, the group agreed on %u",
					       tokens, ep->passes * cap));
		r = ro_ep_dispatch(ep, layer, n ? x + (size_t)start * hidden : x,
				   n ? ids + (size_t)start * top_k : ids,
				   n ? w + (size_t)start * top_k : w, n, &b);
		if (!r)
			r = ro_ep_decode(ep);
		if (!r)
			r = ro_model_experts(ep->m, layer, b->pair_x, b->pair_expert, b->pairs,
					     ro_ep_combine_buffer(ep));
		if (!r)
			r = ro_ep_combine(ep, n ? out + (size_t)start * hidden : out);
		if (r)
			return broken(ep, r);
	}
	return 0;
}

void ro_ep_attach(struct ro_ep *ep, struct ro_model *m)
{
	struct ro_moe_exchange x = {
	    .ctx = ep, .rank = ep->me, .world = ep->W, .exchange = exchange, .summed = true};

	ep->m = m;
	ro_model_set_exchange(m, &x);
}

int ro_ep_forward(struct ro_ep *ep, struct ro_fwd_item *items, size_t count,
		  const struct ro_ep_note *mine)
{
	struct ctl_rec rec = {.op = OP_FWD,
			      .draining = mine && mine->draining,
			      .deadline_ms = mine ? mine->deadline_ms : 0,
			      .ready = mine ? mine->ready : 0};
	struct ctl_rec all[MAX_WORLD];
	int r;

	for (size_t i = 0; i < count; i++)
		rec.tokens += items[i].n;
	r = ctl_allgather(ep, &rec, all);
	if (r)
		return r;
	take_group(ep, all);
	ep->fwd_calls = 0;
	r = ro_model_forward(ep->m, items, count);
	if (r && !ep->broken && !ep->fwd_calls) {
		/* refused before its first layer (a full sequence, say): the group still
		 * expects this rank in every layer */
		int r2 = ro_model_forward(ep->m, NULL, 0);

		if (r2)
			return r2;
	}
	return r;
}

int ro_ep_round_end(struct ro_ep *ep, const struct ro_ep_note *mine, struct ro_ep_group *ret)
{
	struct ctl_rec rec = {.op = OP_DONE,
			      .draining = mine && mine->draining,
			      .done = mine && mine->done,
			      .deadline_ms = mine ? mine->deadline_ms : 0,
			      .ready = mine ? mine->ready : 0};
	struct ctl_rec all[MAX_WORLD];
	bool busy = false;

	for (unsigned rounds = 0;; rounds++) {
		bool fwd = false;
		int r = ctl_allgather(ep, &rec, all);

		if (r)
			return r;
		take_group(ep, all);
		for (uint32_t s = 0; s < ep->W; s++)
			fwd |= all[s].op == OP_FWD;
		if (!fwd)
			break;
		/* someone runs a forward: join it with no tokens */
		busy = true;
		r = ro_model_forward(ep->m, NULL, 0);
		if (r)
			return r;
	}
	ep->grp.busy = busy;
	if (ret)
		*ret = ep->grp;
	return 0;
}
