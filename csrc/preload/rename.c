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
#include <sys/sendfile.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

/* Copy in -> out entirely. */
static int ins_copy_fd(int in, int out)
{
    for (;;) {
        ssize_t n = copy_file_range(in, NULL, out, NULL, (size_t)1 << 30, 0);
        if (n == 0)
            return 0;
        if (n > 0)
            continue;
        if (errno == EINTR)
            continue;
        if (errno != EXDEV && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
            return -1;
        break;
    }
    for (;;) { /* older kernels / special files: sendfile, then read/write */
        ssize_t n = sendfile(out, in, NULL, (size_t)1 << 30);
        if (n == 0)
            return 0;
        if (n > 0)
            continue;
        if (errno == EINTR)
            continue;
        if (errno != EINVAL && errno != ENOSYS)
            return -1;
        break;
    }
    char buf[16384];
    for (;;) {
        ssize_t n = read(in, buf, sizeof buf);
        if (n == 0)
            return 0;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(out, buf + off, (size_t)(n - off));
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0)
                return -1;
            off += w;
        }
    }
}

/* EXDEV: copy the source to a temp beside the key, publish it, drop the source. */
static int ins_copy_publish(int olddirfd, const char *old, const struct ins_path *np, int noreplace)
{
    struct stat st;
    char tmp[PATH_MAX];
    int in = ins_real_openat(olddirfd, old, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        return -1;
    if (fstat(in, &st) != 0 || ins_temp_name(np, tmp) != 0) {
        int e = errno;
        ins_real_close(in);
        errno = e;
        return -1;
    }
    int out = ins_real_open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, st.st_mode & 07777);
    if (out < 0) {
        int e = errno;
        ins_real_close(in);
        errno = e;
        return -1;
    }
    int rc = ins_copy_fd(in, out);
    int e = errno;
    if (rc == 0)
        ins_maybe_fsync(out);
    ins_real_close(in);
    if (ins_real_close(out) != 0 && rc == 0) {
        rc = -1;
        e = errno;
    }
    if (rc != 0) {
        unlink(tmp);
        errno = e;
        return -1;
    }
    if (ins_publish(tmp, np, noreplace) != 0)
        return -1;
    unlinkat(olddirfd, old, 0);
    return 0;
}

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
    int saved = errno, rc;
    int noreplace = (flags & RENAME_NOREPLACE) || !ins_cfg.overwrite;
    ins_busy = 1;
    if (ins_mkdir_parents(np->abs) != 0) {
        ins_busy = 0;
        return -1;
    }
    if (ins_cfg.fsync) {
        int fd = ins_real_openat(olddirfd, old, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            (void)fsync(fd);
            ins_real_close(fd);
        }
    }
    if (!noreplace) {
        rc = ins_real_renameat(olddirfd, old, AT_FDCWD, np->abs);
        if (rc == 0)
            rc = ins_notify_publish(np);
        else if (errno == EXDEV)
            rc = ins_copy_publish(olddirfd, old, np, 0);
    } else {
        rc = linkat(olddirfd, old, AT_FDCWD, np->abs, 0);
        if (rc == 0) {
            unlinkat(olddirfd, old, 0);
            rc = ins_notify_publish_as(np, 0); /* write-once across the cluster too */
        } else if (errno == EXDEV) {
            rc = ins_copy_publish(olddirfd, old, np, 1);
        } else if ((errno == EPERM || errno == EOPNOTSUPP || errno == EMLINK) &&
                   ins_real_renameat2 != NULL) {
            rc = ins_real_renameat2(olddirfd, old, AT_FDCWD, np->abs, RENAME_NOREPLACE);
            if (rc == 0)
                rc = ins_notify_publish_as(np, 0);
        }
    }
    if (rc == 0 && ins_cfg.fsync)
        ins_fsync_dir_of(np->abs);
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
