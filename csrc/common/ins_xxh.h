/*
 * ins_xxh.h -- xxh3-64 for the C hot paths (frame codecs, the transfer receive loop).
 *
 * xxhash.h is inlined (XXH_INLINE_ALL) and compiled for the x86-64 baseline: SSE2, 29 us for
 * 565 KiB on the development VM, against 9 us in the Python xxhash package, which picks AVX2
 * at run time. -march=native is not an option: a library built on a login node must run on
 * the compute nodes. So the streaming update goes, where it can, to libxxhash's run-time
 * dispatch (XXH3_64bits_update_dispatch: the widest vector unit of the CPU it runs on),
 * looked up with dlopen on first use -- not linked: a node without libxxhash0 (a minimal
 * compute-node image) keeps the inlined code instead of failing to load the library. It is
 * used only when the shared library's version is the header's major.minor (XXH3_state_t is
 * shared between the inlined reset/digest and the library's update). Any other case, or
 * INSTRIDE_XXH_DISPATCH=0 in the environment: the inlined update.
 */
#ifndef INS_XXH_H
#define INS_XXH_H

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

typedef XXH_errorcode (*ins_xxh_update_fn)(XXH3_state_t *, const void *, size_t);

static XXH_errorcode ins_xxh_inline_update(XXH3_state_t *st, const void *p, size_t n) {
    return XXH3_64bits_update(st, p, n);
}

/* The update to use, resolved once per library (a race resolves it twice: harmless). */
static ins_xxh_update_fn ins_xxh_update_impl(void) {
    static ins_xxh_update_fn resolved;
    ins_xxh_update_fn fn = __atomic_load_n(&resolved, __ATOMIC_ACQUIRE);
    if (fn != NULL)
        return fn;
    fn = ins_xxh_inline_update;
#if defined(__x86_64__)
    const char *off = getenv("INSTRIDE_XXH_DISPATCH");
    void *lib = off != NULL && strcmp(off, "0") == 0
                    ? NULL
                    : dlopen("libxxhash.so.0", RTLD_NOW | RTLD_LOCAL);
    if (lib != NULL) {
        unsigned (*version)(void) = (unsigned (*)(void))dlsym(lib, "XXH_versionNumber");
        void *update = dlsym(lib, "XXH3_64bits_update_dispatch");
        if (version != NULL && update != NULL && version() / 100 == XXH_VERSION_NUMBER / 100)
            fn = (ins_xxh_update_fn)update; /* (the library stays loaded: it is in use) */
        else
            dlclose(lib);
    }
#endif
    __atomic_store_n(&resolved, fn, __ATOMIC_RELEASE);
    return fn;
}

#define INS_XXH3_UPDATE(st, p, n) (ins_xxh_update_impl()((st), (p), (n)))

#endif
