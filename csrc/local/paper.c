/*
 * paper.c -- libinstride_local: the `paper` frame layout's records, encoded and decoded in C.
 *
 * The paper layout interleaves each atom's int32 id with its three float64 coordinates
 * (28 bytes per atom, little-endian, unaligned). numpy copies such records field by field
 * (a 24-byte item per atom): 200 us for a JAC frame (23,558 atoms) each way on the
 * development VM, against 72 us for the same bytes laid out as arrays (`paper-soa`). Here one
 * loop interleaves (or splits) a chunk of records and hashes it with xxh3-64 while it is in
 * the cache -- the same digest as the Python xxhash package's xxh3_64 over the payload.
 * Callers (instride/frames.py) use it on little-endian machines only.
 *
 * Exported: isl_paper_encode, isl_paper_decode.
 */
#include <stdint.h>
#include <string.h>
#include "../common/ins_xxh.h"

#define ISL_EXPORT __attribute__((visibility("default")))

#define REC 28                      /* bytes per atom */
#define CHUNK_ATOMS ((1 << 18) / REC) /* ~256 KiB of records per hashed chunk */

/* Write n records into dst: ids[i] (or i when ids is NULL), then pos[3i..3i+2]. Returns
 * the xxh3-64 of the n * 28 bytes written. */
ISL_EXPORT uint64_t isl_paper_encode(unsigned char *dst, const double *pos, const int32_t *ids,
                                     int64_t n)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (int64_t lo = 0; lo < n; lo += CHUNK_ATOMS) {
        int64_t hi = lo + CHUNK_ATOMS < n ? lo + CHUNK_ATOMS : n;
        unsigned char *out = dst + lo * REC;
        for (int64_t i = lo; i < hi; i++, out += REC) {
            int32_t id = ids ? ids[i] : (int32_t)i;
            memcpy(out, &id, 4);
            memcpy(out + 4, pos + 3 * i, 24);
        }
        INS_XXH3_UPDATE(&st, dst + lo * REC, (size_t)(hi - lo) * REC);
    }
    return XXH3_64bits_digest(&st);
}

/* Split n records of src into pos (n x 3 float64) and ids (n int32). With hash, returns the
 * xxh3-64 of the n * 28 source bytes (each chunk hashed before it is split, from the cache),
 * else 0. */
ISL_EXPORT uint64_t isl_paper_decode(const unsigned char *src, int64_t n, double *pos,
                                     int32_t *ids, int hash)
{
    XXH3_state_t st;
    if (hash)
        XXH3_64bits_reset(&st);
    for (int64_t lo = 0; lo < n; lo += CHUNK_ATOMS) {
        int64_t hi = lo + CHUNK_ATOMS < n ? lo + CHUNK_ATOMS : n;
        const unsigned char *in = src + lo * REC;
        if (hash)
            INS_XXH3_UPDATE(&st, in, (size_t)(hi - lo) * REC);
        for (int64_t i = lo; i < hi; i++, in += REC) {
            memcpy(ids + i, in, 4);
            memcpy(pos + 3 * i, in + 4, 24);
        }
    }
    return hash ? XXH3_64bits_digest(&st) : 0;
}

