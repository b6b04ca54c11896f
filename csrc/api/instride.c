/*
 * instride.c -- the public C API (include/instride/instride.h), exported by
 * libinstride.so: thin functions over the core (csrc/core/) that every
 * interface shares. Only the instride_* symbols are exported.
 */
#include "ins_core.h"

#include <instride/instride.h>

#include <stdlib.h>
#include <string.h>

#define INS_API INS_EXPORT

struct instride_writer {
    int fd;
    int noreplace;
    pid_t owner; /* the process that created it: the only one that publishes or removes it */
    char tmp[PATH_MAX];
    struct ins_path key;
};

/* Every entry point: settings loaded, no stale message. */
static void ins_api_enter(void)
{
    ins_config_load();
    ins_clear_message();
}

/* Return convention of the API: 0, or the errno value (errno is set too). */
static int ins_api_result(int rc)
{
    if (rc == 0)
        return 0;
    return errno != 0 ? errno : EIO;
}

/* Classify path as a key for the API; -1 with EINVAL and a message when it is not. */
static int ins_api_key(const char *path, struct ins_path *p)
{
    if (path == NULL)
        return ins_fail(EINVAL, "no path given");
    switch (ins_classify(AT_FDCWD, path, p)) {
    case INS_MANAGED:
        return 0;
    case INS_RESERVED:
        return ins_fail(EINVAL, "%.300s is one of instride's own names, not a key", path);
    case INS_TOOLONG:
        return ins_fail(ENAMETOOLONG, "%.300s: the key's path under the managed directory %.300s "
                        "is too long (PATH_MAX)", path, ins_cfg.dir);
    default:
        if (strlen(path) >= PATH_MAX) /* (whatever it names: the kernel refuses it too) */
            return ins_fail(ENAMETOOLONG, "path too long (PATH_MAX): %.300s...", path);
        return ins_fail(EINVAL, "%.300s is not a key: not a file path under the managed "
                        "directory %.300s", path, ins_cfg.dir);
    }
}

INS_API int instride_settings(struct instride_settings *out)
{
    ins_api_enter();
    out->dir = ins_cfg.dir;
    out->socket_path = ins_cfg.socket_path;
    out->timeout = ins_cfg.timeout; /* -1: forever; 0: do not wait */
    out->fsync = ins_cfg.fsync;
    out->overwrite = ins_cfg.overwrite;
    out->cluster = ins_cfg.cluster;
    out->debug = ins_cfg.debug;
    return 0;
}

INS_API int instride_is_key(const char *path)
{
    struct ins_path p;
    int saved = errno;
    ins_config_load();
    int kind = path != NULL ? ins_classify(AT_FDCWD, path, &p) : INS_UNMANAGED;
    /* (a path under the managed directory too long to handle is a key all the same: its
     * callers refuse it with ENAMETOOLONG rather than write it in place as a plain file) */
    int r = kind == INS_MANAGED || kind == INS_TOOLONG;
    errno = saved;
    return r;
}

INS_API int instride_consume(const char *path, char *open_path, size_t cap)
{
    struct ins_path p;
    char where[PATH_MAX];
    ins_api_enter();
    if (ins_api_key(path, &p) != 0 || ins_consume(&p, where) != 0)
        return ins_api_result(-1);
    size_t n = strlen(where);
    if (open_path == NULL || n >= cap)
        return ins_api_result(ins_fail(ERANGE, "the path of key %.300s needs %zu bytes",
                                       ins_key(&p), n + 1));
    memcpy(open_path, where, n + 1);
    return 0;
}

INS_API int instride_open_read(const char *path, int *fd)
{
    struct ins_path p;
    char where[PATH_MAX];
    ins_api_enter();
    if (ins_api_key(path, &p) != 0 || ins_consume(&p, where) != 0)
        return ins_api_result(-1);
    /* local mode: opened confined (beneath the managed directory, no link followed) */
    int f = ins_cfg.cluster ? ins_sys.open(where, O_RDONLY | O_CLOEXEC)
                            : ins_open_read_confined(&p, O_RDONLY | O_CLOEXEC, 0, 0);
    if (f >= 0 && ins_cfg.cluster && ins_hold_frame(f, NULL, where, ins_key(&p)) != 0) {
        ins_sys.close(f); /* a frame retired since it was consumed */
        return ins_api_result(ins_fail(ENOENT, "key %.300s: its frame was retired", ins_key(&p)));
    }
    if (f < 0)
        return ins_api_result(errno == ELOOP || errno == EISDIR || errno == EINVAL
                                  ? -1
                                  : ins_fail(errno, "cannot open key %.300s: %s", ins_key(&p),
                                             strerror(errno)));
    *fd = f;
    return 0;
}

INS_API int instride_create(const char *path, int flags, mode_t mode, instride_writer **out)
{
    ins_api_enter();
    instride_writer *w = malloc(sizeof *w);
    if (w == NULL)
        return ins_api_result(ins_fail(ENOMEM, "out of memory"));
    w->fd = -1;
    w->owner = getpid();
    w->noreplace = (flags & INSTRIDE_NOREPLACE) != 0;
    int oflags = O_WRONLY | O_CREAT | O_TRUNC | (w->noreplace ? O_EXCL : 0);
    if (ins_api_key(path, &w->key) != 0 ||
        ins_prepare_write(&w->key, oflags, &mode, w->tmp) != 0 ||
        (w->fd = ins_create_temp(&w->key, O_WRONLY | O_CLOEXEC, mode, w->tmp)) < 0)
        goto fail;
    *out = w;
    return 0;
fail:
    {
        int e = errno;
        free(w);
        errno = e;
    }
    return ins_api_result(-1);
}

INS_API int instride_writer_fd(const instride_writer *w) { return w->fd; }

INS_API const char *instride_writer_path(const instride_writer *w) { return w->tmp; }

INS_API const char *instride_writer_key(const instride_writer *w) { return ins_key(&w->key); }

INS_API int instride_commit(instride_writer *w)
{
    int rc = -1;
    ins_api_enter();
    if (w == NULL)
        return ins_api_result(ins_fail(EINVAL, "no writer given"));
    if (w->owner != getpid()) { /* a forked child's copy: the parent still writes the key */
        ins_fail(EPERM, "key %.300s was opened by process %ld: only it publishes the key (this "
                 "process, %ld, only closes its copy)", ins_key(&w->key), (long)w->owner,
                 (long)getpid());
        ins_sys.close(w->fd);
        goto cleanup;
    }
    int synced = ins_maybe_fsync(w->fd), sync_errno = errno;
    int held = ins_hold_writing(w->fd); /* the writer's lock, until the rename */
    int closed = ins_sys.close(w->fd);
    if (synced != 0) { /* (the data may not be on disk: not published, whatever close said) */
        closed = -1;
        errno = sync_errno;
    }
    /* (an interrupted close leaves the file whole: published; an interrupted fsync does not
     * say the data is on disk: not published) */
    if (closed != 0 && (synced != 0 || errno != EINTR)) {
        /* The data may not have reached the file: never publish it. */
        ins_fail(errno, "closing key %.300s failed: %s", ins_key(&w->key), strerror(errno));
        unlink(w->tmp);
        ins_release_writing(held);
        goto cleanup;
    }
    rc = ins_publish(w->tmp, &w->key, w->noreplace);
    ins_release_writing(held);
cleanup:
    {
        int e = errno;
        free(w);
        errno = e;
    }
    return ins_api_result(rc);
}

INS_API void instride_abort(instride_writer *w)
{
    if (w == NULL)
        return;
    int saved = errno;
    ins_sys.close(w->fd);
    if (w->owner == getpid()) /* (a forked child's copy: the parent's temp is left to it) */
        unlink(w->tmp);
    free(w);
    errno = saved;
}

INS_API int instride_publish(const char *src, const char *path, int flags)
{
    struct ins_path p;
    struct stat st;
    ins_api_enter();
    if (ins_api_key(path, &p) != 0)
        return ins_api_result(-1);
    /* (refused settings and a ".." back through a link fail every publication, also the
     * "nothing to do" one below) */
    if (ins_cfg.timeout_bad)
        return ins_api_result(ins_fail(EINVAL, "cannot publish %.300s: %s", ins_key(&p),
                                       ins_cfg.bad_msg));
    if (p.refuse)
        return ins_api_result(ins_fail_refused_key(&p));
    if (src == NULL || lstat(src, &st) != 0)
        return ins_api_result(ins_fail(src == NULL ? EINVAL : errno, "cannot publish %.300s: %s",
                                       src ? src : "(null)", strerror(src == NULL ? EINVAL : errno)));
    if (!S_ISREG(st.st_mode))
        return ins_api_result(ins_fail(EINVAL, "cannot publish %.300s: not a regular file", src));
    /* The key looked at confined (no link followed): a key reached only through a link
     * inside the managed directory is no "same file", and ins_publish_move refuses it. */
    struct stat kst;
    if (ins_lstat_key(&p, &kst, 0) == 0 && kst.st_dev == st.st_dev && kst.st_ino == st.st_ino)
        return ins_api_result(0); /* (the key's own file, or a hard link of it: as rename(2)
                                     does under the preload library, nothing to do) */
    ins_clear_message(); /* (a failed look above decides nothing: the move tells) */
    int noreplace = (flags & INSTRIDE_NOREPLACE) || !ins_cfg.overwrite;
    return ins_api_result(ins_publish_move(AT_FDCWD, src, &p, noreplace));
}

INS_API const char *instride_last_error(void) { return ins_last_message(); }

INS_API const char *instride_strerror(int err)
{
    switch (err) {
    case 0:
        return "success";
    case ETIMEDOUT:
        return "the key was not published within INSTRIDE_TIMEOUT";
    case EEXIST:
        return "the key is already published (keys are write-once)";
    case EPERM:
        return "published keys are immutable: no append or in-place update (or: a writer "
               "is published only by the process that created it)";
    case EINVAL:
        return "not a key: outside the managed directory, an instride name, or not a regular file";
    case ELOOP:
        return "the key's path goes through a symbolic link inside the managed directory";
    case EISDIR:
        return "the key names a directory";
    case ECONNREFUSED:
        return "no instride node server listens on INSTRIDE_SOCKET (cluster mode)";
    case ECONNABORTED:
        return "the instride node server shut down while waiting (cluster mode)";
    case ERANGE:
        return "the buffer for the path is too small";
    case ENAMETOOLONG:
        return "a name over NAME_MAX, or the key's path does not fit PATH_MAX";
    default:
        return strerror(err);
    }
}
