/* The kernels' thread team: a job split in parts, claimed one at a time by the calling thread and
   by helper threads, so the caller never waits for a helper the OS has not run yet.

   An OpenMP parallel region ends at a barrier every thread of the team must reach. On a pool whose
   cores also run other processes (a colocated pool shares its two cores with Triton, the
   orchestrator and the text steps, which relay every token), one thread of the team is often
   descheduled for a while, and the region, hence every projection of a decode step, waits for it.
   Here the caller starts on the parts at once and, when none is left to claim, waits only for the
   parts a helper has already claimed; a helper that wakes late finds the job done and sleeps again.

   A job's claim word holds its generation (32 bits), how many helpers joined it (8) and its next
   unclaimed part (24). A helper claims a part by one compare-and-swap on the word it read, so a claim
   can only land on the job it read the fields of: before the caller rewrites the fields for a new job
   it closes the word (next = CLOSED), which fails every claim on the old one. The first claim of a
   helper also takes a slot (1, 2, ... up to threads - 1; the caller is 0), the index of its scratch.

   Helpers spin briefly for the next job (DISAGG_TEAM_SPIN_US microseconds, 100 by default: more
   than the gap between two kernels of a step), then sleep on a futex. Measured on SmolLM2 on two
   cores: with 20 us a helper often slept between kernels and an engine alone stepped 10-20 % slower
   than on OpenMP; with 100 us it matched OpenMP, and inside Triton 100 and 20 did not differ. They are created on first use, from the
   calling thread, so they inherit its CPU affinity; a fork's child starts without any. One caller at a
   time: a second caller meanwhile runs its job alone. Which thread computes a part changes no bits. */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "team.h"

#define MAX_HELPERS 63
#define NEXT_BITS 24
#define CLOSED ((1u << NEXT_BITS) - 1u)
#define GEN(w) ((uint32_t)((w) >> 32))
#define JOINED(w) ((uint32_t)(((w) >> NEXT_BITS) & 0xffu))
#define NEXT(w) ((uint32_t)((w)&CLOSED))
#define WORD(gen, joined, next) (((uint64_t)(gen) << 32) | ((uint64_t)(joined) << NEXT_BITS) | (uint64_t)(next))

static _Atomic uint64_t claim = WORD(0, 0, CLOSED);
static _Atomic(team_part) job_fn;
static _Atomic(void *) job_ctx;
static _Atomic int64_t job_parts, job_threads;
static _Atomic int64_t done;        /* parts of the current job finished */
static _Atomic uint32_t bell;       /* rung once per job: the futex the helpers sleep on */
static _Atomic int32_t sleepers;    /* helpers in futex_wait */
static _Atomic int32_t helpers;     /* helper threads running */
static _Atomic int64_t spin_ns = -1;
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t forks = PTHREAD_ONCE_INIT;

static inline void relax(void) { __builtin_ia32_pause(); }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int64_t spin_budget(void) {
    int64_t ns = atomic_load_explicit(&spin_ns, memory_order_relaxed);
    if (ns < 0) {
        const char *configured = getenv("DISAGG_TEAM_SPIN_US");
        ns = configured ? (int64_t)(atof(configured) * 1000.0) : 100000;
        if (ns < 0) ns = 0;
        atomic_store_explicit(&spin_ns, ns, memory_order_relaxed);
    }
    return ns;
}

/* Claim and run parts of the job `seen` belongs to; `slot` is -1 until this thread joins it. */
static void work(uint64_t seen, int64_t slot) {
    for (;;) {
        const uint64_t w = atomic_load(&claim);
        if (GEN(w) != GEN(seen) || NEXT(w) == CLOSED) return;
        const team_part fn = atomic_load_explicit(&job_fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&job_ctx, memory_order_relaxed);
        const int64_t parts = atomic_load_explicit(&job_parts, memory_order_relaxed);
        const int64_t threads = atomic_load_explicit(&job_threads, memory_order_relaxed);
        if ((int64_t)NEXT(w) >= parts) return;
        const int joining = slot < 0;
        if (joining && (int64_t)JOINED(w) + 1 >= threads) return; /* the job has its threads */
        uint64_t expected = w;
        const uint64_t taken = WORD(GEN(w), JOINED(w) + (uint32_t)joining, NEXT(w) + 1u);
        if (!atomic_compare_exchange_strong(&claim, &expected, taken)) continue; /* the word moved: read again */
        if (joining) slot = (int64_t)JOINED(w) + 1; /* the fields read above are this job's: it was open */
        fn(ctx, (int64_t)NEXT(w), slot);
        atomic_fetch_add(&done, 1);
    }
}

static void *helper(void *unused) {
    (void)unused;
    uint32_t heard = atomic_load(&bell);
    for (;;) {
        const uint64_t w = atomic_load(&claim);
        work(w, -1);
        const int64_t until = now_ns() + spin_budget();
        while (atomic_load(&bell) == heard && now_ns() < until) relax();
        if (atomic_load(&bell) == heard) {
            atomic_fetch_add(&sleepers, 1);
            syscall(SYS_futex, &bell, FUTEX_WAIT_PRIVATE, heard, NULL, NULL, 0);
            atomic_fetch_sub(&sleepers, 1);
        }
        heard = atomic_load(&bell);
    }
    return NULL;
}

static void forked_child(void) { /* the helpers were not copied: start anew */
    atomic_store(&helpers, 0);
    atomic_store(&sleepers, 0);
    atomic_store(&claim, WORD(0, 0, CLOSED));
    pthread_mutex_init(&caller, NULL);
}

static void watch_forks(void) { pthread_atfork(NULL, NULL, forked_child); }

static void hire(int64_t wanted) {
    pthread_once(&forks, watch_forks);
    if (wanted > MAX_HELPERS) wanted = MAX_HELPERS;
    while (atomic_load(&helpers) < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, helper, NULL);
        pthread_attr_destroy(&attr);
        if (failed) return; /* fewer helpers: the caller does more parts */
        atomic_fetch_add(&helpers, 1);
    }
}

void team_run(team_part fn, void *ctx, int64_t parts, int64_t threads) {
    if (parts <= 0) return;
    if (threads <= 1 || parts == 1 || parts >= CLOSED || pthread_mutex_trylock(&caller) != 0) {
        for (int64_t p = 0; p < parts; p++) fn(ctx, p, 0);
        return;
    }
    hire(threads - 1);
    const uint32_t gen = GEN(atomic_load(&claim)) + 1u;
    atomic_store(&claim, WORD(gen, 0, CLOSED)); /* no claim on the last job can land from here on */
    atomic_store_explicit(&job_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&job_ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&job_parts, parts, memory_order_relaxed);
    atomic_store_explicit(&job_threads, threads, memory_order_relaxed);
    atomic_store(&done, 0);
    const uint64_t open = WORD(gen, 0, 0);
    atomic_store(&claim, open);
    atomic_fetch_add(&bell, 1u);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &bell, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    work(open, 0);
    while (atomic_load(&done) < parts) relax(); /* parts a helper claimed and is computing */
    pthread_mutex_unlock(&caller);
}

int64_t team_helpers(void) { return atomic_load(&helpers); }
