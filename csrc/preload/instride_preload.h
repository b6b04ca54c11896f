/*
 * instride_preload.h -- internal declarations of libinstride_preload.so.
 *
 * The library is organised the Darshan way: one .c file per API family
 * (open.c, stdio.c, fd.c, rename.c, mmap.c, unlink.c, link.c, truncate.c), symbol resolution in
 * init.c and the table of produced files in fdtable.c. The protocol itself (settings, which paths
 * are keys, waiting, publishing, the node server's socket) is instride's one C
 * implementation in csrc/core/, shared with libinstride.so.
 *
 * Three macros do what DARSHAN_FORWARD_DECL / DARSHAN_DECL / MAP_OR_FAIL do:
 *   INS_REAL_DECL(name, ret, args)  declares the pointer to the real symbol
 *                                  (INS_REAL_DEF defines it, once, in init.c);
 *   INS_WRAPPER(ret, name, args)    declares an exported wrapper;
 *   INS_MAP_OR_FAIL(name, failval)  makes sure the real symbols are resolved
 *                                  (once, under pthread_once) or fails the call
 *                                  with ENOSYS.
 */
#ifndef INSTRIDE_PRELOAD_H
#define INSTRIDE_PRELOAD_H

#include "ins_core.h"

#include <dirent.h>

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
    X(closefrom, void, (int))                                                       \
    X(mkstemp, int, (char *))                                                       \
    X(mkstemp64, int, (char *))                                                     \
    X(mkostemp, int, (char *, int))                                                 \
    X(mkostemp64, int, (char *, int))                                               \
    X(mkstemps, int, (char *, int))                                                 \
    X(mkstemps64, int, (char *, int))                                               \
    X(mkostemps, int, (char *, int, int))                                           \
    X(mkostemps64, int, (char *, int, int))                                         \
    X(mmap, void *, (void *, size_t, int, int, int, off_t))                         \
    X(mmap64, void *, (void *, size_t, int, int, int, off64_t))                     \
    X(munmap, int, (void *, size_t))                                                \
    X(unlink, int, (const char *))                                                  \
    X(unlinkat, int, (int, const char *, int))                                      \
    X(remove, int, (const char *))                                                  \
    X(link, int, (const char *, const char *))                                      \
    X(linkat, int, (int, const char *, int, const char *, int))                     \
    X(symlink, int, (const char *, const char *))                                   \
    X(symlinkat, int, (const char *, int, const char *))                            \
    X(truncate, int, (const char *, off_t))                                         \
    X(truncate64, int, (const char *, off64_t))

INS_FOR_EACH_REAL(INS_REAL_DECL)

/* Resolve every real symbol once (pthread_once) and read the configuration. */
INS_HIDDEN void ins_init(void);
extern INS_HIDDEN atomic_int ins_ready;

/* Thread-local re-entrancy guard: while set, every wrapper forwards to libc. It is
 * read by every wrapped call: initial-exec TLS (the library is loaded at start-up). */
#define INS_TLS_IE __thread __attribute__((tls_model("initial-exec")))
extern INS_HIDDEN INS_TLS_IE int ins_busy;

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

/* An open refused (INS_OPEN_REFUSE): EROFS for read-write, else EPERM. Returns -1. */
INS_HIDDEN int ins_fail_refused(const struct ins_path *p, int flags);

/* ---- unlink.c: a key's record goes with its file (cluster mode) ---------------- */

/* Cluster mode: is (dirfd, path) a regular file under a key (not one of instride's own names)?
 * Then *p is filled, for ins_key_removed once the file is removed. errno kept. */
INS_HIDDEN int ins_key_file(int dirfd, const char *path, int flags, struct ins_path *p);
/* The file of key p was removed on this node: DELETE to the node server (which deletes the
 * record of a node's original). 0, errno kept, always: the removal took effect (a server not
 * reached or refusing leaves the record, said with INSTRIDE_DEBUG=1). */
INS_HIDDEN int ins_key_removed(const struct ins_path *p);

/* ---- fd table ------------------------------------------------------------ */

/* One produced file: shared by every fd that refers to the same open file
 * description (dup/dup2/dup3/F_DUPFD), published on the last close. */
struct ins_file {
    atomic_int refs;
    pid_t pid; /* process that opened it; only this process publishes */
    int noreplace; /* opened with O_EXCL ("x"): write-once even with INSTRIDE_OVERWRITE=1 */
    int sync_errno; /* a failed fsync (INSTRIDE_FSYNC=1) before the last close: not published */
    int discard;    /* the key unlinked while being written: its last close drops the temp */
    char tmp[PATH_MAX];
    struct ins_path final;
};

INS_HIDDEN struct ins_file *ins_file_new(const char *tmp, const struct ins_path *final);
/* fsync a produced file before its last close (INSTRIDE_FSYNC=1); a failure is kept in the
 * file, and ins_file_finish then fails (errno) instead of publishing. */
INS_HIDDEN void ins_file_sync(struct ins_file *f, int fd);
INS_HIDDEN int ins_table_put(int fd, struct ins_file *f);     /* -1/EMFILE if fd too big */
INS_HIDDEN struct ins_file *ins_table_peek(int fd);           /* lock-free, no ref */
INS_HIDDEN int ins_table_occupied(int fd);   /* a produced file or an internal fd */
INS_HIDDEN int ins_table_is_internal(int fd, const void *token);  /* token's own fd */
INS_HIDDEN int ins_table_mark_internal(int fd, const void *token); /* NULL: no longer */
INS_HIDDEN struct ins_file *ins_table_take(int fd, int *last); /* detach fd */
INS_HIDDEN struct ins_file *ins_table_take_locked(int fd, int *last);
INS_HIDDEN size_t ins_table_capacity(void);
INS_HIDDEN void ins_table_lock(void);
INS_HIDDEN void ins_table_unlock(void);
INS_HIDDEN void ins_table_dup_locked(int oldfd, int newfd); /* newfd now shares oldfd's file */
INS_HIDDEN int ins_table_any(void);
/* Mark this process's files being written under `key` to be dropped by their last close
 * (the key unlinked meanwhile); how many. */
INS_HIDDEN int ins_table_discard(const struct ins_path *key);
INS_HIDDEN void ins_table_undiscard(const struct ins_path *key); /* (the unlink failed) */
/* The files this process writes as `abs` that a shared writable mapping holds (their fds
 * closed, perhaps): `visit` each (under the table's lock); the sum of what the visits return. */
INS_HIDDEN int ins_maps_visit_locked(const char *abs, int (*visit)(struct ins_file *, void *),
                                     void *arg);
INS_HIDDEN size_t ins_table_entries(void); /* occupied slots now */
/* 1 in a process that shares the table's memory without owning it: a vfork child
 * (or a clone(CLONE_VM) child). Its closes and dups pass straight to libc (the table
 * is its parent's), and it cannot write keys. */
INS_HIDDEN int ins_table_foreign(void);
/* A write open of a key there: EPERM, naming the key. Returns -1. */
INS_HIDDEN int ins_fail_foreign(const struct ins_path *p);
/* The files this process is writing as key (not yet published): how many fds hold one.
 * With to, they are retargeted: their last close publishes to (noreplace: write-once). */
INS_HIDDEN int ins_table_retarget(const struct ins_path *key, const struct ins_path *to,
                                  int noreplace);
/* A shared writable mapping of the produced file on fd: one more reference to it, and
 * holdfd (a dup of fd; -1: none) marked as the mapping's. NULL: fd holds no produced
 * file (nothing done). */
INS_HIDDEN struct ins_file *ins_table_map_ref(int fd, int holdfd);
/* The mapping is gone: unmark holdfd; 1 if it was still the mapping's (else the
 * application closed that number meanwhile, and it is not ours to close). */
INS_HIDDEN int ins_table_map_unhold(int holdfd);
/* A pass-through open returned fd: drop a stale entry left for that number. */
INS_HIDDEN void ins_fd_reused(int fd);

/* After the last close of a produced file: publish (or, in a forked child,
 * just forget). Returns 0 or -1 with errno set. Frees f. */
INS_HIDDEN int ins_file_finish(struct ins_file *f, int close_rc, int close_errno);
/* Publish failed before the close: discard the temp and free. */
INS_HIDDEN void ins_file_discard(struct ins_file *f);

/* Allocate the table (once, at init) and install the fork handlers. */
INS_HIDDEN void ins_table_setup(void);

#endif /* INSTRIDE_PRELOAD_H */
