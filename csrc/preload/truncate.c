/*
 * truncate.c -- truncate, truncate64 of a key.
 *
 * A published key is immutable: its readers hold its bytes. truncate() by path changed them in
 * place (libc), where a write open of the key in place is refused. It is refused the same way,
 * EPERM (what Linux answers for an immutable file), and also for a key not published yet, as
 * that open is: the bytes of a key being written are in its writer's temp file, which the
 * writer's own fd reaches (ftruncate). A path under the managed directory too long to confine:
 * ENAMETOOLONG, as an open there. ftruncate needs no wrapper: an fd of a key is its writer's
 * temp, or read-only (the kernel refuses it).
 */
#include "instride_preload.h"

/* 0: libc's; else -1 with errno (the path is a key, or too long to be one). */
static int ins_truncate_refused(const char *path)
{
    struct ins_path p;
    if (ins_busy || path == NULL)
        return 0;
    int saved = errno;
    int kind = ins_classify(AT_FDCWD, path, &p);
    errno = saved;
    if (kind == INS_TOOLONG)
        return ins_fail(ENAMETOOLONG, "%.300s: its path under the managed directory is too "
                        "long (PATH_MAX) to be a key", path);
    if (kind == INS_MANAGED)
        return ins_fail(EPERM, "key %.300s: keys are not modified in place (truncate refused; "
                        "a writer truncates its open file with ftruncate)", ins_key(&p));
    return 0;
}

INS_WRAPPER(int, truncate, (const char *path, off_t length))
{
    INS_MAP_OR_FAIL(truncate, -1);
    if (ins_truncate_refused(path) != 0)
        return -1;
    return ins_real_truncate(path, length);
}

INS_WRAPPER(int, truncate64, (const char *path, off64_t length))
{
    INS_MAP_OR_FAIL(truncate64, -1);
    if (ins_truncate_refused(path) != 0)
        return -1;
    return ins_real_truncate64(path, length);
}
