/* The libfabric transport of expert parallelism: an RDM endpoint chosen at run time (efa,
 * tcp, shm, ...), one region registered for remote writes, one registered send area, RMA
 * writes with remote CQ data, and a completion loop that turns every provider error into
 * -errno with a message naming the peer. Nothing here waits: dispatch.c owns deadlines. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "kernels/ep/internal.h"
#include "kernels/internal.h"

#define CARD_MAGIC 0x524f4550u /* "ROEP" */
#define MAX_CHUNK (4u << 20)
#define N_CTX 1024

struct tx_ctx {
	struct fi_context2 fc; /* first: libfabric hands back its address */
	uint32_t peer;
	int next_free;
};

struct card {
	uint32_t magic, name_len;
	uint64_t base, key, len;
	uint8_t name[256];
	/* same-host direct path: the region's memfd as /proc/<pid>/fd/<fd>, and what makes
	 * "the same host" (boot id and pid namespace) */
	int32_t pid, fd;
	char host[96];
};

struct ro_fab {
	struct fi_info *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_av *av;
	struct fid_cq *cq;
	struct fid_ep *ep;
	struct fid_mr *rmr, *smr;
	void *region, *send, *sdesc;
	size_t region_len, send_len, chunk;
	bool virt_addr;
	uint32_t rank, world, timeout_ms;
	fi_addr_t *peer;
	uint64_t *peer_base, *peer_key;
	struct tx_ctx ctx[N_CTX];
	int free_ctx;
	uint64_t pending;
	int region_fd;	 /* memfd behind the region (direct mode), else -1 */
	bool direct;	 /* peers on this host map our region and write it themselves */
	void **peer_map; /* their regions, mapped here (NULL: through the fabric) */
	uint32_t *stash; /* arrivals seen while posting, and writes to self */
	size_t stash_n, stash_cap;
	char prov[64];
};

/* libfabric returns -FI_E* (errno values) or positive from some calls; keep -errno. */
static int fierr(ssize_t r)
{
	return r < 0 ? (int)r : -(int)r;
}

/* "<boot id>:<pid namespace>": two processes that share it can map each other's memfd. */
static void host_key(char *buf, size_t len)
{
	char boot[64] = "", ns[64] = "";
	FILE *fb = fopen("/proc/sys/kernel/random/boot_id", "r");
	ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);

	if (fb) {
		if (!fgets(boot, sizeof(boot), fb))
			boot[0] = 0;
		(void)fclose(fb);
	}
	boot[strcspn(boot, "\n")] = 0;
	ns[n > 0 ? n : 0] = 0;
	(void)snprintf(buf, len, "%s:%s", boot, ns);
}

static void *map_zeroed(size_t len)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);

	return p == MAP_FAILED ? NULL : p;
}

struct ro_fab *ro_fab_close(struct ro_fab *f)
{
	if (!f)
		return NULL;
	if (f->ep)
		(void)fi_close(&f->ep->fid);
	if (f->rmr)
		(void)fi_close(&f->rmr->fid);
	if (f->smr)
		(void)fi_close(&f->smr->fid);
	if (f->cq)
		(void)fi_close(&f->cq->fid);
	if (f->av)
		(void)fi_close(&f->av->fid);
	if (f->domain)
		(void)fi_close(&f->domain->fid);
	if (f->fabric)
		(void)fi_close(&f->fabric->fid);
	if (f->info)
		fi_freeinfo(f->info);
	if (f->region)
		(void)munmap(f->region, f->region_len);
	if (f->region_fd >= 0)
		(void)close(f->region_fd);
	for (uint32_t i = 0; f->peer_map && i < f->world; i++)
		if (f->peer_map[i])
			(void)munmap(f->peer_map[i], f->region_len);
	free(f->peer_map);
	if (f->send)
		(void)munmap(f->send, f->send_len);
	free(f->stash);
	free(f->peer);
	free(f->peer_base);
	free(f->peer_key);
	free(f);
	return NULL;
}

/* Hints that fit EFA as well as tcp and shm: RDM, messages and RMA, the memory
 * registration modes EFA asks for, completions that carry data. */
static struct fi_info *make_hints(const char *provider)
{
	struct fi_info *h = fi_allocinfo();

	if (!h)
		return NULL;
	h->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
	h->mode = FI_CONTEXT | FI_CONTEXT2;
	h->ep_attr->type = FI_EP_RDM;
	h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
	h->domain_attr->threading = FI_THREAD_DOMAIN;
	if (provider && *provider && strcmp(provider, "auto")) {
		h->fabric_attr->prov_name = strdup(provider);
		if (!h->fabric_attr->prov_name) {
			fi_freeinfo(h);
			return NULL;
		}
	}
	return h;
}

/* shm names its segment in /dev/shm after the pid by default; a rank killed with SIGKILL
 * leaves it behind, and a later process given the same pid then cannot open its endpoint
 * (EBUSY). A name that is ours alone: pid and the time it starts. */
static int shm_name(struct ro_fab *f)
{
	struct timespec ts;
	char name[64];

	if (strcmp(f->prov, "shm"))
		return 0;
	clock_gettime(CLOCK_REALTIME, &ts);
	(void)snprintf(name, sizeof(name), "rolloutd-ep-%d-%llx", (int)getpid(),
		       (unsigned long long)ts.tv_sec * 1000000000ull +
			   (unsigned long long)ts.tv_nsec);
	return fi_setname(&f->ep->fid, name, strlen(name) + 1);
}

int ro_fab_open(const char *provider, size_t region_len, size_t send_len, bool direct,
		struct ro_fab **ret, char *err, size_t errlen)
{
	struct fi_cq_attr cqa = {
	    .format = FI_CQ_FORMAT_DATA, .size = 4096, .wait_obj = FI_WAIT_NONE};
	struct fi_av_attr ava = {.type = FI_AV_TABLE};
	struct fi_info *hints = make_hints(provider), *info = NULL;
	struct ro_fab *f = NULL;
	int r;

	*ret = NULL;
	if (!hints)
		return ro_errf(err, errlen, -ENOMEM, "out of memory");
	r = fi_getinfo(FI_VERSION(1, 11), NULL, NULL, 0, hints, &info);
	fi_freeinfo(hints);
	if (r || !info)
		return ro_errf(
		    err, errlen, r ? fierr(r) : -ENODEV,
		    "no libfabric provider %s offers RDM with RMA and remote CQ data: %s",
		    provider && *provider ? provider : "(any)", r ? fi_strerror(-r) : "none found");
	f = calloc(1, sizeof(*f));
	if (!f) {
		fi_freeinfo(info);
		return ro_errf(err, errlen, -ENOMEM, "out of memory");
	}
	f->region_fd = -1;
	/* the first (best) match only */
	f->info = fi_dupinfo(info);
	fi_freeinfo(info);
	if (!f->info) {
		r = ro_errf(err, errlen, -ENOMEM, "out of memory");
		goto fail;
	}
	(void)snprintf(f->prov, sizeof(f->prov), "%s", f->info->fabric_attr->prov_name);
	f->virt_addr = f->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR;
	f->chunk = f->info->ep_attr->max_msg_size;
	if (!f->chunk || f->chunk > MAX_CHUNK)
		f->chunk = MAX_CHUNK;
	f->region_len = region_len ? region_len : 4096;
	f->send_len = send_len ? send_len : 4096;
	f->region_fd = -1;
	/* shm: ranks of one host write each other's regions with plain stores, the fabric
	 * only signals (a memfd region they map through /proc/<pid>/fd) */
	if (direct && !strcmp(f->prov, "shm")) {
		int fd = memfd_create("rolloutd-ep-region", MFD_CLOEXEC);

		if (fd >= 0 && ftruncate(fd, (off_t)f->region_len) == 0) {
			void *p =
			    mmap(NULL, f->region_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

			if (p != MAP_FAILED) {
				f->region = p;
				f->region_fd = fd;
				f->direct = true;
			}
		}
		if (!f->direct && fd >= 0)
			(void)close(fd);
	}
	if (!f->region)
		f->region = map_zeroed(f->region_len);
	f->send = map_zeroed(f->send_len);
	if (!f->region || !f->send) {
		f->region = f->region ? (munmap(f->region, f->region_len), NULL) : NULL;
		f->send = f->send ? (munmap(f->send, f->send_len), NULL) : NULL;
		r = ro_errf(err, errlen, -ENOMEM, "cannot map %zu + %zu bytes", region_len,
			    send_len);
		goto fail;
	}
	for (int i = 0; i < N_CTX; i++)
		f->ctx[i].next_free = i + 1 < N_CTX ? i + 1 : -1;
	f->free_ctx = 0;
	f->timeout_ms = 10000;
	if ((r = fi_fabric(f->info->fabric_attr, &f->fabric, NULL))) {
		r = ro_errf(err, errlen, fierr(r), "fi_fabric(%s): %s", f->prov, fi_strerror(-r));
		goto fail;
	}
	if ((r = fi_domain(f->fabric, f->info, &f->domain, NULL))) {
		r = ro_errf(err, errlen, fierr(r), "fi_domain(%s): %s", f->prov, fi_strerror(-r));
		goto fail;
	}
	if ((r = fi_av_open(f->domain, &ava, &f->av, NULL)) ||
	    (r = fi_cq_open(f->domain, &cqa, &f->cq, NULL)) ||
	    (r = fi_endpoint(f->domain, f->info, &f->ep, NULL)) || (r = shm_name(f)) ||
	    (r = fi_ep_bind(f->ep, &f->av->fid, 0)) ||
	    (r = fi_ep_bind(f->ep, &f->cq->fid, FI_TRANSMIT | FI_RECV)) || (r = fi_enable(f->ep))) {
		r = ro_errf(err, errlen, fierr(r), "opening the %s endpoint: %s", f->prov,
			    fi_strerror(-r));
		goto fail;
	}
	if ((r = fi_mr_reg(f->domain, f->region, f->region_len, FI_REMOTE_WRITE, 0, 0, 0, &f->rmr,
			   NULL)) ||
	    (r = fi_mr_reg(f->domain, f->send, f->send_len, FI_WRITE, 0, 1, 0, &f->smr, NULL))) {
		r = ro_errf(err, errlen, fierr(r), "registering %zu + %zu bytes with %s: %s",
			    f->region_len, f->send_len, f->prov, fi_strerror(-r));
		goto fail;
	}
	f->sdesc = fi_mr_desc(f->smr);
	*ret = f;
	return 0;
fail:
	(void)ro_fab_close(f);
	return r;
}

const char *ro_fab_provider(const struct ro_fab *f)
{
	return f->prov;
}

void *ro_fab_region(struct ro_fab *f)
{
	return f->region;
}

void *ro_fab_send(struct ro_fab *f)
{
	return f->send;
}

size_t ro_fab_chunk(const struct ro_fab *f)
{
	return f->chunk;
}

int ro_fab_card(struct ro_fab *f, void *buf, size_t *ret_len)
{
	struct card c = {.magic = CARD_MAGIC};
	size_t n = sizeof(c.name);
	int r = fi_getname(&f->ep->fid, c.name, &n);

	if (r)
		return fierr(r);
	c.name_len = (uint32_t)n;
	c.base = f->virt_addr ? (uint64_t)(uintptr_t)f->region : 0;
	c.key = fi_mr_key(f->rmr);
	c.len = f->region_len;
	c.pid = (int32_t)getpid();
	c.fd = f->direct ? f->region_fd : -1;
	host_key(c.host, sizeof(c.host));
	memcpy(buf, &c, sizeof(c));
	*ret_len = sizeof(c);
	return 0;
}

int ro_fab_connect(struct ro_fab *f, uint32_t rank, uint32_t world, const void *const *cards,
		   const size_t *lens, char *err, size_t errlen)
{
	char me[96];

	f->rank = rank;
	f->world = world;
	f->peer = calloc(world, sizeof(*f->peer));
	f->peer_base = calloc(world, sizeof(*f->peer_base));
	f->peer_key = calloc(world, sizeof(*f->peer_key));
	f->peer_map = calloc(world, sizeof(*f->peer_map));
	if (!f->peer || !f->peer_base || !f->peer_key || !f->peer_map)
		return ro_errf(err, errlen, -ENOMEM, "out of memory");
	host_key(me, sizeof(me));
	for (uint32_t i = 0; i < world; i++) {
		struct card c;
		int r;

		if (lens[i] != sizeof(c))
			return ro_errf(err, errlen, -EPROTO,
				       "rank %u's card has %zu bytes, want %zu", i, lens[i],
				       sizeof(c));
		memcpy(&c, cards[i], sizeof(c));
		if (c.magic != CARD_MAGIC || c.name_len > sizeof(c.name) || c.len != f->region_len)
			return ro_errf(
			    err, errlen, -EPROTO,
			    "rank %u's card does not match (another build or other sizes: "
			    "region %llu bytes, ours %zu)",
			    i, (unsigned long long)c.len, f->region_len);
		r = fi_av_insert(f->av, c.name, 1, &f->peer[i], 0, NULL);
		if (r != 1)
			return ro_errf(err, errlen, r < 0 ? r : -EADDRNOTAVAIL,
				       "cannot insert rank %u's address: %s", i,
				       fi_strerror(r < 0 ? -r : FI_EADDRNOTAVAIL));
		f->peer_base[i] = c.base;
		f->peer_key[i] = c.key;
		c.host[sizeof(c.host) - 1] = 0;
		if (f->direct && i != rank && c.fd >= 0 && !strcmp(c.host, me)) {
			char path[64];
			int fd;

			(void)snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)c.pid, (int)c.fd);
			fd = open(path, O_RDWR | O_CLOEXEC);
			if (fd >= 0) {
				void *p = mmap(NULL, f->region_len, PROT_READ | PROT_WRITE,
					       MAP_SHARED, fd, 0);

				if (p != MAP_FAILED)
					f->peer_map[i] = p;
				(void)close(fd);
			}
			/* not mappable (another user, a seccomp profile): the fabric carries it */
		}
	}
	return 0;
}

static int poll_err(struct ro_fab *f, char *err, size_t errlen)
{
	struct fi_cq_err_entry e = {0};
	char pbuf[256] = "";
	const char *pmsg;
	ssize_t n = fi_cq_readerr(f->cq, &e, 0);
	int peer = -1;

	if (n < 0)
		return ro_errf(err, errlen, fierr(n), "fi_cq_readerr: %s", fi_strerror((int)-n));
	if (e.op_context) {
		struct tx_ctx *c = e.op_context;

		peer = (int)c->peer;
		c->next_free = f->free_ctx;
		f->free_ctx = (int)(c - f->ctx);
		f->pending--;
	}
	pmsg = fi_cq_strerror(f->cq, e.prov_errno, e.err_data, pbuf, sizeof(pbuf));
	if (peer >= 0)
		return ro_errf(err, errlen, e.err ? -e.err : -EIO,
			       "write to rank %d failed: %s (%s)", peer, fi_strerror(e.err),
			       pmsg ? pmsg : "");
	return ro_errf(err, errlen, e.err ? -e.err : -EIO, "completion error: %s (%s)",
		       fi_strerror(e.err), pmsg ? pmsg : "");
}

static int stash(struct ro_fab *f, uint32_t data)
{
	if (f->stash_n == f->stash_cap) {
		size_t cap = f->stash_cap ? f->stash_cap * 2 : 256;
		uint32_t *p = realloc(f->stash, cap * sizeof(*p));

		if (!p)
			return -ENOMEM;
		f->stash = p;
		f->stash_cap = cap;
	}
	f->stash[f->stash_n++] = data;
	return 0;
}

/* Read what the CQ holds: local completions free their context; arrivals go to on_data
 * (or, with on_data NULL, to the stash for the next ro_fab_poll). */
static int drain_cq(struct ro_fab *f, ro_fab_data_fn on_data, void *arg, char *err, size_t errlen)
{
	struct fi_cq_data_entry ent[32];
	int handled = 0;

	for (;;) {
		ssize_t n = fi_cq_read(f->cq, ent, 32);

		if (n == -FI_EAGAIN)
			return handled;
		if (n == -FI_EAVAIL)
			return poll_err(f, err, errlen);
		if (n < 0)
			return ro_errf(err, errlen, fierr(n), "fi_cq_read: %s",
				       fi_strerror((int)-n));
		for (ssize_t i = 0; i < n; i++) {
			if (ent[i].flags & FI_REMOTE_CQ_DATA) {
				if (on_data)
					on_data(arg, (uint32_t)ent[i].data);
				else if (stash(f, (uint32_t)ent[i].data))
					return ro_errf(err, errlen, -ENOMEM, "out of memory");
			} else if (ent[i].op_context) {
				struct tx_ctx *c = ent[i].op_context;

				c->next_free = f->free_ctx;
				f->free_ctx = (int)(c - f->ctx);
				f->pending--;
			}
			handled++;
		}
		if (n < 32)
			return handled;
	}
}

int ro_fab_poll(struct ro_fab *f, ro_fab_data_fn on_data, void *arg, char *err, size_t errlen)
{
	int handled = (int)f->stash_n, r;

	for (size_t i = 0; i < f->stash_n; i++)
		on_data(arg, f->stash[i]);
	f->stash_n = 0;
	r = drain_cq(f, on_data, arg, err, errlen);
	return r < 0 ? r : handled + r;
}

/* Post one write, progressing the queue while the provider says -FI_EAGAIN or every
 * context is in flight. Arrivals seen meanwhile are stashed for the caller's next poll. */
static int post(struct ro_fab *f, uint32_t peer, size_t soff, size_t len, size_t roff,
		uint32_t data, char *err, size_t errlen)
{
	int64_t deadline = 0;

	for (unsigned tries = 0;; tries++) {
		struct tx_ctx *c;
		ssize_t r;

		if (f->free_ctx >= 0) {
			c = &f->ctx[f->free_ctx];
			c->peer = peer;
			r = fi_writedata(f->ep, (char *)f->send + soff, len, f->sdesc, data,
					 f->peer[peer], f->peer_base[peer] + roff,
					 f->peer_key[peer], c);
			if (!r) {
				f->free_ctx = c->next_free;
				f->pending++;
				return 0;
			}
			if (r != -FI_EAGAIN)
				return ro_errf(err, errlen, fierr(r), "write to rank %u: %s", peer,
					       fi_strerror((int)-r));
		}
		r = drain_cq(f, NULL, NULL, err, errlen);
		if (r < 0)
			return (int)r;
		if (tries == 0)
			deadline = ro_ep_mono_ms() + f->timeout_ms;
		else if (!(tries & 255) && ro_ep_mono_ms() > deadline)
			return ro_errf(err, errlen, -ETIMEDOUT,
				       "rank %u late: a write to it not accepted after %u ms", peer,
				       f->timeout_ms);
	}
}

void ro_fab_set_timeout(struct ro_fab *f, uint32_t ms)
{
	f->timeout_ms = ms;
}

void *ro_fab_peer_region(struct ro_fab *f, uint32_t peer)
{
	return f->peer_map && peer < f->world ? f->peer_map[peer] : NULL;
}

int ro_fab_signal(struct ro_fab *f, uint32_t peer, size_t len, uint32_t data, char *err,
		  size_t errlen)
{
	size_t chunks = len ? (len + f->chunk - 1) / f->chunk : 1;

	/* our stores into the peer's region happen before the signal that announces them */
	atomic_thread_fence(memory_order_release);
	for (size_t i = 0; i < chunks; i++) {
		int r = post(f, peer, 0, 0, 0, data, err, errlen);

		if (r)
			return r;
	}
	return 0;
}

int ro_fab_signal_self(struct ro_fab *f, size_t len, uint32_t data)
{
	size_t chunks = len ? (len + f->chunk - 1) / f->chunk : 1;

	for (size_t i = 0; i < chunks; i++)
		if (stash(f, data))
			return -ENOMEM;
	return 0;
}

int ro_fab_drain_tx(struct ro_fab *f, char *err, size_t errlen)
{
	const int64_t deadline = ro_ep_mono_ms() + f->timeout_ms;

	while (f->pending) {
		int r = drain_cq(f, NULL, NULL, err, errlen);

		if (r < 0)
			return r;
		if (!r && ro_ep_mono_ms() > deadline)
			return ro_errf(err, errlen, -ETIMEDOUT,
				       "%llu writes not completed after %u ms (a peer gone?)",
				       (unsigned long long)f->pending, f->timeout_ms);
	}
	return 0;
}

int ro_fab_write(struct ro_fab *f, uint32_t peer, size_t soff, size_t len, size_t roff,
		 uint32_t data, char *err, size_t errlen)
{
	if (soff + len > f->send_len || roff + len > f->region_len || peer >= f->world)
		return ro_errf(err, errlen, -EINVAL, "write of %zu bytes to rank %u out of bounds",
			       len, peer);
	if (peer == f->rank) {
		size_t chunks = len ? (len + f->chunk - 1) / f->chunk : 1;

		memcpy((char *)f->region + roff, (char *)f->send + soff, len);
		for (size_t i = 0; i < chunks; i++)
			if (stash(f, data))
				return ro_errf(err, errlen, -ENOMEM, "out of memory");
		return 0;
	}
	if (!len)
		return post(f, peer, soff, 0, roff, data, err, errlen);
	for (size_t off = 0; off < len; off += f->chunk) {
		size_t n = len - off < f->chunk ? len - off : f->chunk;
		int r = post(f, peer, soff + off, n, roff + off, data, err, errlen);

		if (r)
			return r;
	}
	return 0;
}
