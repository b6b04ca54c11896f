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
 * there is refused (ELOOP), and that a file renamed to a path under it too long
 * to confine (PATH_MAX) is refused (ENAMETOOLONG), as an open there. A key this
 * process is still writing (open, not yet closed: only its temp exists) renamed
 * to a key is published there by its last close.
 */
#include "instride_preload.h"

#include <string.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

enum ins_rename_kind {
    INS_RENAME_LIBC,    /* not about a key: libc unchanged */
    INS_RENAME_PUBLISH, /* a regular file renamed to a key: publish it */
    INS_RENAME_OPEN,    /* a key this process still writes (only its temp exists) renamed
                         * to a key: its last close publishes the new key */
    INS_RENAME_CHECKED, /* anything else renamed under the managed directory: libc, but
                         * only if the target does not leave it through a link */
    INS_RENAME_TOOLONG, /* a file (no directory) renamed to a path under the managed
                         * directory too long to confine: refused (ENAMETOOLONG), as an
                         * open there is -- libc would put it there unpublished */
};

/* What this rename is. Fills *np with the destination key (and *op with the source). */
static enum ins_rename_kind ins_rename_kind(int olddirfd, const char *old, int newdirfd,
                                           const char *new, unsigned int flags,
                                           struct ins_path *np, struct ins_path *op)
{
    if (ins_busy)
        return INS_RENAME_LIBC;
    int nkind = ins_classify(newdirfd, new, np);
    if (nkind == INS_TOOLONG) { /* (a directory is no key: moved by libc as anywhere) */
        struct stat st;
        int saved = errno;
        int file = old != NULL && fstatat(olddirfd, old, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                   !S_ISDIR(st.st_mode);
        errno = saved;
        return file ? INS_RENAME_TOOLONG : INS_RENAME_LIBC;
    }
    if (nkind != INS_MANAGED)
        return INS_RENAME_LIBC;
    if ((flags & ~(unsigned int)RENAME_NOREPLACE) != 0)
        return INS_RENAME_CHECKED;
    int okind = ins_classify(olddirfd, old, op);
    if (okind == INS_RESERVED) /* instride's own temp */
        return INS_RENAME_CHECKED;
    struct stat st;
    int saved = errno;
    int found = old != NULL && fstatat(olddirfd, old, &st, AT_SYMLINK_NOFOLLOW) == 0;
    int missing = !found && errno == ENOENT;
    errno = saved;
    if (found) {
        /* old and new the same file (rename(key, key), or a hard link of it): a rename that
         * does nothing and succeeds (POSIX), not a publication over a published key */
        struct stat nst;
        if (fstatat(newdirfd, new, &nst, AT_SYMLINK_NOFOLLOW) == 0 && nst.st_dev == st.st_dev &&
            nst.st_ino == st.st_ino) {
            errno = saved;
            return INS_RENAME_LIBC;
        }
        errno = saved;
        return S_ISREG(st.st_mode) ? INS_RENAME_PUBLISH : INS_RENAME_CHECKED;
    }
    if (missing && okind == INS_MANAGED && ins_table_retarget(op, NULL, 0) > 0)
        return INS_RENAME_OPEN;
    return INS_RENAME_CHECKED;
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

/* rename(x.tmp, x) while x.tmp is open for writing (write, rename, then close): what libc
 * would rename exists only as the writer's temp. The key it names is retargeted instead;
 * the destination is checked now as a write open would check it (write-once: EEXIST). */
static int ins_rename_open(int olddirfd, const char *old, const struct ins_path *op,
                           const struct ins_path *np, unsigned int flags)
{
    int saved = errno, rc = 0;
    int noreplace = (flags & RENAME_NOREPLACE) != 0;
    struct stat st;
    ins_busy = 1;
    if (np->refuse) {
        rc = ins_fail(np->refuse, "key %.300s: its path goes back (..) through a symbolic "
                      "link inside the managed directory (refused)", ins_key(np));
    } else if (ins_lstat_key(np, &st, 1) == 0) { /* confined mkdir -p; the target itself */
        if (ins_check_type(np, &st) != 0)
            rc = -1;
        else if (noreplace || !ins_cfg.overwrite)
            rc = ins_fail(EEXIST, "key %.300s is already published (write-once)", ins_key(np));
    } else if (errno != ENOENT) {
        rc = -1;
    }
    ins_busy = 0;
    if (rc == 0 && ins_table_retarget(op, np, noreplace) == 0) /* closed (published) meanwhile */
        return ins_rename_managed(olddirfd, old, np, flags);
    if (rc == 0)
        errno = saved;
    return rc;
}

#define INS_RENAME_DISPATCH(real_call, olddirfd, old, newdirfd, new, flags)          \
    do {                                                                            \
        struct ins_path np, op;                                                     \
        switch (ins_rename_kind(olddirfd, old, newdirfd, new, flags, &np, &op)) {   \
        case INS_RENAME_PUBLISH:                                                    \
            return ins_rename_managed(olddirfd, old, &np, flags);                   \
        case INS_RENAME_OPEN:                                                       \
            return ins_rename_open(olddirfd, old, &op, &np, flags);                 \
        case INS_RENAME_TOOLONG:                                                    \
            return ins_fail(ENAMETOOLONG, "%.300s: its path under the managed directory " \
                            "is too long (PATH_MAX) to be a key", new);             \
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
