/*
 * unlink.c -- unlink, unlinkat, remove of a key this process is still writing.
 *
 * While a key is written only its hidden temp exists, so the program's unlink of the key
 * found nothing (ENOENT) and its next close published the data it meant to throw away (a
 * "write, fail, unlink, close" path; gfortran's CLOSE(STATUS='DELETE'), which then stopped
 * the program with a runtime error). The key's writers are marked instead: their last close
 * removes the temp, as the kernel drops an unlinked file at its last close; the call then
 * succeeds. A published file under the key is unlinked by libc as before.
 */
#include "instride_preload.h"

#include <fcntl.h>

/* The key's writers in this process, marked to be dropped: how many (0: not a key). */
static int ins_unlink_marks(int dirfd, const char *path, int flags)
{
    struct ins_path p;
    if (ins_busy || path == NULL || (flags & AT_REMOVEDIR) || !ins_table_any() ||
        ins_table_foreign())
        return 0;
    int saved = errno;
    int n = ins_classify(dirfd, path, &p) == INS_MANAGED ? ins_table_discard(&p) : 0;
    errno = saved;
    return n;
}

/* The result of the real call `rc` on `path`, where `marked` writers of the key were marked:
 * only the temp existed (ENOENT) is a success -- it goes at the last close; another failure
 * (EACCES, EROFS, EBUSY...) unlinked nothing, and the writers are marked no more. */
static int ins_unlinked(int rc, int marked, int saved, int dirfd, const char *path)
{
    if (rc == 0 || marked == 0)
        return rc;
    if (errno == ENOENT) {
        errno = saved;
        return 0;
    }
    int e = errno;
    struct ins_path p;
    if (ins_classify(dirfd, path, &p) == INS_MANAGED)
        ins_table_undiscard(&p);
    errno = e;
    return rc;
}

INS_WRAPPER(int, unlink, (const char *path))
{
    INS_MAP_OR_FAIL(unlink, -1);
    int saved = errno, n = ins_unlink_marks(AT_FDCWD, path, 0);
    return ins_unlinked(ins_real_unlink(path), n, saved, AT_FDCWD, path);
}

INS_WRAPPER(int, unlinkat, (int dirfd, const char *path, int flags))
{
    INS_MAP_OR_FAIL(unlinkat, -1);
    int saved = errno, n = ins_unlink_marks(dirfd, path, flags);
    return ins_unlinked(ins_real_unlinkat(dirfd, path, flags), n, saved, dirfd, path);
}

/* (glibc's remove calls its own unlink, not through the symbol: wrapped too) */
INS_WRAPPER(int, remove, (const char *path))
{
    INS_MAP_OR_FAIL(remove, -1);
    int saved = errno, n = ins_unlink_marks(AT_FDCWD, path, 0);
    return ins_unlinked(ins_real_remove(path), n, saved, AT_FDCWD, path);
}
