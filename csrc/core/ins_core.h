/*
 * ins_core.h -- internal declarations of instride's one C implementation of the
 * protocol, shared by libinstride.so (the public C API, include/instride/instride.h)
 * and libinstride_preload.so (the LD_PRELOAD wrappers, csrc/preload/).
 *
 * Modules, each a .c file here; an arrow means "calls", and there is no cycle:
 *
 *   consume.c  -> wait.c, agent.c, confine.c
 *   publish.c  -> agent.c, confine.c, util.c
 *   wait.c     -> util.c
 *   agent.c    -> config.c, util.c, error.c
 *   key.c      -> confine.c, config.c, path.c
 *   confine.c  -> config.c, path.c, util.c, error.c
 *   sys.c                          (the libc calls the preload library wraps)
 *   config.c   -> path.c          (every INSTRIDE_* read by C is parsed here, only here)
 *   error.c    -> config.c        (messages, INSTRIDE_DEBUG diagnostics)
 *   path.c, util.c                (no instride dependencies)
 *
 * Everything here is hidden (not exported) in both libraries.
 */
#ifndef INSTRIDE_CORE_H
#define INSTRIDE_CORE_H

/* The preload library defines open/open64/... itself: no header redirections. */
#undef _FORTIFY_SOURCE
#undef _FILE_OFFSET_BITS
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define INS_EXPORT __attribute__((visibility("default")))
#define INS_HIDDEN __attribute__((visibility("hidden")))
/* Thread-locals of the core: the default model, so that libinstride.so may also be
 * dlopen'ed (e.g. by ctypes); they are only touched on slow paths. */
#define INS_TLS __thread

/* ---- sys.c: the libc calls the core makes that the preload library wraps ---- */

/* libinstride.so leaves these pointing at libc; the preload library points them
 * at the real symbols it resolved (so that the core never re-enters a wrapper). */
struct ins_sys {
    int (*open)(const char *, int, ...);
    int (*openat)(int, const char *, int, ...);
    int (*close)(int);
    int (*rename)(const char *, const char *);
    int (*renameat)(int, const char *, int, const char *);
    int (*renameat2)(int, const char *, int, const char *, unsigned int);
};
extern INS_HIDDEN struct ins_sys ins_sys;

/* ---- config.c: settings ----------------------------------------------------- */

struct ins_config {
    char dir[PATH_MAX];      /* managed directory, lexically normalized        */
    size_t dir_len;
    char dir_real[PATH_MAX]; /* its realpath() when it differs, else ""       */
    size_t dir_real_len;
    char socket_path[PATH_MAX];
    double timeout;          /* seconds; 0: do not wait; < 0: wait forever     */
    int timeout_forever;     /* forever said outright (inf, >= 1e9 s), not unset */
    double connect_timeout;  /* INSTRIDE_CONNECT_TIMEOUT: seconds, > 0 (5)      */
    int timeout_bad;         /* a setting refused (INSTRIDE_TIMEOUT negative or
                                not a number, an on/off setting neither): every
                                consume and publication fails with EINVAL     */
    char bad_msg[160];       /* the first refused setting, named               */
    int fsync;               /* INSTRIDE_FSYNC=1                               */
    int overwrite;           /* INSTRIDE_OVERWRITE=1                           */
    int cluster;             /* INSTRIDE_REDIS_URL non-empty                   */
    int debug;               /* INSTRIDE_DEBUG=1: a diagnostic line per failure */
};
extern INS_HIDDEN struct ins_config ins_cfg;

/* Read every INSTRIDE_* variable (once per process, under pthread_once). */
INS_HIDDEN void ins_config_load(void);
/* The directory all key paths are made under: dir_real if set, else dir. */
INS_HIDDEN const char *ins_root(size_t *len);

/* ---- path.c: lexical path helpers (no I/O but getcwd/readlink) --------------- */

/* Lexically normalize an absolute path in place (".", "..", "//"). */
INS_HIDDEN int ins_normalize(char *path);
/* Make path absolute (against dirfd or the cwd) into out[PATH_MAX]. */
INS_HIDDEN int ins_absolute(int dirfd, const char *path, char *out);
/* ins_absolute into out[cap] (-1 with ENAMETOOLONG when it does not fit). */
INS_HIDDEN int ins_absolute_cap(int dirfd, const char *path, char *out, size_t cap);
/* An absolute path with no "//", "/./" or "/../" is its own normal form. */
INS_HIDDEN int ins_clean_abs(const char *p);
/* Does p start with the directory dir (followed by '/' or the end)? */
INS_HIDDEN int ins_prefix(const char *p, const char *dir, size_t dir_len);
/* Is abs strictly under dir? Sets *key_off to where the key starts. */
INS_HIDDEN int ins_under(const char *abs, const char *dir, size_t dir_len, size_t *key_off);

/* ---- key.c: which paths are keys --------------------------------------------- */

/* A classified path: the absolute normalized path and where its key starts. */
struct ins_path {
    char abs[PATH_MAX]; /* under the managed directory's real path (ins_root) */
    size_t key_off;     /* abs + key_off is the key (relative to the managed dir) */
    int refuse;         /* ELOOP: the path went back (..) through a symbolic link; EINVAL or
                           ENAMETOOLONG: a key keys.normalize_key refuses (a control
                           character, not UTF-8, whitespace only, a component over 200
                           bytes, a key over 1024): every call on it fails with it */
};

enum { INS_UNMANAGED = 0, INS_MANAGED = 1, INS_RESERVED = 2, INS_TOOLONG = 3 };

/* Classify (dirfd, path). Returns INS_MANAGED and fills *out when the path is a
 * key under the managed directory; INS_RESERVED for instride's own names under
 * it; INS_TOOLONG (*out not filled) for a path under it whose absolute form does
 * not fit PATH_MAX (a relative path from a deep directory: the kernel may open
 * it, instride cannot confine it; the C API refuses it with ENAMETOOLONG);
 * INS_UNMANAGED otherwise, including on any error. Never allocates. */
INS_HIDDEN int ins_classify(int dirfd, const char *path, struct ins_path *out);

static inline const char *ins_key(const struct ins_path *p) { return p->abs + p->key_off; }

/* Why p->refuse refuses the key (a phrase following it: "contains a control character"), and
 * the failure naming both: ins_fail(p->refuse, ...), -1. */
INS_HIDDEN const char *ins_refusal(const struct ins_path *p);
INS_HIDDEN int ins_fail_refused_key(const struct ins_path *p);

/* ---- confine.c: nothing escapes the managed directory ---------------------- */

/* An O_PATH fd of the key's directory, resolved beneath the managed directory
 * with no symbolic link followed (ELOOP); missing directories are created
 * (confined) when create. -1 with errno (ENOENT without a message). */
INS_HIDDEN int ins_parent_fd(const struct ins_path *p, int create);
/* lstat of the key through its confined directory (see ins_parent_fd). */
INS_HIDDEN int ins_lstat_key(const struct ins_path *p, struct stat *st, int create_parents);
/* 0 for a regular file; else -1 with ELOOP (symlink), EISDIR, EINVAL (special). */
INS_HIDDEN int ins_check_type(const struct ins_path *p, const struct stat *st);
/* Open a key for reading, confined: no symbolic link followed (ELOOP), FIFOs,
 * sockets and devices refused without blocking (EINVAL), directories refused
 * (EISDIR) unless allow_dir. -1 with errno (ENOENT without a message). */
INS_HIDDEN int ins_open_read_confined(const struct ins_path *p, int flags, mode_t mode,
                                      int allow_dir);
/* A stream's frame (its key's last component frame_<9 digits>.isf) opened as fd
 * from path: hold it as a stream's reader does (a shared flock, for as long as
 * the open file lives) and check it is still the file at path. A bounded stream
 * rewrites a retired frame's file only when it can lock it exclusively, so a
 * held file never changes under its reader. 0: held, or not a frame (st: fd's
 * fstat, or NULL); -1 with ENOENT: retired (the caller closes fd). */
INS_HIDDEN int ins_hold_frame(int fd, const struct stat *st, const char *path, const char *key);
/* 1 when a ".." in the raw absolute path goes back through a symbolic link
 * inside the managed directory (the kernel would leave the directory there). */
INS_HIDDEN int ins_dotdot_through_link(const char *raw);

/* ---- util.c: clocks, random names, mkdir -p ---------------------------------- */

INS_HIDDEN double ins_now(void);
/* Milliseconds left before deadline (deadline < 0: forever -> -1). */
INS_HIDDEN int ins_remaining_ms(double deadline);
INS_HIDDEN uint64_t ins_random64(void);
/* mkdir -p of buf (modified temporarily, restored). */
INS_HIDDEN int ins_mkdir_p(char *buf);

/* ---- error.c: messages --------------------------------------------------------- */

/* Set errno to err and this thread's last error message (printf-style); prints
 * it to stderr when INSTRIDE_DEBUG=1. Returns -1. */
INS_HIDDEN int ins_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* This thread's last error message ("" when none). */
INS_HIDDEN const char *ins_last_message(void);
INS_HIDDEN void ins_clear_message(void);

/* ---- agent.c: Unix-socket client of `instride serve` (cluster mode) ---------- */

/* CONSUME: the server waits/fetches; copies the local path to open into open_path. */
INS_HIDDEN int ins_agent_consume(const char *key, char open_path[PATH_MAX]);
/* Whether the key is recorded (published) now: 1, 0, or -1 with errno (the server or Redis
 * out of reach: never taken for "not published"). */
INS_HIDDEN int ins_agent_lookup(const char *key);
/* ins_agent_consume with a wait of at most ms for the publication (not the configured one). */
INS_HIDDEN int ins_agent_consume_within(const char *key, char open_path[PATH_MAX], int ms);
/* PUBLISH (overwrite = 0: write-once across the cluster) or OVERWRITE. */
INS_HIDDEN int ins_agent_publish(const char *key, int overwrite);
/* DELETE: the key's file on this node was removed; the server deletes the key's record where
 * that file was the node's original (as the Python client's delete). */
INS_HIDDEN int ins_agent_delete(const char *key);

/* ---- wait.c: local mode, inotify ------------------------------------------ */

/* Wait (inotify on its directory) until abs exists, up to INSTRIDE_TIMEOUT. */
INS_HIDDEN int ins_wait_local(const char *abs);

/* Per-thread cached inotify fd. Closing an inotify fd costs an RCU grace period
 * (milliseconds); the preload library, which sees every close, keeps one per
 * thread and registers these hooks to be told when the application closes it.
 * Without hooks (libinstride.so), each wait makes and closes its own fd. */
struct ins_fd_hooks {
    int (*is_internal)(int fd, const void *token);  /* fd is the internal fd of token's thread */
    int (*mark_internal)(int fd, const void *token); /* mark it so (NULL: unmark) */
    int (*foreign)(void); /* 1: a vfork child, whose thread-locals are its parent's: no cache */
};
INS_HIDDEN void ins_inotify_setup(const struct ins_fd_hooks *hooks); /* once, at init */
INS_HIDDEN void ins_inotify_forget(void);                            /* in a forked child */

/* ---- consume.c ---------------------------------------------------------------- */

/* Wait until the key is available locally. On success, copies into open_path
 * the path to open (the final path in local mode, the server's reply in cluster
 * mode). Returns 0, or -1 with errno (ETIMEDOUT, EIO, ECONNREFUSED, ...). */
INS_HIDDEN int ins_consume(const struct ins_path *p, char open_path[PATH_MAX]);

/* ---- publish.c ---------------------------------------------------------------- */

/* Classification of open flags for a key. */
enum ins_open_kind { INS_OPEN_READ, INS_OPEN_WRITE, INS_OPEN_REFUSE };
INS_HIDDEN enum ins_open_kind ins_open_kind(int flags);

/* Decide what a write open of p means. Returns 0 and fills tmp with a fresh
 * temp name in the key's directory (parents created), or -1 with errno. */
INS_HIDDEN int ins_prepare_write(const struct ins_path *p, int flags, mode_t *mode,
                                 char tmp[PATH_MAX]);
/* Make a fresh temp name for p (does not create the file). */
INS_HIDDEN int ins_temp_name(const struct ins_path *p, char tmp[PATH_MAX]);
/* Create a fresh temp file for p (O_CREAT|O_EXCL with extra flags and mode). */
/* Lock (shared) a temp file being written, so that `instride gc` leaves it. */
INS_HIDDEN void ins_mark_writing(int fd);
/* A second descriptor of fd's open file, held from just before the writer's close until
 * its rename is done: the lock lives as long as one descriptor does (-1: none to be had).
 * ins_release_writing closes it (nothing for -1). */
INS_HIDDEN int ins_hold_writing(int fd);
/* A close-on-exec duplicate of fd numbered high (out of the application's way: see util.c);
 * -1 with errno unchanged if none. ins_move_high: fd itself moved there (the original closed),
 * or fd unchanged when it cannot be. */
INS_HIDDEN int ins_dup_high(int fd);
INS_HIDDEN int ins_move_high(int fd);
/* ins_hold_writing with a descriptor number outside [first, last] (a range about to be
 * closed): -1 when none can be had. */
INS_HIDDEN int ins_hold_writing_outside(int fd, unsigned int first, unsigned int last);
INS_HIDDEN void ins_release_writing(int held);
/* Make the key's directory again (confined), after an ENOENT of a file made in it: 0 (errno
 * ENOENT, to retry), or -1 with the error. */
INS_HIDDEN int ins_remake_parent(const struct ins_path *p);
INS_HIDDEN int ins_create_temp(const struct ins_path *p, int flags, mode_t mode,
                               char tmp[PATH_MAX]);

/* Publish tmp as p (write-once link+unlink or rename), then tell the server in
 * cluster mode. The temp never survives: on failure it is unlinked. */
INS_HIDDEN int ins_publish(const char *tmp, const struct ins_path *p, int noreplace);

/* Register a key published locally: PUBLISH or, with overwrite, OVERWRITE
 * (cluster mode only; no-op otherwise). */
INS_HIDDEN int ins_notify_publish_as(const struct ins_path *p, int overwrite);
INS_HIDDEN int ins_notify_publish(const struct ins_path *p); /* INSTRIDE_OVERWRITE decides */
/* Copy the file in to out entirely (copy_file_range, else sendfile, else read and write): 0,
 * or -1 with errno. lease: a descriptor holding a read lease (ins_lease_source), looked at
 * every 64 MiB: -1 with EBUSY once a writer broke it; or -1. */
INS_HIDDEN int ins_copy_fd(int in, int out, int lease);

/* Take a read lease on fd, a private read-only descriptor of a file about to become a key (its
 * breaks signalled with SIGURG, ignored by default, not SIGIO, which kills): 1; 0 where there
 * is none (file system, owner, leases-enable: then moved unchecked, as before); -1 with EBUSY
 * when the file is open for writing somewhere. Released by closing fd. */
INS_HIDDEN int ins_lease_source(int fd);
/* Whether the read lease on fd was broken (a writer opened the file since), or is gone. */
INS_HIDDEN int ins_lease_broken(int fd);
/* The refusal of moving old to the key np because of a writer: EBUSY, -1; what: why (NULL:
 * "it is open for writing elsewhere"). */
INS_HIDDEN int ins_fail_open_for_writing(const char *old, const struct ins_path *np,
                                         const char *what);

/* Publish an existing regular file (olddirfd, old) as np by moving it there, all or nothing
 * (rename, or write-once a no-replace rename; across file systems the source renamed to a
 * hidden name beside it, copied to a temp beside the key, published, then removed -- or named
 * old again when the publication fails). */
INS_HIDDEN int ins_publish_move(int olddirfd, const char *old, const struct ins_path *np,
                                int noreplace);

/* fsync the directory holding abs (for INSTRIDE_FSYNC=1). */
INS_HIDDEN void ins_fsync_dir_of(const char *abs);
/* fsync an fd if INSTRIDE_FSYNC=1 (errors ignored). */
/* fsync(fd) under INSTRIDE_FSYNC=1 (else 0); -1 with errno when it fails: the data may not be
 * on disk, and the file must not be published (a later close no longer reports it). */
INS_HIDDEN int ins_maybe_fsync(int fd);

#endif /* INSTRIDE_CORE_H */
