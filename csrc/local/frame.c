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
 *
 * In cluster mode the frame's record carries its header checksum (instride/record.py,
 * "isf:"): no second pass over the frame for the record, only the record is left to Python.
 *
 * Python keeps the policy, the consumer groups and every error: where these calls meet
 * anything but the common case they say so and Python takes the slow, explaining path.
 *
 * Exported: isl_append.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
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
 * problem), -EINVAL for an unknown layout (nothing written). */
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
        return -EINVAL;
    }
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
    if (sync && msync(dst, HEADER_SIZE + nbytes, MS_SYNC) != 0)
        return -errno; /* (still locked, not published: the slow path flushes and names it) */
    if (fd < 0)
        return 0;
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

ISL_EXPORT int isl_append(unsigned char *dst, int layout, int64_t natoms, const void *pos,
                          const int32_t *ids, int64_t step, double time, const double *box,
                          int fd, const char *src, const char *dst_path, int noreplace,
                          int sync)
{
    return append(dst, layout, natoms, pos, ids, step, time, box, fd, src, dst_path,
                  noreplace, sync);
}

