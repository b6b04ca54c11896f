/*
 * publish.c -- produce a key: a hidden temp file next to it, then publication
 * by link(tmp, key) + unlink(tmp) (write-once) or rename(tmp, key)
 * (INSTRIDE_OVERWRITE=1), fsync when INSTRIDE_FSYNC=1, and in cluster mode the
 * registration with the node server.
 */
#include "ins_core.h"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/sendfile.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/stat.h>

#ifdef STATX_MNT_ID
#define INS_STATX_MNT_ID STATX_MNT_ID
#else
#define INS_STATX_MNT_ID 0x00001000U /* (Linux 5.8; headers older than it) */
#endif
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

/* A source moved into the managed directory becomes a key, whose bytes never change: one still
 * open for writing (by anyone, the mover too) is refused, and one opened for writing while it is
 * moved (copied) is not published. A read lease tells both: the kernel grants F_RDLCK only while
 * no descriptor (nor shared writable mapping) has the file open for writing, and an open for
 * writing (or a truncate) meanwhile breaks it -- the writer then waits until the lease is
 * released (or lease-break-time, 45 s by default, has passed), and F_GETLEASE no longer says
 * F_RDLCK. No lease where the file system has none (NFS, Lustre: EINVAL), the caller neither owns
 * the file nor has CAP_LEASE (EACCES), or /proc/sys/fs/leases-enable is 0: moved as before. */
/* Whether the flags of a VmFlags line ("VmFlags: rd wr sh mr mw me ...") hold flag. */
static int ins_vm_flag(const char *line, const char *flag)
{
    for (const char *at = line + 8; (at = strstr(at, flag)) != NULL; at += 2)
        if (at[-1] == ' ' && (at[2] == ' ' || at[2] == '\0'))
            return 1;
    return 0;
}

/* Whether this process has a shared mapping of the file (dev, ino) that counts as a writer to
 * the kernel's lease: a program that mapped it MAP_SHARED through a descriptor opened for
 * writing and closed the descriptor -- writable, or read-only or mprotect'ed since: "sh" and
 * "mw" (may write) among its VmFlags in /proc/self/smaps (not "rw-s" in maps: a read-only one
 * through a read-only descriptor is no writer, and must not hide another process's). */
static int ins_self_maps(dev_t dev, ino_t ino)
{
    int maps = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/smaps", O_RDONLY | O_CLOEXEC);
    if (maps < 0)
        return 0;
    char buf[8192];
    size_t have = 0;
    int found = 0, ours = 0; /* ours: the mapping whose lines these are is of the file */
    for (;;) {
        ssize_t n = (ssize_t)syscall(SYS_read, maps, buf + have, sizeof buf - 1 - have);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0 && have == 0)
            break;
        have += n > 0 ? (size_t)n : 0;
        buf[have] = '\0';
        char *line = buf, *nl;
        while ((nl = strchr(line, '\n')) != NULL || (n <= 0 && *line != '\0')) {
            if (nl != NULL)
                *nl = '\0';
            char perms[8] = "";
            unsigned int major = 0, minor = 0;
            unsigned long long inode = 0;
            if (strncmp(line, "VmFlags:", 8) == 0) {
                if (ours && ins_vm_flag(line, "sh") && ins_vm_flag(line, "mw"))
                    found = 1;
            } else if (sscanf(line, "%*x-%*x %7s %*x %x:%x %llu", perms, &major, &minor,
                              &inode) == 4) { /* a mapping's first line */
                ours = inode == (unsigned long long)ino && major == major(dev) &&
                       minor == minor(dev);
            }
            if (nl == NULL) {
                line += strlen(line);
                break;
            }
            line = nl + 1;
        }
        if (found || n <= 0)
            break;
        have = strlen(line); /* (a line cut at the buffer's end: kept for the next read) */
        memmove(buf, line, have);
        if (have >= sizeof buf - 1)
            have = 0; /* (a line longer than the buffer: its path only, dropped) */
    }
    syscall(SYS_close, maps);
    return found;
}

/* Whether this process itself has the file of fd (its private descriptor) open for writing
 * through another descriptor or a shared writable mapping -- the idiom "write a temporary file,
 * flush it, rename it into place, then close it" (the writer done, not yet closed) -- or this
 * cannot be told (no /proc: then as before leases). Read from /proc/self (raw system calls: no
 * wrapper of this library on the way). */
static int ins_self_writes(int fd)
{
    struct stat st, other;
    if (fstat(fd, &st) != 0)
        return 1;
    int dir = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/fd",
                           O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) /* (no /proc; out of descriptors, say, it is another's writer as far as known) */
        return errno == ENOENT || errno == ENOTDIR || errno == EACCES;
    char buf[4096];
    int found = 0;
    long n;
    while (!found && (n = syscall(SYS_getdents64, dir, buf, sizeof buf)) > 0) {
        for (long at = 0; at < n && !found;) {
            /* struct linux_dirent64: d_ino (8), d_off (8), d_reclen (2), d_type (1), d_name */
            unsigned short reclen;
            memcpy(&reclen, buf + at + 16, sizeof reclen);
            const char *name = buf + at + 19;
            at += reclen;
            char *end;
            long other_fd = strtol(name, &end, 10);
            if (end == name || *end != '\0' || other_fd == fd || other_fd == dir ||
                other_fd < 0 || other_fd > INT_MAX)
                continue;
            long flags = syscall(SYS_fcntl, (int)other_fd, F_GETFL);
            found = flags >= 0 && (flags & O_ACCMODE) != O_RDONLY &&
                    fstat((int)other_fd, &other) == 0 && other.st_dev == st.st_dev &&
                    other.st_ino == st.st_ino;
        }
    }
    syscall(SYS_close, dir);
    return found || ins_self_maps(st.st_dev, st.st_ino);
}

int ins_lease_source(int fd)
{
    int saved = errno;
    /* A lease break is told to its holder by a signal: SIGIO by default, whose default action
     * kills the process -- and a library cannot install handlers in the program it runs in.
     * SIGURG instead, set on this private descriptor only: ignored by default, and taken
     * spuriously by design by the programs that handle it (out-of-band socket data, which
     * they read if there is any; the Go runtime, which preempts goroutines with it). The
     * break itself is read from F_GETLEASE (ins_lease_broken), never from the signal. */
    if (syscall(SYS_fcntl, fd, F_SETSIG, SIGURG) != 0) {
        errno = saved;
        return 0;
    }
    if (syscall(SYS_fcntl, fd, F_SETLEASE, F_RDLCK) == 0) {
        errno = saved;
        return 1;
    }
    int busy = errno == EAGAIN; /* (open for writing somewhere) */
    /* ... by this very process (its other writers, if any, cannot be told apart): moved
     * unchecked, as before leases -- "write, rename, close" is a common way to put a file in
     * place, and the writer is done with it (what it writes after the rename would change the
     * key: documented, as for a forked child's writes) */
    if (busy && ins_self_writes(fd))
        busy = 0;
    errno = busy ? EBUSY : saved;
    return busy ? -1 : 0;
}

int ins_lease_broken(int fd)
{
    int saved = errno;
    long type = syscall(SYS_fcntl, fd, F_GETLEASE); /* (F_UNLCK once a writer came) */
    errno = saved;
    return type != F_RDLCK;
}

int ins_fail_open_for_writing(const char *old, const struct ins_path *np, const char *what)
{
    return ins_fail(EBUSY, "cannot move %.200s to key %.200s: %s (a key's bytes never change "
                    "once published: close it, then move it)", old, ins_key(np),
                    what != NULL ? what : "it is open for writing elsewhere");
}

/* After n bytes more copied (*since: copied since the lease was last looked at): -1 with
 * EBUSY when a writer broke the lease on the source, looked at every 64 MiB -- a writer that
 * opened it waits for the copy's end, told so soon it waits no longer than a chunk's copy. */
static int ins_copy_step(int lease, ssize_t n, size_t *since)
{
    *since += (size_t)n;
    if (lease < 0 || *since < ((size_t)64 << 20))
        return 0;
    *since = 0;
    if (!ins_lease_broken(lease))
        return 0;
    errno = EBUSY;
    return -1;
}

int ins_copy_fd(int in, int out, int lease)
{
    size_t chunk = lease >= 0 ? (size_t)64 << 20 : (size_t)1 << 30, since = 0;
    for (;;) {
        ssize_t n = copy_file_range(in, NULL, out, NULL, chunk, 0);
        if (n == 0)
            return 0;
        if (n > 0) {
            if (ins_copy_step(lease, n, &since) != 0)
                return -1;
            continue;
        }
        if (errno == EINTR)
            continue;
        if (errno != EXDEV && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
            return -1;
        break;
    }
    for (;;) { /* older kernels / special files: sendfile, then read/write */
        ssize_t n = sendfile(out, in, NULL, chunk);
        if (n == 0)
            return 0;
        if (n > 0) {
            if (ins_copy_step(lease, n, &since) != 0)
                return -1;
            continue;
        }
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
        if (ins_copy_step(lease, n, &since) != 0)
            return -1;
    }
}

/* A hidden name beside the source old (in its directory, relative to olddirfd as old is),
 * in hidden[PATH_MAX]: ".instride-moving-<pid>-<hex>.<name>" -- no temporary file's name
 * (keys.TMP_PATTERN ends in ".tmp"): `instride gc` never takes it, it is the user's file; and,
 * starting with ".instride", never a key either (a source inside the managed directory, a key
 * renamed to another: never listed nor consumed under it meanwhile). 0, or -1 with
 * ENAMETOOLONG. */
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
    snprintf(hidden + dir_len, PATH_MAX - dir_len, ".instride-moving-%ld-%016llx.%.*s",
             (long)getpid(), (unsigned long long)ins_random64(), (int)base_len, base);
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
 * during the copy left it under, for gc to remove.) in: the source opened by the caller
 * (closed here), leased: whether it holds a read lease (ins_lease_source) -- a writer that
 * opened the source during the copy breaks it: EBUSY, nothing published. */
static int ins_copy_publish(int olddirfd, const char *old, const struct ins_path *np,
                            int noreplace, int in, int leased)
{
    struct stat st, now;
    char tmp[PATH_MAX], hidden[PATH_MAX];
    int out = -1, held = -1, rc = -1, hid = 0;
    enum { COPYING, MOVING, PUBLISHED } step = COPYING;
    const char *busy = NULL; /* why EBUSY: the source changed, or a writer came */
    static const char opened[] = "it was open for writing elsewhere during the copy";
    tmp[0] = '\0';
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
    if (ins_copy_fd(in, out, leased ? in : -1) != 0) {
        busy = leased && errno == EBUSY ? opened : NULL;
        goto cleanup;
    }
    if (ins_maybe_fsync(out) != 0)
        goto cleanup; /* (not on disk: not published; errno says why) */
    held = ins_hold_writing(out); /* the lock, until the rename */
    int fd = out;
    out = -1;
    if (ins_sys.close(fd) != 0)
        goto cleanup;
    /* the copy is whole: the source's name goes now (the file copied, unchanged since: one
     * opened for writing meanwhile -- the lease broken --, or, with no lease, one replaced or
     * written to, is not the one copied -- EBUSY, its name given back). A size and time look
     * only misses a rewrite in place to the same size within one tick of the clock (kernels
     * before 6.13) or whose time was set back: the lease, where there is one, does not. */
    step = MOVING;
    if (leased && ins_lease_broken(in)) {
        busy = opened;
        errno = EBUSY;
        goto cleanup;
    }
    if (ins_source_hidden_name(old, hidden) != 0 ||
        ins_rename_noreplace_at(olddirfd, old, olddirfd, hidden, 1) != 0)
        goto cleanup;
    hid = 1;
    if (fstatat(olddirfd, hidden, &now, AT_SYMLINK_NOFOLLOW) != 0)
        goto cleanup;
    if (now.st_dev != st.st_dev || now.st_ino != st.st_ino || now.st_size != st.st_size ||
        now.st_mtim.tv_sec != st.st_mtim.tv_sec || now.st_mtim.tv_nsec != st.st_mtim.tv_nsec) {
        busy = "it changed, or was replaced, during the copy";
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
        if (busy != NULL)
            ins_fail_open_for_writing(old, np, busy);
        else if (step == COPYING)
            ins_fail(e, "cannot copy %.200s to key %.200s: %s", old, ins_key(np), strerror(e));
        else if (step == MOVING)
            ins_fail(e, "cannot move %.200s to key %.200s: %s", old, ins_key(np), strerror(e));
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

/* Whether the file of fd is on the mount of abs's directory -- the same mount, not only the
 * same device: two bind mounts of one file system share st_dev, and rename between them is
 * EXDEV all the same (statx's mount id, Linux 5.8; the device where there is none). A look,
 * no guarantee: a move that still fails with EXDEV is named back and takes the copy's way. */
static int ins_same_fs(int fd, const char *abs)
{
    char parent[PATH_MAX];
    const char *slash = strrchr(abs, '/');
    size_t n = slash != NULL ? (size_t)(slash - abs) : 0;
    if (n == 0 || n >= sizeof parent)
        return 0;
    memcpy(parent, abs, n);
    parent[n] = '\0';
    struct statx file, dir;
    if (statx(fd, "", AT_EMPTY_PATH, INS_STATX_MNT_ID, &file) != 0 ||
        statx(AT_FDCWD, parent, 0, INS_STATX_MNT_ID, &dir) != 0)
        return 0;
    if ((file.stx_mask & INS_STATX_MNT_ID) && (dir.stx_mask & INS_STATX_MNT_ID))
        return file.stx_mnt_id == dir.stx_mnt_id;
    return file.stx_dev_major == dir.stx_dev_major && file.stx_dev_minor == dir.stx_dev_minor;
}

int ins_publish_move(int olddirfd, const char *old, const struct ins_path *np, int noreplace)
{
    struct stat st;
    if (ins_cfg.timeout_bad) /* a setting refused, like Python's ConfigError */
        return ins_fail(EINVAL, "cannot publish %.300s: %s", ins_key(np), ins_cfg.bad_msg);
    if (np->refuse) /* (a ".." back through a link, a name Python refuses) */
        return ins_fail_refused_key(np);
    ins_clear_message();
    int key_there = 0;
    if (ins_lstat_key(np, &st, 1) == 0) { /* confined mkdir -p; the target itself */
        if (ins_check_type(np, &st) != 0)
            return -1;
        key_there = 1;
    } else if (errno != ENOENT) {
        return ins_fail_look(np);
    }
    /* The source, read-only, holds a read lease until it has its new name: refused while open
     * for writing anywhere (EAGAIN), broken by a writer's open meanwhile (no link followed, no
     * FIFO waited on, no writer's lease waited for: EWOULDBLOCK). No descriptor (the caller
     * may not read it: rename needs no read permission) or no lease: moved as before. */
    int lease = ins_sys.openat(olddirfd, old, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    int leased = lease >= 0 ? ins_lease_source(lease) : 0;
    if (leased < 0 || (lease < 0 && errno == EWOULDBLOCK)) {
        if (lease >= 0)
            ins_sys.close(lease);
        return ins_fail_open_for_writing(old, np, NULL);
    }
    if (ins_cfg.fsync && lease >= 0 && fsync(lease) != 0) { /* (not on disk: not published) */
        int e = errno;
        ins_sys.close(lease);
        return ins_fail(e, "cannot publish key %.300s: fsync: %s", ins_key(np), strerror(e));
    }
    /* Leased, the source's name goes first, to a hidden name beside it (same directory: one
     * atomic rename, a name gc never takes): a writer whose open found the name before that
     * waits for the lease, and the look at the lease after it sees it -- before the file is the
     * key, where a reader woken by its appearance could open it. (Not hidden -- its name too
     * long, say: moved in one step, looked at before and after.) */
    /* Only where the move can succeed: the key's directory on the source's file system (else
     * the copy below), and, write-once, no key there yet (else EEXIST) -- hidden for a move
     * bound to fail, the source's name would be missing for nothing, and a file made under it
     * meanwhile would keep the source from being named back. */
    char hidden[PATH_MAX];
    const char *from = old;
    if (leased && !(noreplace && key_there) && ins_same_fs(lease, np->abs) &&
        ins_source_hidden_name(old, hidden) == 0 &&
        ins_rename_noreplace_at(olddirfd, old, olddirfd, hidden, 1) == 0)
        from = hidden;
    int neither = 0, moved = -1;
    for (int tries = 0;; tries++) {
        if (leased && ins_lease_broken(lease)) { /* (a writer came: during the fsync, or before
                                                  * the name went) */
            int back = from == old || ins_rename_noreplace_at(olddirfd, from, olddirfd, old, 0) == 0;
            ins_sys.close(lease);
            if (!back)
                return ins_fail(EBUSY, "cannot move %.200s to key %.200s: it was opened for "
                                "writing elsewhere while it was moved, and it could not be "
                                "named again: it is %.300s", old, ins_key(np), from);
            return ins_fail_open_for_writing(old, np, NULL);
        }
        moved = ins_move_into_place(olddirfd, from, np->abs, noreplace, &neither);
        /* ENOENT with the file still there: the key's directory, empty, was removed since
         * it was made (a reader's failed wait): made again, tried again */
        if (moved == 0 || errno != ENOENT || tries == 7 ||
            faccessat(olddirfd, from, F_OK, AT_SYMLINK_NOFOLLOW) != 0 ||
            ins_remake_parent(np) != 0)
            break;
    }
    if (moved != 0 && from != old) { /* (not moved: its own name again, as it was) */
        int e = errno;
        if (ins_rename_noreplace_at(olddirfd, from, olddirfd, old, 0) != 0) {
            if (lease >= 0)
                ins_sys.close(lease);
            /* (EBUSY, never the move's errno: EXDEV or ENOENT would have mv copy the file now
             * under the name, not the source) */
            return ins_fail(EBUSY, "key %.200s not published (%s); %.200s could not be named "
                            "again (%s): it is %.300s", ins_key(np), strerror(e), old,
                            strerror(errno), from);
        }
        errno = e;
    }
    if (moved != 0) {
        if (errno == EXDEV && noreplace && key_there) { /* (write-once, the key there when looked
                                                         * at: EEXIST now, not after a copy of
                                                         * minutes, the source hidden for it) */
            if (lease >= 0)
                ins_sys.close(lease);
            return ins_fail(EEXIST, "key %.300s is already published (write-once)", ins_key(np));
        }
        if (errno == EXDEV) /* across file systems: ins_publish did the fsyncs and the notice */
            return ins_copy_publish(olddirfd, old, np, noreplace,
                                    lease >= 0 ? lease : ins_sys.openat(olddirfd, old, O_RDONLY |
                                                       O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK),
                                    leased);
        int e = errno;
        if (lease >= 0)
            ins_sys.close(lease);
        errno = e;
        if (errno == EEXIST)
            return ins_fail(EEXIST, "key %.300s is already published (write-once)", ins_key(np));
        if (neither)
            return ins_fail_neither(np);
        return ins_fail(errno, "cannot publish key %.300s: %s", ins_key(np), strerror(errno));
    }
    /* Moved: the file is the key now. A writer whose open began during the move (the lease
     * broken: it waits) would be given the key's file once the lease goes -- write-once, the
     * file is named back and the rename refused. (Replacing, the key's previous file is gone:
     * it stays published. A writer whose open looked the name up before the move but reaches
     * the lease only after it was released is not seen: a window of one rename.) */
    if (leased && noreplace && ins_lease_broken(lease)) {
        /* (its name given back -- or, taken meanwhile, a hidden one: never left at the key,
         * unrecorded, for a writer to change) */
        char back[PATH_MAX];
        const char *to = old;
        int named = ins_rename_noreplace_at(AT_FDCWD, np->abs, olddirfd, old, 0) == 0;
        if (!named && ins_source_hidden_name(old, back) == 0 &&
            ins_rename_noreplace_at(AT_FDCWD, np->abs, olddirfd, back, 1) == 0) {
            named = 1;
            to = back;
        }
        if (!named && ins_source_hidden_name(np->abs, back) == 0 &&
            ins_rename_noreplace_at(AT_FDCWD, np->abs, AT_FDCWD, back, 1) == 0) {
            named = 1; /* (its source's directory gone, say: a hidden name beside the key, never
                        * a key, rather than the key, unrecorded, for a writer to change) */
            to = back;
        }
        ins_sys.close(lease);
        if (!named)
            return ins_fail(EBUSY, "cannot move %.200s to key %.200s: it was opened for writing "
                            "elsewhere while it was moved, and it could not be named back: it "
                            "is at the key, not announced", old, ins_key(np));
        if (to != old)
            return ins_fail(EBUSY, "cannot move %.200s to key %.200s: it was opened for writing "
                            "elsewhere while it was moved, and it could not be named again: "
                            "it is %.300s", old, ins_key(np), to);
        return ins_fail_open_for_writing(old, np, "it was opened for writing elsewhere while it "
                                         "was moved");
    }
    if (lease >= 0)
        ins_sys.close(lease); /* (a writer waiting for it goes on: with the key's file) */
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
