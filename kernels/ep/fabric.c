/* The libfabric transport of expert parallelism: an RDM endpoint chosen at run time (efa,
 * tcp, shm, ...), one region registered for remote writes, one registered send area, RMA
 * writes with remote CQ data, and a completion loop that turns every provider error into
 * -errno with a message naming the peer. Nothing here waits: dispatch.c owns deadlines. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <time.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "kernels/ep/internal.h"
#include "kernels/internal.h"
#include "kernels/model.h"

#define MAX_CHUNK (4u << 20)
#define N_CTX 1024

struct tx_ctx {
	struct fi_context2 fc; /* first: libfabric hands back its address */
	uint32_t peer;
	int next_free;
};

_Static_assert(sizeof(struct ro_fab_card) == offsetof(struct ro_fab_card, mac) + RO_FAB_MAC_LEN &&
		   offsetof(struct ro_fab_card, mac) ==
		       offsetof(struct ro_fab_card, host) + sizeof(((struct ro_fab_card *)0)->host),
	       "the card has no padding: every byte before mac is signed and defined");
_Static_assert(sizeof(struct ro_fab_card) <= RO_EP_CARD_MAX, "a card fits RO_EP_CARD_MAX");

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
	uint64_t group_tag, nonce;
	uint8_t *secret; /* our copy of the group secret (NULL: cards unsigned) */
	size_t secret_len;
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
	if (f->secret) {
		explicit_bzero(f->secret, f->secret_len);
		free(f->secret);
	}
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

uint64_t ro_fab_group_tag(const char *group)
{
	unsigned char md[EVP_MAX_MD_SIZE];
	unsigned int n = 0;
	uint64_t tag = 0;

	if (!group)
		group = "";
	if (EVP_Digest(group, strlen(group), md, &n, EVP_sha256(), NULL) && n >= sizeof(tag))
		memcpy(&tag, md, sizeof(tag));
	return tag;
}

void ro_fab_region_name(char *buf, size_t len, uint32_t rank, uint32_t world, uint64_t group_tag,
			uint64_t nonce)
{
	(void)snprintf(buf, len, "ro-ep-%u-of-%u-%016llx-%016llx", rank, world,
		       (unsigned long long)group_tag, (unsigned long long)nonce);
}

/* The nonce that makes this endpoint's memfd name its own. Not a secret (the card
 * carries it); unpredictable only so that nobody prepares a file of that name ahead. */
static uint64_t make_nonce(void)
{
	uint64_t n = 0;

	if (getrandom(&n, sizeof(n), GRND_NONBLOCK) != (ssize_t)sizeof(n)) {
		struct timespec ts;

		clock_gettime(CLOCK_REALTIME, &ts);
		n = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
		n ^= (uint64_t)getpid() << 40;
	}
	return n;
}

/* The region as a sealed memfd named for this rank, group and endpoint: what peers check
 * before they map it (map_peer). Shrink and grow are sealed once it has its size, so a
 * mapping of it never loses its backing; F_SEAL_SEAL so that nobody adds a seal later. */
static void open_shared_region(struct ro_fab *f)
{
	char name[80];
	int fd;
	void *p;

	ro_fab_region_name(name, sizeof(name), f->rank, f->world, f->group_tag, f->nonce);
	fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return;
	if (ftruncate(fd, (off_t)f->region_len) ||
	    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) {
		(void)close(fd);
		return;
	}
	p = mmap(NULL, f->region_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		(void)close(fd);
		return;
	}
	f->region = p;
	f->region_fd = fd;
	f->direct = true;
}

int ro_fab_open(const char *provider, size_t region_len, size_t send_len, bool direct,
		const struct ro_fab_id *id, struct ro_fab **ret, char *err, size_t errlen)
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
	f->rank = id ? id->rank : 0;
	f->world = id ? id->world : 1;
	f->group_tag = ro_fab_group_tag(id ? id->group : NULL);
	f->nonce = make_nonce();
	/* the first (best) match only */
	f->info = fi_dupinfo(info);
	fi_freeinfo(info);
	if (!f->info) {
		r = ro_errf(err, errlen, -ENOMEM, "out of memory");
		goto fail;
	}
	(void)snprintf(f->prov, sizeof(f->prov), "%s", f->info->fabric_attr->prov_name);
	if (id && id->secret && id->secret_len) {
		f->secret = malloc(id->secret_len);
		if (!f->secret) {
			r = ro_errf(err, errlen, -ENOMEM, "out of memory");
			goto fail;
		}
		memcpy(f->secret, id->secret, id->secret_len);
		f->secret_len = id->secret_len;
	}
	f->virt_addr = f->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR;
	f->chunk = f->info->ep_attr->max_msg_size;
	if (!f->chunk || f->chunk > MAX_CHUNK)
		f->chunk = MAX_CHUNK;
	f->region_len = region_len ? region_len : 4096;
	f->send_len = send_len ? send_len : 4096;
	f->region_fd = -1;
	/* shm: ranks of one host write each other's regions with plain stores, the fabric
	 * only signals (a memfd region they map through /proc/<pid>/fd) */
	if (direct && !strcmp(f->prov, "shm"))
		open_shared_region(f);
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

/* ---- the card ---------------------------------------------------------------------- */

#define MAC_OFF offsetof(struct ro_fab_card, mac)

static int card_mac(const void *card, const uint8_t *secret, size_t secret_len,
		    uint8_t mac[RO_FAB_MAC_LEN])
{
	unsigned int n = 0;

	if (secret_len > 0x7fffffff ||
	    !HMAC(EVP_sha256(), secret, (int)secret_len, card, MAC_OFF, mac, &n) ||
	    n != RO_FAB_MAC_LEN)
		return -EIO;
	return 0;
}

int ro_fab_card_sign(struct ro_fab_card *c, const uint8_t *secret, size_t secret_len)
{
	memset(c->mac, 0, sizeof(c->mac));
	if (!secret || !secret_len) {
		c->flags &= ~RO_FAB_CARD_SIGNED;
		return 0;
	}
	c->flags |= RO_FAB_CARD_SIGNED;
	return card_mac(c, secret, secret_len, c->mac);
}

/* Only what the bytes themselves tell, so that a fuzzer can drive it: the caller checks
 * rank, world and group against its own and the fd against the live peer. The signature
 * comes before any field is believed. */
int ro_fab_card_check(const void *buf, size_t len, const uint8_t *secret, size_t secret_len,
		      size_t region_len, char *err, size_t errlen)
{
	const bool keyed = secret && secret_len;
	struct ro_fab_card c;
	uint32_t head[2];

	if (len < sizeof(head))
		return ro_errf(err, errlen, -EPROTO, "card has %zu bytes: not a card", len);
	memcpy(head, buf, sizeof(head));
	if (head[0] == RO_FAB_CARD_OLD_MAGIC)
		return ro_errf(err, errlen, -EPROTO,
			       "card is of the unversioned format of an older rolloutd: every "
			       "rank of a group must run the same version");
	if (head[0] != RO_FAB_CARD_MAGIC)
		return ro_errf(err, errlen, -EPROTO, "card is not an EP card (magic %08x)",
			       head[0]);
	if (head[1] != RO_FAB_CARD_VERSION)
		return ro_errf(err, errlen, -EPROTO,
			       "card has format version %u, this rolloutd speaks %u: every rank "
			       "of a group must run the same version",
			       head[1], RO_FAB_CARD_VERSION);
	if (len != sizeof(c))
		return ro_errf(err, errlen, -EPROTO, "card has %zu bytes, want %zu", len,
			       sizeof(c));
	memcpy(&c, buf, sizeof(c));
	if (keyed) {
		uint8_t mac[RO_FAB_MAC_LEN];

		if (!(c.flags & RO_FAB_CARD_SIGNED))
			return ro_errf(err, errlen, -EPERM,
				       "card is not signed with this group's secret (it is not "
				       "signed at all: that rank has no ep-secret-file)");
		if (card_mac(buf, secret, secret_len, mac))
			return ro_errf(err, errlen, -EIO, "card: HMAC-SHA256 failed");
		if (CRYPTO_memcmp(mac, c.mac, sizeof(mac)))
			return ro_errf(err, errlen, -EPERM,
				       "card is not signed with this group's secret (every rank "
				       "needs the same ep-secret-file; or the card was forged)");
	} else if (c.flags & RO_FAB_CARD_SIGNED) {
		return ro_errf(err, errlen, -EPERM,
			       "card is signed but this rank has no EP secret: give every rank "
			       "the same ep-secret-file");
	}
	if (c.flags & ~RO_FAB_CARD_SIGNED)
		return ro_errf(err, errlen, -EPROTO, "card has unknown flags %#x", c.flags);
	if (!c.world || c.world > 64 || c.rank >= c.world)
		return ro_errf(err, errlen, -EPROTO, "card names rank %u of %u", c.rank, c.world);
	if (!c.name_len || c.name_len > sizeof(c.name))
		return ro_errf(err, errlen, -EPROTO, "card has a fabric address of %u bytes",
			       c.name_len);
	if (c.len != region_len)
		return ro_errf(err, errlen, -EPROTO,
			       "card does not match (another build or other sizes: region %llu "
			       "bytes, ours %zu)",
			       (unsigned long long)c.len, region_len);
	if (!memchr(c.host, 0, sizeof(c.host)))
		return ro_errf(err, errlen, -EPROTO, "card's host key is not terminated");
	if (c.fd < -1 || (c.fd >= 0 && c.pid <= 0))
		return ro_errf(err, errlen, -EPROTO, "card names fd %d of pid %d", (int)c.fd,
			       (int)c.pid);
	return 0;
}

int ro_fab_card(struct ro_fab *f, void *buf, size_t *ret_len)
{
	struct ro_fab_card c;
	size_t n = sizeof(c.name);
	int r;

	memset(&c, 0, sizeof(c)); /* every byte is signed: padding-free, but be sure */
	r = fi_getname(&f->ep->fid, c.name, &n);
	if (r)
		return fierr(r);
	c.magic = RO_FAB_CARD_MAGIC;
	c.version = RO_FAB_CARD_VERSION;
	c.rank = f->rank;
	c.world = f->world;
	c.name_len = (uint32_t)n;
	c.base = f->virt_addr ? (uint64_t)(uintptr_t)f->region : 0;
	c.key = fi_mr_key(f->rmr);
	c.len = f->region_len;
	c.group_tag = f->group_tag;
	c.nonce = f->nonce;
	c.pid = (int32_t)getpid();
	c.fd = f->direct ? f->region_fd : -1;
	host_key(c.host, sizeof(c.host));
	r = ro_fab_card_sign(&c, f->secret, f->secret_len);
	if (r)
		return r;
	memcpy(buf, &c, sizeof(c));
	*ret_len = sizeof(c);
	return 0;
}

/* Refuse a card's fd: it points at something that is not the peer's region. */
static int refuse(char *err, size_t errlen, uint32_t rank, const struct ro_fab_card *c,
		  const char *why)
{
	return ro_errf(err, errlen, -EPERM,
		       "rank %u's card: /proc/%d/fd/%d %s: refusing to map it (not that rank's "
		       "region: a forged card?)",
		       rank, (int)c->pid, (int)c->fd, why);
}

/* A same-host peer's region, mapped here only once the file behind /proc/<pid>/fd/<fd>
 * proved to be that peer's region: a memfd of the name it was created with (rank, world,
 * group, the card's nonce), owned by our user, sealed against shrinking and growing (the
 * mapping cannot lose its backing), of exactly the region's size. The file is pinned
 * first with O_PATH (following the magic link runs no device's open), the name is read
 * from that pinned descriptor, the read-write descriptor is reopened from it and checked
 * to be the same inode, and seals and size are read from the descriptor that is mapped:
 * nothing can be swapped between the checks and the map.
 * 0 with *ret NULL: not ours to open (ptrace denied, another user, gone), the fabric
 * carries it. -EPERM: the card points at anything else. */
static int map_peer(struct ro_fab *f, uint32_t rank, const struct ro_fab_card *c, void **ret,
		    char *err, size_t errlen)
{
	char path[64], self[64], name[80], want[112], got[256], why[400];
	struct stat ps, ws;
	int pfd, wfd = -1, seals, r = 0;
	ssize_t n;
	void *p;

	*ret = NULL;
	(void)snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)c->pid, (int)c->fd);
	pfd = open(path, O_PATH | O_CLOEXEC);
	if (pfd < 0)
		goto out;
	if (fstat(pfd, &ps) || ps.st_uid != geteuid())
		goto out_pfd; /* another user's: nothing we may map */
	if (!S_ISREG(ps.st_mode)) {
		r = refuse(err, errlen, rank, c, "is not a regular file");
		goto out_pfd;
	}
	(void)snprintf(self, sizeof(self), "/proc/self/fd/%d", pfd);
	n = readlink(self, got, sizeof(got) - 1);
	got[n > 0 ? n : 0] = 0;
	ro_fab_region_name(name, sizeof(name), rank, f->world, f->group_tag, c->nonce);
	(void)snprintf(want, sizeof(want), "/memfd:%s (deleted)", name);
	if (strcmp(got, want)) {
		(void)snprintf(why, sizeof(why), "is \"%s\", not the memfd \"%s\"", got, want);
		r = refuse(err, errlen, rank, c, why);
		goto out_pfd;
	}
	wfd = open(self, O_RDWR | O_CLOEXEC);
	if (wfd < 0)
		goto out_pfd;
	if (fstat(wfd, &ws) || ws.st_dev != ps.st_dev || ws.st_ino != ps.st_ino) {
		r = refuse(err, errlen, rank, c, "changed while it was checked");
		goto out_wfd;
	}
	seals = fcntl(wfd, F_GET_SEALS);
	if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
		r = refuse(err, errlen, rank, c, "is not sealed against shrinking and growing");
		goto out_wfd;
	}
	if (ws.st_size < 0 || (uint64_t)ws.st_size != f->region_len) {
		(void)snprintf(why, sizeof(why), "has %lld bytes, not the region's %zu",
			       (long long)ws.st_size, f->region_len);
		r = refuse(err, errlen, rank, c, why);
		goto out_wfd;
	}
	p = mmap(NULL, f->region_len, PROT_READ | PROT_WRITE, MAP_SHARED, wfd, 0);
	if (p != MAP_FAILED)
		*ret = p;
out_wfd:
	(void)close(wfd);
out_pfd:
	(void)close(pfd);
out:
	return r;
}

int ro_fab_connect(struct ro_fab *f, const void *const *cards, const size_t *lens, char *err,
		   size_t errlen)
{
	const uint32_t world = f->world;
	char me[96], why[224];

	if (f->peer)
		return ro_errf(err, errlen, -EALREADY, "already connected");
	f->peer = calloc(world, sizeof(*f->peer));
	f->peer_base = calloc(world, sizeof(*f->peer_base));
	f->peer_key = calloc(world, sizeof(*f->peer_key));
	f->peer_map = calloc(world, sizeof(*f->peer_map));
	if (!f->peer || !f->peer_base || !f->peer_key || !f->peer_map)
		return ro_errf(err, errlen, -ENOMEM, "out of memory");
	host_key(me, sizeof(me));
	for (uint32_t i = 0; i < world; i++) {
		struct ro_fab_card c;
		int r = ro_fab_card_check(cards[i], lens[i], f->secret, f->secret_len,
					  f->region_len, why, sizeof(why));

		if (r)
			return ro_errf(err, errlen, r, "rank %u's %s", i, why);
		memcpy(&c, cards[i], sizeof(c));
		if (c.rank != i || c.world != world || c.group_tag != f->group_tag)
			return ro_errf(err, errlen, -EPROTO,
				       "rank %u's card is rank %u of %u in group %016llx, we want "
				       "rank %u of %u in %016llx (a card of another group?)",
				       i, c.rank, c.world, (unsigned long long)c.group_tag, i,
				       world, (unsigned long long)f->group_tag);
		r = fi_av_insert(f->av, c.name, 1, &f->peer[i], 0, NULL);
		if (r != 1)
			return ro_errf(err, errlen, r < 0 ? r : -EADDRNOTAVAIL,
				       "cannot insert rank %u's address: %s", i,
				       fi_strerror(r < 0 ? -r : FI_EADDRNOTAVAIL));
		f->peer_base[i] = c.base;
		f->peer_key[i] = c.key;
		/* another host, or a peer without a shareable region: the fabric carries it */
		if (f->direct && i != f->rank && c.fd >= 0 && !strcmp(c.host, me)) {
			r = map_peer(f, i, &c, &f->peer_map[i], err, errlen);
			if (r)
				return r;
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
