/*
 * ins_xxh.h -- xxh3-64 for the C hot paths (frame codecs, the transfer receive loop).
 *
 * On x86-64 the calls go to Debian's libxxhash (libxxhash0, a dependency of libxxhash-dev),
 * whose *_dispatch entry points pick the widest vector unit at run time (AVX2 where there
 * is one): ~3x the SSE2 code that an inlined xxhash.h compiles to without -mavx2 (565 KiB:
 * 9 against 29 us on the development VM) -- the speed of the Python xxhash package, which
 * dispatches the same way. -march=native is not an option: a library built on a login
 * node must run on the compute nodes. Elsewhere the inlined portable code is used.
 */
#ifndef INS_XXH_H
#define INS_XXH_H

#if defined(INS_XXH_DISPATCH)
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxh_x86dispatch.h> /* XXH3_64bits_update -> XXH3_64bits_update_dispatch */
#else
#define XXH_INLINE_ALL
#include <xxhash.h>
#endif

#endif
