/*
 * stdio.c -- fopen, fopen64, freopen, freopen64, fclose.
 *
 * glibc's stdio opens and closes through internal calls that never reach our
 * open/close wrappers, so the stream functions are wrapped themselves: a
 * managed "r" stream consumes first; a "w" stream is a stream on a fresh temp
 * file (opened with "x"), published by the fclose that closes its fd.
 */
#include "instride_preload.h"

#include <stdlib.h>
#include <string.h>

/* fopen mode -> open flags. Returns -1 for a mode libc would reject. */
static int ins_mode_flags(const char *mode, int *flags)
{
    size_t n = strcspn(mode, ",");
    int plus = n > 1 && memchr(mode + 1, '+', n - 1) != NULL;
    int excl = n > 1 && memchr(mode + 1, 'x', n - 1) != NULL;
    int rw = plus ? O_RDWR : O_WRONLY;
    switch (mode[0]) {
    case 'r':
        *flags = plus ? O_RDWR : O_RDONLY;
        return 0;
    case 'w':
        *flags = rw | O_CREAT | O_TRUNC | (excl ? O_EXCL : 0);
        return 0;
    case 'a':
        *flags = rw | O_CREAT | O_APPEND | (excl ? O_EXCL : 0);
        return 0;
    default:
        return -1;
    }
}

/* What a managed fopen/freopen opens: the consumed path (mode unchanged) or a
 * fresh temp name (mode + "x"). */
static int ins_stdio_target(const struct ins_path *p, const char *mode, char target[PATH_MAX],
                            char tmode[64], int *writing)
{
    int flags = 0;
    *writing = 0;
    if (ins_mode_flags(mode, &flags) != 0) {
        errno = EINVAL;
        return -1;
    }
    enum ins_open_kind kind = ins_open_kind(flags);
    if (kind == INS_OPEN_REFUSE)
        return ins_fail_refused(p, flags);
    if (kind == INS_OPEN_WRITE && ins_table_foreign())
        return ins_fail_foreign(p);
    size_t n = strcspn(mode, ",");
    if (strlen(mode) + 2 > 64) {
        errno = EINVAL;
        return -1;
    }
    if (kind == INS_OPEN_READ) {
        memcpy(tmode, mode, strlen(mode) + 1);
        return ins_consume(p, target);
    }
    mode_t m = 0666;
    if (ins_prepare_write(p, flags, &m, target) != 0)
        return -1;
    memcpy(tmode, mode, n);
    size_t k = n;
    if (memchr(mode, 'x', n) == NULL)
        tmode[k++] = 'x';
    memcpy(tmode + k, mode + n, strlen(mode + n) + 1);
    *writing = 1;
    return 0;
}

static FILE *ins_passed_fp(FILE *fp)
{
    if (fp != NULL && ins_table_any())
        ins_fd_reused(fileno(fp));
    return fp;
}

/* Register a freshly opened temp stream. On failure the stream is closed. */
static int ins_register_stream(FILE *fp, const char *tmp, const struct ins_path *p,
                               const char *mode, int (*real_fclose)(FILE *))
{
    struct ins_file *f = ins_file_new(tmp, p);
    if (f != NULL) /* "wx": write-once even with INSTRIDE_OVERWRITE=1 */
        f->noreplace = strchr(mode, 'x') != NULL;
    if (f == NULL || ins_table_put(fileno(fp), f) != 0) {
        int e = f == NULL ? ENOMEM : errno;
        real_fclose(fp);
        unlink(tmp);
        free(f);
        errno = e;
        return -1;
    }
    return 0;
}

typedef FILE *(*ins_fopen_fn)(const char *, const char *);

/* Local mode: a read stream on the key opened confined (no symbolic link,
 * no special file; directories only when allow_dir), then fdopen'ed. */
static FILE *ins_fopen_read_confined(const struct ins_path *p, const char *mode, int allow_dir)
{
    int flags = O_RDONLY | (strchr(mode, 'e') != NULL ? O_CLOEXEC : 0);
    int fd = ins_open_read_confined(p, flags, 0, allow_dir);
    if (fd < 0)
        return NULL;
    FILE *fp = fdopen(fd, mode);
    if (fp == NULL) {
        int e = errno;
        ins_real_close(fd);
        errno = e;
    }
    return fp;
}

static FILE *ins_fopen_managed(const struct ins_path *p, const char *mode, ins_fopen_fn real)
{
    int saved = errno, writing = 0;
    char target[PATH_MAX], tmode[64];
    int flags = 0;
    int local_read = !ins_cfg.cluster && ins_mode_flags(mode, &flags) == 0 &&
                     ins_open_kind(flags) == INS_OPEN_READ;
    FILE *fp = NULL;
    ins_busy = 1;
    if (local_read && ins_cfg.timeout_bad) { /* refused, as open() refuses it */
        (void)ins_consume(p, NULL);           /* fails with EINVAL, naming it */
        goto done;
    }
    if (local_read) {
        /* published keys are complete: try the open first, wait only if missing */
        fp = ins_passed_fp(ins_fopen_read_confined(p, mode, 1));
        if (fp != NULL || errno != ENOENT)
            goto done;
        errno = saved;
    }
    if (ins_stdio_target(p, mode, target, tmode, &writing) != 0)
        goto done;
    fp = local_read ? ins_fopen_read_confined(p, mode, 0) : real(target, tmode);
    if (fp != NULL && !writing && !local_read &&
        ins_hold_frame(fileno(fp), NULL, target, ins_key(p)) != 0) {
        ins_real_fclose(fp); /* a frame retired since it was consumed */
        fp = NULL;
        errno = ENOENT;
    }
    for (int tries = 0; fp == NULL && writing && (errno == EEXIST || errno == ENOENT)
                        && tries < 8; tries++) {
        /* (ENOENT: its directory, empty, was removed meanwhile: made again, as for open) */
        if (errno == ENOENT ? ins_remake_parent(p) != 0 : ins_temp_name(p, target) != 0)
            break;
        fp = real(target, tmode);
    }
    if (fp == NULL)
        goto done;
    if (writing)
        ins_mark_writing(fileno(fp));
    else
        ins_passed_fp(fp);
    if (writing && ins_register_stream(fp, target, p, mode, ins_real_fclose) != 0)
        fp = NULL; /* the stream was closed and its temp removed */
done:
    ins_busy = 0;
    if (fp != NULL)
        errno = saved;
    return fp;
}

#define INS_FOPEN_WRAPPER(name)                                                     \
    INS_WRAPPER(FILE *, name, (const char *path, const char *mode))                 \
    {                                                                               \
        INS_MAP_OR_FAIL(name, NULL);                                                \
        struct ins_path p;                                                          \
        int k_ = ins_busy || mode == NULL ? INS_UNMANAGED                           \
                                          : ins_classify(AT_FDCWD, path, &p);       \
        if (k_ == INS_TOOLONG) { /* (never opened in place: see open.c) */          \
            ins_fail(ENAMETOOLONG, "%.300s: its path under the managed directory is " \
                     "too long (PATH_MAX) to be a key", path);                      \
            return NULL;                                                            \
        }                                                                           \
        if (k_ != INS_MANAGED)                                                      \
            return ins_passed_fp(ins_real_##name(path, mode));                      \
        return ins_fopen_managed(&p, mode, ins_real_##name);                        \
    }

INS_FOPEN_WRAPPER(fopen)
INS_FOPEN_WRAPPER(fopen64)

/* Shared by fclose and freopen: the stream's fd is about to be closed. */
static struct ins_file *ins_detach_stream(FILE *fp, int *last)
{
    *last = 0;
    if (fp == NULL || !ins_table_any())
        return NULL;
    int fd = fileno(fp);
    if (ins_table_peek(fd) == NULL || ins_table_foreign())
        return NULL;
    struct ins_file *f = ins_table_take(fd, last);
    if (f != NULL && *last && ins_cfg.fsync && f->pid == getpid()) {
        fflush(fp);
        ins_file_sync(f, fd);
    }
    return f;
}

static int ins_finish_stream(struct ins_file *f, int rc, int e)
{
    ins_busy = 1;
    int prc = ins_file_finish(f, rc, e);
    ins_busy = 0;
    return prc;
}

INS_WRAPPER(int, fclose, (FILE * fp))
{
    INS_MAP_OR_FAIL(fclose, EOF);
    if (ins_busy)
        return ins_real_fclose(fp);
    int saved = errno, last = 0;
    struct ins_file *f = ins_detach_stream(fp, &last);
    int held = f != NULL && last ? ins_hold_writing(fileno(fp)) : -1; /* lock: to the rename */
    /* An earlier flush that failed (EFBIG, ENOSPC, EIO): glibc dropped the bytes it held and
     * set the stream's error flag, and a later flush that succeeds does not bring them back --
     * the file has a hole: never published (as freopen checks) */
    int failed_before = f != NULL && last && ferror(fp);
    int rc = ins_real_fclose(fp);
    if (f == NULL || !last)
        return rc;
    int e = errno;
    if (failed_before && rc == 0) {
        rc = EOF;
        e = EIO;
    }
    /* fclose's EINTR is its flush's (the buffered bytes did not reach the file), not close(2)'s
     * (after which the file is whole): a stream that failed to close is never published */
    int prc = ins_finish_stream(f, rc == 0 ? 0 : -1, rc != 0 && e == EINTR ? EIO : e);
    ins_release_writing(held);
    if (rc != 0) {
        errno = e;
        return EOF;
    }
    if (prc != 0)
        return EOF;
    errno = saved;
    return rc;
}

typedef FILE *(*ins_freopen_fn)(const char *, const char *, FILE *);

/* freopen closes the stream's file, then opens the new one. When the old file
 * is a produced key, it must be published before the new path is consumed (it
 * may be the same key): the stream is first reopened on /dev/null, which closes
 * the old file, then the old file is published, then the real reopen runs. */
static FILE *ins_freopen_common(const char *path, const char *mode, FILE *stream,
                                ins_freopen_fn real)
{
    struct ins_path p;
    if (ins_busy || path == NULL || mode == NULL)
        return real(path, mode, stream);
    int saved = errno, writing = 0, last = 0;
    struct ins_file *old = ins_detach_stream(stream, &last);
    if (old != NULL) {
        int held = last ? ins_hold_writing(fileno(stream)) : -1; /* the lock: to the rename */
        /* What the stream still buffers goes first, checked: the reopen below flushes it too,
         * but drops a failure (a full disk, a file size limit), and a part of the file would
         * then be published under the key */
        int fl = fflush(stream) == 0 && !ferror(stream) ? 0 : (errno != 0 ? errno : EIO);
        FILE *r0 = real("/dev/null", "r", stream);
        int e0 = errno;
        int prc = last ? ins_finish_stream(old, fl ? -1 : 0, fl == EINTR ? EIO : fl) : 0;
        ins_release_writing(held);
        if (r0 == NULL || prc != 0 || fl != 0) { /* the old key not published: say so */
            int e = fl != 0 ? fl : r0 == NULL ? e0 : errno;
            if (r0 != NULL)
                ins_real_fclose(r0);
            errno = e;
            return NULL;
        }
    }
    int kind = ins_classify(AT_FDCWD, path, &p), managed = kind == INS_MANAGED;
    if (kind == INS_TOOLONG) { /* (never opened in place, as fopen's: see open.c) */
        ins_real_fclose(stream); /* freopen's contract: on failure the stream is closed */
        ins_fail(ENAMETOOLONG, "%.300s: its path under the managed directory is too long "
                 "(PATH_MAX) to be a key", path);
        return NULL;
    }
    char target[PATH_MAX], tmode[64];
    if (managed) {
        ins_busy = 1;
        int rc = ins_stdio_target(&p, mode, target, tmode, &writing);
        ins_busy = 0;
        if (rc != 0) { /* freopen's contract: on failure the stream is closed */
            int e = errno;
            ins_real_fclose(stream);
            errno = e;
            return NULL;
        }
    }
    FILE *r = real(managed ? target : path, managed ? tmode : mode, stream);
    if (r == NULL) {
        int e = errno;
        if (writing)
            unlink(target);
        errno = e;
        return NULL;
    }
    if (writing) {
        ins_mark_writing(fileno(r)); /* (instride gc leaves it, as fopen's) */
        if (ins_register_stream(r, target, &p, mode, ins_real_fclose) != 0)
            return NULL;
    } else {
        ins_passed_fp(r);
    }
    errno = saved;
    return r;
}

INS_WRAPPER(FILE *, freopen, (const char *path, const char *mode, FILE *stream))
{
    INS_MAP_OR_FAIL(freopen, NULL);
    return ins_freopen_common(path, mode, stream, ins_real_freopen);
}

INS_WRAPPER(FILE *, freopen64, (const char *path, const char *mode, FILE *stream))
{
    INS_MAP_OR_FAIL(freopen64, NULL);
    return ins_freopen_common(path, mode, stream, ins_real_freopen64);
}
