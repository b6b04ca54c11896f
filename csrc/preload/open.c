/*
 * open.c -- open, open64, openat, openat64, their fortified variants
 * (__open_2 ...), creat, creat64 and mkstemp & co. (mkostemp, mkstemps,
 * mkostemps and their 64 variants).
 *
 * For a key under the managed directory: a read consumes first, then opens the
 * final (or, in cluster mode, the server-given) path; a write opens a fresh
 * temp file in the key's directory and registers it, to be published on its
 * last close. Every other path goes to libc unchanged.
 */
#include "instride_preload.h"

#include <stdlib.h>
#include <string.h>

#define INS_NEEDS_MODE(flags) (((flags) & O_CREAT) != 0 || ((flags) & O_TMPFILE) == O_TMPFILE)

#define INS_GET_MODE(flags, last, mode)                                             \
    do {                                                                            \
        if (INS_NEEDS_MODE(flags)) {                                                \
            va_list ap_;                                                            \
            va_start(ap_, last);                                                    \
            mode = (mode_t)va_arg(ap_, unsigned int);                               \
            va_end(ap_);                                                            \
        }                                                                           \
    } while (0)

/* Is this open ours? O_DIRECTORY / O_PATH opens never are. 1: a key (*p filled); 0: not
 * ours (libc's); -1 with errno: refused — a path under the managed directory too long to
 * confine (ENAMETOOLONG), never opened in place as a plain file (visible while written). */
static inline int ins_intercept(int dirfd, const char *path, int flags, struct ins_path *p)
{
    if (ins_busy || (flags & (O_DIRECTORY | O_PATH)))
        return 0;
    int kind = ins_classify(dirfd, path, p);
    if (kind == INS_TOOLONG)
        return ins_fail(ENAMETOOLONG, "%.300s: its path under the managed directory is too "
                        "long (PATH_MAX) to be a key", path);
    return kind == INS_MANAGED;
}

static inline int ins_passed(int fd)
{
    if (fd >= 0 && ins_table_any())
        ins_fd_reused(fd);
    return fd;
}

int ins_fail_refused(const struct ins_path *p, int flags)
{
    /* A read-write open gets EROFS: what runtimes that open read-write first retry
     * read-only on (libgfortran's OPEN without ACTION=) */
    if ((flags & O_ACCMODE) == O_RDWR && !(flags & O_APPEND))
        return ins_fail(EROFS, "key %.300s: keys are read-only (no in-place update)", ins_key(p));
    return ins_fail(EPERM, "key %.300s: append and in-place update are refused", ins_key(p));
}

/* Read open of a key after its fast path missed: consume, then open. */
static int ins_open_consumed(const struct ins_path *p, int flags, mode_t mode)
{
    char open_path[PATH_MAX];
    if (ins_consume(p, open_path) != 0)
        return -1;
    int fd = ins_cfg.cluster ? ins_real_open(open_path, flags, mode)
                             : ins_open_read_confined(p, flags, mode, 0);
    if (fd >= 0 && ins_cfg.cluster && ins_hold_frame(fd, NULL, open_path, ins_key(p)) != 0) {
        ins_real_close(fd); /* a frame retired since it was consumed */
        errno = ENOENT;
        return -1;
    }
    return ins_passed(fd);
}

/* Write open of a key: a fresh temp file beside it, registered in the fd table
 * to be published on its last close. */
static int ins_open_produced(const struct ins_path *p, int flags, mode_t mode)
{
    char tmp[PATH_MAX];
    struct ins_file *f = NULL;
    int fd = -1;
    if (ins_prepare_write(p, flags, &mode, tmp) != 0 ||
        (fd = ins_create_temp(p, flags & ~O_TRUNC, mode, tmp)) < 0)
        return -1;
    ins_passed(fd);
    if ((f = ins_file_new(tmp, p)) == NULL) {
        errno = ENOMEM;
        goto fail;
    }
    f->noreplace = (flags & O_EXCL) != 0;
    if (ins_table_put(fd, f) != 0)
        goto fail;
    return fd;
fail:
    {
        int e = errno;
        ins_real_close(fd);
        unlink(tmp);
        free(f);
        errno = e;
    }
    return -1;
}

/* How long a read open with O_CREAT waits for a key the node server says is published (its
 * fetch, or its deletion meanwhile). */
#define INS_READ_MADE_MS 5000

/* A read open of key p as published now (cluster: fetched here if need be): the fd, or -1
 * (ENOENT: not published). In cluster mode the node server is asked whether it is recorded
 * (LOOKUP: a wait's timeout -- another consumer fetching it, a server too slow -- is never
 * taken for "not published"), then for the key (CONSUME, as a read open waits). */
static int ins_open_read_now(const struct ins_path *p, int flags, mode_t mode)
{
    if (!ins_cfg.cluster)
        return ins_open_read_confined(p, flags, mode, 0);
    int recorded = ins_agent_lookup(ins_key(p));
    if (recorded <= 0) {
        if (recorded == 0)
            errno = ENOENT;
        return -1;
    }
    /* (a bounded wait: a key deleted between the look and this is looked at again, not
     * waited for during INSTRIDE_TIMEOUT, for ever where it is unset) */
    char open_path[PATH_MAX];
    if (ins_agent_consume_within(ins_key(p), open_path, INS_READ_MADE_MS) != 0) {
        if (errno == ETIMEDOUT)
            errno = EAGAIN; /* (recorded, not there in time: the caller looks again) */
        return -1;
    }
    int fd = ins_real_open(open_path, flags, mode);
    if (fd >= 0 && ins_hold_frame(fd, NULL, open_path, ins_key(p)) != 0) {
        ins_real_close(fd);
        errno = ENOENT;
        return -1;
    }
    return ins_passed(fd);
}

/* O_RDONLY|O_CREAT ("read it, made empty if missing": util-linux flock(1)'s lock file): a
 * published key opens for reading (O_EXCL: EEXIST); a missing one is published empty at once
 * (write-once: nothing can be written through a read-only descriptor), then opened, so that
 * every such open of the key has the same file -- flock(1)'s processes lock one file. It
 * waited for good for a publication only this open could make. */
static int ins_open_read_made(const struct ins_path *p, int flags, mode_t mode)
{
    int saved = errno, rflags = flags & ~(O_CREAT | O_EXCL);
    for (int tries = 0; tries < 3; tries++) {
        int fd = ins_open_read_now(p, rflags, mode);
        if (fd >= 0) {
            if (!(flags & O_EXCL))
                return ins_passed(fd);
            ins_real_close(fd);
            return ins_fail(EEXIST, "key %.300s is already published (write-once)", ins_key(p));
        }
        if (errno == EAGAIN && ins_cfg.cluster)
            continue; /* (recorded, then not there in time: deleted meanwhile? looked at again) */
        if (errno != ENOENT)
            return -1;
        if (ins_table_foreign()) /* (as for a write open) */
            return ins_fail_foreign(p);
        errno = saved;
        char tmp[PATH_MAX];
        mode_t made = mode;
        int wfd = -1;
        if (ins_prepare_write(p, O_WRONLY | O_CREAT | O_EXCL, &made, tmp) == 0 &&
            (wfd = ins_create_temp(p, O_WRONLY, made, tmp)) >= 0) {
            ins_real_close(wfd);
            if (ins_publish(tmp, p, 1) == 0) {
                fd = ins_open_read_now(p, rflags, mode);
                if (fd >= 0)
                    errno = saved;
                return fd < 0 ? -1 : ins_passed(fd);
            }
        }
        if (errno != EEXIST || (flags & O_EXCL))
            return -1;
        errno = saved; /* (published meanwhile by another: that one is read) */
    }
    return ins_fail(EAGAIN, "key %.300s: neither there to read nor free to make (published and "
                    "removed again meanwhile, three times): try again", ins_key(p));
}

/* Shared implementation of all open variants for a key. */
static int ins_open_managed(const struct ins_path *p, int flags, mode_t mode)
{
    int saved = errno, fd;
    enum ins_open_kind kind = ins_open_kind(flags);
    if (kind == INS_OPEN_REFUSE) /* published keys are immutable; no append / in-place update */
        return ins_fail_refused(p, flags);
    if (kind == INS_OPEN_WRITE && ins_table_foreign())
        return ins_fail_foreign(p);
    ins_busy = 1;
    if (kind == INS_OPEN_READ && ins_cfg.timeout_bad) { /* refused, like Python's ConfigError */
        fd = ins_consume(p, NULL);                       /* fails with EINVAL, naming it */
        goto done;
    }
    if (kind == INS_OPEN_READ && !ins_cfg.cluster && !(flags & O_CREAT)) {
        /* A key is published atomically: if it opens, it is complete. Only a
         * missing key costs more than the open itself. Directories open as in
         * libc; symbolic links and special files are refused. */
        fd = ins_passed(ins_open_read_confined(p, flags, mode, 1));
        if (fd >= 0 || errno != ENOENT)
            goto done;
        errno = saved;
    }
    if (kind == INS_OPEN_READ && ins_cfg.cluster && !(flags & O_CREAT)) {
        /* A directory here opens as in libc (a directory fsync), in cluster mode too:
         * it is never a key the node server could serve. */
        struct stat st;
        if (ins_lstat_key(p, &st, 0) == 0 && S_ISDIR(st.st_mode)) {
            fd = ins_passed(ins_open_read_confined(p, flags, mode, 1));
            goto done;
        }
        errno = saved;
    }
    if (kind == INS_OPEN_READ && (flags & O_CREAT))
        fd = ins_open_read_made(p, flags, mode);
    else
        fd = kind == INS_OPEN_READ ? ins_open_consumed(p, flags, mode)
                                   : ins_open_produced(p, flags, mode);
done:
    ins_busy = 0;
    if (fd >= 0)
        errno = saved;
    return fd;
}

#define INS_OPEN_WRAPPER(name)                                                      \
    INS_WRAPPER(int, name, (const char *path, int flags, ...))                      \
    {                                                                               \
        mode_t mode = 0;                                                            \
        INS_GET_MODE(flags, flags, mode);                                           \
        INS_MAP_OR_FAIL(name, -1);                                                  \
        struct ins_path p;                                                          \
        int k_ = ins_intercept(AT_FDCWD, path, flags, &p);                          \
        if (k_ <= 0)                                                                \
            return k_ < 0 ? -1 : ins_passed(ins_real_##name(path, flags, mode));    \
        return ins_open_managed(&p, flags, mode);                                   \
    }

#define INS_OPENAT_WRAPPER(name)                                                    \
    INS_WRAPPER(int, name, (int dirfd, const char *path, int flags, ...))           \
    {                                                                               \
        mode_t mode = 0;                                                            \
        INS_GET_MODE(flags, flags, mode);                                           \
        INS_MAP_OR_FAIL(name, -1);                                                  \
        struct ins_path p;                                                          \
        int k_ = ins_intercept(dirfd, path, flags, &p);                             \
        if (k_ <= 0)                                                                \
            return k_ < 0 ? -1                                                      \
                    : ins_passed(ins_real_##name(dirfd, path, flags, mode));        \
        return ins_open_managed(&p, flags, mode);                                   \
    }

/* Fortified variants: glibc calls them when flags are not a compile-time
 * constant; they take no mode (O_CREAT is a fatal error there). */
#define INS_OPEN2_WRAPPER(name)                                                     \
    INS_WRAPPER(int, name, (const char *path, int flags))                           \
    {                                                                               \
        INS_MAP_OR_FAIL(name, -1);                                                  \
        struct ins_path p;                                                          \
        int k_ = INS_NEEDS_MODE(flags) ? 0 : ins_intercept(AT_FDCWD, path, flags, &p); \
        if (k_ <= 0)                                                                \
            return k_ < 0 ? -1 : ins_passed(ins_real_##name(path, flags));          \
        return ins_open_managed(&p, flags, 0);                                      \
    }

#define INS_OPENAT2_WRAPPER(name)                                                   \
    INS_WRAPPER(int, name, (int dirfd, const char *path, int flags))                \
    {                                                                               \
        INS_MAP_OR_FAIL(name, -1);                                                  \
        struct ins_path p;                                                          \
        int k_ = INS_NEEDS_MODE(flags) ? 0 : ins_intercept(dirfd, path, flags, &p); \
        if (k_ <= 0)                                                                \
            return k_ < 0 ? -1 : ins_passed(ins_real_##name(dirfd, path, flags));   \
        return ins_open_managed(&p, flags, 0);                                      \
    }

#define INS_CREAT_WRAPPER(name)                                                     \
    INS_WRAPPER(int, name, (const char *path, mode_t mode))                         \
    {                                                                               \
        INS_MAP_OR_FAIL(name, -1);                                                  \
        struct ins_path p;                                                          \
        int k_ = ins_intercept(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, &p);   \
        if (k_ <= 0)                                                                \
            return k_ < 0 ? -1 : ins_passed(ins_real_##name(path, mode));           \
        return ins_open_managed(&p, O_CREAT | O_WRONLY | O_TRUNC, mode);            \
    }

INS_OPEN_WRAPPER(open)
INS_OPEN_WRAPPER(open64)
INS_OPENAT_WRAPPER(openat)
INS_OPENAT_WRAPPER(openat64)
INS_OPEN2_WRAPPER(__open_2)
INS_OPEN2_WRAPPER(__open64_2)
INS_OPENAT2_WRAPPER(__openat_2)
INS_OPENAT2_WRAPPER(__openat64_2)
INS_CREAT_WRAPPER(creat)
INS_CREAT_WRAPPER(creat64)

/* mkstemp & co. of a template under the managed directory: a key written like any other
 * (O_RDWR|O_CREAT|O_EXCL, mode 0600: a temp file, published by its last close), named
 * with six random characters that no published key has. */
static int ins_mkstemp_managed(char *template, int suffixlen, int flags, struct ins_path *p)
{
    static const char letters[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    size_t n = strlen(template), k = strlen(p->abs);
    if (suffixlen < 0 || n < (size_t)suffixlen + 6 || k < (size_t)suffixlen + 6 ||
        memcmp(template + n - suffixlen - 6, "XXXXXX", 6) != 0) {
        errno = EINVAL;
        return -1;
    }
    /* The random part and the suffix must end both the template and the normalized path, in
     * its last component: a suffix with "/" or "..", or one the normalization changed, would
     * create another file than the template names (glibc: ENOENT or EINVAL; here EINVAL) */
    char *x = template + n - suffixlen - 6, *y = p->abs + k - suffixlen - 6;
    if (memchr(x, '/', (size_t)suffixlen + 6) != NULL || memcmp(x, y, (size_t)suffixlen + 6) != 0) {
        errno = EINVAL;
        return -1;
    }
    int saved = errno;
    for (int tries = 0; tries < 100; tries++) {
        uint64_t r = ins_random64();
        for (int i = 0; i < 6; i++, r /= 62)
            x[i] = y[i] = letters[r % 62];
        int fd = ins_open_managed(p, O_RDWR | O_CREAT | O_EXCL | flags, 0600);
        if (fd >= 0)
            errno = saved;
        if (fd >= 0 || errno != EEXIST)
            return fd;
    }
    return -1; /* EEXIST, as libc after as many tries */
}

#define INS_MKSTEMP_WRAPPER(name, params, suffixlen, flags, real_args)             \
    INS_WRAPPER(int, name, params)                                                  \
    {                                                                               \
        INS_MAP_OR_FAIL(name, -1);                                                  \
        struct ins_path p;                                                          \
        int k_ = ins_intercept(AT_FDCWD, template, 0, &p);                          \
        if (k_ <= 0)                                                                \
            return k_ < 0 ? -1 : ins_passed(ins_real_##name real_args);             \
        return ins_mkstemp_managed(template, suffixlen, flags, &p);                 \
    }

INS_MKSTEMP_WRAPPER(mkstemp, (char *template), 0, 0, (template))
INS_MKSTEMP_WRAPPER(mkstemp64, (char *template), 0, 0, (template))
INS_MKSTEMP_WRAPPER(mkostemp, (char *template, int flags), 0, flags, (template, flags))
INS_MKSTEMP_WRAPPER(mkostemp64, (char *template, int flags), 0, flags, (template, flags))
INS_MKSTEMP_WRAPPER(mkstemps, (char *template, int suffixlen), suffixlen, 0,
                    (template, suffixlen))
INS_MKSTEMP_WRAPPER(mkstemps64, (char *template, int suffixlen), suffixlen, 0,
                    (template, suffixlen))
INS_MKSTEMP_WRAPPER(mkostemps, (char *template, int suffixlen, int flags), suffixlen, flags,
                    (template, suffixlen, flags))
INS_MKSTEMP_WRAPPER(mkostemps64, (char *template, int suffixlen, int flags), suffixlen, flags,
                    (template, suffixlen, flags))
