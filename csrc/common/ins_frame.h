/*
 * ins_frame.h -- the checks of a frame file's header (instride/frames.py: decode_header), for
 * the C paths that take whole frames: a local reader's held file (libinstride_local, isl_take)
 * and a remote reader's received one (libinstride_tcp, isc_recv_frame).
 *
 * The header is 128 bytes: "ISF1", version (u16), layout (u16), atoms (u64), ... , the
 * payload's size (u64, at 104) and xxh3 (u64, at 112), then the xxh3 of the 120 bytes before
 * it (at 120); all little-endian, as the producer wrote them on the same kind of machine.
 */
#ifndef INS_FRAME_H
#define INS_FRAME_H

#include <stdint.h>
#include <string.h>

#include "ins_xxh.h"

#define INS_HEADER_SIZE 128
#define INS_HEADER_FIELDS 120 /* bytes covered by the header checksum */

enum { INS_LAYOUT_XYZ32 = 1, INS_LAYOUT_PAPER = 2, INS_LAYOUT_SOA = 3 };

/* Whether the size bytes at p (the whole frame file) have a header that passes
 * decode_header's checks: magic, version, layout, the header's own checksum, and a payload
 * of the size its atoms take that fills the rest of the file. *psum (may be NULL): the
 * payload's checksum the header carries. */
static inline int ins_frame_header_ok(const unsigned char *p, int64_t size, uint64_t *psum)
{
    if (size < INS_HEADER_SIZE || memcmp(p, "ISF1", 4) != 0)
        return 0;
    uint16_t version, layout;
    uint64_t natoms, nbytes, hsum;
    memcpy(&version, p + 4, 2);
    memcpy(&layout, p + 6, 2);
    memcpy(&natoms, p + 8, 8);
    memcpy(&nbytes, p + 104, 8);
    memcpy(&hsum, p + INS_HEADER_FIELDS, 8);
    if (version != 1 || layout < INS_LAYOUT_XYZ32 || layout > INS_LAYOUT_SOA)
        return 0;
    if (XXH3_64bits(p, INS_HEADER_FIELDS) != hsum)
        return 0;
    uint64_t per_atom = layout == INS_LAYOUT_XYZ32 ? 12 : 28;
    if (natoms > UINT64_MAX / per_atom || nbytes != natoms * per_atom
        || (uint64_t)size - INS_HEADER_SIZE != nbytes)
        return 0;
    if (psum != NULL)
        memcpy(psum, p + 112, 8);
    return 1;
}

#endif
