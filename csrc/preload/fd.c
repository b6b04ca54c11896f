/*
 * fd.c -- close, dup, dup2, dup3, fcntl(F_DUPFD*), close_range, closefrom.
 *
 * A produced file is published on the last close of its open file
 * description: every fd that shares it (dup & co.) holds a reference. Untracked
 * fds cost one table load on close and nothing else.
 */
#include "instride_preload.h"

#include <stdlib.h>


/* The last reference to f went away with fd (closed, rc/e from the close). */
static int ins_after_last_close(struct ins_file *f, int rc, int e, int saved)
{
    ins_busy = 1;
    int prc = ins_file_finish(f, rc, e);
    ins_busy = 0;
    if (prc == 0)
        errno = saved;
    return prc;
}

INS_WRAPPER(int, close, (int fd))
{
    INS_MAP_OR_FAIL(close, -1);
    if (ins_busy || !ins_table_occupied(fd) || ins_table_foreign())
        return ins_real_close(fd);
    int saved = errno, last = 0;
    struct ins_file *f = ins_table_take(fd, &last);
    if (f == NULL)
        return ins_real_close(fd);
    if (last && f->pid == getpid())
        ins_file_sync(f, fd);
    int held = last ? ins_hold_writing(fd) : -1; /* the writer's lock, until the rename */
    int rc = ins_real_close(fd);
    if (!last)
        return rc;
    int prc = ins_after_last_close(f, rc, errno, saved);
    ins_release_writing(held);
    return prc;
}

INS_WRAPPER(int, dup, (int oldfd))
{
    INS_MAP_OR_FAIL(dup, -1);
    if (ins_busy || !ins_table_any() || ins_table_foreign())
        return ins_real_dup(oldfd);
    ins_table_lock();
    int nfd = ins_real_dup(oldfd);
    if (nfd >= 0)
        ins_table_dup_locked(oldfd, nfd);
    ins_table_unlock();
    return nfd;
}

/* dup2/dup3: newfd is closed first if open; that may be a last close. */
static int ins_dup23(int oldfd, int newfd, int flags, int use3)
{
    int saved = errno, last = 0;
    struct ins_file *victim = NULL;
    ins_table_lock();
    struct ins_file *v = ins_table_peek(newfd);
    int held = -1; /* a produced file closed here: its writer's lock, until the rename */
    if (v != NULL && oldfd != newfd && atomic_load(&v->refs) == 1) {
        if (v->pid == getpid())
            ins_file_sync(v, newfd);
        held = ins_hold_writing(newfd);
    }
    int rc = use3 ? ins_real_dup3(oldfd, newfd, flags) : ins_real_dup2(oldfd, newfd);
    int e = errno;
    if (rc >= 0 && oldfd != newfd) {
        victim = ins_table_take_locked(newfd, &last);
        ins_table_dup_locked(oldfd, newfd);
    }
    ins_table_unlock();
    if (victim != NULL && last)
        (void)ins_after_last_close(victim, 0, 0, saved);
    ins_release_writing(held);
    errno = rc >= 0 ? saved : e;
    return rc;
}

INS_WRAPPER(int, dup2, (int oldfd, int newfd))
{
    INS_MAP_OR_FAIL(dup2, -1);
    if (ins_busy || !ins_table_any() || ins_table_foreign())
        return ins_real_dup2(oldfd, newfd);
    return ins_dup23(oldfd, newfd, 0, 0);
}

INS_WRAPPER(int, dup3, (int oldfd, int newfd, int flags))
{
    INS_MAP_OR_FAIL(dup3, -1);
    if (ins_busy || !ins_table_any() || ins_table_foreign())
        return ins_real_dup3(oldfd, newfd, flags);
    return ins_dup23(oldfd, newfd, flags, 1);
}

#define INS_FCNTL_WRAPPER(name)                                                     \
    INS_WRAPPER(int, name, (int fd, int cmd, ...))                                  \
    {                                                                               \
        va_list ap;                                                                 \
        va_start(ap, cmd);                                                          \
        void *arg = va_arg(ap, void *);                                             \
        va_end(ap);                                                                 \
        INS_MAP_OR_FAIL(name, -1);                                                  \
        if ((cmd != F_DUPFD && cmd != F_DUPFD_CLOEXEC) || ins_busy || !ins_table_any() || \
            ins_table_foreign())                                                    \
            return ins_real_##name(fd, cmd, arg);                                   \
        ins_table_lock();                                                           \
        int nfd = ins_real_##name(fd, cmd, arg);                                    \
        if (nfd >= 0)                                                               \
            ins_table_dup_locked(fd, nfd);                                          \
        ins_table_unlock();                                                         \
        return nfd;                                                                 \
    }

INS_FCNTL_WRAPPER(fcntl)
INS_FCNTL_WRAPPER(fcntl64)

/* Clamp [first, last] to the fd table. Returns 0 when the span is empty. */
static int ins_span(unsigned int first, unsigned int last, size_t *lo, size_t *hi)
{
    size_t cap = ins_table_capacity();
    if (cap == 0 || first >= cap || first > last)
        return 0;
    *lo = first;
    *hi = last < cap - 1 ? last : cap - 1;
    return 1;
}

/* Take every tracked fd in [first, last]; finish the ones that were last. */
/* The real close_range/closefrom (close_fn) of [first, last] with the table's lock held
 * across it, the range's entries taken under the same lock: another thread's open cannot get
 * one of the freed numbers while its entry is still there (it would take it for a file closed
 * behind our back and discard it, unpublished). Then the files whose last descriptor went
 * are published. Returns close_fn's result (errno: its error). */
static int ins_close_span(unsigned int first, unsigned int last, int (*close_fn)(void *),
                          void *arg)
{
    size_t lo, hi, n = 0, cap = 0;
    struct ins_file **done = NULL;
    int spans = ins_span(first, last, &lo, &hi);
    ins_table_lock();
    int rc = close_fn(arg), e = errno;
    if (rc == 0 && spans) {
        cap = ins_table_entries(); /* (no more entries than the table holds now) */
        done = cap ? malloc(cap * sizeof *done) : NULL;
        for (size_t fd = lo; fd <= hi && ins_table_any(); fd++) {
            if (!ins_table_occupied((int)fd))
                continue;
            int l = 0;
            struct ins_file *f = ins_table_take_locked((int)fd, &l);
            if (f == NULL || !l)
                continue;
            if (done != NULL && n < cap)
                done[n++] = f;
            else /* (no memory for the list: dropped, unpublished, rather than a leak) */
                ins_file_discard(f);
        }
    }
    ins_table_unlock();
    for (size_t i = 0; i < n; i++)
        (void)ins_after_last_close(done[i], 0, 0, errno);
    free(done);
    errno = e;
    return rc;
}

struct ins_close_range_args {
    unsigned int first, last;
    int flags;
};

static int ins_call_close_range(void *arg)
{
    struct ins_close_range_args *a = arg;
    return ins_real_close_range(a->first, a->last, a->flags);
}

static int ins_call_closefrom(void *arg)
{
    ins_real_closefrom(*(int *)arg);
    return 0;
}

/* The writers' locks of the produced files tracked in [first, last], held (a second
 * descriptor each, outside the range) until the range's files are published; at most cap. */
static int ins_hold_span(unsigned int first, unsigned int last, int *held, int cap)
{
    size_t lo, hi;
    int n = 0;
    if (!ins_span(first, last, &lo, &hi))
        return 0;
    for (size_t fd = lo; fd <= hi && n < cap; fd++) {
        if (ins_table_peek((int)fd) == NULL)
            continue;
        int h = ins_hold_writing_outside((int)fd, first, last);
        if (h >= 0)
            held[n++] = h;
    }
    return n;
}

static void ins_release_span(const int *held, int n)
{
    for (int i = 0; i < n; i++)
        ins_release_writing(held[i]);
}

static void ins_fsync_span(unsigned int first, unsigned int last)
{
    size_t lo, hi;
    if (!ins_cfg.fsync || !ins_span(first, last, &lo, &hi))
        return;
    for (size_t fd = lo; fd <= hi; fd++) {
        struct ins_file *f = ins_table_peek((int)fd);
        if (f != NULL && atomic_load(&f->refs) == 1 && f->pid == getpid())
            ins_file_sync(f, (int)fd);
    }
}

/* Writers' locks held across one close_range/closefrom (more produced files in the range
 * are published without: the moment before their rename stays uncovered). */
#define INS_HOLD_SPAN_MAX 16

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

INS_WRAPPER(int, close_range, (unsigned int first, unsigned int last, int flags))
{
    INS_MAP_OR_FAIL(close_range, -1);
    if (ins_busy || !ins_table_any() || (flags & CLOSE_RANGE_CLOEXEC) || ins_table_foreign())
        return ins_real_close_range(first, last, flags);
    int saved = errno;
    ins_fsync_span(first, last);
    int held[INS_HOLD_SPAN_MAX];
    int nheld = ins_hold_span(first, last, held, INS_HOLD_SPAN_MAX);
    struct ins_close_range_args args = {first, last, flags};
    int rc = ins_close_span(first, last, ins_call_close_range, &args);
    int e = errno;
    ins_release_span(held, nheld);
    errno = rc != 0 ? e : saved;
    return rc;
}

INS_WRAPPER(void, closefrom, (int lowfd))
{
    if (!atomic_load_explicit(&ins_ready, memory_order_acquire))
        ins_init();
    if (ins_real_closefrom == NULL)
        return;
    if (ins_busy || !ins_table_any() || lowfd < 0 || ins_table_foreign()) {
        ins_real_closefrom(lowfd);
        return;
    }
    int saved = errno;
    ins_fsync_span((unsigned int)lowfd, UINT_MAX);
    int held[INS_HOLD_SPAN_MAX]; /* (below lowfd only: there is nothing above) */
    int nheld = ins_hold_span((unsigned int)lowfd, UINT_MAX, held, INS_HOLD_SPAN_MAX);
    (void)ins_close_span((unsigned int)lowfd, UINT_MAX, ins_call_closefrom, &lowfd);
    ins_release_span(held, nheld);
    errno = saved;
}
