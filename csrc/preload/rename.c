/*
 * rename.c -- rename, renameat, renameat2 into the managed directory.
 *
 * Renaming a regular file to a key publishes it: an atomic move into place,
 * write-once (link + unlink, EEXIST if the key exists) unless
 * INSTRIDE_OVERWRITE=1 (rename). Across file systems (EXDEV) the file is copied
 * to a temp next to the key, published from there, and the source removed.
 * Everything else (directories, symlinks, renames out of or outside the
 * managed directory, RENAME_EXCHANGE/WHITEOUT) goes to libc unchanged.
 */
#include "instride_preload.h"

#include <string.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

/* Is this rename a publication? Fills *np with the destination key. */
static int ins_rename_ours(int olddirfd, const char *old, int newdirfd, const char *new,
                           unsigned int flags, struct ins_path *np)
{
    if (ins_busy || (flags & ~(unsigned int)RENAME_NOREPLACE) != 0)
        return 0;
    if (ins_classify(newdirfd, new, np) != INS_MANAGED)
        return 0;
    struct ins_path op;
    if (ins_classify(olddirfd, old, &op) == INS_RESERVED) /* instride's own temp */
        return 0;
    struct stat st;
    int saved = errno;
    int regular = old != NULL && fstatat(olddirfd, old, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                  S_ISREG(st.st_mode);
    errno = saved;
    return regular;
}

static int ins_rename_managed(int olddirfd, const char *old, const struct ins_path *np,
                              unsigned int flags)
{
    int saved = errno;
    ins_busy = 1;
    int rc = ins_publish_move(olddirfd, old, np, (flags & RENAME_NOREPLACE) || !ins_cfg.overwrite);
    ins_busy = 0;
    if (rc == 0)
        errno = saved;
    return rc;
}

INS_WRAPPER(int, rename, (const char *old, const char *new))
{
    INS_MAP_OR_FAIL(rename, -1);
    struct ins_path np;
    if (!ins_rename_ours(AT_FDCWD, old, AT_FDCWD, new, 0, &np))
        return ins_real_rename(old, new);
    return ins_rename_managed(AT_FDCWD, old, &np, 0);
}

INS_WRAPPER(int, renameat, (int olddirfd, const char *old, int newdirfd, const char *new))
{
    INS_MAP_OR_FAIL(renameat, -1);
    struct ins_path np;
    if (!ins_rename_ours(olddirfd, old, newdirfd, new, 0, &np))
        return ins_real_renameat(olddirfd, old, newdirfd, new);
    return ins_rename_managed(olddirfd, old, &np, 0);
}

INS_WRAPPER(int, renameat2,
            (int olddirfd, const char *old, int newdirfd, const char *new, unsigned int flags))
{
    INS_MAP_OR_FAIL(renameat2, -1);
    struct ins_path np;
    if (!ins_rename_ours(olddirfd, old, newdirfd, new, flags, &np))
        return ins_real_renameat2(olddirfd, old, newdirfd, new, flags);
    return ins_rename_managed(olddirfd, old, &np, flags);
}
