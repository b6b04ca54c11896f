/*
 * spare.c -- libinstride_local: a new file made by a helper thread while the CPU is idle.
 *
 * A stream that keeps every frame writes each into a new file, and a node that keeps every
 * fetched copy receives each into one; allocating their pages (on a VM that gives free memory
 * back to its host, a host fault per page: ~0.7 ms for 644 KiB) is done ahead, by this helper
 * (instride/store/spare.py says why, and what it changed).
 * The helper is a native thread at SCHED_IDLE: it runs only when no other thread wants the
 * CPU. A Python thread would not do -- it must hold the GIL to return from the system call,
 * and a starved idle thread holding the GIL stops the producer.
 *
 * It can also prefault a mapping of the process first (isl_spare_start_populating): the
 * producer's mapping of the next frame's file, mapped without MAP_POPULATE, so that the ~70 µs
 * of page-table work after a publication happen while the CPU is idle instead of while the
 * frame's server and consumer need it. Only page tables change (MADV_POPULATE_WRITE: no byte
 * is written), and the producer unmaps that mapping only after isl_spare_settle: a populate
 * under way is waited for (the helper raised to a normal thread meanwhile, so that a busy CPU
 * does not keep it, and the caller, waiting), one not started is called off. Raising a thread
 * out of SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE that allows its nice value (Linux's
 * can_nice; an unprivileged user on a cluster node usually has neither): where it is not
 * allowed, isl_spare_prefault_safe says so and the caller fills its mappings itself -- a
 * starved idle helper in the middle of a prefault (holding the process's mmap_lock, too)
 * could keep the producer waiting as long as other threads keep the CPU busy.
 *
 * Exported: isl_spare_start, isl_spare_start_populating, isl_spare_prefault_safe,
 * isl_spare_ready, isl_spare_populated, isl_spare_settle, isl_spare_take, isl_spare_drop,
 * isl_spare_yield_to.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#define ISL_EXPORT __attribute__((visibility("default")))

enum { MAKING, MADE, DROPPED };
/* the prefault's phases: asked for, under way, over (done, failed or never asked), called off */
enum { POP_ASKED, POP_RUNNING, POP_OVER, POP_OFF };

typedef struct {
    atomic_int state;
    atomic_int pop;   /* POP_* */
    int populated;    /* 1: the mapping's page tables were filled */
    void *pop_addr;   /* the mapping to prefault (or NULL) */
    atomic_int tid;   /* the helper's thread id, once it runs */
    size_t pop_len;
    int fd;  /* the file, once MADE (-1: failed) */
    int err; /* errno of the failure */
    long long size;
    char path[4096]; /* the directory */
} spare;

static void forget(spare *s) {
    if (s->fd >= 0)
        close(s->fd); /* (nameless: its pages go with it) */
    free(s);
}

/* The count of this process's receives under way (isl_spare_yield_to; NULL: none given). A
 * helper writes while none is: a file made ahead has its pages written twice (zeros, then the
 * bytes), and beside a transfer the zeros take the memory bandwidth the transfer needs (STMV
 * frames fetched one after the other into new files: 0.58-0.81 of raw TCP with files made
 * ahead beside the transfers, 0.99-1.10 without any). Between transfers -- the pauses of a
 * stream read as it is written, from QUIET_NS after a receive -- it writes as before. */
static int64_t *volatile receiving;

/* A pause shorter than this after a receive is not one: the next transfer is on its way
 * (fetches one after the other leave ~1 ms between them; a stream read as it is written,
 * its frame period less a transfer). */
#define QUIET_NS 2000000LL

/* Have helpers wait while receiving[0] (this process's receives under way, counted by the
 * TCP and UCX engines) is above 0, and until QUIET_NS after the last one ended (receiving[1],
 * CLOCK_MONOTONIC ns). */
ISL_EXPORT void isl_spare_yield_to(int64_t *count) { receiving = count; }

static int receives_near(const int64_t *busy) {
    if (__atomic_load_n(&busy[0], __ATOMIC_ACQUIRE) > 0)
        return 1;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    int64_t now = (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
    return now - __atomic_load_n(&busy[1], __ATOMIC_RELAXED) < QUIET_NS;
}

/* Write size zero bytes into fd: every page allocated *and touched* (a tmpfs page that is only
 * fallocate'd is cleared -- and, on a VM, faulted in the host -- at its first use, which would
 * be the producer's write). Only the new file's own lock is taken: nothing the producer needs.
 * Waits, before each piece, while a receive of this process is under way or ended moments
 * ago (see receiving). */
static int fill(int fd, long long size) {
    static const char zeros[64 * 1024];
    for (long long at = 0; at < size;) {
        int64_t *busy = receiving;
        while (busy != NULL && receives_near(busy)) {
            struct timespec ms = {0, 1000000}; /* (at SCHED_IDLE: no core is kept from work) */
            nanosleep(&ms, NULL);
        }
        size_t n = size - at < (long long)sizeof zeros ? (size_t)(size - at) : sizeof zeros;
        ssize_t w = pwrite(fd, zeros, n, (off_t)at);
        if (w == 0)
            errno = ENOSPC; /* (never for a regular file; not a reason to loop forever) */
        if (w == 0 || (w < 0 && errno != EINTR))
            return -1;
        if (w > 0)
            at += w;
    }
    return 0;
}

static void *make(void *arg) {
    spare *s = arg;
    struct sched_param none = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &none); /* (set already, or best effort) */
    atomic_store(&s->tid, (int)gettid());
    int asked = POP_ASKED;
    if (atomic_compare_exchange_strong(&s->pop, &asked, POP_RUNNING)) {
        s->populated = madvise(s->pop_addr, s->pop_len, MADV_POPULATE_WRITE) == 0;
        atomic_store(&s->pop, POP_OVER);
        /* (isl_spare_settle may have raised it to finish the prefault: idle again) */
        pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
    }
    /* a file without a name in the directory: nothing is left behind if this process dies
     * or drops it; the taker gives it a name (linkat through /proc/self/fd) */
    int fd = open(s->path, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0)
        s->err = errno; /* (a file system without O_TMPFILE: no files made ahead) */
    else if (fill(fd, s->size) != 0) {
        s->err = errno;
        close(fd);
        fd = -1;
    }
    s->fd = fd;
    int expected = MAKING;
    if (!atomic_compare_exchange_strong(&s->state, &expected, MADE))
        forget(s); /* dropped meanwhile: nobody will take it */
    return NULL;
}

/* Start making a file without a name in the directory dir, of size bytes, its pages allocated.
 * Returns a handle for isl_spare_ready / _take / _drop, or NULL (errno) if no thread started. */
static void *start(const char *dir, long long size, void *pop_addr, size_t pop_len);

ISL_EXPORT void *isl_spare_start(const char *dir, long long size) {
    return start(dir, size, NULL, 0);
}

/* The same, and first prefault the process's mapping [addr, addr + len) (its page tables
 * filled, writable: MADV_POPULATE_WRITE); isl_spare_populated says whether it was. The
 * caller must call isl_spare_settle (or _take, or _drop) before it unmaps that range. */
ISL_EXPORT void *isl_spare_start_populating(const char *dir, long long size, void *addr,
                                            long long len) {
    return start(dir, size, addr, (size_t)len);
}

static void *start(const char *dir, long long size, void *pop_addr, size_t pop_len) {
    size_t n = strlen(dir);
    if (n >= sizeof ((spare *)0)->path) {
        errno = ENAMETOOLONG;
        return NULL;
    }
    spare *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    atomic_init(&s->state, MAKING);
    atomic_init(&s->pop, pop_addr != NULL ? POP_ASKED : POP_OVER);
    atomic_init(&s->tid, 0);
    s->pop_addr = pop_addr;
    s->pop_len = pop_len;
    s->fd = -1;
    s->size = size;
    memcpy(s->path, dir, n + 1);
    pthread_attr_t attr;
    pthread_t t;
    /* the helper takes no signals (they stay with the process's other threads: Python's
     * handlers run in its main thread) and starts at SCHED_IDLE */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_attr_init(&attr);
    if (rc == 0) {
        struct sched_param none = {0};
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        pthread_attr_setinheritsched(&attr, PTHREAD_EXPLICIT_SCHED);
        pthread_attr_setschedpolicy(&attr, SCHED_IDLE);
        pthread_attr_setschedparam(&attr, &none);
        rc = pthread_create(&t, &attr, make, s);
        if (rc == EPERM) { /* (not allowed here: inherit, and lower it from inside) */
            pthread_attr_setinheritsched(&attr, PTHREAD_INHERIT_SCHED);
            rc = pthread_create(&t, &attr, make, s);
        }
        pthread_attr_destroy(&attr);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        free(s);
        errno = rc;
        return NULL;
    }
    return s;
}

/* set once raising a helper was refused in this process (isl_spare_prefault_safe: no more) */
static atomic_int raise_refused;

/* Whether this process is in the initial user namespace (its uid_map the identity of every
 * id): only there does a capability capget reports count for the kernel's capable(), which
 * asks the initial namespace -- inside another (rootless containers, unshare -r) a process
 * sees CAP_SYS_NICE it cannot use. Unreadable: taken as another namespace. */
static int initial_userns(void) {
    /* -1: not read yet (a process rarely leaves its user namespace: read once) */
    static atomic_int known = -1;
    int v = atomic_load(&known);
    if (v >= 0)
        return v;
    FILE *f = fopen("/proc/self/uid_map", "re");
    if (f == NULL) {
        atomic_store(&known, 0);
        return 0;
    }
    unsigned long inside, outside, count;
    int n = fscanf(f, "%lu %lu %lu", &inside, &outside, &count);
    int extra = n == 3 ? fgetc(f) : EOF;
    while (extra == ' ' || extra == '\n')
        extra = fgetc(f);
    fclose(f);
    v = n == 3 && inside == 0 && outside == 0 && count == 4294967295UL && extra == EOF;
    atomic_store(&known, v);
    return v;
}

/* Whether this thread may raise a thread it makes at SCHED_IDLE back to a normal one: its nice
 * value within RLIMIT_NICE, or CAP_SYS_NICE in its effective set in the initial user namespace
 * (the kernel's can_nice), and no such raise refused so far. Only then may a helper prefault
 * the caller's mappings. */
ISL_EXPORT int isl_spare_prefault_safe(void) {
    if (atomic_load(&raise_refused))
        return 0;
    errno = 0;
    int nice = getpriority(PRIO_PROCESS, (id_t)gettid()); /* (this thread's: -1 is a value) */
    struct rlimit lim;
    if (errno == 0 && getrlimit(RLIMIT_NICE, &lim) == 0 &&
        (lim.rlim_cur == RLIM_INFINITY || (rlim_t)(20 - nice) <= lim.rlim_cur))
        return 1;
    if (!initial_userns())
        return 0;
    struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3];
    if (syscall(SYS_capget, &head, caps) != 0)
        return 0;
    return (caps[CAP_SYS_NICE / 32].effective >> (CAP_SYS_NICE % 32)) & 1;
}

/* No populate of the mapping after this returns: one not started is called off, one under
 * way is waited for (~70 µs at most for a JAC frame). Then the mapping may be unmapped. */
ISL_EXPORT void isl_spare_settle(void *h) {
    spare *s = h;
    int asked = POP_ASKED;
    if (atomic_compare_exchange_strong(&s->pop, &asked, POP_OFF))
        return;
    if (atomic_load(&s->pop) == POP_RUNNING) {
        /* A helper at SCHED_IDLE preempted in the middle would make the caller wait as long as
         * the CPU is busy: it runs as a normal thread until its prefault is over (then lowers
         * itself again). While the prefault runs, the thread is alive: its id is its own. */
        struct sched_param none = {0};
        int tid = atomic_load(&s->tid);
        if (tid > 0 && sched_setscheduler(tid, SCHED_OTHER, &none) != 0 && errno == EPERM)
            atomic_store(&raise_refused, 1); /* (not again: see isl_spare_prefault_safe) */
        while (atomic_load(&s->pop) == POP_RUNNING)
            sched_yield();
    }
}

/* Whether the mapping was prefaulted (its populate is over and succeeded). */
ISL_EXPORT int isl_spare_populated(void *h) {
    spare *s = h;
    return atomic_load(&s->pop) == POP_OVER && s->populated;
}

/* Whether the file is made (or failed): isl_spare_take then returns at once. */
ISL_EXPORT int isl_spare_ready(void *h) { return atomic_load(&((spare *)h)->state) == MADE; }

/* Once ready: the file, named name now (it must not exist), as its descriptor (open
 * read-write); or -errno of the failure (the file is gone then). The handle is freed. */
ISL_EXPORT int isl_spare_take(void *h, const char *name) {
    spare *s = h;
    int fd = s->fd, err = s->err;
    free(s);
    if (fd < 0)
        return -err;
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    if (linkat(AT_FDCWD, proc, AT_FDCWD, name, AT_SYMLINK_FOLLOW) != 0) {
        err = errno;
        close(fd);
        return -err;
    }
    return fd;
}

/* Give up on the file: closed now if made (it has no name: gone), else by the helper when it
 * is done. The handle is freed either way. */
ISL_EXPORT void isl_spare_drop(void *h) {
    spare *s = h;
    isl_spare_settle(s); /* (the mapping may go right after) */
    int expected = MAKING;
    if (!atomic_compare_exchange_strong(&s->state, &expected, DROPPED))
        forget(s); /* made already */
}
