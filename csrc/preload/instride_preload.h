/*
 * instride_preload.h -- internal declarations of libinstride_preload.so.
 *
 * The library is organised the Darshan way: one .c file per API family
 * (open.c, stdio.c, fd.c, rename.c), the shared machinery in core.c (symbol
 * resolution, configuration, path classification, fd table) and the
 * publish/consume protocol in protocol.c.
 *
 * Three macros do what DARSHAN_FORWARD_DECL / DARSHAN_DECL / MAP_OR_FAIL do:
 *   INS_REAL_DECL(name, ret, args)  declares the pointer to the real symbol
 *                                  (INS_REAL_DEF defines it, once, in core.c);
 *   INS_WRAPPER(ret, name, args)    declares an exported wrapper;
 *   INS_MAP_OR_FAIL(name, failval)  makes sure the real symbols are resolved
 *                                  (once, under pthread_once) or fails the call
 *                                  with ENOSYS.
 */
#ifndef INSTRIDE_PRELOAD_H
#define INSTRIDE_PRELOAD_H

/* We define open/open64/fopen/... ourselves: no header redirections. */
#undef _FORTIFY_SOURCE
#undef _FILE_OFFSET_BITS
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define INS_EXPORT __attribute__((visibility("default")))
#define INS_HIDDEN __attribute__((visibility("hidden")))
#define INS_TLS __thread __attribute__((tls_model("initial-exec")))

/* ---- real symbols -------------------------------------------------------- */

#define INS_REAL_DECL(name, ret, args) extern INS_HIDDEN ret(*ins_real_##name) args;
#define INS_REAL_DEF(name, ret, args) INS_HIDDEN ret(*ins_real_##name) args = NULL;
#define INS_WRAPPER(ret, name, args) INS_EXPORT ret name args

/* X-macro list of every real symbol the library uses or forwards to. */
#define INS_FOR_EACH_REAL(X)                                                        \
    X(open, int, (const char *, int, ...))                                          \
    X(open64, int, (const char *, int, ...))                                        \
    X(openat, int, (int, const char *, int, ...))                                   \
    X(openat64, int, (int, const char *, int, ...))                                 \
    X(__open_2, int, (const char *, int))                                           \
    X(__open64_2, int, (const char *, int))                                         \
    X(__openat_2, int, (int, const char *, int))                                    \
    X(__openat64_2, int, (int, const char *, int))                                  \
    X(creat, int, (const char *, mode_t))                                           \
    X(creat64, int, (const char *, mode_t))                                         \
    X(fopen, FILE *, (const char *, const char *))                                  \
    X(fopen64, FILE *, (const char *, const char *))                                \
    X(freopen, FILE *, (const char *, const char *, FILE *))                        \
    X(freopen64, FILE *, (const char *, const char *, FILE *))                      \
    X(fclose, int, (FILE *))                                                        \
    X(close, int, (int))                                                            \
    X(dup, int, (int))                                                              \
    X(dup2, int, (int, int))                                                        \
    X(dup3, int, (int, int, int))                                                   \
    X(fcntl, int, (int, int, ...))                                                  \
    X(fcntl64, int, (int, int, ...))                                                \
    X(rename, int, (const char *, const char *))                                    \
    X(renameat, int, (int, const char *, int, const char *))                        \
    X(renameat2, int, (int, const char *, int, const char *, unsigned int))           \
    X(close_range, int, (unsigned int, unsigned int, int))                          \
    X(closefrom, void, (int))

INS_FOR_EACH_REAL(INS_REAL_DECL)

/* Resolve every real symbol once (pthread_once) and read the configuration. */
INS_HIDDEN void ins_init(void);
extern INS_HIDDEN atomic_int ins_ready;

/* Thread-local re-entrancy guard: while set, every wrapper forwards to libc. */
extern INS_HIDDEN INS_TLS int ins_busy;

#define INS_MAP_OR_FAIL(name, failval)                                              \
    do {                                                                            \
        if (__builtin_expect(!atomic_load_explicit(&ins_ready, memory_order_acquire), \
                             0))                                                    \
            ins_init();                                                             \
        if (__builtin_expect(ins_real_##name == NULL, 0)) {                         \
            errno = ENOSYS;                                                         \
            return failval;                                                         \
        }                                                                           \
    } while (0)

/* ---- configuration (read once at init) ----------------------------------- */

struct ins_config {
    char dir[PATH_MAX];      /* managed directory, lexically normalized        */
    size_t dir_len;
    char dir_real[PATH_MAX]; /* its realpath() when it differs, else ""       */
    size_t dir_real_len;
    char socket_path[PATH_MAX];
    double timeout;          /* seconds; <= 0 means wait forever               */
    int fsync;               /* INSTRIDE_FSYNC=1                               */
    int overwrite;           /* INSTRIDE_OVERWRITE=1                           */
    int cluster;             /* INSTRIDE_REDIS_URL non-empty                   */
};
extern INS_HIDDEN struct ins_config ins_cfg;

/* ---- paths --------------------------------------------------------------- */

/* A classified path: the absolute normalized path and where its key starts. */
struct ins_path {
    char abs[PATH_MAX];
    size_t key_off; /* abs + key_off is the key (relative to the managed dir) */
};

enum { INS_UNMANAGED = 0, INS_MANAGED = 1, INS_RESERVED = 2 };

/* Classify (dirfd, path). Returns INS_MANAGED and fills *out when the path is a
 * key under the managed directory; INS_RESERVED for instride's own names under
 * it (temp files, .instride*); INS_UNMANAGED otherwise, including on any error
 * (the call then goes to libc unchanged). Never allocates. */
INS_HIDDEN int ins_classify(int dirfd, const char *path, struct ins_path *out);

/* Lexically normalize an absolute path in place (".", "..", "//"). */
INS_HIDDEN int ins_normalize(char *path);

/* ---- fd table ------------------------------------------------------------ */

/* One produced file: shared by every fd that refers to the same open file
 * description (dup/dup2/dup3/F_DUPFD), published on the last close. */
struct ins_file {
    atomic_int refs;
    pid_t pid; /* process that opened it; only this process publishes */
    int noreplace; /* opened with O_EXCL ("x"): write-once even with INSTRIDE_OVERWRITE=1 */
    char tmp[PATH_MAX];
    struct ins_path final;
};

INS_HIDDEN struct ins_file *ins_file_new(const char *tmp, const struct ins_path *final);
INS_HIDDEN int ins_table_put(int fd, struct ins_file *f);     /* -1/EMFILE if fd too big */
INS_HIDDEN struct ins_file *ins_table_peek(int fd);           /* lock-free, no ref */
INS_HIDDEN int ins_table_occupied(int fd);   /* a produced file or an internal fd */
INS_HIDDEN int ins_table_is_internal(int fd);
INS_HIDDEN int ins_table_mark_internal(int fd, int on);
INS_HIDDEN struct ins_file *ins_table_take(int fd, int *last); /* detach fd */
INS_HIDDEN struct ins_file *ins_table_take_locked(int fd, int *last);
INS_HIDDEN size_t ins_table_capacity(void);
INS_HIDDEN void ins_table_lock(void);
INS_HIDDEN void ins_table_unlock(void);
INS_HIDDEN void ins_table_dup_locked(int oldfd, int newfd); /* newfd now shares oldfd's file */
INS_HIDDEN int ins_table_any(void);
/* A pass-through open returned fd: drop a stale entry left for that number. */
INS_HIDDEN void ins_fd_reused(int fd);

/* After the last close of a produced file: publish (or, in a forked child,
 * just forget). Returns 0 or -1 with errno set. Frees f. */
INS_HIDDEN int ins_file_finish(struct ins_file *f, int close_rc, int close_errno);
/* Publish failed before the close: discard the temp and free. */
INS_HIDDEN void ins_file_discard(struct ins_file *f);

/* ---- protocol ------------------------------------------------------------ */

/* Wait until the key is available locally. On success, copies into open_path
 * the path to open (the final path in local mode, the server's reply in cluster
 * mode). Returns 0, or -1 with errno (ETIMEDOUT, EIO, ECONNREFUSED, ...). */
INS_HIDDEN int ins_consume(const struct ins_path *p, char open_path[PATH_MAX]);

/* Decide what a write open of p means. Returns 0 and fills tmp with a fresh
 * temp name in the key's directory (parents created), or -1 with errno. */
INS_HIDDEN int ins_prepare_write(const struct ins_path *p, int flags, mode_t *mode,
                                 char tmp[PATH_MAX]);
/* Make a fresh temp name for p (does not create the file). */
INS_HIDDEN int ins_temp_name(const struct ins_path *p, char tmp[PATH_MAX]);

/* Publish tmp as p (write-once link+unlink or rename), then tell the server in
 * cluster mode. The temp never survives: on failure it is unlinked. */
INS_HIDDEN int ins_publish(const char *tmp, const struct ins_path *p, int noreplace);

/* Per-thread cached inotify fd (closing an inotify fd costs an RCU grace
 * period, milliseconds: it is kept for the thread's life and reused). */
INS_HIDDEN void ins_inotify_setup(void);  /* once, at init */
INS_HIDDEN void ins_inotify_forget(void); /* in a forked child */

/* Create the parent directories of an absolute path (mkdir -p of dirname). */
INS_HIDDEN int ins_mkdir_parents(const char *abs);

/* Classification of open flags for a managed path. */
enum ins_open_kind { INS_OPEN_READ, INS_OPEN_WRITE, INS_OPEN_REFUSE };
INS_HIDDEN enum ins_open_kind ins_open_kind(int flags);

/* Shared implementation of all open variants for a managed path. */
INS_HIDDEN int ins_open_managed(const struct ins_path *p, int flags, mode_t mode);

/* Send PUBLISH <key> to the node's server (cluster mode only; no-op otherwise). */
INS_HIDDEN int ins_notify_publish(const struct ins_path *p);
/* The same with an explicit overwrite flag (0: write-once across the cluster). */
INS_HIDDEN int ins_notify_publish_as(const struct ins_path *p, int overwrite);

/* fsync the directory holding abs (for INSTRIDE_FSYNC=1). */
INS_HIDDEN void ins_fsync_dir_of(const char *abs);

/* fsync an fd via the real syscall if INSTRIDE_FSYNC=1 (errors ignored). */
INS_HIDDEN void ins_maybe_fsync(int fd);

#endif /* INSTRIDE_PRELOAD_H */
