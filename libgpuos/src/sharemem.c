/* SPDX-License-Identifier: MIT */
/*
 * sharemem.c - a warm standby maps its client's start-up memory instead of holding a
 * second copy of it (docs/mps.md, "Memory shared with the standby").
 *
 * Why: a warm standby (standby.c) has run its program's start-up, so it holds a copy of
 * everything its client put on the GPU before its first launch (weights, for a model
 * server): as much GPU memory again as the client's, which for a large model does not
 * fit.  With GPUOS_MPS_SHARE_MEMORY=1 (`gpuos mps start --share-standby-memory`):
 *
 * Client side (GPUOS_MPS_KERNELS=LIST): each cuMemAlloc of at least the VMM granularity
 * before its first launch is made exportable (an address range, physical memory made
 * with cuMemCreate as a POSIX fd, mapped at its start: memory.c's way, without the
 * allocation map of a tracked process).  From its first launch on, a thread serves
 * them on the unix socket LIST.share, in the client's own 0700 directory, to processes
 * of its own user: one message per allocation (its order and size) with its fd.
 *
 * Standby side (LIST and GPUOS_MPS_STANDBY_AT=launch): its start-up allocations are made
 * the same way.  While it waits at its first launch, the loader thread (preload.c) asks
 * the client's socket; for each client allocation it takes its own next one of the same
 * size, maps the client's at a spare address and compares the two (fingerprint.cu's
 * chunk hashes).  Where they are equal it copies its own content to host memory, releases
 * its own physical memory and maps the client's at its own address: one copy on the
 * GPU, held also by the standby, so it outlives the faulted server (measured:
 * tools/probes/mps_vmm_probe.py).  Its own content is kept in pinned host memory, so
 * that putting it back runs at PCIe speed.  While it waits it hashes what it shares once
 * a second and puts its own content back wherever the client wrote it (a training
 * client's weights: memory written is not memory to share), so the release seldom has
 * copies to make: when it is released, before the program's first launch goes on, it
 * hashes what it still shares once more (one launch, into buffers made ahead) and puts
 * its own content back where the client wrote it since.  The program sees its own
 * start-up state either way.  The report says what was shared and put back, and when.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "core.h"

#define SHARE_MAX 1024 /* start-up allocations shared at most */
#define CHUNK 4096ull  /* fingerprint.cu's chunk */
#define BACKUP_PIECE (64ull << 20)
/* While waiting, what the client wrote is given back: checked once a second, or less
 * often where hashing all of it would read more than RECHECK_RATE bytes a second of the
 * GPU's memory (a standby's checks must not slow its co-runners). */
#define RECHECK_NS 1000000000ull
#define RECHECK_RATE (8ull << 30)

struct shared_msg {
	uint64_t seq;  /* the allocation's place in the start-up order; UINT64_MAX: the end */
	uint64_t size; /* its physical memory's bytes */
};

static struct entry {
	uint64_t base, size;
	CUmemGenericAllocationHandle h;
	CUcontext ctx;
	int device;
	uint64_t seq;
	int freed;
	/* the standby's: the client's memory mapped here instead, and its own content; the
	 * fd it came as, kept: the driver does not export an imported handle again (measured
	 * on an H100, r580), and a standby that takes over serves it to the next one */
	int shared, fd;
	void *backup; /* pinned where the driver allowed (backup_pinned) */
	int backup_pinned;
	uint64_t *hashes;
} table[SHARE_MAX];
static size_t ntable;
static uint64_t next_seq;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static int enabled = -1;
static const char *list;
static int standby;

static struct {
	size_t allocations, restored, given_back;
	uint64_t bytes, restored_bytes, given_back_bytes, check_ns, check_hash_ns;
	/* the release, on the wall clock (a benchmark compares them with its fault's time):
	 * when the wait ended, and when the check began (after a waiting check under way) */
	double released_at, check_started_at;
} report;
static int asked;    /* the client's socket answered (shared or not): not asked again */
static int stopping; /* released: a pass under way stops at its next allocation */

static int on(void)
{
	int e = __atomic_load_n(&enabled, __ATOMIC_ACQUIRE);
	if (e >= 0)
		return e;
	const char *s = getenv("GPUOS_MPS_SHARE_MEMORY");
	list = getenv("GPUOS_MPS_KERNELS");
	const char *at = getenv("GPUOS_MPS_STANDBY_AT");
	standby = at && !strcmp(at, "launch") && getenv("GPUOS_MPS_STANDBY");
	e = s && !strcmp(s, "1") && list && *list;
	__atomic_store_n(&enabled, e, __ATOMIC_RELEASE);
	return e;
}

/* LIST.share as a socket address.  A socket's path must fit in 108 bytes, which a
 * GPUOS_HOME's kernel list need not: the directory is named through an fd of it
 * (/proc/self/fd/N/NAME), *dirfd, to close after bind or connect. */
static int socket_addr(struct sockaddr_un *sa, int *dirfd)
{
	memset(sa, 0, sizeof *sa);
	sa->sun_family = AF_UNIX;
	const char *slash = strrchr(list, '/');
	char dir[4096];
	if (!slash || (size_t)(slash - list) >= sizeof dir)
		return -1;
	memcpy(dir, list, (size_t)(slash - list));
	dir[slash - list] = 0;
	*dirfd = open(*dir ? dir : "/", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (*dirfd < 0)
		return -1;
	if (snprintf(sa->sun_path, sizeof sa->sun_path, "/proc/self/fd/%d/%s.share", *dirfd, slash + 1) >=
	    (int)sizeof sa->sun_path) {
		close(*dirfd);
		return -1;
	}
	return 0;
}

/* ---- both sides: start-up allocations, exportable --------------------------------------------- */

int gpuos_sharemem_alloc(CUdeviceptr *dptr, size_t bytes)
{
	if (!on() || gpuos_blaswarm_thread || gpuos_preload_launched() || !gpuos_drv.mem_export)
		return 0;
	CUdevice dev;
	if (!gpuos_drv.ctx_get_device || gpuos_drv.ctx_get_device(&dev) != CUDA_SUCCESS)
		return 0;
	size_t g = gpuos_movable_granularity(dev); /* SIZE_MAX: no VMM API here */
	if (g == SIZE_MAX || bytes < g || bytes > SIZE_MAX - g)
		return 0;
	size_t size = (bytes + g - 1) & ~(g - 1);
	pthread_mutex_lock(&mu);
	if (ntable == SHARE_MAX) {
		pthread_mutex_unlock(&mu);
		return 0;
	}
	CUdeviceptr va;
	CUmemGenericAllocationHandle h;
	if (gpuos_drv.mem_address_reserve(&va, size, 0, 0, 0) != CUDA_SUCCESS) {
		pthread_mutex_unlock(&mu);
		return 0;
	}
	if (gpuos_movable_map_new(va, size, dev, &h) != CUDA_SUCCESS) {
		gpuos_drv.mem_address_free(va, size);
		pthread_mutex_unlock(&mu);
		return 0;
	}
	table[ntable++] = (struct entry){ .base = va, .size = size, .h = h, .ctx = (CUcontext)(uintptr_t)gpuos_current_ctx(),
					  .device = dev, .seq = next_seq++, .fd = -1 };
	pthread_mutex_unlock(&mu);
	*dptr = va;
	return 1;
}

/* e's own content in host memory, and its hashes: no longer needed. */
static void backup_drop(struct entry *e)
{
	if (e->backup_pinned)
		gpuos_drv.mem_host_unregister(e->backup);
	free(e->backup);
	free(e->hashes);
	e->backup = NULL;
	e->backup_pinned = 0;
	e->hashes = NULL;
}

static void entry_drop(struct entry *e)
{
	backup_drop(e);
	if (e->fd >= 0)
		close(e->fd);
	e->fd = -1;
	e->freed = 1;
}

int gpuos_sharemem_free(CUdeviceptr p, CUresult *r)
{
	if (__atomic_load_n(&enabled, __ATOMIC_ACQUIRE) != 1)
		return 0;
	pthread_mutex_lock(&mu);
	struct entry *e = NULL;
	for (size_t i = 0; i < ntable && !e; i++)
		if (!table[i].freed && table[i].base == p)
			e = &table[i];
	if (!e) {
		pthread_mutex_unlock(&mu);
		return 0;
	}
	if ((*r = gpuos_vmm_free(e->base, e->size, e->h)) == CUDA_SUCCESS)
		entry_drop(e);
	pthread_mutex_unlock(&mu);
	return 1;
}

/* ---- client side: the socket ----------------------------------------------------------------- */

static int send_one(int c, const struct shared_msg *m, int fd)
{
	struct iovec iov = { (void *)m, sizeof *m };
	char ctl[CMSG_SPACE(sizeof(int))];
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
	if (fd >= 0) {
		memset(ctl, 0, sizeof ctl);
		msg.msg_control = ctl;
		msg.msg_controllen = sizeof ctl;
		struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(cm), &fd, sizeof fd);
	}
	ssize_t n;
	do
		n = sendmsg(c, &msg, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	return n == (ssize_t)sizeof *m ? 0 : -1;
}

static void serve(int c)
{
	struct ucred cred;
	socklen_t len = sizeof cred;
	if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) || cred.uid != getuid())
		return; /* another user's: its GPU memory is not theirs to map */
	/* Exported under the lock, sent without it: a standby reads them at its own pace (it
	 * compares each), and the program's frees must not wait for that. */
	static struct shared_msg m[SHARE_MAX];
	static int fds[SHARE_MAX];
	size_t n = 0;
	pthread_mutex_lock(&mu);
	for (size_t i = 0; i < ntable; i++) {
		if (table[i].freed)
			continue;
		int ok = table[i].fd >= 0 ? (fds[n] = fcntl(table[i].fd, F_DUPFD_CLOEXEC, 0)) >= 0
					  : gpuos_drv.mem_export(&fds[n], table[i].h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
								 0) == CUDA_SUCCESS;
		if (ok)
			m[n++] = (struct shared_msg){ table[i].seq, table[i].size };
	}
	pthread_mutex_unlock(&mu);
	size_t sent = 0;
	while (sent < n && !send_one(c, &m[sent], fds[sent]))
		sent++;
	if (sent == n) {
		struct shared_msg end = { UINT64_MAX, 0 };
		send_one(c, &end, -1);
	}
	for (size_t i = 0; i < n; i++)
		close(fds[i]);
}

/* One connection at a time, on this one thread (serve's arrays are its own). */
static void *server_main(void *arg)
{
	int s = (int)(intptr_t)arg;
	for (;;) {
		int c = accept4(s, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			break;
		}
		serve(c);
		close(c);
	}
	close(s);
	return NULL;
}

static void start_server(void)
{
	struct sockaddr_un sa;
	int dirfd;
	if (socket_addr(&sa, &dirfd))
		return;
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0) {
		close(dirfd);
		return;
	}
	unlink(sa.sun_path); /* an earlier run's */
	/* Who may connect: the directory is the user's own, 0700 (launch.py kernel_list), and
	 * serve() answers only a peer of this user (SO_PEERCRED). */
	int bad = bind(s, (struct sockaddr *)&sa, sizeof sa) || listen(s, 8);
	close(dirfd);
	int e = bad ? errno : gpuos_thread_detached(server_main, (void *)(intptr_t)s);
	if (e) {
		gpuos_dbg("sharemem: no socket at %s: %s", sa.sun_path, strerror(e));
		close(s);
	}
}

static pthread_once_t server_once = PTHREAD_ONCE_INIT;

void gpuos_sharemem_launched(void)
{
	if (on() && !standby && !gpuos_blaswarm_thread)
		pthread_once(&server_once, start_server);
}
/* (A standby that took over serves its own start-up memory, shared or not, to the next
 * standby: gpuos_sharemem_released.) */

/* ---- standby side: the client's memory in place of its own ------------------------------------ */

/* The hasher and the stream of the standby's copies and hashes, kept: the release's
 * check (on the take-over's path) then allocates nothing (reserved after the pass). */
static struct gpuos_fp_hasher fp;
static CUstream fp_s;

/* Chunk hashes of segs (on the GPU, in the current context) into out (n in all), or -1. */
static int hash(const struct gpuos_fp_seg *segs, unsigned int nseg, uint64_t *out, uint64_t n)
{
	if (!fp_s && gpuos_drv.stream_create(&fp_s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
		fp_s = NULL;
		return -1;
	}
	return gpuos_fp_hasher_run(&fp, segs, nseg, out, n, fp_s);
}

/* h mapped at [va, va + size), read-write for the device and its peers (movable memory's). */
static CUresult map_at(uint64_t va, uint64_t size, int device, CUmemGenericAllocationHandle h)
{
	const CUmemAccessDesc *acc;
	size_t nacc = gpuos_movable_access(device, &acc);
	CUresult r = gpuos_drv.mem_map(va, size, 0, h, 0);
	return r == CUDA_SUCCESS ? gpuos_drv.mem_set_access(va, size, acc, nacc) : r;
}

/* Map the client's memory (handle h, e->size bytes) at e's address if it holds what e
 * holds: e's own content goes to host memory first.  1 shared, 0 not, -1 failed. */
static int share_one(struct entry *e, CUmemGenericAllocationHandle h, int fd)
{
	uint64_t n = e->size / CHUNK;
	CUdeviceptr tmp;
	if (gpuos_drv.mem_address_reserve(&tmp, e->size, 0, 0, 0) != CUDA_SUCCESS)
		return -1;
	int r = -1;
	uint64_t *hashes = malloc(2 * n * 8);
	void *backup = NULL;
	int pinned = 0;
	if (!hashes)
		goto free_tmp;
	if (map_at(tmp, e->size, e->device, h) != CUDA_SUCCESS)
		goto unmap_tmp; /* (an unmap of nothing mapped is refused, harmlessly) */
	struct gpuos_fp_seg segs[2] = { { e->base, e->size, 0 }, { tmp, e->size, n } };
	if (hash(segs, 2, hashes, 2 * n))
		goto unmap_tmp;
	if (memcmp(hashes, hashes + n, n * 8)) {
		r = 0;
		goto unmap_tmp;
	}
	if (!(backup = malloc(e->size)))
		goto unmap_tmp;
	/* Pinned, so that putting it back (maybe on the take-over's path) runs at PCIe speed;
	 * pageable where the driver refuses (still correct, slower). */
	pinned = gpuos_drv.mem_host_register &&
		 gpuos_drv.mem_host_register(backup, e->size, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS;
	/* In pieces, so that a release meanwhile does not wait for a whole large copy: the
	 * allocation is then left the standby's own. */
	for (uint64_t o = 0; o < e->size; o += BACKUP_PIECE) {
		uint64_t len = e->size - o < BACKUP_PIECE ? e->size - o : BACKUP_PIECE;
		if (__atomic_load_n(&stopping, __ATOMIC_ACQUIRE)) {
			r = 0;
			goto unpin;
		}
		if (gpuos_drv.memcpy_dtoh_async((char *)backup + o, e->base + o, len, fp_s) != CUDA_SUCCESS ||
		    gpuos_drv.stream_sync(fp_s) != CUDA_SUCCESS)
			goto unpin;
	}
	/* Own memory out, the client's in, at the program's address. */
	if (gpuos_drv.mem_unmap(e->base, e->size) != CUDA_SUCCESS)
		goto unpin;
	if (map_at(e->base, e->size, e->device, h) != CUDA_SUCCESS) {
		/* put its own back: nothing was lost */
		gpuos_drv.mem_unmap(e->base, e->size);
		if (map_at(e->base, e->size, e->device, e->h) != CUDA_SUCCESS)
			fprintf(stderr, "libgpuos: sharemem: the standby's memory at %#llx could not be mapped "
					"again\n", (unsigned long long)e->base);
		goto unpin;
	}
	gpuos_drv.mem_release(e->h);
	e->h = h;
	e->fd = fd;
	e->shared = 1;
	e->backup = backup;
	e->backup_pinned = pinned;
	backup = NULL;
	pinned = 0;
	uint64_t *kept = realloc(hashes, n * 8); /* its own half only */
	e->hashes = kept ? kept : hashes;
	hashes = NULL;
	r = 1;
unpin:
	if (pinned)
		gpuos_drv.mem_host_unregister(backup);
unmap_tmp:
	gpuos_drv.mem_unmap(tmp, e->size);
free_tmp:
	gpuos_drv.mem_address_free(tmp, e->size);
	free(backup);
	free(hashes);
	return r;
}

/* The shared allocations that still have their own content aside, as hash segments in
 * check_segs (their table indexes in check_idx); their number, and their chunks in *n. */
static struct gpuos_fp_seg check_segs[SHARE_MAX];
static size_t check_idx[SHARE_MAX];
static size_t shared_segs(uint64_t *n)
{
	size_t nseg = 0;
	*n = 0;
	for (size_t i = 0; i < ntable; i++)
		if (!table[i].freed && table[i].shared && table[i].backup) {
			check_segs[nseg] = (struct gpuos_fp_seg){ table[i].base, table[i].size, *n };
			check_idx[nseg++] = i;
			*n += table[i].size / CHUNK;
		}
	return nseg;
}

static int recv_one(int c, struct shared_msg *m, int *fd)
{
	struct iovec iov = { m, sizeof *m };
	char ctl[CMSG_SPACE(sizeof(int))];
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl };
	ssize_t n;
	do
		n = recvmsg(c, &msg, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	*fd = -1;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
		if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS && cm->cmsg_len == CMSG_LEN(sizeof(int)))
			memcpy(fd, CMSG_DATA(cm), sizeof *fd);
	return n == (ssize_t)sizeof *m ? 0 : -1;
}

int gpuos_sharemem_standby_pass(void)
{
	if (!on() || !standby || __atomic_load_n(&asked, __ATOMIC_ACQUIRE))
		return 0;
	struct sockaddr_un sa;
	int dirfd;
	if (socket_addr(&sa, &dirfd))
		return 0;
	int c = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	int bad = c < 0 || connect(c, (struct sockaddr *)&sa, sizeof sa);
	close(dirfd);
	if (bad) { /* the client has not launched yet */
		if (c >= 0)
			close(c);
		return 0;
	}
	uint64_t t0 = gpuos_now_ns();
	pthread_mutex_lock(&mu);
	size_t next = 0; /* own allocations are matched in their order */
	for (;;) {
		struct shared_msg m;
		int fd = -1;
		/* Released (also just before this pass took the lock): the program goes on with
		 * what is shared so far, checked; nothing is swapped under it from now on. */
		if (__atomic_load_n(&stopping, __ATOMIC_ACQUIRE))
			break;
		if (recv_one(c, &m, &fd) || m.seq == UINT64_MAX) {
			if (fd >= 0)
				close(fd);
			break;
		}
		if (fd < 0)
			continue;
		CUmemGenericAllocationHandle h;
		if (gpuos_drv.mem_import(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) !=
		    CUDA_SUCCESS) {
			close(fd);
			continue;
		}
		int r = 0;
		for (size_t i = next; i < ntable; i++)
			if (!table[i].freed && !table[i].shared && table[i].size == m.size) {
				r = share_one(&table[i], h, fd);
				if (r == 1) {
					report.allocations++;
					report.bytes += m.size;
				}
				next = i + 1;
				break;
			}
		if (r != 1) {
			gpuos_drv.mem_release(h);
			close(fd);
		}
	}
	/* The release's check allocates no GPU memory: its hash buffers are made now. */
	uint64_t n;
	size_t nseg = shared_segs(&n);
	if (nseg)
		gpuos_fp_hasher_reserve(&fp, nseg, n);
	pthread_mutex_unlock(&mu);
	close(c);
	__atomic_store_n(&asked, 1, __ATOMIC_RELEASE);
	gpuos_dbg("sharemem: %zu allocations, %llu bytes shared in %.3f s", report.allocations,
		  (unsigned long long)report.bytes, (double)(gpuos_now_ns() - t0) / 1e9);
	return 1;
}

/* e's own bytes back, in memory of its own at its address, in place of the client's. */
static int restore(struct entry *e)
{
	CUmemGenericAllocationHandle h;
	if (gpuos_drv.mem_unmap(e->base, e->size) != CUDA_SUCCESS)
		return -1;
	if (gpuos_movable_map_new(e->base, e->size, e->device, &h) != CUDA_SUCCESS) {
		map_at(e->base, e->size, e->device, e->h); /* the client's again: it goes on with that */
		return -1;
	}
	if (gpuos_drv.memcpy_htod_async(e->base, e->backup, e->size, fp_s) != CUDA_SUCCESS ||
	    gpuos_drv.stream_sync(fp_s) != CUDA_SUCCESS) {
		gpuos_drv.mem_unmap(e->base, e->size);
		gpuos_drv.mem_release(h);
		map_at(e->base, e->size, e->device, e->h);
		return -1;
	}
	gpuos_drv.mem_release(e->h);
	e->h = h;
	e->shared = 0;
	close(e->fd); /* its own memory now: exported when asked */
	e->fd = -1;
	return 0;
}

/* Every shared allocation that still has its own content aside, hashed in one launch:
 * where the client wrote it (or it cannot be told), the standby's own content goes back.
 * At the release (final) the content aside is dropped either way: sharing is settled. */
static void check_shared(int final)
{
	uint64_t n;
	size_t nseg = shared_segs(&n);
	if (!nseg)
		return;
	uint64_t *now = malloc(n * 8);
	uint64_t t0 = gpuos_now_ns();
	int hashed = now && !hash(check_segs, (unsigned int)nseg, now, n);
	if (final)
		report.check_hash_ns = gpuos_now_ns() - t0;
	if (!hashed && !final) {
		free(now); /* told next time, or at the release */
		return;
	}
	for (size_t k = 0; k < nseg; k++) {
		struct entry *e = &table[check_idx[k]];
		if (!final && __atomic_load_n(&stopping, __ATOMIC_ACQUIRE))
			break; /* released: the release checks the rest */
		int written = !hashed || memcmp(now + check_segs[k].first_chunk, e->hashes, e->size / CHUNK * 8);
		if (written) {
			/* The client wrote it since (or it cannot be told): the standby's own bytes. */
			if (restore(e) == 0) {
				if (final) {
					report.restored++;
					report.restored_bytes += e->size;
				} else {
					report.given_back++;
					report.given_back_bytes += e->size;
				}
			} else if (final) {
				fprintf(stderr, "libgpuos: sharemem: the standby's own bytes at %#llx could not be put "
						"back: it goes on with its client's there\n", (unsigned long long)e->base);
			} else {
				continue; /* tried again next time; the release's check has the last word */
			}
		}
		if (written && !final)
			backup_drop(e);
	}
	free(now); /* at the release, the content aside is dropped later (drop_backups_later) */
}

/* A released standby's own content aside, no longer needed, dropped a second later on
 * a thread of its own, off the take-over's path: unpinning 512 MiB right after a trap
 * took 0.38 s on an H200 (the driver's lock, held by the faulting client's teardown),
 * time the standby's program waited before its first iteration. */
#define DROP_DELAY_S 1
static void drop_backups(void)
{
	for (;;) { /* one at a time, outside the lock: a free() of the program's waits for it */
		struct entry aside = { 0 };
		pthread_mutex_lock(&mu);
		for (size_t i = 0; i < ntable && !aside.backup; i++)
			if (table[i].backup) {
				aside = table[i];
				table[i].backup = NULL;
				table[i].backup_pinned = 0;
				table[i].hashes = NULL;
			}
		pthread_mutex_unlock(&mu);
		if (!aside.backup)
			return;
		/* the driver unpins only with a context current (the fake driver refuses too) */
		CUcontext old;
		int pushed = aside.backup_pinned && gpuos_drv.ctx_push && gpuos_drv.ctx_push(aside.ctx) == CUDA_SUCCESS;
		backup_drop(&aside);
		if (pushed)
			gpuos_drv.ctx_pop(&old);
	}
}

static void *drop_backups_main(void *arg)
{
	(void)arg;
	struct timespec d = { DROP_DELAY_S, 0 };
	while (nanosleep(&d, &d) && errno == EINTR)
		;
	drop_backups();
	return NULL;
}

static void drop_backups_later(void)
{
	if (gpuos_thread_detached(drop_backups_main, NULL))
		drop_backups(); /* no thread: dropped now */
}

int gpuos_sharemem_standby_recheck(void)
{
	static uint64_t last;
	if (__atomic_load_n(&enabled, __ATOMIC_ACQUIRE) != 1 || !standby || !__atomic_load_n(&asked, __ATOMIC_ACQUIRE) ||
	    __atomic_load_n(&stopping, __ATOMIC_ACQUIRE))
		return 0;
	uint64_t t = gpuos_now_ns(), every = RECHECK_NS;
	if (report.bytes / RECHECK_RATE >= 1)
		every = report.bytes / RECHECK_RATE * RECHECK_NS;
	if (t - last < every)
		return 0;
	last = t;
	pthread_mutex_lock(&mu);
	size_t before = report.given_back;
	if (!__atomic_load_n(&stopping, __ATOMIC_ACQUIRE))
		check_shared(0);
	int news = report.given_back != before;
	pthread_mutex_unlock(&mu);
	return news;
}

static double wall_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

void gpuos_sharemem_released(void)
{
	if (__atomic_load_n(&enabled, __ATOMIC_ACQUIRE) != 1 || !standby)
		return;
	__atomic_store_n(&stopping, 1, __ATOMIC_RELEASE);
	double released_at = wall_now();
	pthread_mutex_lock(&mu); /* waits for a pass under way: to the end of its allocation */
	report.released_at = released_at;
	report.check_started_at = wall_now();
	uint64_t t0 = gpuos_now_ns();
	check_shared(1); /* on the take-over's path: one launch, buffers made ahead */
	report.check_ns = gpuos_now_ns() - t0;
	pthread_mutex_unlock(&mu);
	drop_backups_later();
	/* It is the client now: its next standby asks it (at the same socket path; the
	 * victim's, held or gone, is replaced). */
	pthread_once(&server_once, start_server);
}

void gpuos_sharemem_report(char *out, size_t cap)
{
	if (__atomic_load_n(&enabled, __ATOMIC_ACQUIRE) != 1 || !standby) {
		snprintf(out, cap, "null");
		return;
	}
	pthread_mutex_lock(&mu);
	uint64_t aside = 0; /* its own content kept in host memory, not yet dropped */
	for (size_t i = 0; i < ntable; i++)
		if (table[i].backup)
			aside += table[i].size;
	snprintf(out, cap,
		 "{\"asked\": %s, \"allocations\": %zu, \"bytes\": %llu, \"aside_bytes\": %llu, \"given_back\": %zu, "
		 "\"given_back_bytes\": %llu, \"restored\": %zu, \"restored_bytes\": %llu, \"check_seconds\": %.6f, "
		 "\"check_hash_seconds\": %.6f, \"released_at\": %.6f, \"check_started_at\": %.6f}",
		 __atomic_load_n(&asked, __ATOMIC_ACQUIRE) ? "true" : "false", report.allocations, (unsigned long long)report.bytes,
		 (unsigned long long)aside,
		 report.given_back, (unsigned long long)report.given_back_bytes, report.restored,
		 (unsigned long long)report.restored_bytes, (double)report.check_ns / 1e9, (double)report.check_hash_ns / 1e9,
		 report.released_at, report.check_started_at);
	pthread_mutex_unlock(&mu);
}
