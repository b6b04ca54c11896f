/*
 * sys.c -- the libc calls the core makes that the preload library interposes.
 * They point at libc here; the preload library repoints them, at load, to the
 * real symbols it resolved with dlsym(RTLD_NEXT).
 */
#include "ins_core.h"

#include <stdio.h>

INS_HIDDEN struct ins_sys ins_sys = {
    .open = open,
    .openat = openat,
    .close = close,
    .rename = rename,
    .renameat = renameat,
    .renameat2 = renameat2,
};
