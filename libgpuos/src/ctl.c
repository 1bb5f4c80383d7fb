/* SPDX-License-Identifier: MIT */
/*
 * ctl.c - starting, stopping, and the control socket (gpuos_ctl.h).
 *
 * Tracking starts lazily at the first wrapped driver call of a process: without
 * GPUOS_CTL the library stays passive (wrappers only call through); with it, the ring
 * is made, the control socket is connected and checked, and the ring's fd is handed to
 * `gpuos run`.  Any failure turns tracking off for good (gpuos_track_off): the ring
 * header says why, a STATUS record is written, and the application runs on untouched.
 * A forked child forgets the parent's ring, tables and connection and starts afresh
 * at its own first driver call.
 */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "core.h"
#include "gpuos_ctl.h"

#define CTL_REPLY_TIMEOUT_MS 5000

/* pause_word: hdr.ops_paused of this process's ring; gpuos_not_paused before the ring
 * exists, after a fork and in validation mode (which must see every operation). */
const uint32_t gpuos_not_paused;
struct gpuos_hot gpuos_hot = { .pause_word = &gpuos_not_paused };
int gpuos_validating;
GPUOS_TLS uint32_t gpuos_tls_tid;

static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;
static GPUOS_TLS int tls_starting;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static int conn_fd = -1; /* kept open: `gpuos run` sees EOF when the process exits */
static int debug = -1;

int gpuos_debugging(void)
{
	if (debug < 0) {
		const char *d = getenv("GPUOS_LIB_DEBUG");
		debug = d && !strcmp(d, "1");
	}
	return debug;
}

void gpuos_dbg(const char *fmt, ...)
{
	if (!gpuos_debugging())
		return;
	char buf[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof buf, fmt, ap);
	va_end(ap);
	fprintf(stderr, "libgpuos[%d]: %s\n", (int)getpid(), buf);
}

uint32_t gpuos_tid_slow(void)
{
	gpuos_tls_tid = (uint32_t)syscall(SYS_gettid);
	return gpuos_tls_tid;
}

/* A STATUS record (state, err, the formatted reason); turning off also writes the
 * reason into the ring header and its state there. */
static void emit_status(uint32_t state, int32_t err, const char *fmt, va_list ap)
{
	struct gpuos_rec_status st;
	memset(&st, 0, sizeof st);
	vsnprintf(st.reason, sizeof st.reason, fmt, ap);
	gpuos_dbg("tracking %s: %s", state == GPUOS_TRACK_OFF ? "off" : "incomplete", st.reason);
	struct gpuos_ring_hdr *h = gpuos_ring_hdr();
	if (!h)
		return;
	if (state == GPUOS_TRACK_OFF) {
		memcpy(h->reason, st.reason, sizeof h->reason);
		h->reason_errno = err;
		__atomic_store_n(&h->state, GPUOS_TRACK_OFF, __ATOMIC_RELEASE);
	}
	st.state = state;
	st.err = err;
	gpuos_ring_emit(GPUOS_REC_STATUS, 0, &st, sizeof st, NULL, 0);
}

void gpuos_track_off(int err, const char *fmt, ...)
{
	if (__atomic_exchange_n(&gpuos_hot.run_state, GPUOS_RUN_OFF, __ATOMIC_ACQ_REL) == GPUOS_RUN_OFF)
		return;
	va_list ap;
	va_start(ap, fmt);
	emit_status(GPUOS_TRACK_OFF, err, fmt, ap);
	va_end(ap);
}

void gpuos_track_incomplete(uint32_t why, const char *fmt, ...)
{
	struct gpuos_ring_hdr *h = gpuos_ring_hdr();
	if (!h || (__atomic_fetch_or(&h->incomplete, why, __ATOMIC_ACQ_REL) & why))
		return; /* no ring, or said already */
	uint32_t on = GPUOS_TRACK_ON;
	__atomic_compare_exchange_n(&h->state, &on, GPUOS_TRACK_INCOMPLETE, 0, __ATOMIC_ACQ_REL,
				    __ATOMIC_ACQUIRE); /* off stays off */
	va_list ap;
	va_start(ap, fmt);
	emit_status(GPUOS_TRACK_INCOMPLETE, (int32_t)why, fmt, ap);
	va_end(ap);
}

/* ---- the handshake ------------------------------------------------------------------- */

static int send_hello(int fd, uint32_t flags)
{
	struct gpuos_ctl_hello hello;
	memset(&hello, 0, sizeof hello);
	hello.magic = GPUOS_CTL_MAGIC;
	hello.version = GPUOS_CTL_VERSION;
	hello.pid = (uint32_t)getpid();
	hello.ppid = (uint32_t)getppid();
	hello.ring_bytes = gpuos_ring_bytes();
	hello.flags = flags;
	hello.state = GPUOS_TRACK_ON;
	ssize_t n = readlink("/proc/self/exe", hello.exe, sizeof hello.exe - 1);
	if (n < 0)
		hello.exe[0] = 0;

	int ring_fd = gpuos_ring_fd();
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} ctrl;
	memset(&ctrl, 0, sizeof ctrl);
	struct iovec iov = { .iov_base = &hello, .iov_len = sizeof hello };
	struct msghdr msg = {
		.msg_iov = &iov,
		.msg_iovlen = 1,
		.msg_control = ctrl.buf,
		.msg_controllen = sizeof ctrl.buf,
	};
	struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &ring_fd, sizeof ring_fd);
	do
		n = sendmsg(fd, &msg, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno;
	return (size_t)n == sizeof hello ? 0 : EPROTO;
}

/* Read the reply within the deadline: 0, or an errno (ETIMEDOUT, EPIPE at EOF). */
static int read_reply(int fd, struct gpuos_ctl_reply *reply)
{
	size_t got = 0;
	uint64_t deadline = gpuos_now_ns() + CTL_REPLY_TIMEOUT_MS * 1000000ull;
	while (got < sizeof *reply) {
		uint64_t now = gpuos_now_ns();
		if (now >= deadline)
			return ETIMEDOUT;
		struct pollfd p = { .fd = fd, .events = POLLIN };
		int r = poll(&p, 1, (int)((deadline - now) / 1000000ull) + 1);
		if (r < 0 && errno != EINTR)
			return errno;
		if (r <= 0)
			continue;
		ssize_t n = recv(fd, (char *)reply + got, sizeof *reply - got, 0);
		if (n < 0 && errno != EINTR && errno != EAGAIN)
			return errno;
		if (n == 0)
			return EPIPE;
		if (n > 0)
			got += (size_t)n;
	}
	return 0;
}

typedef void (*ctl_fail_fn)(int err, const char *fmt, ...);

/* 0 when `gpuos run` accepted us; else fail() was told why (at the start: tracking off). */
static int handshake(const char *path, uint32_t flags, ctl_fail_fn fail)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	if (strlen(path) >= sizeof sa.sun_path) {
		fail(ENAMETOOLONG, "GPUOS_CTL is too long for a unix socket path (%zu bytes)",
				strlen(path));
		return -1;
	}
	strcpy(sa.sun_path, path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		int e = errno;
		fail(e, "cannot make a unix socket: %s", strerror(e));
		return -1;
	}
	int e, r;
	do
		r = connect(fd, (struct sockaddr *)&sa, sizeof sa);
	while (r < 0 && errno == EINTR);
	if (r < 0) {
		e = errno;
		fail(e, "cannot connect to the control socket %s: %s", path, strerror(e));
		goto fail;
	}
	struct ucred cr;
	socklen_t len = sizeof cr;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0) {
		e = errno;
		fail(e, "cannot read the control socket's credentials: %s", strerror(e));
		goto fail;
	}
	if (cr.uid != 0 && cr.uid != getuid() && cr.uid != geteuid()) {
		fail(EPERM, "control socket owned by uid %u", (unsigned)cr.uid);
		goto fail;
	}
	e = send_hello(fd, flags);
	if (e) {
		fail(e, "cannot send the hello to the control socket: %s", strerror(e));
		goto fail;
	}
	struct gpuos_ctl_reply reply;
	e = read_reply(fd, &reply);
	if (e == ETIMEDOUT) {
		fail(e, "no reply from the control socket within %d s", CTL_REPLY_TIMEOUT_MS / 1000);
		goto fail;
	}
	if (e) {
		fail(e, "no reply from the control socket: %s",
				e == EPIPE ? "it closed the connection" : strerror(e));
		goto fail;
	}
	if (reply.magic != GPUOS_CTL_MAGIC) {
		fail(EPROTO, "bad reply from the control socket (magic %#x)", reply.magic);
		goto fail;
	}
	if (reply.status) {
		fail((int)reply.status, "gpuos run refused the process: %s",
				strerror((int)reply.status));
		goto fail;
	}
	conn_fd = fd;
	return 0;
fail:
	close(fd);
	return -1;
}

static uint32_t hello_flags; /* the first hello's, for a reattach */

static void reattach_failed(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void reattach_failed(int err, const char *fmt, ...)
{
	char why[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(why, sizeof why, fmt, ap);
	va_end(ap);
	gpuos_dbg("not reattached to gpuos run (%s): the ring goes on unread", why);
	(void)err;
}

void gpuos_ctl_detach(void)
{
	if (conn_fd >= 0)
		close(conn_fd);
	conn_fd = -1;
}

void gpuos_ctl_reattach(void)
{
	const char *ctl = getenv("GPUOS_CTL");
	if (conn_fd < 0 && ctl && *ctl)
		handshake(ctl, hello_flags, reattach_failed);
}

/* ---- start, fork ------------------------------------------------------------------------ */

static void atfork_child(void)
{
	/* The child's only thread is the one that forked: locks held by other threads of
	 * the parent are re-made, everything the parent tracked is forgotten. */
	gpuos_tls_tid = 0;
	pthread_mutex_init(&start_mu, NULL);
	pthread_mutex_init(&gpuos_val_lock, NULL);
	if (conn_fd >= 0)
		close(conn_fd);
	conn_fd = -1;
	gpuos_ring_forget();
	gpuos_agent_forget();
	gpuos_track_forget();
	gpuos_scan_forget();
	gpuos_val_forget();
	gpuos_touched_forget();
	gpuos_defer_forget();
	gpuos_share_forget();
	gpuos_preload_forget();
	gpuos_seq.v = 0;
	gpuos_validating = 0;
	gpuos_hot.capturing = 0;
	__atomic_store_n(&gpuos_hot.run_state, GPUOS_RUN_UNSTARTED, __ATOMIC_RELEASE);
}

static void register_atfork(void)
{
	pthread_atfork(NULL, NULL, atfork_child);
}

static int start_tracking(void)
{
	pthread_once(&atfork_once, register_atfork);
	const char *ctl = getenv("GPUOS_CTL");
	if (!ctl || !*ctl) {
		__atomic_store_n(&gpuos_hot.run_state, GPUOS_RUN_PASSIVE, __ATOMIC_RELEASE);
		return GPUOS_RUN_PASSIVE;
	}
	const char *v = getenv("GPUOS_VALIDATE");
	int validate = !v ? 0 : !strcmp(v, "1") ? 1 : !strcmp(v, "touched") ? GPUOS_VALIDATE_TOUCHED : 0;
	gpuos_scan_config();
	int e = gpuos_ring_create((validate ? GPUOS_RING_VALIDATE : 0) |
				  (validate == GPUOS_VALIDATE_TOUCHED ? GPUOS_RING_TOUCHED : 0));
	if (e) {
		gpuos_track_off(e, "cannot make the ring: %s", strerror(e));
		return GPUOS_RUN_OFF;
	}
	gpuos_resolve();
	gpuos_memory_mode(); /* into the ring header */
	int dv = 0;
	if (gpuos_drv.driver_get_version && gpuos_drv.driver_get_version(&dv) == CUDA_SUCCESS)
		gpuos_ring_hdr()->driver_version = (uint32_t)dv;
	hello_flags = validate ? GPUOS_CTL_VALIDATE : 0;
	if (handshake(ctl, hello_flags, gpuos_track_off))
		return GPUOS_RUN_OFF;
	gpuos_validating = validate;
	if (gpuos_memory_mode() == GPUOS_MEMORY_MOVABLE && (e = gpuos_agent_start()))
		gpuos_dbg("no movable-memory agent: %s", strerror(e)); /* gpuos checkpoint then stops the world */
	int s = GPUOS_RUN_STARTING;
	if (!__atomic_compare_exchange_n(&gpuos_hot.run_state, &s, GPUOS_RUN_ON, 0, __ATOMIC_ACQ_REL,
					 __ATOMIC_ACQUIRE))
		return s; /* turned off meanwhile */
	gpuos_dbg("tracking on (%s%s)", ctl, validate ? ", validating" : "");
	return GPUOS_RUN_ON;
}

int gpuos_start(void)
{
	/* A wrapper reached while this thread is starting (nothing we call should get
	 * there, but if it does) passes through instead of deadlocking. */
	if (tls_starting)
		return GPUOS_RUN_PASSIVE;
	pthread_mutex_lock(&start_mu);
	int s = __atomic_load_n(&gpuos_hot.run_state, __ATOMIC_ACQUIRE);
	if (s == GPUOS_RUN_UNSTARTED) {
		tls_starting = 1;
		__atomic_store_n(&gpuos_hot.run_state, GPUOS_RUN_STARTING, __ATOMIC_RELEASE);
		s = start_tracking();
		tls_starting = 0;
	}
	pthread_mutex_unlock(&start_mu);
	return s;
}
