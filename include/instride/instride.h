/*
 * instride/instride.h -- the C API of instride (libinstride.so).
 *
 * A producer writes a key under a hidden temporary name and publishes it, complete
 * and at once, on commit; a consumer that asks for a key before it exists waits
 * until it is published (local mode: inotify on the key's directory; cluster mode,
 * INSTRIDE_REDIS_URL set: the node server `instride serve`, over its Unix socket).
 * It is the same implementation as libinstride_preload.so's, and follows the same
 * settings (INSTRIDE_DIR, INSTRIDE_TIMEOUT, INSTRIDE_FSYNC, INSTRIDE_OVERWRITE,
 * INSTRIDE_REDIS_URL, INSTRIDE_SOCKET, INSTRIDE_DEBUG), read once per process.
 * INSTRIDE_TIMEOUT has the meaning of the `instride` command's --timeout: unset,
 * empty or inf waits forever; 0 does not wait (a key not yet published fails at once
 * with ETIMEDOUT); a negative value or not a number is refused (every consume fails
 * with EINVAL). In cluster mode an unset (or blank) INSTRIDE_TIMEOUT leaves the
 * timeout to the node server (its own INSTRIDE_TIMEOUT, forever when it has none);
 * an explicit inf waits forever whatever the server's setting.
 *
 *     #include <instride/instride.h>
 *
 *     instride_writer *w;
 *     int err = instride_create("/dev/shm/instride-1000/run7/frame_000042.bin", 0, 0644, &w);
 *     if (err) { fprintf(stderr, "%s\n", instride_last_error()); return 1; }
 *     write(instride_writer_fd(w), buf, n);
 *     err = instride_commit(w);            // publishes; w is freed either way
 *
 *     int fd;
 *     err = instride_open_read("/dev/shm/instride-1000/run7/frame_000042.bin", &fd);
 *     if (err == ETIMEDOUT) ...            // not published within INSTRIDE_TIMEOUT
 *
 * Build: cc prog.c $(instride preload-path --cflags --libs)
 * (that is -I<include dir> -L<library dir> -Wl,-rpath,<library dir> -linstride).
 *
 * Conventions
 * -----------
 * - Paths are file paths as for open(2): absolute, or relative to the current
 *   directory. A path under the managed directory (INSTRIDE_DIR) is a key; the key
 *   is the path relative to that directory. Paths are compared lexically
 *   ("." and ".." are resolved as text); resolution on disk is confined beneath the
 *   managed directory (no symbolic link is followed below it).
 * - Every function that can fail returns 0 on success or a positive errno value
 *   (also stored in errno). instride_last_error() then returns a message that names
 *   the key and the cause, for this thread. The errno values and their meaning are
 *   listed in docs/preload.md ("Errors"); the main ones:
 *     ETIMEDOUT     the key was not published within INSTRIDE_TIMEOUT (at once
 *                   when INSTRIDE_TIMEOUT=0)
 *     EEXIST        write-once: the key is already published
 *     EINVAL        the path is not a key (outside the managed directory, an
 *                   instride-reserved name, a name ending in "/"), or the key is
 *                   not a regular file (a FIFO, socket or device)
 *     ELOOP         resolving the key would follow a symbolic link
 *     ENAMETOOLONG  a name over NAME_MAX, or a key whose absolute path does not
 *                   fit PATH_MAX (e.g. a relative path from a deep directory)
 *     EISDIR        the key names a directory
 *     ECONNREFUSED  cluster mode: no node server listens on INSTRIDE_SOCKET
 * - All functions are thread-safe.
 */
#ifndef INSTRIDE_INSTRIDE_H
#define INSTRIDE_INSTRIDE_H

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of this API: incremented when a declaration below changes. */
#define INSTRIDE_API_VERSION 1

/* ---- settings ------------------------------------------------------------ */

/* The settings this process runs with (read from the environment once). */
struct instride_settings {
    const char *dir;         /* managed directory, absolute and normalized (INSTRIDE_DIR) */
    const char *socket_path; /* node server's Unix socket (INSTRIDE_SOCKET)              */
    double timeout;          /* seconds a consume waits (INSTRIDE_TIMEOUT): -1 forever    */
                             /* (cluster mode, unset: the node server's own timeout),    */
                             /* 0 do not wait (fail at once unless published)            */
    int fsync;               /* 1: fsync before publishing (INSTRIDE_FSYNC)                */
    int overwrite;           /* 1: publishing replaces a key (INSTRIDE_OVERWRITE)          */
    int cluster;             /* 1: cluster mode (INSTRIDE_REDIS_URL is set)               */
    int debug;               /* 1: one line on stderr per failure (INSTRIDE_DEBUG)        */
};

/* Fill *out (its strings live as long as the process). Returns 0. */
int instride_settings(struct instride_settings *out);

/* 1 if path is a key (under the managed directory and not instride's own name), else 0.
 * A path under the managed directory too long to handle is a key too (the functions
 * below refuse it with ENAMETOOLONG): never write it as a plain file. */
int instride_is_key(const char *path);

/* ---- consume --------------------------------------------------------------- */

/* Wait until the key at path is published (at most INSTRIDE_TIMEOUT seconds) and
 * copy into open_path (cap bytes) the path to open: in local mode the key's path
 * under the managed directory's real path; in cluster mode the node-local copy
 * the node server made.
 * Errors: ETIMEDOUT, EINVAL (also: INSTRIDE_TIMEOUT negative or not a number), ELOOP,
 * EISDIR, ERANGE (cap too small), ECONNREFUSED, EIO, or the errno of the underlying
 * call. */
int instride_consume(const char *path, char *open_path, size_t cap);

/* instride_consume, then open the key read-only (O_CLOEXEC), confined; *fd receives
 * the fd. A stream's frame (frame_<9 digits>.isf) is held while the fd is open: a
 * bounded stream's producer does not recycle its file under the reader (a path from
 * instride_consume, opened later, holds nothing). */
int instride_open_read(const char *path, int *fd);

/* ---- produce --------------------------------------------------------------- */

/* A key being written: a hidden temporary file beside it
 * (.<name>.instride-<pid>-<hex>.tmp), published by instride_commit. Only the process
 * that created it publishes or removes it: a forked child that inherits it gets EPERM
 * from instride_commit, and its instride_abort only closes its copy of the fd. */
typedef struct instride_writer instride_writer;

/* instride_create flags. */
#define INSTRIDE_NOREPLACE 1 /* write-once even with INSTRIDE_OVERWRITE=1 */

/* Start writing the key at path: create its temp file (mode & ~umask; missing
 * parent directories are created) and return a writer in *out.
 * Errors: EEXIST (write-once: the key is published; with INSTRIDE_OVERWRITE=1 the
 * key is replaced on commit unless INSTRIDE_NOREPLACE), EINVAL, ELOOP, EISDIR,
 * ENAMETOOLONG (a name over NAME_MAX, a path over PATH_MAX), ENOMEM, or the errno
 * of the underlying call. */
int instride_create(const char *path, int flags, mode_t mode, instride_writer **out);

/* The writer's fd (open for writing, O_CLOEXEC); owned by the writer. */
int instride_writer_fd(const instride_writer *w);

/* The absolute path of the writer's temp file (e.g. to reopen it with a stream). */
const char *instride_writer_path(const instride_writer *w);

/* The key being written (relative to the managed directory). */
const char *instride_writer_key(const instride_writer *w);

/* Close the writer's fd (fsync first if INSTRIDE_FSYNC=1) and publish the key:
 * write-once link, or rename with INSTRIDE_OVERWRITE=1, then in cluster mode
 * registration with the node server. w is freed whatever the result; on failure
 * nothing is published and the temp file is removed.
 * Errors: EEXIST (published by someone else meanwhile), ECONNREFUSED/EIO
 * (cluster mode: the file stays published locally, see docs/preload.md), EPERM
 * (w was created by another process, e.g. this is a forked child: the fd is closed
 * and w freed, nothing is published and the temp file is left to its owner), or the
 * errno of close/link/rename. */
int instride_commit(instride_writer *w);

/* Close the writer's fd, remove its temp file and free w. Nothing is published.
 * In another process than w's creator (a forked child): close and free only. */
void instride_abort(instride_writer *w);

/* Publish an existing complete file src as the key at path by moving it there
 * (write-once link + unlink, or rename with INSTRIDE_OVERWRITE=1; across file
 * systems, a copy then removal of src), as rename(2) into the managed directory
 * does under the preload library. flags: 0 or INSTRIDE_NOREPLACE. src already
 * being the key's own file (looked at confined) is success, nothing to do.
 * Errors: EEXIST, EBUSY (src is open for writing by another process, or was opened
 * for writing while it was moved: nothing published, src kept -- told by a read
 * lease where the file system grants one), EINVAL (src is not a regular file, path
 * is not a key, or a setting is refused), ELOOP, EISDIR, or the errno of the
 * underlying call. */
int instride_publish(const char *src, const char *path, int flags);

/* ---- errors ---------------------------------------------------------------- */

/* This thread's message for the last failed instride call ("" if none), e.g.
 * "instride: key run7/f.bin was not published within INSTRIDE_TIMEOUT=0.5 s". */
const char *instride_last_error(void);

/* What err means when an instride call returns it (a static string; for errno
 * values instride does not give a meaning of its own, strerror's text). */
const char *instride_strerror(int err);

#ifdef __cplusplus
}
#endif

#endif /* INSTRIDE_INSTRIDE_H */
