/*
 * fdtable.c -- the table of produced files, indexed by fd: which fds hold a key
 * being written (published on the last close of its open file description),
 * and which fds are the library's own (a thread's cached inotify fd).
 */
#include "instride_preload.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>

static _Atomic(struct ins_file *) *ins_table; /* ins_table_size slots, mmap'd once */
static size_t ins_table_size;
static atomic_int ins_table_count; /* number of occupied slots */
static pthread_mutex_t ins_table_mu = PTHREAD_MUTEX_INITIALIZER;
/* The process whose memory the table is in: set at load and in fork's child. A vfork
 * child (or any clone sharing the memory without fork's handlers) has another pid. */
static pid_t ins_table_owner;

int ins_table_foreign(void) { return getpid() != ins_table_owner; }

int ins_fail_foreign(const struct ins_path *p)
{
    return ins_fail(EPERM, "key %.300s: a vfork child (sharing its parent's memory) cannot "
                    "write a key", ins_key(p));
}

/* ins_busy while the table's lock is held (set before taking it): a signal handler that
 * calls close, dup2, ... meanwhile (async-signal-safe calls) goes straight to libc instead
 * of taking the lock its own thread holds (a deadlock). What ins_busy was, restored after. */
static INS_TLS_IE int ins_busy_before_lock;
/* 1 while this thread holds the table's lock (a signal handler's pass-through open must not
 * take it: see ins_fd_reused) */
static INS_TLS_IE int ins_table_held;

void ins_table_lock(void)
{
    int before = ins_busy;
    ins_busy = 1;
    ins_table_held = 1;
    pthread_mutex_lock(&ins_table_mu);
    ins_busy_before_lock = before;
}

void ins_table_unlock(void)
{
    int before = ins_busy_before_lock;
    pthread_mutex_unlock(&ins_table_mu);
    ins_table_held = 0;
    ins_busy = before;
}

size_t ins_table_entries(void)
{
    int n = atomic_load_explicit(&ins_table_count, memory_order_acquire);
    return n > 0 ? (size_t)n : 0;
}

int ins_table_any(void)
{
    return atomic_load_explicit(&ins_table_count, memory_order_acquire) > 0;
}

/* Internal fds (a thread's cached inotify fd) are marked with their owner's token (the
 * address of a thread-local variable, an even number) with its low bit set, so that the
 * application closing or reusing their number is noticed -- and a thread never takes another
 * thread's fd, made on the same number after the application closed its own, for its own. */
#define INS_OWNED(token) ((struct ins_file *)((uintptr_t)(token) | 1))
/* The fd a shared writable mapping of a produced file holds (mmap.c): a sentinel too. */
#define INS_MAPHOLD ((struct ins_file *)(uintptr_t)2)
#define INS_SENTINEL(f) ((uintptr_t)(f) <= 2 || ((uintptr_t)(f) & 1))
#define INS_IS_OWNED(f) ((uintptr_t)(f) & 1)

int ins_table_occupied(int fd)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL)
        return 0;
    return atomic_load_explicit(&ins_table[fd], memory_order_acquire) != NULL;
}

struct ins_file *ins_table_peek(int fd)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL)
        return NULL;
    struct ins_file *f = atomic_load_explicit(&ins_table[fd], memory_order_acquire);
    return INS_SENTINEL(f) ? NULL : f;
}

int ins_table_is_internal(int fd, const void *token)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL || token == NULL)
        return 0;
    return atomic_load_explicit(&ins_table[fd], memory_order_acquire) == INS_OWNED(token);
}

int ins_table_mark_internal(int fd, const void *token)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL)
        return -1;
    int last = 0;
    ins_table_lock();
    struct ins_file *stale = ins_table_take_locked(fd, &last);
    if (token != NULL) {
        atomic_store_explicit(&ins_table[fd], INS_OWNED(token), memory_order_release);
        atomic_fetch_add(&ins_table_count, 1);
    }
    ins_table_unlock();
    if (stale && last)
        ins_file_discard(stale);
    return 0;
}

size_t ins_table_capacity(void) { return ins_table == NULL ? 0 : ins_table_size; }

struct ins_file *ins_table_take_locked(int fd, int *last)
{
    *last = 0;
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL)
        return NULL;
    struct ins_file *f = atomic_load_explicit(&ins_table[fd], memory_order_relaxed);
    if (f == NULL)
        return NULL;
    atomic_store_explicit(&ins_table[fd], NULL, memory_order_release);
    atomic_fetch_sub(&ins_table_count, 1);
    if (INS_SENTINEL(f)) /* our internal fd is being closed / reused by the app */
        return NULL;
    *last = atomic_fetch_sub(&f->refs, 1) == 1;
    return f;
}

struct ins_file *ins_table_take(int fd, int *last)
{
    ins_table_lock();
    struct ins_file *f = ins_table_take_locked(fd, last);
    ins_table_unlock();
    return f;
}

int ins_table_put(int fd, struct ins_file *f)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL) {
        errno = EMFILE;
        return -1;
    }
    int last = 0;
    ins_table_lock();
    /* A stale slot means the fd was closed behind our back (raw syscall). */
    struct ins_file *stale = ins_table_take_locked(fd, &last);
    atomic_store_explicit(&ins_table[fd], f, memory_order_release);
    atomic_fetch_add(&ins_table_count, 1);
    ins_table_unlock();
    if (stale && last)
        ins_file_discard(stale);
    return 0;
}

void ins_table_dup_locked(int oldfd, int newfd)
{
    struct ins_file *f = ins_table_peek(oldfd);
    if (f == NULL || newfd < 0 || (size_t)newfd >= ins_table_size)
        return;
    int last = 0;
    struct ins_file *stale = ins_table_take_locked(newfd, &last); /* closed behind our back */
    if (stale != NULL && last)
        ins_file_discard(stale);
    atomic_fetch_add(&f->refs, 1);
    atomic_store_explicit(&ins_table[newfd], f, memory_order_release);
    atomic_fetch_add(&ins_table_count, 1);
}

/* A pass-through open returned fd: if the table still has an entry for it, the
 * fd had been closed without us seeing it. Forget that entry (the temp file is
 * removed, nothing is published: we cannot know it was complete). */
void ins_fd_reused(int fd)
{
    /* (in a signal handler that interrupted this thread's locked section: left to the next
     * ins_table_put of that number, which drops a stale entry too) */
    if (fd < 0 || ins_table_held || !ins_table_any() || !ins_table_occupied(fd) ||
        ins_table_foreign())
        return;
    int saved = errno, last = 0;
    struct ins_file *f = ins_table_take(fd, &last);
    if (f && last)
        ins_file_discard(f);
    errno = saved;
}

struct ins_retarget {
    const struct ins_path *to;
    int noreplace;
};

static int ins_retarget_one(struct ins_file *f, void *arg)
{
    struct ins_retarget *r = arg;
    if (f->discard)
        return 0;
    if (r->to != NULL) {
        f->final = *r->to;
        f->noreplace |= r->noreplace;
    }
    return 1;
}

static int ins_discard_one(struct ins_file *f, void *arg)
{
    (void)arg;
    f->discard = 1;
    return 1;
}

/* visit(f, arg) for each file this process writes as `key`: each fd's (a record shared by
 * dup'ed fds is met once per fd), then each one only a shared mapping still writes (its fds
 * all closed). The sum of what the visits return. */
static int ins_table_visit(const struct ins_path *key, int (*visit)(struct ins_file *, void *),
                           void *arg)
{
    int n = 0;
    if (!ins_table_any() || ins_table_foreign())
        return 0;
    pid_t self = getpid();
    ins_table_lock();
    int left = atomic_load(&ins_table_count);
    for (size_t fd = 0; fd < ins_table_size && left > 0; fd++) {
        struct ins_file *f = atomic_load_explicit(&ins_table[fd], memory_order_relaxed);
        if (f == NULL)
            continue;
        left--;
        if (INS_SENTINEL(f) || f->pid != self || strcmp(f->final.abs, key->abs) != 0)
            continue;
        n += visit(f, arg);
    }
    n += ins_maps_visit_locked(key->abs, visit, arg);
    ins_table_unlock();
    return n;
}

int ins_table_retarget(const struct ins_path *key, const struct ins_path *to, int noreplace)
{
    struct ins_retarget r = {to, noreplace};
    return ins_table_visit(key, ins_retarget_one, &r);
}

int ins_table_discard(const struct ins_path *key)
{
    return ins_table_visit(key, ins_discard_one, NULL);
}

static int ins_undiscard_one(struct ins_file *f, void *arg)
{
    (void)arg;
    f->discard = 0;
    return 1;
}

void ins_table_undiscard(const struct ins_path *key)
{
    (void)ins_table_visit(key, ins_undiscard_one, NULL);
}

struct ins_file *ins_table_map_ref(int fd, int holdfd)
{
    ins_table_lock();
    struct ins_file *f = ins_table_peek(fd);
    if (f != NULL)
        atomic_fetch_add(&f->refs, 1);
    if (f != NULL && holdfd >= 0 && (size_t)holdfd < ins_table_size) {
        int last = 0;
        struct ins_file *stale = ins_table_take_locked(holdfd, &last);
        if (stale != NULL && last)
            ins_file_discard(stale);
        atomic_store_explicit(&ins_table[holdfd], INS_MAPHOLD, memory_order_release);
        atomic_fetch_add(&ins_table_count, 1);
    }
    ins_table_unlock();
    return f;
}

int ins_table_map_unhold(int holdfd)
{
    int ours = 0;
    ins_table_lock();
    if (holdfd >= 0 && (size_t)holdfd < ins_table_size &&
        atomic_load_explicit(&ins_table[holdfd], memory_order_relaxed) == INS_MAPHOLD) {
        atomic_store_explicit(&ins_table[holdfd], NULL, memory_order_release);
        atomic_fetch_sub(&ins_table_count, 1);
        ours = 1;
    }
    ins_table_unlock();
    return ours;
}

struct ins_file *ins_file_new(const char *tmp, const struct ins_path *final)
{
    struct ins_file *f = malloc(sizeof *f);
    if (f == NULL)
        return NULL;
    atomic_init(&f->refs, 1);
    f->pid = getpid();
    f->noreplace = 0;
    f->sync_errno = 0;
    f->discard = 0;
    memcpy(f->tmp, tmp, strlen(tmp) + 1);
    f->final = *final;
    return f;
}

void ins_file_discard(struct ins_file *f)
{
    if (f->pid == getpid())
        unlink(f->tmp);
    free(f);
}

void ins_file_sync(struct ins_file *f, int fd)
{
    int saved = errno;
    if (ins_maybe_fsync(fd) != 0 && f->sync_errno == 0)
        f->sync_errno = errno ? errno : EIO;
    errno = saved;
}

int ins_file_finish(struct ins_file *f, int close_rc, int close_errno)
{
    int rc = 0;
    int sync_failed = f->sync_errno != 0 && f->pid == getpid();
    if (sync_failed) { /* (whatever the close said: EINTR too) */
        close_rc = -1; /* (fsync failed: the data may not be on disk, as a failed close) */
        close_errno = f->sync_errno;
    }
    if (f->pid != getpid()) {
        /* A forked child closing an inherited fd: it does not own the file. */
        free(f);
        if (close_rc != 0) {
            errno = close_errno;
            return -1;
        }
        return 0;
    }
    if (close_rc != 0 && (sync_failed || close_errno != EINTR)) {
        /* The data may not have reached the file (an interrupted fsync included): never
         * publish it. */
        unlink(f->tmp);
        errno = close_errno;
        rc = -1;
    } else if (f->discard) {
        unlink(f->tmp); /* (its key was unlinked while it was written: nothing to publish) */
        rc = 0;
    } else {
        rc = ins_publish(f->tmp, &f->final, f->noreplace);
    }
    int e = errno;
    free(f);
    errno = e;
    return rc;
}

static void ins_alloc_table(void)
{
    struct rlimit rl;
    size_t n = 1024;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rlim_t m = rl.rlim_max;
        if (m == RLIM_INFINITY || m > (1u << 20))
            m = 1u << 20;
        if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur > m)
            m = rl.rlim_cur > (1u << 20) ? (1u << 20) : rl.rlim_cur;
        if ((size_t)m > n)
            n = (size_t)m;
    }
    void *p = mmap(NULL, n * sizeof *ins_table, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return; /* no table: managed writes fail with EMFILE, reads still work */
    ins_table = p;
    ins_table_size = n;
}

static void ins_atfork_prepare(void) { pthread_mutex_lock(&ins_table_mu); }
static void ins_atfork_parent(void) { pthread_mutex_unlock(&ins_table_mu); }
static void ins_atfork_child(void)
{
    ins_table_owner = getpid();
    pthread_mutex_unlock(&ins_table_mu);
    ins_inotify_forget(); /* the inotify instance is shared with the parent now */
    /* every other thread's cached inotify fd too (those threads are not in the child: their
     * instances would stay open until exec, counted against the user's inotify limit) */
    for (size_t fd = 0; atomic_load_explicit(&ins_table_count, memory_order_relaxed) > 0 &&
                        fd < ins_table_size; fd++) {
        struct ins_file *f = atomic_load_explicit(&ins_table[fd], memory_order_relaxed);
        if (f != NULL && INS_IS_OWNED(f)) {
            atomic_store_explicit(&ins_table[fd], NULL, memory_order_relaxed);
            atomic_fetch_sub(&ins_table_count, 1);
            ins_sys.close((int)fd);
        }
    }
}

/* No destructor removes the temps of files still open at exit: language
 * runtimes (libgfortran, ...) close their units from their own destructors,
 * possibly after ours, and those closes must still publish. A file that is
 * never closed is never published; its temp (named with the pid) is left for
 * `instride gc`. */

void ins_table_setup(void)
{
    ins_table_owner = getpid();
    ins_alloc_table();
    pthread_atfork(ins_atfork_prepare, ins_atfork_parent, ins_atfork_child);
}
