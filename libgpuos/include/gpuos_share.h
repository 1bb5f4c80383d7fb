/* SPDX-License-Identifier: MIT */
/*
 * gpuos_share.h - a group of processes sharing one pool of GPU memory
 * (`gpuos run --share NAME --gpu-memory LIMIT`, libgpuos/src/share.c).
 *
 * The group is a file in shared memory, /dev/shm/gpuos-share-UID-NAME (mode 0600: a
 * group is one user's), mapped by every member: struct gpuos_share below.  NAME is
 * 1..GPUOS_SHARE_NAME_MAX of [A-Za-z0-9_.-] (`gpuos run` checks it).  A process joins at
 * its first movable allocation, under an exclusive flock(2) of the file: the first one
 * (or the first after every member has gone) sets the limit and the time slice; a later
 * one with another limit is refused (`gpuos run` says so before starting it).
 *
 * The rules, all under `mu` (a robust, process-shared mutex; waiters sleep on `wake`):
 *   - resident = the sum of the members' resident bytes <= limit.  A member maps memory
 *     only after adding it to both; it subtracts what it unmaps.
 *   - A call whose memory is resident goes on.  One that needs memory made resident
 *     goes on without the GPU's turn if the pool has free room for it while no member
 *     waits for the turn, is asked to evict, or is the holder busy making room: members
 *     run side by side while their memory fits together.  Any other waits for the turn.
 *   - The GPU's turn is held by one member (holder; -1: none) and the members admitted
 *     `beside` it: the turn's set.  A waiting member takes the turn when no one holds
 *     it, or when the holder has held it for slice_ns (counted from when its first
 *     call's memory was in) and no call of the set is busy making memory resident, the
 *     one waiting longest first.  Taking it, it admits beside itself the other waiting
 *     members, longest waiting first, whose working sets fit in the limit together
 *     with its own and those admitted before them, then the members that do not wait
 *     but have memory resident (they run on it now), the most first, whose resident
 *     bytes fit too: members whose memory fits together take their turns together (a member's working_set is the bytes its calls needed
 *     over its last two turns and between them, as it took its next one; its
 *     reservations until then).  A member of the set whose slice is over while members outside it wait
 *     ends the turn for the whole set at its next call.
 *   - Only the set asks others to evict (below).  The holder asks the members outside
 *     the set first (their memory is used after the turn, the set's during it: the
 *     known future), those not waiting before those waiting, then the members beside
 *     it; a member beside the holder asks only those outside the set.  Asking sets
 *     their `release`, and each member's release thread evicts that much of its memory
 *     to host memory and sets it to 0.  When the others have nothing left, the asker
 *     evicts its own.  The room the holder asks for is its `claim` until it has taken
 *     it: no other member takes it meanwhile.  At a turn's start the holder asks at once
 *     for the room of its first call and of the turn's batch (what it used in its last
 *     turn), claims all of it, and takes it part by part as the evictions free it (each
 *     member gives back an evicted allocation's room as soon as its copy out has ended),
 *     copying each part in meanwhile.  A member beside the holder that still
 *     lacks room (its working
 *     set grew) leaves the set (steps_aside) and waits for a turn of its own.  No two
 *     askers ask each other, and one beside the holder waits only for evictions by
 *     members outside the set, so none waits for another's evictions in a cycle.
 *   - A member that exits leaves: its slot is freed and its bytes subtracted; the last
 *     one removes the file (under the flock; a joiner that opened it before checks,
 *     under the flock, that it is still the file at that path).  A member
 *     that died without leaving (its /proc entry gone, a zombie, or another process
 *     with its pid) is reaped by whoever looks next: the same, counted in `reaped`.
 *     (The driver frees a dead process's memory as it exits; a member whose mapping
 *     fails for lack of GPU memory retries for a while.)  Members must see each other in
 *     /proc: one pid namespace.
 * Readers that do not take the lock (`gpuos mem stats GROUP`) may see a moment's
 * inconsistency between fields; they read under a shared flock, so never a file half made
 * (an empty one, or one whose magic is 0, is no group yet).  Everything below `mu` is for libgpuos only.
 */
#ifndef GPUOS_SHARE_H
#define GPUOS_SHARE_H

#include <pthread.h>
#include <stdint.h>

#include "gpuos_agent.h" /* GPUOS_STALL_BUCKETS */

#define GPUOS_SHARE_MAGIC 0x45524853u /* "SHRE", written last at creation */
#define GPUOS_SHARE_VERSION 3u
#define GPUOS_SHARE_MEMBERS 64
#define GPUOS_SHARE_NAME_MAX 64
#define GPUOS_SHARE_PATH "/dev/shm/gpuos-share-" /* + uid "-" name */

struct gpuos_share_member {
	uint32_t pid;             /* 0: a free slot */
	uint16_t waiting;         /* its calls waiting for the GPU */
	uint16_t busy;            /* its calls past the wait, making their memory resident */
	uint64_t start_time;      /* /proc/PID/stat's starttime: a reused pid is not this member */
	uint64_t resident;        /* its resident bytes (counted in the group's) */
	uint64_t reserved;        /* its movable allocations' reservations */
	uint64_t release;         /* bytes the holder asked it to evict (0: none) */
	uint64_t waiting_since;   /* CLOCK_MONOTONIC ns its oldest waiting call began */
	uint64_t slices;          /* times it took the GPU */
	uint64_t held_ns;         /* time it held the GPU, ended slices only */
	uint64_t released_bytes;  /* evicted at others' requests */
	uint64_t wait_ns;         /* time its calls waited for the GPU */
	uint64_t working_set;     /* bytes its calls needed since the turn before its last
				   * began, as it began its next one (0: none yet; its
				   * reservations count) */
	uint64_t beside_slices;   /* times it was admitted to a turn beside the holder */
	uint32_t beside;          /* 1: admitted to the current turn beside the holder */
	uint32_t steps_aside;     /* times it left a turn it was admitted to, lacking room */
};

struct gpuos_share {
	uint32_t magic;           /* GPUOS_SHARE_MAGIC once initialised */
	uint32_t version;         /* GPUOS_SHARE_VERSION */
	uint32_t size;            /* sizeof(struct gpuos_share) */
	int32_t holder;           /* member index holding the GPU; -1: none */
	uint64_t limit;           /* bytes */
	uint64_t slice_ns;        /* a holder keeps the GPU at least this long when others wait */
	uint64_t resident;        /* bytes, all members */
	uint64_t held_since;      /* CLOCK_MONOTONIC ns the holder took it, or its first call's
				   * memory was in after a switch: its slice counts from there */
	uint64_t switches;        /* the GPU went from one member to another */
	uint64_t switch_ns;       /* from each switch to its new holder's first call having its memory
				   * resident (the wait for the turn is the members' wait_ns) */
	uint64_t reaped;          /* members found dead */
	uint64_t beside_turns;    /* members admitted beside a holder, in all */
	uint64_t claim;           /* bytes the holder asked others to make room for: no other
				   * member may take them until the holder has (or its turn ends) */
	uint64_t ask_timeouts;    /* asks whose evictions were not all done in ASK_TIMEOUT_NS */
	uint64_t switch_hist[GPUOS_STALL_BUCKETS]; /* those first calls, by stall: [2^i, 2^(i+1)) us */
	struct gpuos_share_member m[GPUOS_SHARE_MEMBERS];
	pthread_mutex_t mu;
	uint32_t wake;            /* futex word: bumped and woken when anything changes (a
				   * process-shared condition variable would hang on members
				   * that died waiting on it) */
};

#endif /* GPUOS_SHARE_H */
