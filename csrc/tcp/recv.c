/*
 * libinstride_tcp, client half: receive a fetched body into its destination file (or memory).
 *
 * The body arrives on a socket in pieces; each piece is hashed (xxh3-64, streaming, while it
 * is in the CPU cache) and written to the destination file, without the Python loop around
 * recv/hash/write that cost more than the bytes themselves. Called through ctypes (the GIL is
 * released for the call). Whoever calls it checks the digest against the record.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../common/ins_xxh.h"
#include "tcp.h"

#define ISC_API __attribute__((visibility("default")))
/* Bytes taken from the socket per recv: each piece is hashed and written while it is still in
 * the CPU's L2 cache. With 1 MiB pieces a JAC frame (644 KiB) went through memory three times
 * (recv, hash, write), ~250 µs more per frame on a VM after an idle pause. */
#define ISC_CHUNK (1 << 17)
#define ISC_LOWAT (1 << 20) /* most bytes waited for at once (SO_RCVLOWAT) */
/* Bodies of at least this many bytes go into a file by splice (splice_file, below). */
#define ISC_SPLICE_MIN (1 << 16)
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* (Linux 5.14; older kernels refuse it: the pages fault in) */
#endif

enum { ISC_AT_RECV = 0, ISC_AT_WRITE = 1 };

/* The library's calling convention (ISC_ABI, tcp.h), checked by the Python binding. */
ISC_API int isc_abi(void) {
    return ISC_ABI;
}

/* Receive size bytes from sock into dest (at its current offset), hashing them from byte
 * hash_from on (0: all of them; a frame file's header, which carries the checksum of what
 * follows it, is left out with hash_from = its size).
 *
 * Returns 0 and the digest as 16 lowercase hex digits in hex (xxhash's canonical form, as
 * Python's xxhash.xxh3_64_hexdigest), or a negative errno: -ETIMEDOUT when nothing arrived
 * for stall_ms, -ECONNRESET when the peer closed the connection early, another -errno from
 * recv or write. *got says how many bytes were received, *where whether the failure was on
 * the socket (0) or the file (1). head (NULL, or hash_from bytes): also receives a copy of
 * the bytes before hash_from (a frame's header, which the caller checks: a file opened only
 * for writing cannot be read back). */
static int recv_file(int sock, int dest, char *mem, uint64_t size, uint64_t hash_from,
                     int stall_ms, char *hex, uint64_t *got, int *where, int *lowat_set,
                     char *head);

/* The count of receives under way in this process (isc_count_receives; NULL: not counted):
 * a helper making a file ahead waits while it is above 0 and for 2 ms after the last
 * (libinstride_local's isl_spare_yield_to), so that its zeros do not compete with the bytes for memory bandwidth. */
static int64_t *volatile receiving;

/* Count receives in count[0] and stamp count[1] with the end of the last (CLOCK_MONOTONIC, ns). */
ISC_API void isc_count_receives(int64_t *count) {
    receiving = count;
}

static void receive_ended(int64_t *count) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    __atomic_store_n(&count[1], (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec, __ATOMIC_RELAXED);
    __atomic_fetch_sub(&count[0], 1, __ATOMIC_RELEASE); /* (the stamp seen with the count) */
}

static int recv_restoring(int sock, int dest, char *mem, uint64_t size, uint64_t hash_from,
                          int stall_ms, char *hex, uint64_t *got, int *where, char *head) {
    int lowat_set = 0;
    int64_t *count = receiving;
    if (count != NULL)
        __atomic_fetch_add(&count[0], 1, __ATOMIC_RELAXED);
    int rc = recv_file(sock, dest, mem, size, hash_from, stall_ms, hex, got, where, &lowat_set,
                       head);
    if (count != NULL)
        receive_ended(count);
    if (lowat_set) { /* the connection is kept alive: leave it as it was */
        int one = 1;
        setsockopt(sock, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    }
    return rc;
}

ISC_API int isc_recv_file(int sock, int dest, uint64_t size, uint64_t hash_from, int stall_ms,
                          char *hex, uint64_t *got, int *where, char *head) {
    return recv_restoring(sock, dest, NULL, size, hash_from, stall_ms, hex, got, where, head);
}

/* The same into memory at mem (size bytes writable, e.g. a shared mapping of a memory file):
 * each piece lands where it belongs, no copy through a buffer and no write. */
ISC_API int isc_recv_mem(int sock, char *mem, uint64_t size, uint64_t hash_from, int stall_ms,
                         char *hex, uint64_t *got) {
    int where = ISC_AT_RECV;
    return recv_restoring(sock, -1, mem, size, hash_from, stall_ms, hex, got, &where, NULL);
}

/* Sleep until the socket has the next large piece of the left bytes (SO_RCVLOWAT, raised as
 * needed: *cur is its value now, *lowat_set whether it was changed), or for stall_ms:
 * 0, -ETIMEDOUT, or a negative errno. On a VM every wake-up of a sleeping thread costs
 * ~100-400 µs, and a drained socket would wake us per packet. */
static int wait_piece(int sock, uint64_t left, int stall_ms, int *cur, int *lowat_set) {
    int lowat = (int)(left < ISC_LOWAT ? left : ISC_LOWAT);
    if (lowat != *cur && setsockopt(sock, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat) == 0)
        *cur = lowat, *lowat_set = 1;
    struct pollfd p = {sock, POLLIN, 0};
    int r = poll(&p, 1, stall_ms);
    if (r == 0)
        return -ETIMEDOUT;
    if (r < 0 && errno != EINTR)
        return -errno;
    return 0;
}

/* The n bytes at buf, body offset at: into the digest from hash_from on, and the part before
 * it into head (when given). */
static void take_piece(XXH3_state_t *state, const char *buf, size_t n, uint64_t at,
                       uint64_t hash_from, char *head) {
    if (head != NULL && at < hash_from) {
        uint64_t k = hash_from - at < (uint64_t)n ? hash_from - at : (uint64_t)n;
        memcpy(head + at, buf, (size_t)k);
    }
    if (at + (uint64_t)n > hash_from) {
        uint64_t skip = at < hash_from ? hash_from - at : 0;
        INS_XXH3_UPDATE(state, buf + skip, (size_t)((uint64_t)n - skip));
    }
}

/* Write all n bytes of buf to dest at its offset: 0, or a negative errno. */
static int write_all(int dest, const char *buf, size_t n) {
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(dest, buf + done, n - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -errno;
        done += (size_t)w;
    }
    return 0;
}

/* This thread's buffer for the pieces taken with recv. */
static char *chunk_buffer(void) {
    static __thread char *chunk;
    if (chunk == NULL)
        chunk = malloc(ISC_CHUNK);
    return chunk;
}

/* The bytes from *got to size: each piece received, hashed and written (into mem: received
 * where it belongs, no write). */
static int recv_pieces(int sock, int dest, char *mem, uint64_t size, uint64_t hash_from,
                       int stall_ms, XXH3_state_t *state, uint64_t *got, int *where,
                       int *cur_lowat, int *lowat_set, char *head) {
    char *chunk = mem != NULL ? NULL : chunk_buffer();
    if (mem == NULL && chunk == NULL)
        return -ENOMEM;
    while (*got < size) {
        size_t want = size - *got < ISC_CHUNK ? (size_t)(size - *got) : ISC_CHUNK;
        char *buf = mem != NULL ? mem + *got : chunk;
        ssize_t n = recv(sock, buf, want, MSG_DONTWAIT);
        if (n == 0)
            return -ECONNRESET;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN)
                return -errno;
            int rc = wait_piece(sock, size - *got, stall_ms, cur_lowat, lowat_set);
            if (rc != 0)
                return rc;
            continue;
        }
        take_piece(state, buf, (size_t)n, *got, hash_from, head);
        if (mem == NULL) { /* (in memory: where it belongs already) */
            int rc = write_all(dest, buf, (size_t)n);
            if (rc != 0) {
                *where = ISC_AT_WRITE;
                return rc;
            }
        }
        *got += (uint64_t)n;
    }
    return 0;
}

/* ---- the splice route ----------------------------------------------------------------
 *
 * recv copies each piece out of the kernel into our buffer, and write copies it back in: on
 * the development VM those two kernel copies, not the hash, were the receive's cost (STMV
 * frames into new files, raw sockets: 670-720 MB/s with recv and write, 1,250-1,300 MB/s
 * with splice and the digest over a mapping, 1,750-1,850 MB/s with splice and no digest;
 * JAC frames 590 against 970 MB/s). splice moves the socket's pages into a pipe by reference
 * and copies them once, into the file; the digest then reads them where they landed, through
 * a read-only shared mapping of the file (its page tables filled per piece with
 * MADV_POPULATE_READ, one call instead of a fault per page). Where the route cannot be taken
 * (a write-only descriptor, a file system that cannot map or splice into files, no pipe),
 * the pieces go through the buffer as before; INSTRIDE_RECV_SPLICE=0 in the environment
 * always takes that way. */

/* This thread's pipe (made on first use). A child forked by the thread inherits it: the pid
 * tells, and the child makes its own (parent and child would share one pipe). */
static __thread int splice_pipe[2] = {-1, -1};
static __thread pid_t splice_pid;
static __thread size_t splice_cap;

static void splice_pipe_drop(void) {
    if (splice_pipe[0] >= 0) {
        close(splice_pipe[0]);
        close(splice_pipe[1]);
    }
    splice_pipe[0] = splice_pipe[1] = -1;
}

static int splice_pipe_ready(void) {
    pid_t me = getpid();
    if (splice_pipe[0] >= 0 && splice_pid == me)
        return 1;
    splice_pipe_drop();
    if (pipe2(splice_pipe, O_CLOEXEC) != 0) {
        splice_pipe[0] = splice_pipe[1] = -1;
        return 0;
    }
    fcntl(splice_pipe[1], F_SETPIPE_SZ, ISC_LOWAT); /* (may be refused: the size it has then) */
    int cap = fcntl(splice_pipe[1], F_GETPIPE_SZ);
    splice_cap = cap > 0 ? (size_t)cap : 65536;
    splice_pid = me;
    return 1;
}

static int splice_enabled(void) {
    static int enabled = -1;
    int on = __atomic_load_n(&enabled, __ATOMIC_RELAXED);
    if (on < 0) {
        const char *v = getenv("INSTRIDE_RECV_SPLICE");
        on = v == NULL || strcmp(v, "0") != 0;
        __atomic_store_n(&enabled, on, __ATOMIC_RELAXED);
    }
    return on;
}

/* The n bytes in the pipe (the body's from got on) into dest at start + got: 0, or a negative
 * errno; *unsupported: the file system cannot take them by splice (none of them written). */
static int drain_pipe(int dest, off_t start, uint64_t got, size_t n, int *unsupported) {
    loff_t at = start + (off_t)got;
    size_t left = n;
    *unsupported = 0;
    while (left > 0) {
        ssize_t w = splice(splice_pipe[0], NULL, dest, &at, left, SPLICE_F_MOVE);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && left == n && (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP))
            *unsupported = 1;
        if (w <= 0)
            return w < 0 ? -errno : -EIO;
        left -= (size_t)w;
    }
    return 0;
}

/* Bytes in the pipe (n) through the buffer instead: read, hashed, written at start + *got
 * (a file system that cannot take them by splice; the rest comes by recv_pieces). */
static int pipe_through_buffer(int dest, off_t start, uint64_t *got, size_t n, uint64_t hash_from,
                               XXH3_state_t *state, char *head, int *where) {
    char *chunk = chunk_buffer();
    if (chunk == NULL)
        return -ENOMEM;
    if (lseek(dest, start + (off_t)*got, SEEK_SET) < 0) {
        *where = ISC_AT_WRITE;
        return -errno;
    }
    while (n > 0) {
        ssize_t r = read(splice_pipe[0], chunk, n < ISC_CHUNK ? n : ISC_CHUNK);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? -errno : -EIO;
        take_piece(state, chunk, (size_t)r, *got, hash_from, head);
        int rc = write_all(dest, chunk, (size_t)r);
        if (rc != 0) {
            *where = ISC_AT_WRITE;
            return rc;
        }
        *got += (uint64_t)r;
        n -= (size_t)r;
    }
    return 0;
}

/* The body into dest by splice (see above). Returns 1 when the route does not apply and
 * nothing was taken off the socket (the caller goes on with recv_pieces), else as recv_file. */
static int splice_file(int sock, int dest, uint64_t size, uint64_t hash_from, int stall_ms,
                       XXH3_state_t *state, uint64_t *got, int *where, int *cur_lowat,
                       int *lowat_set, char *head) {
    if (size < ISC_SPLICE_MIN || !splice_enabled())
        return 1;
    off_t start = lseek(dest, 0, SEEK_CUR);
    if (start < 0)
        return 1;
    off_t page = (off_t)sysconf(_SC_PAGESIZE);
    off_t base = start & ~(page - 1);
    size_t lead = (size_t)(start - base), span = lead + (size_t)size;
    /* (pages beyond the file's end are mapped too, and only read once written) */
    char *map = mmap(NULL, span, PROT_READ, MAP_SHARED, dest, base);
    if (map == MAP_FAILED)
        return 1; /* a write-only descriptor, a file system that cannot map */
    if (!splice_pipe_ready()) {
        munmap(map, span);
        return 1;
    }
    int rc = 0;
    while (*got < size) {
        size_t want = size - *got < splice_cap ? (size_t)(size - *got) : splice_cap;
        ssize_t n = splice(sock, NULL, splice_pipe[1], NULL, want, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
        if (n == 0) {
            rc = -ECONNRESET;
            break;
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN) {
                if ((rc = wait_piece(sock, size - *got, stall_ms, cur_lowat, lowat_set)) != 0)
                    break;
                continue;
            }
            if (*got == 0 && (errno == EINVAL || errno == ENOSYS)) {
                munmap(map, span);
                return 1; /* (a socket that cannot be spliced: nothing taken) */
            }
            rc = -errno;
            break;
        }
        int unsupported;
        rc = drain_pipe(dest, start, *got, (size_t)n, &unsupported);
        if (rc != 0 && unsupported && *got == 0) { /* the file system takes no splice */
            munmap(map, span);
            rc = pipe_through_buffer(dest, start, got, (size_t)n, hash_from, state, head, where);
            if (rc != 0) {
                splice_pipe_drop();
                return rc;
            }
            return recv_pieces(sock, dest, NULL, size, hash_from, stall_ms, state, got, where,
                               cur_lowat, lowat_set, head);
        }
        if (rc != 0) {
            *where = ISC_AT_WRITE;
            break;
        }
        char *at = map + lead + *got;
        char *from = (char *)((uintptr_t)at & ~(uintptr_t)(page - 1));
        madvise(from, (size_t)(at + n - from), MADV_POPULATE_READ);
        take_piece(state, at, (size_t)n, *got, hash_from, head);
        *got += (uint64_t)n;
    }
    munmap(map, span);
    if (rc != 0) {
        splice_pipe_drop(); /* (it may hold bytes of this body) */
        return rc;
    }
    if (lseek(dest, start + (off_t)size, SEEK_SET) < 0) { /* (where the buffer's way leaves it) */
        *where = ISC_AT_WRITE;
        return -errno;
    }
    return 0;
}

static int recv_file(int sock, int dest, char *mem, uint64_t size, uint64_t hash_from,
                     int stall_ms, char *hex, uint64_t *got, int *where, int *lowat_set,
                     char *head) {
    *got = 0;
    *where = ISC_AT_RECV;
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    int cur_lowat = 1;
    int rc = mem != NULL ? 1
                         : splice_file(sock, dest, size, hash_from, stall_ms, &state, got, where,
                                       &cur_lowat, lowat_set, head);
    if (rc == 1)
        rc = recv_pieces(sock, dest, mem, size, hash_from, stall_ms, &state, got, where,
                         &cur_lowat, lowat_set, head);
    if (rc != 0)
        return rc;
    snprintf(hex, 17, "%016llx", (unsigned long long)XXH3_64bits_digest(&state));
    return 0;
}

/* Read exactly len bytes of a reply's head into buf; the first byte may take first_ms (a held
 * fetch's reply comes when its key is published), each later one stall_ms. A signal while
 * waiting for the first byte returns -EINTR (nothing read: the caller runs its handlers, then
 * calls again); later ones are waited through. */
static int recv_head(int sock, char *buf, size_t len, int first_ms, int stall_ms, size_t *have,
                     int interruptible) {
    while (*have < len) {
        ssize_t n = recv(sock, buf + *have, len - *have, MSG_DONTWAIT);
        if (n > 0) {
            *have += (size_t)n;
            continue;
        }
        if (n == 0)
            return -ECONNRESET;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN)
            return -errno;
        struct pollfd p = {sock, POLLIN, 0};
        int r = poll(&p, 1, *have == 0 ? first_ms : stall_ms);
        if (r == 0)
            return -ETIMEDOUT;
        if (r < 0 && (errno != EINTR || (interruptible && *have == 0)))
            return -errno;
    }
    return 0;
}

/* The body size a successful reply announces ({"ok":true,...,"size":N,...}, as both servers
 * write it), or -1 for any other reply (an error, another shape: the caller parses it). */
static long long reply_size(const char *h, size_t len) {
    static const char ok[] = "{\"ok\":true,", sz[] = "\"size\":";
    if (len < sizeof ok - 1 || memcmp(h, ok, sizeof ok - 1) != 0)
        return -1;
    const char *at = memmem(h, len, sz, sizeof sz - 1);
    if (at == NULL)
        return -1;
    const char *p = at + sizeof sz - 1, *end = h + len;
    long long v = 0;
    int digits = 0;
    for (; p < end && *p >= '0' && *p <= '9' && digits < 18; p++, digits++)
        v = v * 10 + (*p - '0');
    return digits > 0 && p < end && (*p == ',' || *p == '}') ? v : -1;
}

/* One reply of a held fetch, its body into memory: the length prefix and the JSON header
 * (copied into hdr, *hdrlen bytes), then, when the header says ok with a body of at most
 * memcap bytes, the body into mem as isc_recv_mem receives it (*size: its size). One call
 * instead of an interpreter loop around four reads, a poll and two changes of the socket's
 * timeout per frame of a stream's remote reader.
 *
 * Returns 0: header and body received (hex: the body's digest from hash_from on); 1: the
 * header alone (an error reply, or a body that does not fit: the caller goes on from there);
 * -EBADMSG: a header length out of range (*hdrlen: that length); -EINTR: a signal came before
 * any of the reply (nothing read: call again once its handler ran); another negative errno as
 * isc_recv_mem (*hdrlen < 0: it happened before the whole header was there). */
ISC_API int isc_recv_reply(int sock, int first_ms, int stall_ms, char *hdr, uint32_t hdrcap,
                           int32_t *hdrlen, char *mem, uint64_t memcap, uint64_t hash_from,
                           char *hex, uint64_t *got, uint64_t *size) {
    unsigned char prefix[4];
    size_t have = 0;
    *hdrlen = -1;
    *got = 0;
    *size = 0;
    int rc = recv_head(sock, (char *)prefix, 4, first_ms, stall_ms, &have, 1);
    if (rc != 0)
        return rc;
    uint32_t n = (uint32_t)prefix[0] << 24 | (uint32_t)prefix[1] << 16 | (uint32_t)prefix[2] << 8 |
                 prefix[3];
    if (n == 0 || n > hdrcap) {
        *hdrlen = (int32_t)(n > INT32_MAX ? INT32_MAX : n);
        return -EBADMSG;
    }
    have = 0;
    rc = recv_head(sock, hdr, n, stall_ms, stall_ms, &have, 0);
    if (rc != 0)
        return rc;
    *hdrlen = (int32_t)n;
    long long body = reply_size(hdr, n);
    if (body < 0 || mem == NULL || (uint64_t)body > memcap)
        return 1;
    *size = (uint64_t)body;
    int where = ISC_AT_RECV;
    return recv_restoring(sock, -1, mem, (uint64_t)body, hash_from, stall_ms, hex, got, &where,
                          NULL);
}
