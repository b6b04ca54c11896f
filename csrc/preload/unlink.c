/*
 * unlink.c -- unlink, unlinkat, remove of a key this process is still writing.
 *
 * While a key is written only its hidden temp exists, so the program's unlink of the key
 * found nothing (ENOENT) and its next close published the data it meant to throw away (a
 * "write, fail, unlink, close" path; gfortran's CLOSE(STATUS='DELETE'), which then stopped
 * the program with a runtime error). The key's writers are marked instead: their last close
 * removes the temp, as the kernel drops an unlinked file at its last close; the call then
 * succeeds. A published file under the key is unlinked by libc as before.
 *
 * In cluster mode the key's record goes with its file: the node server is told (DELETE) once
 * a regular file under a key -- never a temp or another of instride's own names -- was
 * unlinked, and deletes the record where that file was the node's original, as the Python
 * client's delete does. Before, other nodes still saw the key, fetched it and failed, and its
 * publication again was refused (EEXIST, write-once) on every node. (A fetched copy removed is
 * that node's cache: the server keeps the record.) When the server cannot be told (none
 * listens, or it answers ERR), the call fails with that errno and a message: the file is gone
 * and the record stayed, as a close whose publication the server refused. rename.c does the
 * same for a key renamed away (out of the managed directory, or to another key).
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

int ins_key_file(int dirfd, const char *path, int flags, struct ins_path *p)
{
    struct stat st;
    if (!ins_cfg.cluster || ins_busy || path == NULL || (flags & AT_REMOVEDIR))
        return 0;
    int saved = errno;
    int key = ins_classify(dirfd, path, p) == INS_MANAGED &&
              fstatat(dirfd, path, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
    errno = saved;
    return key;
}

int ins_key_removed(const struct ins_path *p)
{
    /* The call took effect (the file is gone): it succeeds whatever the node server says. Not
     * reached (stopped: a job's cleanup after its services), or refusing (a name no key can
     * have, ERR 22: it never had a record), the record stays -- said with INSTRIDE_DEBUG=1 and
     * in the thread's last message; an rm that removed the file must not report a failure
     * (and cannot be retried). */
    int saved = errno;
    ins_busy = 1;
    (void)ins_agent_delete(ins_key(p));
    ins_busy = 0;
    errno = saved;
    return 0;
}

/* The wrapper's result: that of ins_unlinked, and where libc removed a key's file (real == 0,
 * key: found by ins_key_file), the node server told. */
static int ins_unlink_done(int real, int marked, int saved, int dirfd, const char *path, int key,
                           const struct ins_path *p)
{
    int rc = ins_unlinked(real, marked, saved, dirfd, path);
    return real == 0 && key ? ins_key_removed(p) : rc;
}

INS_WRAPPER(int, unlink, (const char *path))
{
    INS_MAP_OR_FAIL(unlink, -1);
    struct ins_path p;
    int saved = errno, n = ins_unlink_marks(AT_FDCWD, path, 0);
    int key = ins_key_file(AT_FDCWD, path, 0, &p);
    return ins_unlink_done(ins_real_unlink(path), n, saved, AT_FDCWD, path, key, &p);
}

INS_WRAPPER(int, unlinkat, (int dirfd, const char *path, int flags))
{
    INS_MAP_OR_FAIL(unlinkat, -1);
    struct ins_path p;
    int saved = errno, n = ins_unlink_marks(dirfd, path, flags);
    int key = ins_key_file(dirfd, path, flags, &p);
    return ins_unlink_done(ins_real_unlinkat(dirfd, path, flags), n, saved, dirfd, path, key, &p);
}

/* (glibc's remove calls its own unlink, not through the symbol: wrapped too) */
INS_WRAPPER(int, remove, (const char *path))
{
    INS_MAP_OR_FAIL(remove, -1);
    struct ins_path p;
    int saved = errno, n = ins_unlink_marks(AT_FDCWD, path, 0);
    int key = ins_key_file(AT_FDCWD, path, 0, &p);
    return ins_unlink_done(ins_real_remove(path), n, saved, AT_FDCWD, path, key, &p);
}
