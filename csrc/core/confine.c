/*
 * confine.c -- nothing escapes the managed directory. A key's path is resolved
 * beneath the managed directory without following any symbolic link there
 * (openat2(RESOLVE_NO_SYMLINKS) on the directory's real path, or on kernels
 * without openat2 an O_NOFOLLOW walk component by component from the managed
 * directory); missing parent directories are created the same confined way.
 * A key that is a symbolic link is refused with ELOOP, a directory with
 * EISDIR, a FIFO, socket or device with EINVAL.
 */
#include "ins_core.h"

#include <linux/openat2.h>
#include <string.h>
#include <sys/file.h>
#include <sys/syscall.h>

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

static atomic_int ins_no_openat2; /* the kernel said ENOSYS once */

static int ins_openat2(int dirfd, const char *path, int flags, mode_t mode)
{
    if (atomic_load_explicit(&ins_no_openat2, memory_order_relaxed)) {
        errno = ENOSYS;
        return -1;
    }
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = (uint64_t)(unsigned)flags;
    how.mode = (flags & (O_CREAT | O_TMPFILE)) ? (uint64_t)(mode & 07777) : 0;
    how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    long fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
    if (fd < 0 && (errno == ENOSYS || errno == EPERM) && dirfd == AT_FDCWD) {
        /* ENOSYS: kernel < 5.6; EPERM: a seccomp filter that refuses it. */
        if (errno == ENOSYS)
            atomic_store_explicit(&ins_no_openat2, 1, memory_order_relaxed);
        errno = ENOSYS;
    }
    return (int)fd;
}

static atomic_int ins_root_ok; /* the managed directory passed ins_root_safe once */

/* Whether the managed directory is safe to use (as instride/store/dirs.py's
 * ensure_private_dir has it): this user's own, and writable by no one else unless sticky
 * (/dev/shm). Another user who made it first (its default name is predictable) could
 * put files under its keys' names, read what is written there, or take keys away.
 * Checked until it passes once per process; a directory not there yet passes (it is made
 * 0700 when needed, ins_mkdir_p). 0, or -1 with EINVAL (a refused setting) and a message. */
static int ins_root_safe(void)
{
    if (atomic_load_explicit(&ins_root_ok, memory_order_acquire))
        return 0;
    size_t len;
    const char *root = ins_root(&len);
    struct stat st;
    if (ins_cfg.dir_len > 0 && lstat(ins_cfg.dir, &st) == 0 && S_ISLNK(st.st_mode))
        return ins_fail(EINVAL, "the managed directory %.300s is a symbolic link (refused, as "
                        "by the Python client: set INSTRIDE_DIR to the directory itself)",
                        ins_cfg.dir);
    if (stat(root, &st) != 0 || !S_ISDIR(st.st_mode))
        return 0; /* (not there yet; or not a directory: the open says ENOTDIR) */
    if (st.st_uid != getuid())
        return ins_fail(EINVAL, "the managed directory %.300s belongs to uid %u, not %u "
                        "(refused: its owner could plant or take keys; set INSTRIDE_DIR)",
                        root, (unsigned)st.st_uid, (unsigned)getuid());
    if ((st.st_mode & 022) && !(st.st_mode & S_ISVTX))
        return ins_fail(EINVAL, "the managed directory %.300s is writable by %s (refused: "
                        "others could plant or take keys; chmod go-w it)", root,
                        (st.st_mode & 02) ? "every user" : "its group");
    atomic_store_explicit(&ins_root_ok, 1, memory_order_release);
    return 0;
}

/* Open the directory abs[0, len) (under the root) by an O_NOFOLLOW walk from the
 * root, creating missing components when create. */
static int ins_walk_dir(const char *abs, size_t len, int create)
{
    size_t rlen;
    const char *root = ins_root(&rlen);
    if (len < rlen || strncmp(abs, root, rlen) != 0 || (len > rlen && abs[rlen] != '/')) {
        errno = EINVAL;
        return -1;
    }
    int dfd = ins_sys.open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 && errno == ENOENT && create) {
        char buf[PATH_MAX];
        memcpy(buf, root, rlen + 1);
        if (ins_mkdir_p(buf) == 0)
            dfd = ins_sys.open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    }
    if (dfd < 0)
        return -1;
    size_t i = rlen;
    while (i < len) {
        while (i < len && abs[i] == '/')
            i++;
        if (i >= len)
            break;
        size_t s = i;
        while (i < len && abs[i] != '/')
            i++;
        char comp[NAME_MAX + 1];
        if (i - s > NAME_MAX) {
            ins_sys.close(dfd);
            errno = ENAMETOOLONG;
            return -1;
        }
        memcpy(comp, abs + s, i - s);
        comp[i - s] = '\0';
        int nfd = ins_sys.openat(dfd, comp, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (nfd < 0 && errno == ENOENT && create &&
            (mkdirat(dfd, comp, 0777) == 0 || errno == EEXIST))
            nfd = ins_sys.openat(dfd, comp, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (nfd < 0 && errno == ENOTDIR) {
            struct stat st;
            if (fstatat(dfd, comp, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
                errno = ELOOP;
            else
                errno = ENOTDIR;
        }
        int e = errno;
        ins_sys.close(dfd);
        if (nfd < 0) {
            errno = e;
            return -1;
        }
        dfd = nfd;
    }
    return dfd;
}

int ins_parent_fd(const struct ins_path *p, int create)
{
    if (ins_root_safe() != 0)
        return -1;
    const char *slash = strrchr(p->abs, '/');
    size_t len = (size_t)(slash - p->abs);
    char dir[PATH_MAX];
    memcpy(dir, p->abs, len);
    dir[len] = '\0';
    int fd = ins_openat2(AT_FDCWD, len ? dir : "/", O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
    if (fd >= 0)
        return fd;
    /* ELOOP: the walk tells a link below the managed directory (refused) from one
     * made above it after start-up (the user's choice, followed). */
    if (errno == ENOSYS || errno == ELOOP || (errno == ENOENT && create))
        fd = ins_walk_dir(p->abs, len, create);
    if (fd >= 0)
        return fd;
    if (errno == ELOOP)
        return ins_fail(ELOOP, "key %.300s: its path goes through a symbolic link inside the "
                        "managed directory (refused: nothing escapes it)", ins_key(p));
    if (errno == ENOENT)
        return -1; /* the caller decides; no message */
    return ins_fail(errno, "key %.300s: cannot open its directory: %s", ins_key(p),
                    strerror(errno));
}

int ins_check_type(const struct ins_path *p, const struct stat *st)
{
    if (S_ISREG(st->st_mode))
        return 0;
    if (S_ISLNK(st->st_mode))
        return ins_fail(ELOOP, "key %.300s is a symbolic link (refused: nothing escapes the "
                        "managed directory)", ins_key(p));
    if (S_ISDIR(st->st_mode))
        return ins_fail(EISDIR, "key %.300s names a directory, not a file", ins_key(p));
    return ins_fail(EINVAL, "key %.300s is not a regular file (a FIFO, socket or device)",
                    ins_key(p));
}

int ins_lstat_key(const struct ins_path *p, struct stat *st, int create_parents)
{
    int pfd = ins_parent_fd(p, create_parents);
    if (pfd < 0)
        return -1;
    int rc = fstatat(pfd, strrchr(p->abs, '/') + 1, st, AT_SYMLINK_NOFOLLOW);
    int e = errno;
    ins_sys.close(pfd);
    errno = e;
    return rc;
}

int ins_open_read_confined(const struct ins_path *p, int flags, mode_t mode, int allow_dir)
{
    if (p->refuse)
        return ins_fail_refused_key(p);
    if (ins_root_safe() != 0)
        return -1;
    /* O_NONBLOCK: a FIFO must not block the open before it can be refused. */
    int extra = (flags & O_NONBLOCK) ? 0 : O_NONBLOCK;
    int fd = ins_openat2(AT_FDCWD, p->abs, flags | extra, mode);
    /* No openat2 (ENOSYS), flags it refuses but open(2) ignores (EINVAL), or a
     * link that may lie above the managed directory (ELOOP): O_NOFOLLOW from a
     * confined parent. */
    if (fd < 0 && (errno == ENOSYS || errno == EINVAL || errno == ELOOP)) {
        int pfd = ins_parent_fd(p, 0);
        if (pfd < 0)
            return -1;
        fd = ins_sys.openat(pfd, strrchr(p->abs, '/') + 1, flags | extra | O_NOFOLLOW, mode);
        int e = errno;
        ins_sys.close(pfd);
        errno = e;
    }
    if (fd < 0) {
        if (errno == ELOOP)
            return ins_fail(ELOOP, "key %.300s: its path goes through a symbolic link inside "
                            "the managed directory (refused: nothing escapes it)", ins_key(p));
        return -1; /* ENOENT & co: the caller decides */
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        ins_sys.close(fd);
        errno = e;
        return -1;
    }
    if (!S_ISREG(st.st_mode) && !(allow_dir && S_ISDIR(st.st_mode))) {
        ins_sys.close(fd);
        return ins_check_type(p, &st);
    }
    if (extra && fcntl(fd, F_SETFL, flags) != 0) {
        int e = errno;
        ins_sys.close(fd);
        errno = e;
        return -1;
    }
    if (S_ISREG(st.st_mode) && ins_hold_frame(fd, &st, p->abs, ins_key(p)) != 0) {
        ins_sys.close(fd);
        errno = ENOENT;
        return -1;
    }
    return fd;
}

/* Whether a key names a stream's frame: frame_<9 digits>.isf (stream.FRAME_FORMAT). */
static int ins_is_frame(const char *key)
{
    const char *name = strrchr(key, '/');
    name = name != NULL ? name + 1 : key;
    if (strlen(name) != 19 || strncmp(name, "frame_", 6) != 0 || strcmp(name + 15, ".isf") != 0)
        return 0;
    for (int i = 6; i < 15; i++)
        if (name[i] < '0' || name[i] > '9')
            return 0;
    return 1;
}

int ins_hold_frame(int fd, const struct stat *st, const char *path, const char *key)
{
    if (!ins_is_frame(key))
        return 0;
    struct stat own, now;
    if (flock(fd, LOCK_SH | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK) /* its producer rewrites it for a later frame: retired */
            return ins_fail(ENOENT, "key %.300s: its frame was retired", key);
        return 0; /* no flock here (as for a stream's reader): nothing to hold */
    }
    if (st == NULL) {
        if (fstat(fd, &own) != 0)
            return 0;
        st = &own;
    }
    if (lstat(path, &now) != 0 || now.st_ino != st->st_ino || now.st_dev != st->st_dev)
        return ins_fail(ENOENT, "key %.300s: its frame was retired", key);
    return 0;
}

int ins_dotdot_through_link(const char *raw)
{
    char prefix[PATH_MAX];
    size_t w = 0, r = 0;
    prefix[0] = '\0';
    while (raw[r]) {
        while (raw[r] == '/')
            r++;
        if (!raw[r])
            break;
        size_t s = r;
        while (raw[r] && raw[r] != '/')
            r++;
        size_t n = r - s;
        if (n == 1 && raw[s] == '.')
            continue;
        if (n == 2 && raw[s] == '.' && raw[s + 1] == '.') {
            size_t koff;
            struct stat st;
            if ((ins_under(prefix, ins_cfg.dir, ins_cfg.dir_len, &koff) ||
                 ins_under(prefix, ins_cfg.dir_real, ins_cfg.dir_real_len, &koff)) &&
                lstat(prefix, &st) == 0 && S_ISLNK(st.st_mode))
                return 1;
            while (w > 0 && prefix[w - 1] != '/')
                w--;
            if (w > 0)
                w--;
            prefix[w] = '\0';
            continue;
        }
        if (w + 1 + n >= sizeof prefix)
            return 0;
        prefix[w++] = '/';
        memcpy(prefix + w, raw + s, n);
        w += n;
        prefix[w] = '\0';
    }
    return 0;
}
