/*
 * rename.c -- rename, renameat, renameat2 into the managed directory.
 *
 * Renaming a regular file to a key publishes it: an atomic move into place,
 * write-once (link + unlink, EEXIST if the key exists) unless
 * INSTRIDE_OVERWRITE=1 (rename). Across file systems (EXDEV) the file is copied
 * to a temp next to the key, published from there, and the source removed.
 *
 * A key appears only by publication, so two renames are refused:
 * - a directory renamed to a name under the managed directory (from outside, from
 *   another name there, or over the managed directory itself): libc made every file
 *   in it a key at once, unpublished (not write-once checked, no record in cluster
 *   mode: other nodes never saw them), or renamed keys without their records. It
 *   fails with EXDEV, as if the managed directory were another file system: mv and
 *   shutil.move then move the tree file by file (mkdir, then a rename or a copy of
 *   each file, which publishes it) and remove the source. Also an empty directory:
 *   files made in it between a look and the rename would move in unpublished too.
 *   (Not one renamed to a path there too long to confine, where no key can be
 *   opened or published at all: libc moves it.)
 * - renameat2(RENAME_EXCHANGE) with either name under the managed directory (or the
 *   directory itself): it swapped a published key's file with another file. It
 *   fails with EINVAL, what a file system that cannot exchange answers: programs
 *   that exchange expect it and fall back (or report it); EXDEV would tell them to
 *   copy, which no exchange can be.
 * - renameat2(RENAME_WHITEOUT) (ext4, tmpfs, with CAP_MKNOD; overlay file systems' own,
 *   made in the kernel, never through libc) with either name there: it replaced a published
 *   key unchecked (no write-once, no record), or left a whiteout, a character device, as a
 *   key renamed away. EINVAL too, what a file system without whiteouts answers.
 *
 * A key's bytes never change once published, so two sources are not moved in as libc would:
 * - a regular file with other hard links (`ln a b; mv a $D/k`): moved by link + unlink it kept
 *   its inode, which its other names still change in place (`echo x >> b` changed the
 *   published key under its readers). It is published as a copy instead -- written through this
 *   library's own open and close, as a program writing the key (write-once unless
 *   INSTRIDE_OVERWRITE=1, recorded in cluster mode) -- and the source name is removed, as
 *   rename would have: rename(), mv and shutil.move all keep working (EXDEV would have made
 *   mv copy too, but failed every program that calls rename() itself). All or nothing: a
 *   source name that cannot be removed fails the rename with nothing published.
 * - a symbolic link, FIFO, socket or device: a key every reader refuses (ELOOP, EINVAL) that
 *   blocked the key's real publication (EEXIST). A symbolic link fails with EPERM, as
 *   symlink() there does (link.c); a special file with EINVAL, what an open of a key that is
 *   one answers.
 *
 * In cluster mode a key renamed away (out of the managed directory, or to another key) takes
 * its record with it: the node server is told (DELETE), as for an unlink (unlink.c).
 *
 * Everything else (renames out of or outside the managed directory) goes to libc unchanged,
 * except
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
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif
#ifndef RENAME_WHITEOUT
#define RENAME_WHITEOUT (1 << 2)
#endif

enum ins_rename_kind {
    INS_RENAME_LIBC,    /* not about a key: libc unchanged */
    INS_RENAME_PUBLISH, /* a regular file renamed to a key: publish it */
    INS_RENAME_COPY,    /* one with other hard links: publish a copy, the source removed */
    INS_RENAME_SYMLINK, /* a symbolic link renamed to a key: EPERM */
    INS_RENAME_SPECIAL, /* a FIFO, socket or device renamed to a key: EINVAL */
    INS_RENAME_OPEN,    /* a key this process still writes (only its temp exists) renamed
                         * to a key: its last close publishes the new key */
    INS_RENAME_CHECKED, /* anything else renamed under the managed directory: libc, but
                         * only if the target does not leave it through a link */
    INS_RENAME_TOOLONG, /* a file (no directory) renamed to a path under the managed
                         * directory too long to confine: refused (ENAMETOOLONG), as an
                         * open there is -- libc would put it there unpublished */
    INS_RENAME_DIR,     /* a directory renamed to a key: EXDEV (ELOOP if its path leaves
                         * the managed directory through a link there, as before) */
    INS_RENAME_DIR_ROOT, /* a directory renamed over the managed directory itself: EXDEV */
    INS_RENAME_DIR_OUT, /* cluster mode: a directory of keys renamed out of the managed
                         * directory: EXDEV (its keys' records would stay) */
    INS_RENAME_EXCHANGE, /* RENAME_EXCHANGE naming the managed directory or under it: EINVAL */
    INS_RENAME_WHITEOUT, /* RENAME_WHITEOUT naming the managed directory or under it: EINVAL */
};

/* What (dirfd, path), found INS_UNMANAGED by ins_classify, is as a directory's new name:
 * INS_DIR_ROOT, the managed directory itself (named without ".."); INS_DIR_KEY, a key once the
 * '/'s ending it are dropped (a directory's name, which ins_classify leaves to libc: *out is
 * filled); else 0. *scratch is overwritten. */
enum { INS_DIR_KEY = 1, INS_DIR_ROOT = 2 };

static int ins_dir_name_managed(int dirfd, const char *path, struct ins_path *scratch,
                                struct ins_path *out)
{
    if (path == NULL || path[0] == '\0' || ins_cfg.dir_len == 0)
        return 0;
    int saved = errno;
    int ok = strstr(path, "..") == NULL && ins_absolute(dirfd, path, scratch->abs) == 0 &&
             ins_normalize(scratch->abs) == 0;
    errno = saved;
    if (ok && (strcmp(scratch->abs, ins_cfg.dir) == 0 ||
               (ins_cfg.dir_real_len > 0 && strcmp(scratch->abs, ins_cfg.dir_real) == 0)))
        return INS_DIR_ROOT;
    size_t len = strlen(path);
    if (path[len - 1] != '/')
        return 0;
    while (len > 1 && path[len - 1] == '/')
        len--;
    if (len >= sizeof scratch->abs)
        return 0;
    memcpy(scratch->abs, path, len);
    scratch->abs[len] = '\0';
    return ins_classify(dirfd, scratch->abs, out) == INS_MANAGED ? INS_DIR_KEY : 0;
}

/* Does a name of an exchange (dirfd, path), classified kind, name the managed directory or a
 * path under it (a key, or one too long to confine)? */
static int ins_exchange_names_managed(int dirfd, const char *path, int kind,
                                      struct ins_path *scratch, struct ins_path *out)
{
    if (kind == INS_MANAGED || kind == INS_TOOLONG)
        return 1;
    return kind == INS_UNMANAGED && ins_dir_name_managed(dirfd, path, scratch, out) != 0;
}

/* Is (dirfd, path) a directory (not following a last symbolic link)? errno kept. */
static int ins_is_dir(int dirfd, const char *path)
{
    struct stat st;
    int saved = errno;
    int dir = path != NULL && fstatat(dirfd, path, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
              S_ISDIR(st.st_mode);
    errno = saved;
    return dir;
}

/* Are (olddirfd, old) and (newdirfd, new) the same file (rename(x, x): POSIX does nothing)? */
static int ins_same_file(int olddirfd, const char *old, int newdirfd, const char *new)
{
    struct stat ost, nst;
    int saved = errno;
    int same = old != NULL && new != NULL &&
               fstatat(olddirfd, old, &ost, AT_SYMLINK_NOFOLLOW) == 0 &&
               fstatat(newdirfd, new, &nst, AT_SYMLINK_NOFOLLOW) == 0 &&
               ost.st_dev == nst.st_dev && ost.st_ino == nst.st_ino;
    errno = saved;
    return same;
}

/* What this rename is. Fills *np with the destination key (and *op with the source). */
static enum ins_rename_kind ins_rename_kind(int olddirfd, const char *old, int newdirfd,
                                           const char *new, unsigned int flags,
                                           struct ins_path *np, struct ins_path *op)
{
    if (ins_busy)
        return INS_RENAME_LIBC;
    int nkind = ins_classify(newdirfd, new, np);
    if (flags & (RENAME_EXCHANGE | RENAME_WHITEOUT)) /* (np, op: scratch only: refused or libc's) */
        return !(ins_exchange_names_managed(newdirfd, new, nkind, op, np) ||
                 ins_exchange_names_managed(olddirfd, old, ins_classify(olddirfd, old, op), np,
                                            op))
                   ? INS_RENAME_LIBC
               : (flags & RENAME_EXCHANGE) ? INS_RENAME_EXCHANGE
                                           : INS_RENAME_WHITEOUT;
    /* a directory: its files would be keys unpublished (a rename onto itself does nothing;
     * one to a path too long to confine is libc's: no key there can be opened or published) */
    int dir = nkind == INS_MANAGED     ? INS_DIR_KEY
              : nkind == INS_UNMANAGED ? ins_dir_name_managed(newdirfd, new, op, np)
                                       : 0;
    if (dir != 0 && ins_is_dir(olddirfd, old) && !ins_same_file(olddirfd, old, newdirfd, new))
        return dir == INS_DIR_KEY ? INS_RENAME_DIR : INS_RENAME_DIR_ROOT;
    if (nkind == INS_TOOLONG) { /* (a directory is moved by libc as anywhere) */
        struct stat st;
        int saved = errno;
        int file = old != NULL && fstatat(olddirfd, old, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                   !S_ISDIR(st.st_mode);
        errno = saved;
        return file ? INS_RENAME_TOOLONG : INS_RENAME_LIBC;
    }
    if (nkind == INS_UNMANAGED && ins_cfg.cluster && ins_is_dir(olddirfd, old) &&
        ins_classify(olddirfd, old, op) == INS_MANAGED)
        /* (moved file by file instead, each source's unlink takes its key's record along:
         * moved whole, every key in it kept its record -- other nodes fetched missing files,
         * and a new publication of any of them was refused EEXIST) */
        return INS_RENAME_DIR_OUT;
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
        if (S_ISLNK(st.st_mode))
            return INS_RENAME_SYMLINK;
        if (S_ISDIR(st.st_mode)) /* (made a directory since ins_is_dir looked) */
            return INS_RENAME_CHECKED;
        if (!S_ISREG(st.st_mode))
            return INS_RENAME_SPECIAL;
        return st.st_nlink > 1 ? INS_RENAME_COPY : INS_RENAME_PUBLISH;
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
        rc = ins_fail_refused_key(np);
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

/* A regular file with other hard links renamed to the key np: its bytes published as the key
 * through this library's open and close (a temp, then write-once or replace, recorded in
 * cluster mode), the source name removed in between. All or nothing, as a rename: the name goes
 * before the publication, so that a removal refused (EACCES, EPERM, EROFS, EBUSY: what libc's
 * rename would have said) publishes nothing; a publication that fails then (EEXIST from a
 * writer of the key meanwhile, fsync) puts the name back, a link to the source still open here
 * (its other hard links keep the file meanwhile). A key's record goes with a source that was one
 * once the rename succeeded (ins_renamed_away). A source open for writing (through any of its
 * names, by anyone) is refused, and one opened for writing during the copy is not published
 * (EBUSY): the copy would hold bytes the file never held once its writer was done. A read lease
 * tells (ins_lease_source); where there is none, copied unchecked as before. */
static int ins_rename_copy(int olddirfd, const char *old, const struct ins_path *np,
                           unsigned int flags)
{
    int saved = errno;
    struct stat st;
    if (np->refuse)
        return ins_fail_refused_key(np);
    /* (O_NONBLOCK: a writer's lease on it refuses, EWOULDBLOCK, instead of a wait) */
    int in = ins_sys.openat(olddirfd, old, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    int leased = in >= 0 ? ins_lease_source(in) : 0;
    if (leased < 0 || (in < 0 && errno == EWOULDBLOCK)) {
        if (in >= 0)
            ins_sys.close(in);
        return ins_fail_open_for_writing(old, np, NULL);
    }
    if (in < 0 || fstat(in, &st) != 0) {
        int e = errno;
        if (in >= 0)
            ins_sys.close(in);
        return ins_fail(e, "cannot copy %.300s to key %.300s: %s", old, ins_key(np), strerror(e));
    }
    int noreplace = (flags & RENAME_NOREPLACE) || !ins_cfg.overwrite;
    mode_t mode = st.st_mode & 07777;
    int out = open(np->abs, O_WRONLY | O_CREAT | O_CLOEXEC | (noreplace ? O_EXCL : O_TRUNC), mode);
    if (out < 0) { /* (open said why: EEXIST, a symbolic link in the way...) */
        int e = errno;
        ins_sys.close(in);
        errno = e;
        return -1;
    }
    /* the mode the source had, as a rename keeps it (the open's is masked by the umask) */
    int rc = ins_copy_fd(in, out, leased ? in : -1) == 0 && fchmod(out, mode) == 0 ? 0 : -1,
        e = errno;
    const char *failed = "cannot copy %.300s to key %.300s: %s";
    if ((rc == 0 || e == EBUSY) && leased && ins_lease_broken(in)) { /* (a writer came) */
        rc = -1;
        e = EBUSY;
        failed = "cannot copy %.300s to key %.300s: %s (it was open for writing elsewhere "
                 "during the copy)";
    }
    if (rc == 0 && ins_real_unlinkat(olddirfd, old, 0) != 0) {
        rc = -1;
        e = errno;
        failed = "cannot rename %.300s to key %.300s: the source cannot be removed: %s";
    }
    if (rc != 0) {
        struct ins_file *f = ins_table_peek(out);
        if (f != NULL)
            f->discard = 1; /* its close drops the temp: nothing published */
        close(out);
        ins_sys.close(in);
        return ins_fail(e, failed, old, ins_key(np), strerror(e));
    }
    if (close(out) != 0) { /* not published (EEXIST, fsync...): the source name back */
        e = errno;
        char self[64];
        snprintf(self, sizeof self, "/proc/self/fd/%d", in);
        if (ins_real_linkat(AT_FDCWD, self, olddirfd, old, AT_SYMLINK_FOLLOW) != 0)
            ins_fail(e, "key %.300s not published (%s), and %.300s could not be put back "
                     "(%s): its other hard links still hold it", ins_key(np), strerror(e),
                     old, strerror(errno));
        ins_sys.close(in);
        errno = e;
        return -1;
    }
    ins_sys.close(in);
    errno = saved;
    return 0;
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
        rc = ins_fail_refused_key(np);
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

/* Cluster mode: the file of a key renamed away (kind: what was done; rc: its result) -- out of
 * the managed directory, or to another key (also as a copy) -- takes the key's record with it
 * (DELETE, as an unlink of it); anything refused or left in place did not move. */
static int ins_renamed_away(int rc, enum ins_rename_kind kind, int src_key,
                            const struct ins_path *sp, int newdirfd, const char *new)
{
    if (rc != 0 || !src_key ||
        (kind != INS_RENAME_PUBLISH && kind != INS_RENAME_COPY && kind != INS_RENAME_CHECKED &&
         kind != INS_RENAME_LIBC))
        return rc;
    /* A key moved to one of instride's own names is instride's own bookkeeping (the Python
     * package under the library: a bounded stream's producer retires each frame into its
     * pool, its record forgotten with its next publication): not a removal to record. */
    struct ins_path np;
    int saved = errno, own = ins_classify(newdirfd, new, &np) == INS_RESERVED;
    errno = saved;
    return own ? rc : ins_key_removed(sp);
}

#define INS_RENAME_DISPATCH(real_call, olddirfd, old, newdirfd, new, flags)          \
    do {                                                                            \
        struct ins_path np, op, sp;                                                 \
        int src_key = ins_key_file(olddirfd, old, 0, &sp) &&                        \
                      !ins_same_file(olddirfd, old, newdirfd, new);                 \
        enum ins_rename_kind kind =                                                 \
            ins_rename_kind(olddirfd, old, newdirfd, new, flags, &np, &op);         \
        switch (kind) {                                                             \
        case INS_RENAME_PUBLISH:                                                    \
            return ins_renamed_away(ins_rename_managed(olddirfd, old, &np, flags), kind, \
                                    src_key, &sp, newdirfd, new);                   \
        case INS_RENAME_COPY:                                                       \
            return ins_renamed_away(ins_rename_copy(olddirfd, old, &np, flags), kind, \
                                    src_key, &sp, newdirfd, new);                   \
        case INS_RENAME_SYMLINK:                                                    \
            return ins_fail(EPERM, "%.300s: a symbolic link is not renamed to a key (a key " \
                            "that is one is refused by every reader)", new);       \
        case INS_RENAME_SPECIAL:                                                    \
            return ins_fail(EINVAL, "%.300s: a FIFO, socket or device is not renamed to a " \
                            "key (a key that is one is refused by every reader)", new); \
        case INS_RENAME_OPEN:                                                       \
            return ins_rename_open(olddirfd, old, &op, &np, flags);                 \
        case INS_RENAME_TOOLONG:                                                    \
            return ins_fail(ENAMETOOLONG, "%.300s: its path under the managed directory " \
                            "is too long (PATH_MAX) to be a key", new);             \
        case INS_RENAME_DIR:                                                        \
            if (ins_rename_confined(&np) != 0)                                      \
                return -1;                                                          \
            __attribute__((fallthrough));                                           \
        case INS_RENAME_DIR_ROOT:                                                   \
            return ins_fail(EXDEV, "%.300s: a directory is not renamed under the managed " \
                            "directory (its files would appear as keys unpublished): "   \
                            "move it file by file (mv and shutil.move do so on EXDEV)", \
                            new);                                                       \
        case INS_RENAME_DIR_OUT:                                                    \
            return ins_fail(EXDEV, "%.300s: a directory of keys is not renamed out of the " \
                            "managed directory in cluster mode (its keys' records would " \
                            "stay): move it file by file (mv and shutil.move do so on " \
                            "EXDEV)", old);                                             \
        case INS_RENAME_EXCHANGE:                                                   \
            return ins_fail(EINVAL, "%.300s, %.300s: RENAME_EXCHANGE is not supported under " \
                            "the managed directory (a published key never changes)", old, \
                            new);                                                       \
        case INS_RENAME_WHITEOUT:                                                   \
            return ins_fail(EINVAL, "%.300s, %.300s: RENAME_WHITEOUT is not supported under " \
                            "the managed directory (a key appears only by publication, " \
                            "and a whiteout there would be a key every reader refuses)", \
                            old, new);                                                  \
        case INS_RENAME_CHECKED:                                                    \
            if (ins_rename_confined(&np) != 0)                                      \
                return -1;                                                          \
            return ins_renamed_away(real_call, kind, src_key, &sp, newdirfd, new);  \
        default:                                                                    \
            return ins_renamed_away(real_call, kind, src_key, &sp, newdirfd, new);  \
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
