/*
 * publish.c -- produce a key: a hidden temp file next to it, then publication
 * by link(tmp, key) + unlink(tmp) (write-once) or rename(tmp, key)
 * (INSTRIDE_OVERWRITE=1), fsync when INSTRIDE_FSYNC=1, and in cluster mode the
 * registration with the node server.
 */
#include "ins_core.h"

#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/file.h>
#include <sys/sendfile.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

int ins_temp_name(const struct ins_path *p, char tmp[PATH_MAX])
{
    const char *base = strrchr(p->abs, '/') + 1;
    size_t dir_len = (size_t)(base - p->abs); /* includes the slash */
    size_t base_len = strlen(base);
    /* Keep the temp's own name within NAME_MAX: shorten the copied basename. */
    if (base_len > 200)
        base_len = 200;
    if (dir_len + base_len + 64 >= PATH_MAX)
        return ins_fail(ENAMETOOLONG, "the temp name of key %.200s would be too long", ins_key(p));
    memcpy(tmp, p->abs, dir_len);
    int n = snprintf(tmp + dir_len, PATH_MAX - dir_len, ".%.*s.instride-%ld-%016llx.tmp",
                     (int)base_len, base, (long)getpid(), (unsigned long long)ins_random64());
    if (n < 0 || (size_t)n >= PATH_MAX - dir_len)
        return ins_fail(ENAMETOOLONG, "the temp name of key %.200s would be too long", ins_key(p));
    return 0;
}

/* ins_lstat_key failed (not ENOENT): its own message when it gave one (a link, the key's
 * directory), else one naming the key (ENAMETOOLONG: a name over NAME_MAX, EACCES, ...). The
 * message was cleared before the look. */
static int ins_fail_look(const struct ins_path *p)
{
    if (ins_last_message()[0] != '\0')
        return -1;
    int e = errno;
    return ins_fail(e, "key %.300s: %s", ins_key(p), strerror(e));
}

enum ins_open_kind ins_open_kind(int flags)
{
    int acc = flags & O_ACCMODE;
    if (acc == O_RDONLY)
        return (flags & O_TRUNC) ? INS_OPEN_REFUSE : INS_OPEN_READ;
    if (acc != O_WRONLY && acc != O_RDWR)
        return INS_OPEN_REFUSE;
    /* Append is allowed only where it cannot touch existing bytes. */
    if ((flags & O_APPEND) && !(flags & O_TRUNC) && (flags & (O_CREAT | O_EXCL)) != (O_CREAT | O_EXCL))
        return INS_OPEN_REFUSE;
    if (flags & (O_CREAT | O_TRUNC))
        return INS_OPEN_WRITE;
    return INS_OPEN_REFUSE; /* read-modify-write in place */
}

int ins_prepare_write(const struct ins_path *p, int flags, mode_t *mode, char tmp[PATH_MAX])
{
    struct stat st;
    if (ins_cfg.timeout_bad) /* a setting refused, like Python's ConfigError */
        return ins_fail(EINVAL, "cannot publish %.300s: %s", ins_key(p), ins_cfg.bad_msg);
    if (p->refuse) /* (a ".." back through a link, a name Python refuses) */
        return ins_fail_refused_key(p);
    /* The key's directory is made (confined: no symbolic link followed) and the key
     * itself looked at without following it. */
    ins_clear_message();
    if (ins_lstat_key(p, &st, 1) == 0) {
        if (ins_check_type(p, &st) != 0)
            return -1;
        /* O_RDWR|O_CREAT: "open for update, create if missing"; what exists is read-only
         * (EROFS: libgfortran's OPEN without ACTION= then retries read-only) */
        if ((flags & O_ACCMODE) == O_RDWR && !(flags & (O_TRUNC | O_EXCL)))
            return ins_fail(EROFS, "key %.300s is published: it can only be read", ins_key(p));
        if ((flags & (O_CREAT | O_EXCL)) == (O_CREAT | O_EXCL) || !ins_cfg.overwrite)
            return ins_fail(EEXIST, "key %.300s is already published (write-once)", ins_key(p));
        if (!(flags & O_TRUNC))
            return ins_fail(EPERM, "key %.300s is published: it cannot be modified in place",
                            ins_key(p));
        *mode = st.st_mode & 07777;
    } else if (errno == ENOENT) {
        if (!(flags & O_CREAT))
            return ins_fail(ENOENT, "key %.300s does not exist (O_TRUNC without O_CREAT)",
                            ins_key(p));
    } else {
        return ins_fail_look(p);
    }
    return ins_temp_name(p, tmp);
}

void ins_mark_writing(int fd)
{
    /* A shared lock while the writer has its temp file open: `instride gc` leaves a locked
     * temp file alone (its writer runs, whatever its process id says in another PID
     * namespace). Shared, so a reader's lease on the published file never conflicts.
     * EWOULDBLOCK: a gc's probe holds the new file exclusively for a moment (gc.lock_held:
     * open, lock, close) -- tried again, not given up (unlocked for good, the file of a writer
     * that pauses was a later gc's to remove). Only such probes ever lock a temp file so, for
     * microseconds: 1 s at most. (Other failures, a file system without flock: unlocked.) */
    int saved = errno;
    for (int tries = 0; flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK &&
                        tries < 2000; tries++) {
        struct timespec pause = {0, 500000};
        nanosleep(&pause, NULL);
    }
    errno = saved;
}

int ins_hold_writing(int fd)
{
    return ins_dup_high(fd); /* (a mapping keeps it as long as it lives) */
}

int ins_hold_writing_outside(int fd, unsigned int first, unsigned int last)
{
    /* the lowest free number first (below the range, often: closefrom(3) and the like reach
     * every high one), then a high one, then one above the range */
    int saved = errno;
    int held = (int)syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 0);
    errno = saved;
    if (held < 0 || (unsigned int)held < first || (unsigned int)held > last)
        return held;
    ins_release_writing(held);
    held = ins_hold_writing(fd);
    if (held < 0 || (unsigned int)held < first || (unsigned int)held > last)
        return held;
    ins_release_writing(held);
    if (last >= (unsigned int)INT_MAX)
        return -1;
    saved = errno; /* above the range (EINVAL past the descriptor limit) */
    held = (int)syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, (int)last + 1);
    errno = saved;
    return held;
}

void ins_release_writing(int held)
{
    if (held < 0)
        return;
    int saved = errno;
    ins_sys.close(held);
    errno = saved;
}

int ins_remake_parent(const struct ins_path *p)
{
    int pfd = ins_parent_fd(p, 1); /* (confined: no symbolic link followed) */
    if (pfd < 0)
        return -1;
    ins_sys.close(pfd);
    errno = ENOENT;
    return 0;
}

int ins_create_temp(const struct ins_path *p, int flags, mode_t mode, char tmp[PATH_MAX])
{
    int fd = -1;
    for (int tries = 0; tries < 8; tries++) {
        fd = ins_sys.open(tmp, flags | O_CREAT | O_EXCL, mode);
        if (fd >= 0)
            break;
        /* ENOENT: the key's directory, empty, was removed since it was made (a reader's
         * failed wait takes away the directories it made): made again, tried again */
        if (errno == ENOENT ? ins_remake_parent(p) != 0
                            : errno != EEXIST || ins_temp_name(p, tmp) != 0)
            break;
    }
    if (fd < 0 && errno != ENAMETOOLONG)
        ins_fail(errno, "cannot create the temp file of key %.300s: %s", ins_key(p),
                 strerror(errno));
    if (fd >= 0)
        ins_mark_writing(fd);
    return fd;
}

void ins_fsync_dir_of(const char *abs)
{
    char dir[PATH_MAX];
    memcpy(dir, abs, strlen(abs) + 1);
    char *slash = strrchr(dir, '/');
    if (slash == NULL)
        return;
    if (slash == dir)
        slash[1] = '\0';
    else
        *slash = '\0';
    int fd = ins_sys.open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        ins_sys.close(fd);
    }
}

int ins_maybe_fsync(int fd)
{
    return ins_cfg.fsync ? fsync(fd) : 0;
}

int ins_notify_publish_as(const struct ins_path *p, int overwrite)
{
    if (!ins_cfg.cluster)
        return 0;
    return ins_agent_publish(ins_key(p), overwrite);
}

/* Whether a failed PUBLISH was the node server's refusal of the key itself, answered before
 * anything was recorded (a key its rules refuse, a name it does not find in place, a request
 * too long): the file just given the key's name must not stay there without a record. A
 * failure to record (ERR n of the metadata) the server undoes itself; where the server's
 * state is unknown (no answer, a lost connection) nothing is undone. */
static int ins_refused_before_record(int e)
{
    return e == EINVAL || e == ENOENT || e == E2BIG;
}

int ins_notify_publish(const struct ins_path *p)
{
    return ins_notify_publish_as(p, ins_cfg.overwrite);
}

/* Give old (relative to olddirfd) the name abs without replacing one: link + unlink, or on
 * file systems without hard links an atomic no-replace rename. *neither: set when the file
 * system has neither (link refused, renameat2 without RENAME_NOREPLACE: some FUSE file
 * systems). */
static int ins_link_noreplace(int olddirfd, const char *old, const char *abs, int *neither)
{
    *neither = 0;
    if (linkat(olddirfd, old, AT_FDCWD, abs, 0) == 0) {
        unlinkat(olddirfd, old, 0);
        return 0;
    }
    int e = errno;
    if (e == EPERM || e == EOPNOTSUPP || e == EMLINK || e == ENOSYS) {
        if (ins_sys.renameat2(olddirfd, old, AT_FDCWD, abs, RENAME_NOREPLACE) == 0)
            return 0;
        int r = errno;
        *neither = e != EMLINK && (r == EINVAL || r == ENOSYS || r == EOPNOTSUPP);
        e = r;
    }
    errno = e;
    return -1;
}

/* The refusal of a write-once publication where the file system can do neither. */
static int ins_fail_neither(const struct ins_path *p)
{
    return ins_fail(EOPNOTSUPP, "cannot publish key %.150s write-once: its file system has "
                    "neither hard links nor renameat2(RENAME_NOREPLACE), so no name can be made "
                    "there without the risk of replacing another writer's file (a publication "
                    "that may replace, INSTRIDE_OVERWRITE=1 and no exclusive create, works there; "
                    "or put the managed directory on a file system with either)", ins_key(p));
}

int ins_publish(const char *tmp, const struct ins_path *p, int noreplace)
{
    int overwrite = ins_cfg.overwrite && !noreplace;
    int neither = 0;
    int rc = overwrite ? ins_sys.rename(tmp, p->abs)
                       : ins_link_noreplace(AT_FDCWD, tmp, p->abs, &neither);
    if (rc != 0) {
        int e = errno;
        unlink(tmp);
        if (e == EEXIST)
            return ins_fail(EEXIST, "key %.300s was published by someone else first (write-once)",
                            ins_key(p));
        if (neither)
            return ins_fail_neither(p);
        return ins_fail(e, "cannot publish key %.300s: %s", ins_key(p), strerror(e));
    }
    if (ins_cfg.fsync)
        ins_fsync_dir_of(p->abs);
    if (ins_notify_publish_as(p, overwrite) == 0)
        return 0;
    int e = errno;
    if (!overwrite && ins_refused_before_record(e))
        unlink(p->abs); /* (write-once: the file this call made) */
    errno = e;
    return -1;
}

/* ---- publishing an existing file (rename into the managed directory) ---- */

/* Copy in -> out entirely (copy_file_range, else sendfile, else read and write); 0 or -1 with
 * errno. */
int ins_copy_fd(int in, int out)
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

/* A hidden name beside the source old (in its directory, relative to olddirfd as old is),
 * in hidden[PATH_MAX]: ".<name>.instride-moving-<pid>-<hex>" -- no temporary file's name
 * (keys.TMP_PATTERN ends in ".tmp"): `instride gc` never takes it, it is the user's file.
 * 0, or -1 with ENAMETOOLONG. */
static int ins_source_hidden_name(const char *old, char hidden[PATH_MAX])
{
    const char *slash = strrchr(old, '/');
    const char *base = slash != NULL ? slash + 1 : old;
    size_t dir_len = (size_t)(base - old), base_len = strlen(base);
    if (base_len > 200) /* (the hidden name within NAME_MAX) */
        base_len = 200;
    if (dir_len + base_len + 64 >= PATH_MAX) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(hidden, old, dir_len);
    snprintf(hidden + dir_len, PATH_MAX - dir_len, ".%.*s.instride-moving-%ld-%016llx",
             (int)base_len, base, (long)getpid(), (unsigned long long)ins_random64());
    return 0;
}

/* rename (fromdir, from) to (todir, to), same file system, without replacing a file there.
 * Where the file system has no RENAME_NOREPLACE (NFS, Lustre, GPFS often): link + unlink,
 * which replaces nothing either (EEXIST), the link undone when the unlink fails; where it has
 * no hard links either, a plain rename only when to is a fresh random name (fresh), which
 * no one else takes, or a name that is free -- else the failure. */
static int ins_rename_noreplace_at(int fromdir, const char *from, int todir, const char *to,
                                   int fresh)
{
    if (ins_sys.renameat2(fromdir, from, todir, to, RENAME_NOREPLACE) == 0)
        return 0;
    if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
        return -1;
    if (linkat(fromdir, from, todir, to, 0) != 0) {
        int e = errno;
        struct stat there;
        /* no hard links here (or not for this file: protected_hardlinks, another user's):
         * a plain rename where no file can be replaced -- to a fresh random name, or to one
         * that is free (a put-back of the user's source: left hidden, it would be lost to
         * them; a file that took the name in between these two calls is the one window) */
        if ((e == EPERM || e == EOPNOTSUPP || e == ENOSYS) &&
            (fresh || (fstatat(todir, to, &there, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT)))
            return ins_sys.renameat(fromdir, from, todir, to);
        errno = e;
        return -1;
    }
    if (unlinkat(fromdir, from, 0) != 0) {
        int e = errno;
        unlinkat(todir, to, 0);
        errno = e;
        return -1;
    }
    return 0;
}

/* EXDEV: copy the source to a temp beside the key and publish it -- all or nothing, as a
 * rename. The copy is made from the source under its own name (a process killed during it --
 * minutes, for GBs -- leaves the source where it was, and a dead writer's temp that gc takes).
 * Once it is whole, the source's name goes, renamed to a hidden name in its own directory
 * (same file system: atomic; a name gc never takes), so that a source that cannot go (an
 * immutable file, a directory the user cannot write, a read-only file system) fails the
 * rename with that errno, nothing published; then the key is published, and the hidden name
 * removed -- or named old again when the publication fails. (The source used to be removed
 * after the publication, the failure ignored: rename() said 0, the key published and the
 * source still there; then renamed to a temporary file's name before the copy, which a kill
 * during the copy left it under, for gc to remove.) */
static int ins_copy_publish(int olddirfd, const char *old, const struct ins_path *np, int noreplace)
{
    struct stat st, now;
    char tmp[PATH_MAX], hidden[PATH_MAX];
    int in = -1, out = -1, held = -1, rc = -1, hid = 0;
    enum { COPYING, MOVING, PUBLISHED } step = COPYING;
    tmp[0] = '\0';
    /* (no link followed, no FIFO waited on: a regular file only is copied) */
    in = ins_sys.openat(olddirfd, old, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (in < 0 || fstat(in, &st) != 0)
        goto cleanup;
    if (!S_ISREG(st.st_mode)) {
        errno = EINVAL;
        goto cleanup;
    }
    if (ins_temp_name(np, tmp) != 0)
        goto cleanup;
    /* (made again where a reader's failed wait removed the key's new, empty directory, as
     * the other paths do; marked as being written: instride gc leaves it) */
    out = ins_create_temp(np, O_WRONLY | O_CLOEXEC, st.st_mode & 07777, tmp);
    if (out < 0) {
        tmp[0] = '\0'; /* not ours to remove */
        goto cleanup;
    }
    if (ins_copy_fd(in, out) != 0)
        goto cleanup;
    if (ins_maybe_fsync(out) != 0)
        goto cleanup; /* (not on disk: not published; errno says why) */
    held = ins_hold_writing(out); /* the lock, until the rename */
    int fd = out;
    out = -1;
    if (ins_sys.close(fd) != 0)
        goto cleanup;
    /* the copy is whole: the source's name goes now (the file copied, unchanged since: one
     * replaced or written to meanwhile is not the one copied -- EBUSY, its name given back) */
    step = MOVING;
    if (ins_source_hidden_name(old, hidden) != 0 ||
        ins_rename_noreplace_at(olddirfd, old, olddirfd, hidden, 1) != 0)
        goto cleanup;
    hid = 1;
    if (fstatat(olddirfd, hidden, &now, AT_SYMLINK_NOFOLLOW) != 0)
        goto cleanup;
    if (now.st_dev != st.st_dev || now.st_ino != st.st_ino || now.st_size != st.st_size ||
        now.st_mtim.tv_sec != st.st_mtim.tv_sec || now.st_mtim.tv_nsec != st.st_mtim.tv_nsec) {
        errno = EBUSY;
        goto cleanup;
    }
    rc = ins_publish(tmp, np, noreplace); /* removes the temp, sets the message on failure */
    step = PUBLISHED;
    tmp[0] = '\0';
    if (rc == 0)
        unlinkat(olddirfd, hidden, 0); /* (a name this call just made there: it goes) */
cleanup:
    {
        int e = errno;
        if (in >= 0)
            ins_sys.close(in);
        if (out >= 0)
            ins_sys.close(out);
        if (tmp[0] != '\0')
            unlink(tmp);
        ins_release_writing(held);
        /* not published: the source under its name again (unless a file took the name
         * meanwhile: then it stays hidden, replacing nothing, and the message says where) */
        int back = !hid || rc == 0 || ins_rename_noreplace_at(olddirfd, hidden, olddirfd, old,
                                                              0) == 0;
        int be = errno;
        errno = e;
        if (step == COPYING)
            ins_fail(e, "cannot copy %.200s to key %.200s: %s", old, ins_key(np), strerror(e));
        else if (step == MOVING)
            ins_fail(e, "cannot move %.200s to key %.200s: %s%s", old, ins_key(np),
                     strerror(e), e == EBUSY ? " (it changed, or was replaced, during the "
                                               "copy)" : "");
        if (!back)
            ins_fail(e, "key %.200s not published (%s); %.200s could not be named again "
                     "(%s): it is %.200s", ins_key(np), strerror(e), old, strerror(be), hidden);
        errno = e;
    }
    return rc;
}

/* Move (olddirfd, old) to the key: rename, or write-once an atomic no-replace rename -- all or
 * nothing, as libc's rename: a source name that cannot go (an immutable directory, one the user
 * cannot write) fails it, nothing published. (link + unlink, ins_publish's way for its own temp,
 * left the key published and the source name beside it, one file still writable in place by
 * that name.) Where the file system has no RENAME_NOREPLACE: link + unlink, the link undone
 * when the unlink fails -- not atomic there: between the link and its undoing the key's name
 * is visible (a reader woken then may open it, and keeps what it opened), though rename()
 * fails. EXDEV is left to the caller. */
static int ins_move_into_place(int olddirfd, const char *old, const char *abs, int noreplace,
                               int *neither)
{
    *neither = 0;
    if (!noreplace)
        return ins_sys.renameat(olddirfd, old, AT_FDCWD, abs);
    if (ins_sys.renameat2(olddirfd, old, AT_FDCWD, abs, RENAME_NOREPLACE) == 0)
        return 0;
    int e = errno;
    if (e != EINVAL && e != ENOSYS && e != EOPNOTSUPP)
        return -1; /* (EEXIST, EXDEV, EACCES, EPERM...: libc's rename's answer) */
    if (linkat(olddirfd, old, AT_FDCWD, abs, 0) != 0) {
        e = errno;
        *neither = e == EPERM || e == EOPNOTSUPP || e == ENOSYS;
        errno = e;
        return -1;
    }
    if (unlinkat(olddirfd, old, 0) != 0) {
        e = errno;
        unlink(abs);
        errno = e;
        return -1;
    }
    return 0;
}

int ins_publish_move(int olddirfd, const char *old, const struct ins_path *np, int noreplace)
{
    struct stat st;
    if (ins_cfg.timeout_bad) /* a setting refused, like Python's ConfigError */
        return ins_fail(EINVAL, "cannot publish %.300s: %s", ins_key(np), ins_cfg.bad_msg);
    if (np->refuse) /* (a ".." back through a link, a name Python refuses) */
        return ins_fail_refused_key(np);
    ins_clear_message();
    if (ins_lstat_key(np, &st, 1) == 0) { /* confined mkdir -p; the target itself */
        if (ins_check_type(np, &st) != 0)
            return -1;
    } else if (errno != ENOENT) {
        return ins_fail_look(np);
    }
    if (ins_cfg.fsync) {
        int fd = ins_sys.openat(olddirfd, old, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            int synced = fsync(fd), e = errno;
            ins_sys.close(fd);
            if (synced != 0) /* (the data may not be on disk: not published) */
                return ins_fail(e, "cannot publish key %.300s: fsync: %s", ins_key(np),
                                strerror(e));
        }
    }
    int neither = 0, moved;
    for (int tries = 0;; tries++) {
        moved = ins_move_into_place(olddirfd, old, np->abs, noreplace, &neither);
        /* ENOENT with the file still there: the key's directory, empty, was removed since
         * it was made (a reader's failed wait): made again, tried again */
        if (moved == 0 || errno != ENOENT || tries == 7 ||
            faccessat(olddirfd, old, F_OK, AT_SYMLINK_NOFOLLOW) != 0 ||
            ins_remake_parent(np) != 0)
            break;
    }
    if (moved != 0) {
        if (errno == EXDEV) /* across file systems: ins_publish did the fsyncs and the notice */
            return ins_copy_publish(olddirfd, old, np, noreplace);
        if (errno == EEXIST)
            return ins_fail(EEXIST, "key %.300s is already published (write-once)", ins_key(np));
        if (neither)
            return ins_fail_neither(np);
        return ins_fail(errno, "cannot publish key %.300s: %s", ins_key(np), strerror(errno));
    }
    if (ins_cfg.fsync)
        ins_fsync_dir_of(np->abs);
    /* noreplace: write-once across the cluster too */
    int overwrite = !noreplace && ins_cfg.overwrite;
    if (ins_notify_publish_as(np, overwrite) == 0)
        return 0;
    int e = errno;
    if (!overwrite && ins_refused_before_record(e)) /* (back where it came from, unless a
                                                     * file took that name meanwhile) */
        (void)ins_rename_noreplace_at(AT_FDCWD, np->abs, olddirfd, old, 0);
    errno = e;
    return -1;
}
