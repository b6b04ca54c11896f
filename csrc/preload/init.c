/*
 * init.c -- load-time set-up of libinstride_preload.so: the real symbols are
 * resolved once (dlsym(RTLD_NEXT), under pthread_once), the core is pointed at
 * them, the settings are read (csrc/core/config.c) and the fd table allocated.
 */
#include "instride_preload.h"

#include <dlfcn.h>

INS_FOR_EACH_REAL(INS_REAL_DEF)

INS_HIDDEN atomic_int ins_ready = 0;
INS_HIDDEN INS_TLS_IE int ins_busy = 0;

static pthread_once_t ins_once = PTHREAD_ONCE_INIT;

/* The core's own libc calls go to the real symbols, never to our wrappers. */
static void ins_point_core_at_real(void)
{
    if (ins_real_open)
        ins_sys.open = ins_real_open;
    if (ins_real_openat)
        ins_sys.openat = ins_real_openat;
    if (ins_real_close)
        ins_sys.close = ins_real_close;
    if (ins_real_rename)
        ins_sys.rename = ins_real_rename;
    if (ins_real_renameat)
        ins_sys.renameat = ins_real_renameat;
    if (ins_real_renameat2)
        ins_sys.renameat2 = ins_real_renameat2;
}

static void ins_init_once(void)
{
    ins_busy = 1;
#define INS_RESOLVE(name, ret, args)                                                \
    *(void **)(&ins_real_##name) = dlsym(RTLD_NEXT, #name);
    INS_FOR_EACH_REAL(INS_RESOLVE)
#undef INS_RESOLVE
    ins_point_core_at_real();
    ins_config_load();
    ins_table_setup();
    static const struct ins_fd_hooks hooks = {
        .is_internal = ins_table_is_internal,
        .mark_internal = ins_table_mark_internal,
        .foreign = ins_table_foreign,
    };
    ins_inotify_setup(&hooks);
    ins_busy = 0;
    atomic_store_explicit(&ins_ready, 1, memory_order_release);
}

void ins_init(void)
{
    if (ins_busy) /* called from inside our own initialisation */
        return;
    int saved = errno;
    pthread_once(&ins_once, ins_init_once);
    errno = saved;
}

__attribute__((constructor)) static void ins_ctor(void) { ins_init(); }
