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
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
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
static _Atomic int32_t borrowed_count; /* borrowed helpers running (on another pool's core, below) */
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

/* Claim one part of the job `seen` belongs to: 1 with its fields in `fn`, `ctx`, `part`, and `*slot`
   set on the thread's first claim of the job (it is -1 until then); 0 when the job has no part left
   for this thread (done, closed, replaced, or its threads all joined). */
static int claim_part(uint64_t seen, int64_t *slot, team_part *fn, void **ctx, int64_t *part) {
    for (;;) {
        const uint64_t w = atomic_load(&claim);
        if (GEN(w) != GEN(seen) || NEXT(w) == CLOSED) return 0;
        *fn = atomic_load_explicit(&job_fn, memory_order_relaxed);
        *ctx = atomic_load_explicit(&job_ctx, memory_order_relaxed);
        const int64_t parts = atomic_load_explicit(&job_parts, memory_order_relaxed);
        const int64_t threads = atomic_load_explicit(&job_threads, memory_order_relaxed);
        if ((int64_t)NEXT(w) >= parts) return 0;
        const int joining = *slot < 0;
        if (joining && (int64_t)JOINED(w) + 1 >= threads) return 0; /* the job has its threads */
        uint64_t expected = w;
        const uint64_t taken = WORD(GEN(w), JOINED(w) + (uint32_t)joining, NEXT(w) + 1u);
        if (!atomic_compare_exchange_strong(&claim, &expected, taken)) continue; /* the word moved: read again */
        if (joining) *slot = (int64_t)JOINED(w) + 1; /* the fields read above are this job's: it was open */
        *part = (int64_t)NEXT(w);
        return 1;
    }
}

/* Claim and run parts of the job `seen` belongs to; `slot` is -1 until this thread joins it. */
static void work(uint64_t seen, int64_t slot) {
    team_part fn;
    void *ctx;
    int64_t part;
    while (claim_part(seen, &slot, &fn, &ctx, &part)) {
        fn(ctx, part, slot);
        atomic_fetch_add(&done, 1);
    }
}

/* Wait for the bell to ring past `heard` (the next job): spin for the spin budget, then sleep on it.
   With `word`, only while `*word & mask` holds, and asleep at most `timeout_ns` (a borrowed helper's
   loan ends without ringing the bell); without, asleep until the bell rings. */
static void await_job(uint32_t heard, _Atomic uint32_t *word, uint32_t mask, int64_t timeout_ns) {
    const int64_t until = now_ns() + spin_budget();
#define STILL (atomic_load(&bell) == heard && (word == NULL || (atomic_load(word) & mask)))
    while (STILL && now_ns() < until) relax();
    if (STILL) {
        struct timespec t = {timeout_ns / 1000000000, timeout_ns % 1000000000};
        atomic_fetch_add(&sleepers, 1);
        syscall(SYS_futex, &bell, FUTEX_WAIT_PRIVATE, heard, word ? &t : NULL, NULL, 0);
        atomic_fetch_sub(&sleepers, 1);
    }
#undef STILL
}

static void *helper(void *unused) {
    (void)unused;
    for (;;) {
        const uint32_t heard = atomic_load(&bell);
        work(atomic_load(&claim), -1);
        await_job(heard, NULL, 0, 0);
    }
    return NULL;
}

static void forked_child(void) { /* the helpers were not copied: start anew */
    atomic_store(&helpers, 0);
    atomic_store(&borrowed_count, 0);
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


/* ---------------------------------------------------------------- loans of another pool's core

   A pool (the lender, a decode pool) may lend one of its cores to another (the borrower, a prefill
   pool) while it does not need it. They share one loan segment per lent core (64 bytes of shared
   memory) whose word says LENT (the lender does not need the core now), WANT (the borrower has prompt
   work), BUSY (a borrowed helper is inside a part) and WAITER (the lender waits for that part).

   The borrower runs one borrowed helper thread per lent core, pinned to it (at SCHED_IDLE if asked). It claims
   parts of the team's jobs like any helper, but one part at a time and only after marking the word
   BUSY while it says LENT: the lender takes the core back by clearing LENT and then waits, asleep on
   the word (a process-shared futex), for at most the one part in flight. A helper that finds the word
   not both LENT and WANT sleeps on it; the lender's lend and the borrower's want wake it. */

#define LOAN_LENT 1u
#define LOAN_BUSY 2u
#define LOAN_WAITER 4u
#define LOAN_WANT 8u
#define MAX_BORROWED 8

struct loan_segment {
    _Atomic uint32_t word;
    uint32_t reserved;
    _Atomic uint64_t borrowed_ns; /* time borrowed helpers spent computing parts on the core */
    _Atomic uint64_t parts;       /* parts they computed */
    _Atomic uint64_t waits;       /* reclaims that found a part in flight */
    _Atomic uint64_t wait_ns;     /* time those reclaims waited for it */
    char lender[20];              /* the lending pool's name (written by it, for metrics) */
    _Atomic int32_t borrower;     /* the borrowing process's pid, for a lender to see it is gone */
};

struct borrowed {
    _Atomic(struct loan_segment *) segment; /* NULL: a free slot, or its helper is told to end */
    int64_t cpu;
    _Atomic int32_t tid; /* the helper's thread id while it runs; 0 before it starts and after it ends */
    int32_t idle;        /* asked for: SCHED_IDLE; then whether it runs at it */
};

static struct borrowed borrowed[MAX_BORROWED];

static long futex_shared(_Atomic uint32_t *word, int op, uint32_t value, int64_t timeout_ns) {
    struct timespec t = {timeout_ns / 1000000000, timeout_ns % 1000000000};
    return syscall(SYS_futex, word, op, value, timeout_ns >= 0 ? &t : NULL, NULL, 0);
}

static void release_part(struct loan_segment *s) {
    const uint32_t old = atomic_fetch_and(&s->word, ~(LOAN_BUSY | LOAN_WAITER));
    if (old & LOAN_WAITER) futex_shared(&s->word, FUTEX_WAKE, INT_MAX, -1);
}

/* Parts of the job `seen` belongs to, one at a time, each only while the word says LENT. */
static void borrowed_work(struct loan_segment *s, uint64_t seen) {
    int64_t slot = -1, part;
    team_part fn;
    void *ctx;
    for (;;) {
        uint32_t v = atomic_load(&s->word);
        if (!(v & LOAN_LENT) || (v & LOAN_BUSY)) return;
        if (!atomic_compare_exchange_weak(&s->word, &v, v | LOAN_BUSY)) continue;
        const int claimed = claim_part(seen, &slot, &fn, &ctx, &part);
        if (claimed) {
            const int64_t start = now_ns();
            fn(ctx, part, slot);
            atomic_fetch_add(&s->borrowed_ns, (uint64_t)(now_ns() - start));
            atomic_fetch_add(&s->parts, 1);
            atomic_fetch_add(&done, 1);
        }
        release_part(s);
        if (!claimed) return;
    }
}

static void *borrowed_helper(void *arg) {
    struct borrowed *b = arg;
    struct sched_param idle = {0};
    if (b->idle) b->idle = syscall(SYS_sched_setscheduler, 0, SCHED_IDLE, &idle) == 0;
    atomic_store(&b->tid, (int32_t)syscall(SYS_gettid));
    syscall(SYS_futex, &b->tid, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    for (;;) {
        struct loan_segment *s = atomic_load(&b->segment);
        if (s == NULL) break; /* retired */
        const uint32_t v = atomic_load(&s->word);
        if ((v & (LOAN_LENT | LOAN_WANT)) != (LOAN_LENT | LOAN_WANT)) {
            futex_shared(&s->word, FUTEX_WAIT, v, 100000000); /* bounded: the segment may be replaced */
            continue;
        }
        const uint32_t heard = atomic_load(&bell);
        borrowed_work(s, atomic_load(&claim));
        await_job(heard, &s->word, LOAN_LENT, 1000000); /* the word again within a millisecond */
    }
    atomic_fetch_sub(&borrowed_count, 1);
    atomic_store(&b->tid, 0);
    syscall(SYS_futex, &b->tid, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    return NULL;
}

int64_t loan_segment_bytes(void) { return (int64_t)sizeof(struct loan_segment); }

/* Borrower: start a helper pinned to `cpu` (at SCHED_IDLE if `idle`) that works while `segment` says
   LENT. Returns its index
   (0 ..), or -errno: EINVAL for a core this process may not run on, ENOSPC past MAX_BORROWED. */
int64_t team_borrow(struct loan_segment *segment, int64_t cpu, int64_t idle) {
    pthread_once(&forks, watch_forks);
    if (cpu < 0 || cpu >= CPU_SETSIZE || segment == NULL) return -EINVAL;
    int64_t index = 0;
    while (index < MAX_BORROWED && (atomic_load(&borrowed[index].segment) || atomic_load(&borrowed[index].tid)))
        index++;
    if (index >= MAX_BORROWED) return -ENOSPC;
    struct borrowed *b = &borrowed[index];
    b->cpu = cpu;
    b->idle = idle != 0;
    atomic_store(&segment->borrower, (int32_t)getpid());
    atomic_store(&b->segment, segment);
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET((int)cpu, &set);
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setaffinity_np(&attr, sizeof(set), &set);
    atomic_fetch_add(&borrowed_count, 1);
    const int failed = pthread_create(&thread, &attr, borrowed_helper, b);
    pthread_attr_destroy(&attr);
    if (failed) {
        atomic_fetch_sub(&borrowed_count, 1);
        atomic_store(&b->segment, NULL);
        return -failed;
    }
    int32_t tid;
    while ((tid = atomic_load(&b->tid)) == 0) syscall(SYS_futex, &b->tid, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
    return index;
}

/* End borrowed helper `index` and wait until it has: its segment may be unmapped afterwards. */
int64_t team_unborrow(int64_t index) {
    if (index < 0 || index >= MAX_BORROWED) return -EINVAL;
    struct borrowed *b = &borrowed[index];
    struct loan_segment *s = atomic_exchange(&b->segment, NULL);
    if (s == NULL) return -EINVAL;
    futex_shared(&s->word, FUTEX_WAKE, INT_MAX, -1);
    atomic_fetch_add(&bell, 1u); /* a helper asleep on the bell looks again */
    syscall(SYS_futex, &bell, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    int32_t tid;
    while ((tid = atomic_load(&b->tid)) != 0) syscall(SYS_futex, &b->tid, FUTEX_WAIT_PRIVATE, tid, NULL, NULL, 0);
    return 0;
}

/* The borrowed helper `index`'s thread id (0 for none), and whether it runs at SCHED_IDLE. */
int64_t team_borrowed_tid(int64_t index) {
    if (index < 0 || index >= MAX_BORROWED) return 0;
    return atomic_load(&borrowed[index].tid);
}

int64_t team_borrowed_idle(int64_t index) {
    if (index < 0 || index >= MAX_BORROWED) return 0;
    return borrowed[index].idle;
}

/* Point borrowed helper `index` at another segment (the lender's was made anew). */
int64_t team_borrow_segment(int64_t index, struct loan_segment *segment) {
    if (index < 0 || index >= MAX_BORROWED || segment == NULL || !atomic_load(&borrowed[index].segment)) return -EINVAL;
    atomic_store(&segment->borrower, (int32_t)getpid());
    atomic_store(&borrowed[index].segment, segment);
    return 0;
}

int64_t team_borrowed(void) { return atomic_load(&borrowed_count); }

/* Borrower: say whether prompt work waits (the lender lends only then, and a helper works only then). */
int64_t loan_want(struct loan_segment *s, int64_t on) {
    const uint32_t old = on ? atomic_fetch_or(&s->word, LOAN_WANT) : atomic_fetch_and(&s->word, ~LOAN_WANT);
    if (((old & LOAN_WANT) != 0) != (on != 0)) futex_shared(&s->word, FUTEX_WAKE, INT_MAX, -1);
    return 0;
}

/* Lender: lend the core (wakes a helper that waits for it). */
int64_t loan_lend(struct loan_segment *s) {
    const uint32_t old = atomic_fetch_or(&s->word, LOAN_LENT);
    if (!(old & LOAN_LENT)) futex_shared(&s->word, FUTEX_WAKE, INT_MAX, -1);
    return 0;
}

/* Lender: take the core back. Returns once the part in flight, if any, has ended: the nanoseconds
   waited for it (0 when none was), or -1 when it is still in flight after `timeout_ns` (the caller
   looks whether its borrower still lives, and calls again). */
int64_t loan_reclaim(struct loan_segment *s, int64_t timeout_ns) {
    uint32_t v = atomic_fetch_and(&s->word, ~LOAN_LENT);
    if (!(v & LOAN_BUSY)) return 0;
    const int64_t start = now_ns(), until = start + timeout_ns;
    for (;;) {
        v = atomic_load(&s->word);
        if (!(v & LOAN_BUSY)) break;
        if (!(v & LOAN_WAITER)) {
            if (!atomic_compare_exchange_weak(&s->word, &v, v | LOAN_WAITER)) continue;
            v |= LOAN_WAITER;
        }
        const int64_t left = until - now_ns();
        if (left <= 0) return -1;
        futex_shared(&s->word, FUTEX_WAIT, v, left);
    }
    const int64_t waited = now_ns() - start;
    atomic_fetch_add(&s->waits, 1);
    atomic_fetch_add(&s->wait_ns, (uint64_t)waited);
    return waited;
}

/* Lender: its borrower died inside a part: nothing is in flight any more. */
int64_t loan_abandoned(struct loan_segment *s) {
    atomic_fetch_and(&s->word, ~(LOAN_BUSY | LOAN_WAITER | LOAN_WANT));
    return 0;
}

/* Lender: wait, lent, until the borrower wants the core no more (returns 0) or `timeout_ns` has
   passed (returns 1). */
int64_t loan_await(struct loan_segment *s, int64_t timeout_ns) {
    const int64_t until = now_ns() + timeout_ns;
    for (;;) {
        const uint32_t v = atomic_load(&s->word);
        if (!(v & LOAN_WANT)) return 0;
        const int64_t left = until - now_ns();
        if (left <= 0) return 1;
        futex_shared(&s->word, FUTEX_WAIT, v, left);
    }
}

uint32_t loan_state(struct loan_segment *s) { return atomic_load(&s->word); }

void team_run(team_part fn, void *ctx, int64_t parts, int64_t threads) {
    if (parts <= 0) return;
    if (threads <= 1 || parts == 1 || parts >= CLOSED || pthread_mutex_trylock(&caller) != 0) {
        for (int64_t p = 0; p < parts; p++) fn(ctx, p, 0);
        return;
    }
    const int64_t own = threads - 1 - atomic_load(&borrowed_count); /* borrowed helpers join as well */
    hire(own > 0 ? own : 0);
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
