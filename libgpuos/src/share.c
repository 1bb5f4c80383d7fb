/* SPDX-License-Identifier: MIT */
/*
 * share.c - processes sharing one pool of GPU memory (`gpuos run --share NAME`,
 * GPUOS_SHARE): the group file, whose turn it is on the GPU, and evictions asked by
 * another member.  The protocol is gpuos_share.h's top comment; resident.c calls in:
 *
 *   gpuos_share_join()     from the limit's first reading: map the group, take a slot,
 *                          start the release thread;
 *   gpuos_share_take_free() a call without the GPU's turn: free room, if no one needs it more;
 *   gpuos_share_acquire()  before a call that needs room it cannot have so: wait for the
 *                          GPU (1: this call begins a turn taken from another member);
 *   gpuos_share_take/give  charge and discharge the group's resident bytes;
 *   gpuos_share_ask()      the turn's set lacks room: others evict first (they run later);
 *   gpuos_share_role()     whether this member holds the turn, is beside the holder, or
 *                          neither (another of its threads stepped aside for it);
 *   gpuos_share_step_aside() a member beside the holder that cannot have its room leaves
 *                          the set (then waits for a turn of its own);
 *   gpuos_share_working_set() the bytes this member's calls needed over its last two
 *                          turns (what the next holder admits it beside itself by);
 *   gpuos_share_done()     the call's memory is resident (the first call after taking the
 *                          GPU: the time from the take to here is the switch's stall).
 *
 * The release thread sleeps on the group's futex word until `release` is set on this
 * member, then evicts that much through resident.c (gpuos_res_evict_for_others), in
 * every context that has resident memory.  The member's own calls do the same first
 * thing if it is still asked (gpuos_share_release_asked): an application that launches
 * without pause holds resident.c's lock nearly always, and the release thread, woken
 * each time the lock is let go, can lose it to the next call for seconds at a time.
 * Only the turn's set asks, and its members never ask each other both ways (the holder
 * asks those beside it, they never ask it), so no two members wait for each other's
 * evictions.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "gpuos_share.h"

#define POLL_NS 20000000ull      /* waits look at the members this often */
#define ASK_TIMEOUT_NS 10000000000ull /* then the holder evicts its own */

static struct {
	struct gpuos_share *g; /* NULL: not in a group */
	int me;
	char path[128];        /* the group file */
	dev_t dev;             /* ... and its identity when this process joined */
	ino_t ino;
	uint64_t switch_t0;    /* took the GPU from another member at (0: reported) */
	/* the turn it last stepped aside from (its holder and that holder's slices): not
	 * admitted into it again while it lasts */
	int aside_holder;
	uint64_t aside_slices;
} S = { .me = -1, .aside_holder = -1 };

/* /proc/PID/stat: its start time (field 22), 0 if it is gone or a zombie. */
static uint64_t start_time(pid_t pid)
{
	char path[64], buf[1024];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	char *p = strrchr(buf, ')'); /* the command may hold spaces and parentheses */
	if (!p || p[1] != ' ')
		return 0;
	p += 2;
	if (*p == 'Z' || *p == 'X')
		return 0;
	for (int field = 3; field < 22 && p; field++) {
		p = strchr(p, ' ');
		if (p)
			p++;
	}
	return p ? strtoull(p, NULL, 10) : 0;
}

/* Wake every waiter of the group (the lock held). */
static void gwake(struct gpuos_share *g)
{
	__atomic_add_fetch(&g->wake, 1, __ATOMIC_RELEASE);
	syscall(SYS_futex, &g->wake, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static void vacate(struct gpuos_share *g, int i)
{
	struct gpuos_share_member *m = &g->m[i];
	if (g->holder == i) {
		g->m[i].held_ns += gpuos_now_ns() - g->held_since;
		g->holder = -1;
	}
	memset(m, 0, sizeof *m);
}

/* Free the slots of members that died without leaving; recount the group's bytes. */
static void reap(struct gpuos_share *g)
{
	uint64_t resident = 0;
	for (int i = 0; i < GPUOS_SHARE_MEMBERS; i++) {
		struct gpuos_share_member *m = &g->m[i];
		if (!m->pid)
			continue;
		if (i != S.me && start_time((pid_t)m->pid) != m->start_time) {
			vacate(g, i);
			g->reaped++;
			gwake(g);
			continue;
		}
		resident += m->resident;
	}
	g->resident = resident;
}

static void glock(struct gpuos_share *g)
{
	if (pthread_mutex_lock(&g->mu) == EOWNERDEAD) {
		reap(g); /* a member died holding the lock: its slot goes, the sum is recounted */
		pthread_mutex_consistent(&g->mu);
	}
}

static void gunlock(struct gpuos_share *g)
{
	pthread_mutex_unlock(&g->mu);
}

/* Wait for a wake for at most ns (the lock held, as before; it is let go meanwhile). */
static void gwait(struct gpuos_share *g, uint64_t ns)
{
	uint32_t seen = __atomic_load_n(&g->wake, __ATOMIC_ACQUIRE);
	gunlock(g);
	struct timespec ts = { .tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull) };
	syscall(SYS_futex, &g->wake, FUTEX_WAIT, seen, &ts, NULL, 0);
	glock(g);
}

/* ---- the release thread ------------------------------------------------------------------ */

static void *release_main(void *arg)
{
	struct gpuos_share *g = arg;
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL); /* the application's signals are not ours */
	glock(g);
	for (;;) {
		struct gpuos_share_member *m = &g->m[S.me];
		if (m->pid != (uint32_t)getpid())
			break; /* left (the slot may be another's by now) */
		if (!m->release) {
			gwait(g, POLL_NS * 50);
			continue;
		}
		gunlock(g);
		gpuos_res_evict_for_others();
		glock(g);
	}
	gunlock(g);
	return NULL;
}

/* Bytes the set asked this member to evict, not done yet (0: none).  Read without the
 * group's lock at every call: a hint, checked again under it. */
uint64_t gpuos_share_release_asked(void)
{
	struct gpuos_share *g = S.g;
	return g ? __atomic_load_n(&g->m[S.me].release, __ATOMIC_RELAXED) : 0;
}

/* `done` bytes evicted for an ask of `asked` (the set may have asked more since). */
void gpuos_share_released(uint64_t asked, uint64_t done)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return;
	glock(g);
	struct gpuos_share_member *m = &g->m[S.me];
	uint64_t left = m->release;
	__atomic_store_n(&m->release, left - (asked < left ? asked : left), __ATOMIC_RELAXED);
	m->released_bytes += done;
	gwake(g);
	gunlock(g);
}

/* ---- joining and leaving ------------------------------------------------------------------- */

/* The group file, open and flock(2)ed exclusively, still the one at `path` (the last
 * member to leave removes it: a file unlinked meanwhile is not the group's any more);
 * *st its state under the lock.  -1 (errno), or -2: not a regular file of this user. */
static int open_locked(const char *path, int create, struct stat *st)
{
	for (int attempt = 0; attempt < 8; attempt++) {
		int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | create, 0600);
		if (fd < 0)
			return -1;
		struct stat now;
		if (flock(fd, LOCK_EX) || fstat(fd, st)) {
			int e = errno;
			close(fd);
			errno = e;
			return -1;
		}
		if (st->st_uid != getuid() || !S_ISREG(st->st_mode)) {
			close(fd);
			return -2;
		}
		if (!stat(path, &now) && now.st_ino == st->st_ino && now.st_dev == st->st_dev)
			return fd;
		close(fd); /* removed (or replaced) while we waited for the lock */
	}
	errno = EAGAIN;
	return -1;
}

static int members(const struct gpuos_share *g)
{
	int n = 0;
	for (int i = 0; i < GPUOS_SHARE_MEMBERS; i++)
		n += g->m[i].pid != 0;
	return n;
}

static void leave(void)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return;
	glock(g);
	g->resident -= g->m[S.me].resident;
	vacate(g, S.me);
	gwake(g);
	int left = members(g);
	gunlock(g);
	if (left)
		return;
	/* The last one out removes the file, under its flock: a process joining holds it
	 * too, and finds the file gone if it came second. */
	struct stat st;
	int fd = open_locked(S.path, 0, &st);
	if (fd < 0)
		return;
	glock(g);
	if (!members(g) && st.st_ino == S.ino && st.st_dev == S.dev)
		unlink(S.path);
	gunlock(g);
	close(fd);
}

void gpuos_share_forget(void)
{
	S.g = NULL; /* a forked child is not its parent's member */
	S.me = -1;
}

static int init_group(struct gpuos_share *g, uint64_t limit, uint64_t slice_ns)
{
	memset(g, 0, sizeof *g);
	pthread_mutexattr_t ma;
	if (pthread_mutexattr_init(&ma) || pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED) ||
	    pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST) || pthread_mutex_init(&g->mu, &ma))
		return -1;
	g->version = GPUOS_SHARE_VERSION;
	g->size = sizeof *g;
	g->holder = -1;
	g->limit = limit;
	g->slice_ns = slice_ns;
	__atomic_store_n(&g->magic, GPUOS_SHARE_MAGIC, __ATOMIC_RELEASE);
	return 0;
}

int gpuos_share_join(const char *name, uint64_t *limit)
{
	if (S.g)
		return 0;
	size_t len = strlen(name);
	if (!len || len > GPUOS_SHARE_NAME_MAX || strspn(name, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
							 "0123456789_.-") != len || name[0] == '.') {
		fprintf(stderr, "gpuos: GPUOS_SHARE=%s is not a group name ([A-Za-z0-9_.-], at most %d); not shared\n",
			name, GPUOS_SHARE_NAME_MAX);
		return -1;
	}
	uint64_t slice_ns = 200000000ull;
	const char *sl = getenv("GPUOS_SHARE_SLICE_MS");
	if (sl && *sl) {
		char *end;
		unsigned long long ms = strtoull(sl, &end, 10);
		if (!*end && ms)
			slice_ns = ms * 1000000ull;
	}
	char *path = S.path;
	snprintf(path, sizeof S.path, GPUOS_SHARE_PATH "%u-%s", (unsigned)getuid(), name);
	struct stat st;
	int fd = open_locked(path, O_CREAT, &st);
	if (fd < 0) {
		fprintf(stderr, "gpuos: cannot use the group file %s: %s; not shared\n", path,
			fd == -1 ? strerror(errno) : "not a file of this user");
		return -1;
	}
	S.dev = st.st_dev;
	S.ino = st.st_ino;
	struct gpuos_share *g = MAP_FAILED;
	const char *why = NULL;
	if (st.st_size != (off_t)sizeof *g && st.st_size && (why = "made by another version of gpuos"))
		;
	else if (!st.st_size && ftruncate(fd, sizeof *g))
		why = strerror(errno);
	else if ((g = mmap(NULL, sizeof *g, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
		why = strerror(errno);
	else if (__atomic_load_n(&g->magic, __ATOMIC_ACQUIRE) != GPUOS_SHARE_MAGIC && init_group(g, *limit, slice_ns))
		why = "cannot make its lock";
	else if (g->version != GPUOS_SHARE_VERSION || g->size != sizeof *g)
		why = "made by another version of gpuos";
	if (!why) {
		S.g = g; /* reap() knows S.me: set below, -1 meanwhile */
		glock(g);
		reap(g);
		int live = 0, slot = -1;
		for (int i = 0; i < GPUOS_SHARE_MEMBERS; i++) {
			if (g->m[i].pid)
				live++;
			else if (slot < 0)
				slot = i;
		}
		if (!live) { /* a new group, or one all of whose members have gone */
			g->limit = *limit;
			g->slice_ns = slice_ns;
			g->holder = -1;
			g->resident = 0;
		} else if (g->limit != *limit) {
			fprintf(stderr, "gpuos: group %s shares %llu bytes of GPU memory; this process uses that, "
					"not the %llu it asked for\n", name, (unsigned long long)g->limit,
				(unsigned long long)*limit);
			*limit = g->limit;
		}
		if (slot < 0) {
			why = "it has " "64 members already";
		} else {
			g->m[slot] = (struct gpuos_share_member){ .pid = (uint32_t)getpid(),
								  .start_time = start_time(getpid()) };
			S.me = slot;
		}
		gunlock(g);
	}
	flock(fd, LOCK_UN);
	close(fd);
	if (why) {
		fprintf(stderr, "gpuos: cannot join group %s (%s): %s; not shared\n", name, path, why);
		if (g != MAP_FAILED)
			munmap(g, sizeof *g);
		S.g = NULL;
		return -1;
	}
	pthread_t t;
	if (pthread_create(&t, NULL, release_main, g)) {
		leave();
		S.g = NULL;
		fprintf(stderr, "gpuos: cannot join group %s: no thread for evictions; not shared\n", name);
		return -1;
	}
	pthread_detach(t);
	atexit(leave);
	return 0;
}

/* ---- the GPU's turn ------------------------------------------------------------------------ */

/* Whether member i is in the turn's set: the holder or admitted beside it. */
static int in_set(const struct gpuos_share *g, int i)
{
	return i == g->holder || g->m[i].beside;
}

/* The member outside the set that has waited longest, or -1. */
static int oldest_waiter(const struct gpuos_share *g)
{
	int best = -1;
	for (int i = 0; i < GPUOS_SHARE_MEMBERS; i++)
		if (g->m[i].pid && g->m[i].waiting && !in_set(g, i) &&
		    (best < 0 || g->m[i].waiting_since < g->m[best].waiting_since))
			best = i;
	return best;
}

/* Whether the turn is over: the holder's slice has run out (if there is a holder) and no
 * call of the set is busy making memory resident (one that has begun to is not cut
 * short). */
static int turn_over(const struct gpuos_share *g, uint64_t now)
{
	if (g->holder >= 0 && now - g->held_since < g->slice_ns)
		return 0;
	for (int i = 0; i < GPUOS_SHARE_MEMBERS; i++)
		if (g->m[i].pid && in_set(g, i) && g->m[i].busy)
			return 0;
	return 1;
}

static int others_wait(const struct gpuos_share *g)
{
	return oldest_waiter(g) >= 0;
}

/* The turn ends for the whole set. */
static void end_turn(struct gpuos_share *g, uint64_t now)
{
	if (g->holder >= 0)
		g->m[g->holder].held_ns += now - g->held_since;
	g->holder = -1;
	g->claim = 0;
	for (int i = 0; i < GPUOS_SHARE_MEMBERS; i++)
		g->m[i].beside = 0;
}

static uint64_t working_set(const struct gpuos_share_member *m)
{
	return m->working_set ? m->working_set : m->reserved;
}

/* Whether member a goes before b into the new holder's set: a waiting member before one
 * that does not wait, the longest waiting first; of those that do not wait, the one with
 * the most memory resident. */
static int admits_before(const struct gpuos_share_member *a, const struct gpuos_share_member *b)
{
	if (!!a->waiting != !!b->waiting)
		return a->waiting != 0;
	return a->waiting ? a->waiting_since < b->waiting_since : a->resident > b->resident;
}

/* The bytes member m takes in a set: a waiting member's working set; one that does not
 * wait runs (if at all) on what it has resident. */
static uint64_t set_bytes(const struct gpuos_share_member *m)
{
	return m->waiting ? working_set(m) : m->resident;
}

/* Member i is in the turn's set beside its holder, and counted so. */
static void seat_beside(struct gpuos_share *g, int i)
{
	g->m[i].beside = 1;
	g->m[i].beside_slices++;
	g->beside_turns++;
}

/* The new holder admits beside itself the waiting members, longest waiting first, whose
 * working sets fit in the limit with its own and those admitted before them; then the
 * members that do not wait but have memory resident, if that fits too.  Those run now,
 * their memory resident: outside the set they would be asked to evict first
 * (the holder asks outside the set before inside, those not waiting before those
 * waiting), and their next calls would wait for it to come back.  Measured on an H200:
 * in the DNN mix at 150% resnet50-infer, 0.66 GB that fits beside every other member,
 * stalled 1.2-4.6 s of a 3-8 s run. */
static void admit(struct gpuos_share *g)
{
	uint64_t used = working_set(&g->m[g->holder]);
	for (;;) {
		int pick = -1;
		for (int i = 0; i < GPUOS_SHARE_MEMBERS; i++) {
			const struct gpuos_share_member *m = &g->m[i];
			if (m->pid && (m->waiting || m->resident) && !in_set(g, i) &&
			    used + set_bytes(m) <= g->limit && (pick < 0 || admits_before(m, &g->m[pick])))
				pick = i;
		}
		if (pick < 0)
			return;
		used += set_bytes(&g->m[pick]);
		seat_beside(g, pick);
	}
}

/* Whether waiting member i may join the turn under way beside its holder: the holder's
 * slice is not over, i did not step aside from this turn, and i's working set fits in the
 * limit beside what the set holds or needs (each member's working set or resident bytes,
 * the larger).  Admitted at the turn's start only, a member that began to wait after it
 * waited out the slice though it fitted: on an H200, in the DNN mix at 150%, turns of
 * 0.8-1 s in which an inference member held the GPU alone while resnet50-train, which
 * fitted beside it, waited. */
static int joins_turn(const struct gpuos_share *g, int i, uint64_t now)
{
	int h = g->holder;
	if (h < 0 || h == i || in_set(g, i) || turn_over(g, now) ||
	    (S.aside_holder == h && S.aside_slices == g->m[h].slices))
		return 0;
	uint64_t used = working_set(&g->m[i]);
	for (int k = 0; k < GPUOS_SHARE_MEMBERS; k++)
		if (g->m[k].pid && in_set(g, k))
			used += working_set(&g->m[k]) > g->m[k].resident ? working_set(&g->m[k]) : g->m[k].resident;
	return used <= g->limit;
}

int gpuos_share_acquire(void)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return 0;
	glock(g);
	struct gpuos_share_member *m = &g->m[S.me];
	uint64_t t0 = gpuos_now_ns();
	if (in_set(g, S.me)) {
		if (!turn_over(g, t0) || !others_wait(g)) {
			m->busy++;
			gunlock(g);
			return 0;
		}
		end_turn(g, t0); /* the slice is over and others wait: the set lets go */
		gwake(g);
	}
	if (!m->waiting++)
		m->waiting_since = t0;
	int admitted = 0;
	for (;;) {
		uint64_t now = gpuos_now_ns();
		int h = g->holder;
		if (h == S.me)
			break; /* another thread of this process took it */
		if (m->beside) {
			admitted = 1; /* the new holder admitted this member beside it */
			break;
		}
		if (joins_turn(g, S.me, now)) {
			seat_beside(g, S.me);
			admitted = 1;
			break;
		}
		if ((h < 0 || turn_over(g, now)) && oldest_waiter(g) == S.me) {
			if (h >= 0 || g->held_since)
				g->switches++, S.switch_t0 = now;
			end_turn(g, now);
			g->holder = S.me;
			g->held_since = now;
			m->slices++;
			admit(g);
			gwake(g);
			break;
		}
		uint64_t left = h >= 0 && now - g->held_since < g->slice_ns ? g->slice_ns - (now - g->held_since) : 0;
		gwait(g, left && left < POLL_NS ? left : POLL_NS);
		reap(g);
	}
	if (!--m->waiting)
		m->waiting_since = 0;
	m->wait_ns += gpuos_now_ns() - t0;
	m->busy++;
	int turn = S.switch_t0 != 0 || admitted;
	gunlock(g);
	return turn;
}

int gpuos_share_role(void)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return GPUOS_SHARE_OUT;
	glock(g);
	int role = g->holder == S.me ? GPUOS_SHARE_HOLDER : g->m[S.me].beside ? GPUOS_SHARE_BESIDE : GPUOS_SHARE_OUT;
	gunlock(g);
	return role;
}

void gpuos_share_step_aside(void)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return;
	glock(g);
	struct gpuos_share_member *m = &g->m[S.me];
	if (m->beside) {
		m->beside = 0;
		m->steps_aside++;
		if (g->holder >= 0) {
			S.aside_holder = g->holder;
			S.aside_slices = g->m[g->holder].slices;
		}
		gwake(g);
	}
	gunlock(g);
}

void gpuos_share_unclaim(void)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return;
	glock(g);
	if (g->holder == S.me && g->claim) {
		g->claim = 0;
		gwake(g);
	}
	gunlock(g);
}

void gpuos_share_working_set(uint64_t bytes)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return;
	glock(g);
	g->m[S.me].working_set = bytes;
	gunlock(g);
}

void gpuos_share_done(void)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return;
	glock(g);
	g->m[S.me].busy--;
	if (S.switch_t0) { /* the first call since it took the GPU from another */
		/* from the take, not from the call's start: the wait for the turn is not the
		 * switch's cost (members' wait_ns has it) */
		uint64_t now = gpuos_now_ns(), stall_ns = now - S.switch_t0;
		S.switch_t0 = 0;
		/* the slice counts from here: the switch's moves are not the holder's work */
		if (g->holder == S.me)
			g->held_since = now;
		g->switch_ns += stall_ns;
		g->switch_hist[gpuos_stall_bucket(stall_ns)]++;
	}
	if (!g->m[S.me].busy)
		gwake(g); /* a waiter may take it now */
	gunlock(g);
}

/* ---- the pool ------------------------------------------------------------------------------ */

/* The group's resident bytes as this member sees them: with the holder's claim, unless
 * it is the holder (the lock held). */
static uint64_t used(const struct gpuos_share *g)
{
	return g->resident + (g->holder >= 0 && g->holder != S.me ? g->claim : 0);
}

/* Charge `bytes` to this member if they fit; with `free_only` (a call that does not hold
 * the GPU's turn), only while no member waits for the turn, is asked to evict, or holds
 * the GPU busy making room: their need comes first (the room a holder has just had
 * evicted is its own).  1 if charged. */
static int take(uint64_t bytes, int free_only)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return 1;
	glock(g);
	int holds = g->holder == S.me;
	int ok = used(g) + bytes <= g->limit;
	if (ok && holds) /* what it asked room for is its own now, as far as it takes it */
		g->claim = g->claim > bytes ? g->claim - bytes : 0;
	if (free_only)
		for (int i = 0; ok && i < GPUOS_SHARE_MEMBERS; i++)
			ok = !g->m[i].pid || (!g->m[i].waiting && !g->m[i].release && !(in_set(g, i) && g->m[i].busy));
	if (ok) {
		g->resident += bytes;
		g->m[S.me].resident += bytes;
	}
	gunlock(g);
	return ok;
}

/* (After a fork the child is no member: S.g is NULL, and these do nothing.) */
int gpuos_share_take(uint64_t bytes)
{
	return take(bytes, 0);
}

int gpuos_share_take_free(uint64_t bytes)
{
	return take(bytes, 1);
}

void gpuos_share_give(uint64_t bytes)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return;
	glock(g);
	g->resident -= bytes;
	g->m[S.me].resident -= bytes;
	gwake(g);
	gunlock(g);
}

uint64_t gpuos_share_used(void)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return 0;
	glock(g);
	uint64_t n = used(g);
	gunlock(g);
	return n;
}

void gpuos_share_reserved(int64_t delta)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return;
	glock(g);
	g->m[S.me].reserved += (uint64_t)delta;
	gunlock(g);
}

/* Whether an eviction this member's ask may wait for is under way: any other member's
 * for the holder; for a member beside it, only those outside the set (two members
 * beside the holder, each waiting for the other's eviction with its own lock held,
 * would hold each other until ASK_TIMEOUT_NS: the release thread needs that lock). */
static int waits_on(const struct gpuos_share *g)
{
	int holder = g->holder == S.me;
	for (int i = 0; i < GPUOS_SHARE_MEMBERS; i++)
		if (i != S.me && g->m[i].pid && g->m[i].release && (holder || !in_set(g, i)))
			return 1;
	return 0;
}

int gpuos_share_ask(uint64_t excess, uint64_t want)
{
	return gpuos_share_ask_claim(excess, want, want);
}

int gpuos_share_ask_claim(uint64_t excess, uint64_t want, uint64_t claim)
{
	struct gpuos_share *g = S.g;
	if (!g)
		return 0;
	glock(g);
	reap(g);
	if (!in_set(g, S.me)) { /* only the turn's set asks (gpuos_share.h) */
		gunlock(g);
		return 0;
	}
	/* Outside the set, those not waiting for the GPU first, then those waiting, the latest
	 * first: the order in which their memory will be needed again, farthest first; then,
	 * the holder only, the members beside it. */
	uint64_t asked = 0, before = g->resident;
	int passes = g->holder == S.me ? 3 : 2;
	if (g->holder == S.me)
		g->claim = claim; /* the room made is the holder's: the set's others must not take it */
	for (int pass = 0; pass < passes && asked < excess; pass++) {
		for (;;) {
			int pick = -1;
			for (int i = 0; i < GPUOS_SHARE_MEMBERS; i++) {
				struct gpuos_share_member *m = &g->m[i];
				int kind = in_set(g, i) ? 2 : m->waiting ? 1 : 0;
				if (i == S.me || !m->pid || m->resident <= m->release || kind != pass)
					continue;
				if (pick < 0 || (pass == 1 && m->waiting_since > g->m[pick].waiting_since))
					pick = i;
			}
			if (pick < 0 || asked >= excess)
				break;
			struct gpuos_share_member *m = &g->m[pick];
			uint64_t take = m->resident - m->release;
			if (take > excess - asked)
				take = excess - asked;
			m->release += take;
			asked += take;
		}
	}
	int pending = waits_on(g); /* evictions another of the set asked for free room too */
	if (!asked && !pending) {
		gunlock(g);
		return 0;
	}
	gwake(g);
	uint64_t deadline = gpuos_now_ns() + ASK_TIMEOUT_NS;
	for (;;) {
		pending = waits_on(g);
		if (!pending || used(g) + want <= g->limit || gpuos_now_ns() >= deadline)
			break;
		gwait(g, POLL_NS);
		reap(g);
	}
	g->ask_timeouts += pending && used(g) + want > g->limit;
	int progress = g->resident < before || used(g) + want <= g->limit;
	gunlock(g);
	return progress;
}


