/*
 * frame.c -- libinstride_local: a local stream's per-frame path, the producer's side, in C.
 *
 * A frame of a stream with retention is written into a recycled, already mapped file and
 * published by a rename; a reader holds it with a shared flock and reads it from a mapping it
 * keeps. Each of these steps is a handful of system calls and one pass over the bytes, and
 * between frames (tens of ms apart in a real run) the CPU's caches and branch predictors go
 * cold: a step written in Python then pays for every interpreter instruction on the way, 5-25x
 * its warm time on the development VM. Here each side's step is one call (the reader's:
 * take.c):
 *
 *   isl_append      encode a frame into its mapping (each chunk of coordinates copied, then
 *                   hashed while in the cache; the header with both checksums), flush it
 *                   where publications fsync (msync), drop the producer's exclusive lock,
 *                   publish it (rename, RENAME_NOREPLACE unless overwriting). The layout of
 *                   instride/frames.py, little-endian only.
 *   isl_append_fd   the same into a file that is not mapped, with write(2): a stream without
 *                   retention, whose every frame is a new file. Mapping a new file, taking a
 *                   page fault per page and unmapping it (a TLB shootdown) cost twice what
 *                   writing it does on a VM (644 KiB: 553-705 against 276-351 us); writing
 *                   also reports a full file system as ENOSPC, where a store into a mapping
 *                   of a sparse file takes SIGBUS.
 *
 * In cluster mode the frame's record carries its header checksum (instride/record.py,
 * "isf:"): no second pass over the frame for the record, only the record is left to Python.
 *
 * Python keeps the policy, the consumer groups and every error: where these calls meet
 * anything but the common case they say so and Python takes the slow, explaining path.
 *
 * Exported: isl_append, isl_append_fd.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "../common/ins_xxh.h"
#include "isl_local.h"

#define CHUNK (1 << 18) /* bytes copied, then hashed from the cache */

uint64_t isl_paper_encode(unsigned char *dst, const double *pos, const int32_t *ids, int64_t n);

/* Copy n bytes from src to dst in chunks, hashing each chunk of dst right after its copy. */
void isl_copy_hashed(unsigned char *dst, const unsigned char *src, size_t n, XXH3_state_t *st)
{
    for (size_t lo = 0; lo < n; lo += CHUNK) {
        size_t k = n - lo < CHUNK ? n - lo : CHUNK;
        memcpy(dst + lo, src + lo, k);
        INS_XXH3_UPDATE(st, dst + lo, k);
    }
}

/* Records lo..hi of the paper layout (id, then x, y, z as float64) at dst. */
static void paper_records(unsigned char *dst, const double *pos, const int32_t *ids, int64_t lo,
                          int64_t hi)
{
    for (int64_t i = lo; i < hi; i++, dst += 28) {
        int32_t id = ids ? ids[i] : (int32_t)i;
        memcpy(dst, &id, 4);
        memcpy(dst + 4, pos + 3 * i, 24);
    }
}

/* The soa/xyz32 payload: coordinates, then (soa) ids; returns its digest. */
static uint64_t encode_arrays(unsigned char *dst, const void *pos, size_t pos_bytes,
                              const int32_t *ids, int64_t n_ids)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    isl_copy_hashed(dst, pos, pos_bytes, &st);
    if (n_ids > 0) {
        unsigned char *out = dst + pos_bytes;
        if (ids != NULL)
            memcpy(out, ids, (size_t)n_ids * 4);
        else
            for (int64_t i = 0; i < n_ids; i++) {
                int32_t id = (int32_t)i;
                memcpy(out + 4 * i, &id, 4);
            }
        INS_XXH3_UPDATE(&st, out, (size_t)n_ids * 4);
    }
    return XXH3_64bits_digest(&st);
}

/* The frame's header at dst (HEADER_SIZE bytes), both checksums in it. */
static void header(unsigned char *dst, int layout, int64_t natoms, int64_t step, double time,
                   const double *box, uint64_t nbytes, uint64_t digest)
{
    /* "<4sHHQqd9dQQ" then the header checksum: little-endian, as stored in memory here */
    uint16_t version = 1, code = (uint16_t)layout;
    uint64_t n = (uint64_t)natoms;
    memcpy(dst, "ISF1", 4);
    memcpy(dst + 4, &version, 2);
    memcpy(dst + 6, &code, 2);
    memcpy(dst + 8, &n, 8);
    memcpy(dst + 16, &step, 8);
    memcpy(dst + 24, &time, 8);
    memcpy(dst + 32, box, 72);
    memcpy(dst + 104, &nbytes, 8);
    memcpy(dst + 112, &digest, 8);
    uint64_t hsum = XXH3_64bits(dst, HEADER_FIELDS);
    memcpy(dst + HEADER_FIELDS, &hsum, 8);
}

/* Stamp fd with the publication time, drop the producer's lock and rename src to dst_path
 * (see append). Returns 0 or -errno of the rename. */
static int publish(int fd, const char *src, const char *dst_path, int noreplace)
{
    /* the publication time, to the nanosecond (the kernel's own stamps are a clock tick
     * coarse): a data server reports it to a stream's readers on other nodes */
    struct timespec now[2];
    if (clock_gettime(CLOCK_REALTIME, &now[0]) == 0) {
        now[1] = now[0];
        futimens(fd, now);
    }
    flock(fd, LOCK_UN);
    if (renameat2(AT_FDCWD, src, AT_FDCWD, dst_path, noreplace ? RENAME_NOREPLACE : 0) != 0)
        return -errno;
    return 0;
}

/* Encode a frame at dst (HEADER_SIZE + payload bytes, checked by the caller) and publish it.
 *
 * pos: natoms x 3 contiguous float32 (xyz32) or float64 (paper, paper-soa); ids: natoms
 * int32, or NULL for 0..natoms-1 (ignored for xyz32); box: 9 float64. With sync, the frame
 * is flushed to its file (msync) before it is published. Then, where fd >= 0: stamp fd's
 * times with now (the publication time: see instride.store.ring.stamp), unlock it (the
 * producer's exclusive flock, so that a reader woken by the rename finds the frame lockable)
 * and rename src to dst_path (RENAME_NOREPLACE when noreplace).
 *
 * Returns 0 when the frame is published (or only encoded, fd < 0), -errno of a failed
 * rename (the frame is encoded and unlocked, not published: the caller's slow path names the
 * problem), errno (positive) of a failed flush, or EINVAL for an unknown layout (nothing
 * written): not published, the caller drops the file and raises. (Never a negative answer
 * for a frame not encoded: the caller's slow path would publish the file as it is -- a
 * recycled one holds an older frame, which passes every check.) */
static int append(unsigned char *dst, int layout, int64_t natoms, const void *pos,
                  const int32_t *ids, int64_t step, double time, const double *box, int fd,
                  const char *src, const char *dst_path, int noreplace, int sync)
{
    unsigned char *payload = dst + HEADER_SIZE;
    uint64_t nbytes, digest;
    switch (layout) {
    case LAYOUT_XYZ32:
        nbytes = (uint64_t)natoms * 12;
        digest = encode_arrays(payload, pos, nbytes, NULL, 0);
        break;
    case LAYOUT_PAPER:
        nbytes = (uint64_t)natoms * 28;
        digest = isl_paper_encode(payload, pos, ids, natoms);
        break;
    case LAYOUT_SOA:
        nbytes = (uint64_t)natoms * 28;
        digest = encode_arrays(payload, pos, (size_t)natoms * 24, ids, natoms);
        break;
    default:
        return EINVAL;
    }
    header(dst, layout, natoms, step, time, box, nbytes, digest);
    if (sync && msync(dst, HEADER_SIZE + nbytes, MS_SYNC) != 0)
        return errno; /* (still locked, not published, and never to be: a flush tried again
                       * reports success, Linux reporting a write-back error once per file) */
    if (fd < 0)
        return 0;
    return publish(fd, src, dst_path, noreplace);
}

/* Write n bytes of buf to fd at off, hashing them first (while in the cache). 0 or errno. */
static int put(int fd, const unsigned char *buf, size_t n, off_t off, XXH3_state_t *st)
{
    if (st != NULL)
        INS_XXH3_UPDATE(st, buf, n);
    while (n > 0) {
        ssize_t w = pwrite(fd, buf, n, off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (w == 0)
            return EIO;
        buf += w, off += w, n -= (size_t)w;
    }
    return 0;
}

/* A thread's encode buffer (CHUNK bytes), kept while the thread lives (warm in the cache) and
 * freed when it exits; NULL when it cannot be had. */
static pthread_key_t buf_key;
static pthread_once_t buf_once = PTHREAD_ONCE_INIT;
static int buf_keyed;

static void make_buf_key(void)
{
    buf_keyed = pthread_key_create(&buf_key, free) == 0;
}

static unsigned char *thread_buf(void)
{
    pthread_once(&buf_once, make_buf_key);
    if (!buf_keyed)
        return NULL;
    unsigned char *buf = pthread_getspecific(buf_key);
    if (buf == NULL && (buf = malloc(CHUNK)) != NULL && pthread_setspecific(buf_key, buf) != 0) {
        free(buf);
        buf = NULL;
    }
    return buf;
}

/* The payload of a frame written to fd from HEADER_SIZE on: the arrays' own bytes where the
 * layout stores them as they are (xyz32, paper-soa coordinates and given ids), else encoded a
 * chunk at a time into the thread's buffer (CHUNK bytes). Returns 0 or errno; *nbytes and
 * *digest: the payload's. */
static int write_payload(int fd, int layout, int64_t natoms, const void *pos,
                         const int32_t *ids, uint64_t *nbytes, uint64_t *digest)
{
    unsigned char *buf = NULL;
    if ((layout == LAYOUT_PAPER || (layout == LAYOUT_SOA && ids == NULL)) && natoms > 0
        && (buf = thread_buf()) == NULL)
        return ENOMEM;
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    off_t off = HEADER_SIZE;
    int rc = 0;
    if (layout == LAYOUT_PAPER) {
        const int64_t per = CHUNK / 28;
        for (int64_t lo = 0; lo < natoms && rc == 0; lo += per) {
            int64_t hi = lo + per < natoms ? lo + per : natoms;
            paper_records(buf, pos, ids, lo, hi);
            rc = put(fd, buf, (size_t)(hi - lo) * 28, off, &st);
            off += (hi - lo) * 28;
        }
    } else {
        size_t pos_bytes = (size_t)natoms * (layout == LAYOUT_XYZ32 ? 12 : 24);
        const unsigned char *p = pos;
        for (size_t lo = 0; lo < pos_bytes && rc == 0; lo += CHUNK) {
            size_t k = pos_bytes - lo < CHUNK ? pos_bytes - lo : CHUNK;
            rc = put(fd, p + lo, k, off, &st);
            off += (off_t)k;
        }
        if (layout == LAYOUT_SOA && ids != NULL && rc == 0) {
            rc = put(fd, (const unsigned char *)ids, (size_t)natoms * 4, off, &st);
            off += natoms * 4;
        } else if (layout == LAYOUT_SOA && rc == 0) {
            const int64_t per = CHUNK / 4;
            for (int64_t lo = 0; lo < natoms && rc == 0; lo += per) {
                int64_t hi = lo + per < natoms ? lo + per : natoms;
                for (int64_t i = lo; i < hi; i++) {
                    int32_t id = (int32_t)i;
                    memcpy(buf + 4 * (i - lo), &id, 4);
                }
                rc = put(fd, buf, (size_t)(hi - lo) * 4, off, &st);
                off += (hi - lo) * 4;
            }
        }
    }
    *nbytes = (uint64_t)(off - HEADER_SIZE);
    *digest = XXH3_64bits_digest(&st);
    return rc;
}

/* isl_append into the file fd, which is not mapped, with pwrite(2) (see the top of this
 * file): the payload, then the header at offset 0, a copy of which goes to head (HEADER_SIZE
 * bytes: the caller reads the frame's header checksum from it). With sync, fdatasync.
 *
 * Returns 0 when the frame is published; -errno of a failed rename (the frame is written and
 * unlocked, not published: the caller's slow path names the problem); a positive errno when
 * the frame could not be written or flushed (ENOSPC, EIO, ...: the file is incomplete, still
 * locked, and must not be published); EINVAL for an unknown layout (nothing written). */
ISL_EXPORT int isl_append_fd(unsigned char *head, int layout, int64_t natoms, const void *pos,
                             const int32_t *ids, int64_t step, double time, const double *box,
                             int fd, const char *src, const char *dst_path, int noreplace,
                             int sync)
{
    if (layout != LAYOUT_XYZ32 && layout != LAYOUT_PAPER && layout != LAYOUT_SOA)
        return EINVAL;
    uint64_t nbytes, digest;
    int rc = write_payload(fd, layout, natoms, pos, ids, &nbytes, &digest);
    if (rc != 0)
        return rc;
    header(head, layout, natoms, step, time, box, nbytes, digest);
    if ((rc = put(fd, head, HEADER_SIZE, 0, NULL)) != 0)
        return rc;
    if (sync) { /* (interrupted by a signal -- FUSE, NFS --: again, as Python's os.fsync) */
        int synced;
        while ((synced = fdatasync(fd)) != 0 && errno == EINTR)
            ;
        if (synced != 0)
            return errno;
    }
    return publish(fd, src, dst_path, noreplace);
}

ISL_EXPORT int isl_append(unsigned char *dst, int layout, int64_t natoms, const void *pos,
                          const int32_t *ids, int64_t step, double time, const double *box,
                          int fd, const char *src, const char *dst_path, int noreplace,
                          int sync)
{
    return append(dst, layout, natoms, pos, ids, step, time, box, fd, src, dst_path,
                  noreplace, sync);
}

