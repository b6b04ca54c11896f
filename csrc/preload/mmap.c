/*
 * mmap.c -- mmap, mmap64, munmap.
 *
 * A shared writable mapping of a produced file writes it too: the file is
 * published when its last fd is closed and its last such mapping is unmapped,
 * whichever comes last. Each mapping holds one reference to the file and a dup
 * of its fd (marked in the fd table; it keeps the writer's lock), released when
 * the last byte of the mapping is unmapped (munmap, or a MAP_FIXED mapping made
 * over it). Every other mapping costs a few comparisons.
 */
#include "instride_preload.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* One shared writable mapping of a produced file. */
struct ins_hold {
    struct ins_file *f;
    int fd;           /* its dup (the writer's lock), -1 if none could be had */
    size_t pieces;    /* its ranges still mapped (a partial munmap may split one) */
    struct ins_hold *next; /* (on the list of holds to release) */
};

struct ins_piece {
    uintptr_t start, end;
    struct ins_hold *hold;
};

/* The ranges mapped, under the fd table's lock (its fork handlers cover it). */
static struct ins_piece *ins_pieces;
static size_t ins_npieces, ins_cap;
static atomic_size_t ins_mapped; /* ins_npieces, read without the lock */

static size_t ins_page_up(size_t len)
{
    static size_t pg;
    if (pg == 0)
        pg = (size_t)sysconf(_SC_PAGESIZE);
    return (len + pg - 1) & ~(pg - 1);
}

/* Room for twice as many ranges (under the lock). 0: out of memory. */
static int ins_grow(void)
{
    size_t cap = ins_cap ? 2 * ins_cap : 16;
    struct ins_piece *n = realloc(ins_pieces, cap * sizeof *n);
    if (n == NULL)
        return 0;
    ins_pieces = n;
    ins_cap = cap;
    return 1;
}

/* The mapping is gone: drop its reference; the last one publishes (as a last close
 * does; munmap cannot report a failure: INSTRIDE_DEBUG=1 prints it). */
static void ins_hold_release(struct ins_hold *h)
{
    int saved = errno;
    int ours = h->fd >= 0 && ins_table_map_unhold(h->fd);
    if (atomic_fetch_sub(&h->f->refs, 1) == 1) {
        if (ours && h->f->pid == getpid())
            ins_file_sync(h->f, h->fd);
        ins_busy = 1;
        (void)ins_file_finish(h->f, 0, 0);
        ins_busy = 0;
    }
    if (ours)
        ins_real_close(h->fd);
    free(h);
    errno = saved;
}

/* [addr, addr + len) is no longer mapped: cut it out of the ranges (under the lock); the
 * mappings that have no range left are put on *done, to release once the lock is let go. */
static void ins_unmapped_locked(void *addr, size_t len, struct ins_hold **donep)
{
    uintptr_t a = (uintptr_t)addr, b = a + ins_page_up(len);
    struct ins_hold *done = *donep;
    for (size_t i = 0; i < ins_npieces;) {
        struct ins_piece *p = &ins_pieces[i];
        if (p->end <= a || b <= p->start) {
            i++;
            continue;
        }
        if (p->start < a && b < p->end) { /* a hole: two ranges */
            if (ins_npieces == ins_cap && !ins_grow()) {
                i++; /* (out of memory: kept whole, released never rather than early) */
                continue;
            }
            p = &ins_pieces[i];
            ins_pieces[ins_npieces++] = (struct ins_piece){b, p->end, p->hold};
            p->hold->pieces++;
            p->end = a;
        } else if (p->start < a) {
            p->end = a;
        } else if (b < p->end) {
            p->start = b;
        } else {
            struct ins_hold *h = p->hold;
            *p = ins_pieces[--ins_npieces];
            if (--h->pieces == 0) {
                h->next = done;
                done = h;
            }
            continue;
        }
        i++;
    }
    atomic_store(&ins_mapped, ins_npieces);
    *donep = done;
}

int ins_maps_visit_locked(const char *abs, int (*visit)(struct ins_file *, void *), void *arg)
{
    int n = 0;
    pid_t self = getpid();
    for (size_t i = 0; i < ins_npieces; i++) {
        struct ins_file *f = ins_pieces[i].hold->f;
        if (f->pid != self || strcmp(f->final.abs, abs) != 0)
            continue;
        n += visit(f, arg);
    }
    return n;
}

static void ins_release_all(struct ins_hold *done)
{
    while (done != NULL) {
        struct ins_hold *h = done;
        done = h->next;
        ins_hold_release(h);
    }
}

/* [addr, addr + len) is no longer mapped: cut it out of the ranges; release the
 * mappings that have no range left. */
static void ins_unmapped(void *addr, size_t len)
{
    struct ins_hold *done = NULL;
    ins_table_lock();
    ins_unmapped_locked(addr, len, &done);
    ins_table_unlock();
    ins_release_all(done);
}

/* p = mmap(..., fd, ...) shared and writable, fd a produced file: track it. -1 (ENOMEM)
 * when it cannot be tracked (the caller unmaps it). */
static int ins_track(void *p, size_t len, int fd)
{
    struct ins_hold *h = malloc(sizeof *h);
    if (h == NULL) {
        errno = ENOMEM;
        return -1;
    }
    h->fd = ins_hold_writing(fd);
    if (h->fd >= 0 && (size_t)h->fd >= ins_table_capacity()) {
        ins_release_writing(h->fd);
        h->fd = -1;
    }
    h->f = ins_table_map_ref(fd, h->fd);
    if (h->f == NULL) { /* closed meanwhile (another thread): an ordinary mapping */
        ins_release_writing(h->fd);
        free(h);
        return 0;
    }
    h->pieces = 1;
    ins_table_lock();
    int ok = ins_npieces < ins_cap || ins_grow();
    if (ok) {
        ins_pieces[ins_npieces++] = (struct ins_piece){(uintptr_t)p, (uintptr_t)p + ins_page_up(len), h};
        atomic_store(&ins_mapped, ins_npieces);
    }
    ins_table_unlock();
    if (!ok) {
        ins_hold_release(h); /* (not the last reference: fd is open) */
        errno = ENOMEM;
        return -1;
    }
    return 0;
}

static void *ins_mapped_now(void *p, size_t len, int prot, int flags, int fd,
                            int (*real_munmap)(void *, size_t))
{
    if (p == MAP_FAILED || ins_busy || ins_table_foreign())
        return p;
    if ((flags & MAP_FIXED) && atomic_load(&ins_mapped) > 0)
        ins_unmapped(p, len); /* what it replaced is unmapped */
    if (fd < 0 || !(flags & MAP_SHARED) || !(prot & PROT_WRITE) || !ins_table_any() ||
        ins_table_peek(fd) == NULL)
        return p;
    int saved = errno;
    if (ins_track(p, len, fd) != 0) {
        int e = errno;
        real_munmap(p, len);
        errno = e;
        return MAP_FAILED;
    }
    errno = saved;
    return p;
}

INS_WRAPPER(void *, mmap, (void *addr, size_t len, int prot, int flags, int fd, off_t off))
{
    INS_MAP_OR_FAIL(mmap, MAP_FAILED);
    void *p = ins_real_mmap(addr, len, prot, flags, fd, off);
    return ins_mapped_now(p, len, prot, flags, fd, ins_real_munmap);
}

INS_WRAPPER(void *, mmap64, (void *addr, size_t len, int prot, int flags, int fd, off64_t off))
{
    INS_MAP_OR_FAIL(mmap64, MAP_FAILED);
    void *p = ins_real_mmap64(addr, len, prot, flags, fd, off);
    return ins_mapped_now(p, len, prot, flags, fd, ins_real_munmap);
}

INS_WRAPPER(int, munmap, (void *addr, size_t len))
{
    INS_MAP_OR_FAIL(munmap, -1);
    if (ins_busy || atomic_load(&ins_mapped) == 0 || ins_table_foreign())
        return ins_real_munmap(addr, len);
    /* The unmap and the cut of its ranges under one hold of the lock: between the two, the
     * kernel could give the range to another thread's new mapping of another written key,
     * tracked meanwhile, and this cut took that one's range too (its key published while it
     * was still being stored into). Tracking takes the lock: it comes after the cut. */
    struct ins_hold *done = NULL;
    ins_table_lock();
    int rc = ins_real_munmap(addr, len);
    int e = errno;
    if (rc == 0)
        ins_unmapped_locked(addr, len, &done);
    ins_table_unlock();
    ins_release_all(done);
    errno = e;
    return rc;
}
