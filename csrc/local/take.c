/*
 * take.c -- libinstride_local: a local stream's per-frame path, the reader's side, in C.
 *
 * A reader of a stream waits for the next frame's key, holds the file with a shared flock
 * (the producer recycles a file only once it can lock it exclusively), checks that the key
 * still names the file, and verifies the frame in the mapping it keeps of that file. Between
 * frames the CPU's caches go cold (see frame.c): each of these steps in Python costs 5-25x
 * its warm time, so the common case is one call from the sleep to the verified frame:
 *
 *   isl_lease   open a key beneath the managed directory refusing every symbolic link
 *               (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), take the shared lock, and
 *               check that the file is still the one published under the key.
 *   isl_take    wait for a key as isl_wait does (wait.c: the caller's inotify descriptor,
 *               watches armed by the caller), optionally polling in a window around when
 *               it is due; hold it (isl_lease); find the caller's mapping of the file in a
 *               table and check the frame there: magic, version, layout, header checksum,
 *               sizes and (verify) the payload's xxh3. A copying reader passes arrays of
 *               its own: the payload is copied into them, each chunk hashed from the cache
 *               right after its copy, and the hold ends in the same call.
 *
 * Python keeps the mapping table, the policy and every error: a frame that fails a check,
 * an event of another key, a link on the way, a retired file -- anything but the common case
 * -- goes back to Python's path, which looks again and names the problem.
 *
 * Exported: isl_lease, isl_take.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "../common/ins_frame.h"
#include "../common/ins_xxh.h"
#include "isl_local.h"

/* isl_lease's results */
enum {
    LEASE_HELD = 0,    /* out = {fd, st_dev, st_ino, st_size}: the caller closes fd */
    LEASE_ABSENT = 1,  /* no file under the key (yet) */
    LEASE_RETIRED = 2, /* the file is being rewritten, or no longer the key's: retired */
    LEASE_ASK = 3,     /* anything else (a link, a special file, openat2 missing...): the
                          caller's slow path finds out and names it */
};

/* A lease's descriptor, from its open until it is handed to the caller (out[0]) or closed,
 * is in no record of the caller's: a fork() meanwhile (another thread's: a multiprocessing
 * worker) gave the child a copy that no at-fork handler could close, and with it the lock
 * (flock belongs to the open file, which the child shares) -- the producer could not reuse
 * the file while the child lived. Leases hold this lock shared over that span, fork takes it
 * exclusive (pthread_atfork), so a child sees every lease's descriptor in out[0] or none.
 * (Uncontended, shared: two atomic operations, no system call; a fork waits at most for the
 * leases under way, never for a wait: the sleep is outside.) Writers first: a fork is not
 * starved by reader threads taking frames one after the other. */
static pthread_rwlock_t fork_guard = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;

/* A fork waits 5 s at most (as the Python half, ring._FORK_WAIT): a lease's open can hang as
 * long as its file system does (a hard-mounted NFS or Lustre directory whose server does not
 * answer), and the forking thread holds the GIL meanwhile. Past that it forks unguarded, and
 * unlocks after only what it took (per thread: two threads may fork at once). */
static __thread int fork_guarded;

static void guard_fork(void)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += 5;
    int e;
    do
        e = pthread_rwlock_clockwrlock(&fork_guard, CLOCK_MONOTONIC, &until);
    while (e == EINTR);
    fork_guarded = e == 0;
}

static void guard_forked(void)
{
    if (fork_guarded)
        pthread_rwlock_unlock(&fork_guard);
    fork_guarded = 0;
}

static void guard_child(void)
{
    /* (the child's one thread is the forking one under another thread id: made anew) */
    static const pthread_rwlock_t fresh = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
    memcpy(&fork_guard, &fresh, sizeof fork_guard);
    fork_guarded = 0;
}

__attribute__((constructor)) static void guard_install(void)
{
    pthread_atfork(guard_fork, guard_forked, guard_child);
}

static int lease(int dirfd, const char *key, int64_t *out);

/* Hold the file published under key (relative to dirfd, the managed directory): open it
 * read-only refusing symbolic links anywhere and escapes, take a shared flock without
 * waiting, and check that key still names it (a retired file may be renamed away between
 * our open and our lock). out[0] is left alone unless the file is held. */
ISL_EXPORT int isl_lease(int dirfd, const char *key, int64_t *out)
{
    pthread_rwlock_rdlock(&fork_guard);
    int rc = lease(dirfd, key, out);
    pthread_rwlock_unlock(&fork_guard);
    return rc;
}

static int lease(int dirfd, const char *key, int64_t *out)
{
    struct open_how how = {
        .flags = O_RDONLY | O_NONBLOCK | O_CLOEXEC,
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    int fd = (int)syscall(SYS_openat2, dirfd, key, &how, sizeof how);
    if (fd < 0)
        return errno == ENOENT ? LEASE_ABSENT : LEASE_ASK;
    struct stat st, now;
    int rc = LEASE_ASK;
    if (flock(fd, LOCK_SH | LOCK_NB) != 0)
        rc = errno == EWOULDBLOCK ? LEASE_RETIRED : LEASE_ASK;
    else if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0)
        rc = LEASE_ASK;
    else if (fstatat(dirfd, key, &now, AT_SYMLINK_NOFOLLOW) != 0)
        rc = errno == ENOENT ? LEASE_RETIRED : LEASE_ASK;
    else if (now.st_ino != st.st_ino || now.st_dev != st.st_dev)
        rc = LEASE_RETIRED;
    else {
        out[0] = fd;
        out[1] = (int64_t)st.st_dev;
        out[2] = (int64_t)st.st_ino;
        out[3] = (int64_t)st.st_size;
        return LEASE_HELD;
    }
    close(fd);
    return rc;
}

void isl_copy_hashed(unsigned char *dst, const unsigned char *src, size_t n, XXH3_state_t *st);
uint64_t isl_paper_decode(const unsigned char *src, int64_t n, double *pos, int32_t *ids,
                          int hash);

/* isl_take's results (>= 0); a negative result is -errno of a failed poll or read. */
enum {
    TAKE_HELD = 0,        /* out = {fd, st_dev, st_ino, st_size, map, waited}: keys[0] held
                             (the caller closes fd); map: the index of the table entry whose
                             frame passed every check, or -1 (not in the table, or a check
                             failed: the caller maps and decodes it, which names the problem);
                             waited: 0 when it was there at the first look, else when it
                             was found (CLOCK_MONOTONIC, us) */
    TAKE_OTHER = 1,       /* anything else: another key's file, keys[0] retired, being
                             rewritten or something to look at; the caller's path looks */
    TAKE_TIMEOUT = 2,     /* nothing within timeout_us */
    TAKE_INTERRUPTED = 3, /* a signal arrived */
    TAKE_REARM = 4,       /* as isl_wait's ISL_REARM: *gone_n = the number of watch
                             descriptors in gone, or -1 when the queue overflowed */
    TAKE_COPIED = 5,      /* keys[0]'s frame copied into the caller's arrays and checked, the
                             hold ended: out = {-1, st_dev, st_ino, st_size, map, waited,
                             then the frame's 128 header bytes} */
};

/* Whether the frame at p (size bytes, the whole file) passes decode_frame's checks. */
static int frame_ok(const unsigned char *p, int64_t size, int verify)
{
    uint64_t psum;
    if (!ins_frame_header_ok(p, size, &psum))
        return 0;
    if (!verify)
        return 1;
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    INS_XXH3_UPDATE(&st, p + HEADER_SIZE, (size_t)size - HEADER_SIZE);
    return XXH3_64bits_digest(&st) == psum;
}

/* The caller's arrays for a copying read: the frame must have natoms atoms. */
struct dest {
    void *pos;       /* natoms x 3 coordinates of the layout's type; NULL: no copy */
    int32_t *ids;    /* natoms ids (the paper layouts) */
    int64_t natoms;
    double *box;     /* 9: the box vectors of a frame that passed the checks, or NULL */
};

/* Copy the payload of the checked frame p (header read) into d's arrays; returns whether
 * its xxh3 (over the copies, each chunk right after its copy) matches, or 1 without verify. */
static int copy_frame(const unsigned char *p, const struct dest *d, int verify)
{
    uint16_t layout;
    uint64_t psum;
    memcpy(&layout, p + 6, 2);
    memcpy(&psum, p + 112, 8);
    const unsigned char *payload = p + HEADER_SIZE;
    size_t n = (size_t)d->natoms;
    if (layout == LAYOUT_PAPER)
        return isl_paper_decode(payload, d->natoms, d->pos, d->ids, verify) == psum || !verify;
    size_t pos_bytes = n * (layout == LAYOUT_XYZ32 ? 12 : 24);
    if (!verify) {
        memcpy(d->pos, payload, pos_bytes);
        if (layout == LAYOUT_SOA)
            memcpy(d->ids, payload + pos_bytes, n * 4);
        return 1;
    }
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    isl_copy_hashed(d->pos, payload, pos_bytes, &st);
    if (layout == LAYOUT_SOA)
        isl_copy_hashed((unsigned char *)d->ids, payload + pos_bytes, n * 4, &st);
    return XXH3_64bits_digest(&st) == psum;
}

/* Try to hold keys[0] and check it in the caller's mapping (copying it into d's arrays when
 * given and the frame has their size): TAKE_HELD, TAKE_COPIED, TAKE_OTHER, or -1 when there
 * is no file under the key (yet). */
static int take_held(const int64_t *maps, int nmaps, int verify, const struct dest *d,
                     int64_t *out);

static int try_take(int dirfd, const char *key, const int64_t *maps, int nmaps, int verify,
                    const struct dest *d, int64_t *out)
{
    pthread_rwlock_rdlock(&fork_guard); /* (until the descriptor is in out[0], or closed) */
    int rc = lease(dirfd, key, out);
    if (rc == LEASE_HELD)
        rc = take_held(maps, nmaps, verify, d, out);
    else
        rc = rc == LEASE_ABSENT ? -1 : TAKE_OTHER;
    pthread_rwlock_unlock(&fork_guard);
    return rc;
}

/* try_take's file held (out[0..3] set): checked in the caller's mapping, or copied. */
static int take_held(const int64_t *maps, int nmaps, int verify, const struct dest *d,
                     int64_t *out)
{
    out[4] = -1;
    for (int i = 0; i < nmaps; i++) {
        const int64_t *m = maps + 4 * i; /* {st_dev, st_ino, size, address} */
        if (m[0] != out[1] || m[1] != out[2] || m[2] != out[3])
            continue;
        const unsigned char *p = (const unsigned char *)(intptr_t)m[3];
        uint64_t natoms;
        uint16_t layout;
        memcpy(&natoms, p + 8, 8);
        memcpy(&layout, p + 6, 2);
        /* (the arrays' types are the layout's: xyz32's float32 coordinates and no ids, the
         * paper layouts' float64 and int32 ids -- a frame of the other kind is held instead,
         * never copied into arrays of another type or size) */
        if (d->pos != NULL && frame_ok(p, out[3], 0) && natoms == (uint64_t)d->natoms &&
            (layout == LAYOUT_XYZ32) == (d->ids == NULL)) {
            if (copy_frame(p, d, verify)) {
                memcpy(out + 6, p, HEADER_SIZE); /* (before the hold ends: then it may change) */
                if (d->box != NULL)
                    memcpy(d->box, p + 32, 72);
                close((int)out[0]);
                out[0] = -1;
                out[4] = i;
                return TAKE_COPIED;
            }
        } else if (frame_ok(p, out[3], verify)) {
            out[4] = i;
            if (d->box != NULL)
                memcpy(d->box, p + 32, 72);
        }
        break;
    }
    return TAKE_HELD;
}

/* Whether anything is under key (relative to dirfd): not "absent" is for the caller to see. */
static int present(int dirfd, const char *key)
{
    struct stat st;
    return fstatat(dirfd, key, &st, AT_SYMLINK_NOFOLLOW) == 0 || (errno != ENOENT
                                                                 && errno != ENOTDIR);
}

/* Wait for keys[0] (a frame) or keys[1..n) (the end marker, a later frame) under dirfd, the
 * managed directory, sleeping on the inotify descriptor ifd whose watches on the keys'
 * directories the caller armed, at most timeout_us; between poll_from_us and poll_until_us
 * (from now; poll_until_us <= poll_from_us: never) poll instead of sleeping. keys[0] there:
 * held and checked (see TAKE_HELD), or copied into dst_pos / dst_ids (dst_natoms atoms; a
 * frame of another size is held instead) and released (TAKE_COPIED), its box vectors written
 * to dst_box (9 doubles, where not NULL) when it passed the checks; anything else:
 * TAKE_OTHER. maps: nmaps entries {st_dev, st_ino, size, address} of the caller's
 * read-only mappings of frame files; out: 22 entries. */
ISL_EXPORT int isl_take(int ifd, int dirfd, const char *const *keys, int n,
                        long long timeout_us, long long poll_from_us, long long poll_until_us,
                        const int64_t *maps, int nmaps, int verify, void *dst_pos,
                        int32_t *dst_ids, int64_t dst_natoms, double *dst_box, int *gone,
                        int gone_cap, int *gone_n, int64_t *out)
{
    const struct dest d = {.pos = dst_pos, .ids = dst_ids, .natoms = dst_natoms, .box = dst_box};
    out[5] = 0;
    int rc = try_take(dirfd, keys[0], maps, nmaps, verify, &d, out);
    if (rc >= 0)
        return rc;
    for (int i = 1; i < n; i++)
        if (present(dirfd, keys[i]))
            return TAKE_OTHER;
    char buf[8192] __attribute__((aligned(__alignof__(struct inotify_event))));
    long long now = isl_now_us();
    long long deadline = now + timeout_us, from = now + poll_from_us, until = now + poll_until_us;
    struct pollfd pfd = {.fd = ifd, .events = POLLIN};
    for (;;) {
        now = isl_now_us();
        if (now >= deadline)
            return TAKE_TIMEOUT;
        /* asleep until the window opens (or the deadline), polling in it, asleep after it */
        long long left = now >= from && now < until ? 0 : deadline - now;
        if (now < from && from < until && from - now < left)
            left = from - now;
        struct timespec ts = isl_span(left);
        rc = ppoll(&pfd, 1, &ts, NULL);
        if (rc == 0)
            continue;
        if (rc < 0)
            return errno == EINTR ? TAKE_INTERRUPTED : -errno;
        ssize_t got = read(ifd, buf, sizeof buf);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return errno == EINTR ? TAKE_INTERRUPTED : -errno;
        }
        int named, ngone = isl_events(buf, got, keys, n, gone, gone_cap, &named);
        if (ngone != 0) {
            *gone_n = ngone;
            return TAKE_REARM;
        }
        if (named > 0)
            return TAKE_OTHER;
        if (named == 0) {
            rc = try_take(dirfd, keys[0], maps, nmaps, verify, &d, out);
            if (rc >= 0) {
                out[5] = isl_now_us(); /* (found at: a reader's cadence, without a clock read) */
                return rc;
            }
            /* Not there: the event was of a file of the same name elsewhere (another watched
             * directory: readers of several streams in one thread, frames named alike) or
             * one gone again. The batch may have named a later key too (isl_events reports
             * the lowest), whose event is read and gone: look at them, or an end marker
             * published meanwhile would be slept through until the timeout. (Only on this
             * miss: the common wake-up, the frame there, costs nothing more.) */
            for (int i = 1; i < n; i++)
                if (present(dirfd, keys[i]))
                    return TAKE_OTHER;
        }
    }
}
