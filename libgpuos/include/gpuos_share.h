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
 *   - One member holds the GPU at a time (holder; -1: none): only it may ask the others
 *     to evict (below).  A waiting member takes the
 *     GPU when no one holds it, or when the holder has held it for slice_ns (counted from
 *     when its first call's memory was in) and none of its calls is busy making memory
 *     resident, the one waiting longest first.  A holder
 *     whose slice is over while others wait lets it go at its next call.
 *   - A holder that needs room asks the others first (their memory is used after its
 *     slice, its own during it: the known future): it sets their `release`, and each
 *     member's release thread evicts that much of its memory to host memory and sets
 *     it to 0.  When the others have nothing left, the holder evicts its own.
 *   - A member that exits leaves: its slot is freed and its bytes subtracted; the last
 *     one removes the file (under the flock; a joiner that opened it before checks,
 *     under the flock, that it is still the file at that path).  A member
 *     that died without leaving (its /proc entry gone, a zombie, or another process
 *     with its pid) is reaped by whoever looks next: the same, counted in `reaped`.
 *     (The driver frees a dead process's memory as it exits; a member whose mapping
 *     fails for lack of GPU memory retries for a while.)  Members must see each other in
 *     /proc: one pid namespace.
 * Readers that do not take the lock (`gpuos mem stats GROUP`) may see a moment's
 * inconsistency between fields.  Everything below `mu` is for libgpuos only.
 */
#ifndef GPUOS_SHARE_H
#define GPUOS_SHARE_H

#include <pthread.h>
#include <stdint.h>

#include "gpuos_agent.h" /* GPUOS_STALL_BUCKETS */

#define GPUOS_SHARE_MAGIC 0x45524853u /* "SHRE", written last at creation */
#define GPUOS_SHARE_VERSION 1u
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
	uint64_t switch_hist[GPUOS_STALL_BUCKETS]; /* those first calls, by stall: [2^i, 2^(i+1)) us */
	struct gpuos_share_member m[GPUOS_SHARE_MEMBERS];
	pthread_mutex_t mu;
	uint32_t wake;            /* futex word: bumped and woken when anything changes (a
				   * process-shared condition variable would hang on members
				   * that died waiting on it) */
};

#endif /* GPUOS_SHARE_H */
