/*
 * rename.c -- rename, renameat, renameat2 into the managed directory.
 *
 * Renaming a regular file to a key publishes it: an atomic move into place,
 * write-once (link + unlink, EEXIST if the key exists) unless
 * INSTRIDE_OVERWRITE=1 (rename). Across file systems (EXDEV) the file is copied
 * to a temp next to the key, published from there, and the source removed.
 * Everything else (directories, symlinks, renames out of or outside the
 * managed directory, RENAME_EXCHANGE/WHITEOUT) goes to libc unchanged, except
 * that a target under the managed directory reached through a symbolic link
 * there is refused (ELOOP).
 */
#include "instride_preload.h"

#include <string.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

enum ins_rename_kind {
    INS_RENAME_LIBC,    /* not about a key: libc unchanged */
    INS_RENAME_PUBLISH, /* a regular file renamed to a key: publish it */
    INS_RENAME_CHECKED, /* anything else renamed under the managed directory: libc, but
                         * only if the target does not leave it through a link */
};

/* What this rename is. Fills *np with the destination key. */
static enum ins_rename_kind ins_rename_kind(int olddirfd, const char *old, int newdirfd,
                                           const char *new, unsigned int flags,
                                           struct ins_path *np)
{
    if (ins_busy || ins_classify(newdirfd, new, np) != INS_MANAGED)
        return INS_RENAME_LIBC;
    if ((flags & ~(unsigned int)RENAME_NOREPLACE) != 0)
        return INS_RENAME_CHECKED;
    struct ins_path op;
    if (ins_classify(olddirfd, old, &op) == INS_RESERVED) /* instride's own temp */
        return INS_RENAME_CHECKED;
    struct stat st;
    int saved = errno;
    int regular = old != NULL && fstatat(olddirfd, old, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                  S_ISREG(st.st_mode);
    errno = saved;
    return regular ? INS_RENAME_PUBLISH : INS_RENAME_CHECKED;
}

/* A rename left to libc whose target is under the managed directory: refused
 * (ELOOP) if the target's directory is reached through a symbolic link there. */
static int ins_rename_confined(const struct ins_path *np)
{
    int saved = errno, rc = 0;
    ins_busy = 1;
    if (np->refuse) {
        rc = ins_fail(np->refuse, "key %.300s: its path goes back (..) through a symbolic "
                      "link inside the managed directory (refused)", ins_key(np));
    } else {
        int pfd = ins_parent_fd(np, 0);
        if (pfd >= 0)
            ins_real_close(pfd);
        else if (errno == ELOOP)
            rc = -1;
    }
    ins_busy = 0;
    if (rc == 0)
        errno = saved;
    return rc;
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

#define INS_RENAME_DISPATCH(real_call, olddirfd, old, newdirfd, new, flags)          \
    do {                                                                            \
        struct ins_path np;                                                         \
        switch (ins_rename_kind(olddirfd, old, newdirfd, new, flags, &np)) {        \
        case INS_RENAME_PUBLISH:                                                    \
            return ins_rename_managed(olddirfd, old, &np, flags);                   \
        case INS_RENAME_CHECKED:                                                    \
            if (ins_rename_confined(&np) != 0)                                      \
                return -1;                                                          \
            return real_call;                                                       \
        default:                                                                    \
            return real_call;                                                       \
        }                                                                           \
    } while (0)

INS_WRAPPER(int, rename, (const char *old, const char *new))
{
    INS_MAP_OR_FAIL(rename, -1);
    INS_RENAME_DISPATCH(ins_real_rename(old, new), AT_FDCWD, old, AT_FDCWD, new, 0);
}

INS_WRAPPER(int, renameat, (int olddirfd, const char *old, int newdirfd, const char *new))
{
    INS_MAP_OR_FAIL(renameat, -1);
    INS_RENAME_DISPATCH(ins_real_renameat(olddirfd, old, newdirfd, new), olddirfd, old,
                        newdirfd, new, 0);
}

INS_WRAPPER(int, renameat2,
            (int olddirfd, const char *old, int newdirfd, const char *new, unsigned int flags))
{
    INS_MAP_OR_FAIL(renameat2, -1);
    INS_RENAME_DISPATCH(ins_real_renameat2(olddirfd, old, newdirfd, new, flags), olddirfd, old,
                        newdirfd, new, flags);
}
