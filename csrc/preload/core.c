/*
 * core.c -- shared machinery of libinstride_preload.so: resolution of the real
 * symbols (once, under pthread_once), configuration from INSTRIDE_*
 * environment variables, lexical path classification, and the table of
 * produced files indexed by fd.
 */
#include "instride_preload.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/resource.h>

INS_FOR_EACH_REAL(INS_REAL_DEF)

INS_HIDDEN atomic_int ins_ready = 0;
INS_HIDDEN INS_TLS int ins_busy = 0;
INS_HIDDEN struct ins_config ins_cfg;

static pthread_once_t ins_once = PTHREAD_ONCE_INIT;

/* ---- fd table ------------------------------------------------------------ */

static _Atomic(struct ins_file *) *ins_table; /* ins_table_size slots, mmap'd once */
static size_t ins_table_size;
static atomic_int ins_table_count; /* number of occupied slots */
static pthread_mutex_t ins_table_mu = PTHREAD_MUTEX_INITIALIZER;

void ins_table_lock(void) { pthread_mutex_lock(&ins_table_mu); }
void ins_table_unlock(void) { pthread_mutex_unlock(&ins_table_mu); }

int ins_table_any(void)
{
    return atomic_load_explicit(&ins_table_count, memory_order_acquire) > 0;
}

/* Internal fds (a thread's cached inotify fd) are marked with this sentinel,
 * so that the application closing or reusing their number is noticed. */
#define INS_INTERNAL ((struct ins_file *)(uintptr_t)1)

int ins_table_occupied(int fd)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL)
        return 0;
    return atomic_load_explicit(&ins_table[fd], memory_order_acquire) != NULL;
}

struct ins_file *ins_table_peek(int fd)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL)
        return NULL;
    struct ins_file *f = atomic_load_explicit(&ins_table[fd], memory_order_acquire);
    return f == INS_INTERNAL ? NULL : f;
}

int ins_table_is_internal(int fd)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL)
        return 0;
    return atomic_load_explicit(&ins_table[fd], memory_order_acquire) == INS_INTERNAL;
}

int ins_table_mark_internal(int fd, int on)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL)
        return -1;
    int last = 0;
    ins_table_lock();
    struct ins_file *stale = ins_table_take_locked(fd, &last);
    if (on) {
        atomic_store_explicit(&ins_table[fd], INS_INTERNAL, memory_order_release);
        atomic_fetch_add(&ins_table_count, 1);
    }
    ins_table_unlock();
    if (stale && last)
        ins_file_discard(stale);
    return 0;
}

size_t ins_table_capacity(void) { return ins_table == NULL ? 0 : ins_table_size; }

struct ins_file *ins_table_take_locked(int fd, int *last)
{
    *last = 0;
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL)
        return NULL;
    struct ins_file *f = atomic_load_explicit(&ins_table[fd], memory_order_relaxed);
    if (f == NULL)
        return NULL;
    atomic_store_explicit(&ins_table[fd], NULL, memory_order_release);
    atomic_fetch_sub(&ins_table_count, 1);
    if (f == INS_INTERNAL) /* our internal fd is being closed / reused by the app */
        return NULL;
    *last = atomic_fetch_sub(&f->refs, 1) == 1;
    return f;
}

struct ins_file *ins_table_take(int fd, int *last)
{
    ins_table_lock();
    struct ins_file *f = ins_table_take_locked(fd, last);
    ins_table_unlock();
    return f;
}

int ins_table_put(int fd, struct ins_file *f)
{
    if (fd < 0 || (size_t)fd >= ins_table_size || ins_table == NULL) {
        errno = EMFILE;
        return -1;
    }
    int last = 0;
    ins_table_lock();
    /* A stale slot means the fd was closed behind our back (raw syscall). */
    struct ins_file *stale = ins_table_take_locked(fd, &last);
    atomic_store_explicit(&ins_table[fd], f, memory_order_release);
    atomic_fetch_add(&ins_table_count, 1);
    ins_table_unlock();
    if (stale && last)
        ins_file_discard(stale);
    return 0;
}

void ins_table_dup_locked(int oldfd, int newfd)
{
    struct ins_file *f = ins_table_peek(oldfd);
    if (f == NULL || newfd < 0 || (size_t)newfd >= ins_table_size)
        return;
    int last = 0;
    struct ins_file *stale = ins_table_take_locked(newfd, &last); /* closed behind our back */
    if (stale != NULL && last)
        ins_file_discard(stale);
    atomic_fetch_add(&f->refs, 1);
    atomic_store_explicit(&ins_table[newfd], f, memory_order_release);
    atomic_fetch_add(&ins_table_count, 1);
}

/* A pass-through open returned fd: if the table still has an entry for it, the
 * fd had been closed without us seeing it. Forget that entry (the temp file is
 * removed, nothing is published: we cannot know it was complete). */
void ins_fd_reused(int fd)
{
    if (fd < 0 || !ins_table_any() || !ins_table_occupied(fd))
        return;
    int saved = errno, last = 0;
    struct ins_file *f = ins_table_take(fd, &last);
    if (f && last)
        ins_file_discard(f);
    errno = saved;
}

struct ins_file *ins_file_new(const char *tmp, const struct ins_path *final)
{
    struct ins_file *f = malloc(sizeof *f);
    if (f == NULL)
        return NULL;
    atomic_init(&f->refs, 1);
    f->pid = getpid();
    f->noreplace = 0;
    memcpy(f->tmp, tmp, strlen(tmp) + 1);
    f->final = *final;
    return f;
}

void ins_file_discard(struct ins_file *f)
{
    if (f->pid == getpid())
        unlink(f->tmp);
    free(f);
}

int ins_file_finish(struct ins_file *f, int close_rc, int close_errno)
{
    int rc = 0;
    if (f->pid != getpid()) {
        /* A forked child closing an inherited fd: it does not own the file. */
        free(f);
        if (close_rc != 0) {
            errno = close_errno;
            return -1;
        }
        return 0;
    }
    if (close_rc != 0 && close_errno != EINTR) {
        /* The data may not have reached the file: never publish it. */
        unlink(f->tmp);
        errno = close_errno;
        rc = -1;
    } else {
        rc = ins_publish(f->tmp, &f->final, f->noreplace);
    }
    int e = errno;
    free(f);
    errno = e;
    return rc;
}

void ins_maybe_fsync(int fd)
{
    if (ins_cfg.fsync)
        (void)fsync(fd);
}

static void ins_atfork_prepare(void) { pthread_mutex_lock(&ins_table_mu); }
static void ins_atfork_parent(void) { pthread_mutex_unlock(&ins_table_mu); }
static void ins_atfork_child(void)
{
    pthread_mutex_unlock(&ins_table_mu);
    ins_inotify_forget(); /* the inotify instance is shared with the parent now */
}

/* No destructor removes the temps of files still open at exit: language
 * runtimes (libgfortran, ...) close their units from their own destructors,
 * possibly after ours, and those closes must still publish. A file that is
 * never closed is never published; its temp (named with the pid) is left for
 * `instride gc`. */

/* ---- paths --------------------------------------------------------------- */

int ins_normalize(char *p)
{
    size_t r = 0, w = 0;
    if (p[0] != '/')
        return -1;
    while (p[r]) {
        while (p[r] == '/')
            r++;
        if (!p[r])
            break;
        size_t s = r;
        while (p[r] && p[r] != '/')
            r++;
        size_t n = r - s;
        if (n == 1 && p[s] == '.')
            continue;
        if (n == 2 && p[s] == '.' && p[s + 1] == '.') {
            while (w > 0 && p[w - 1] != '/')
                w--;
            if (w > 0)
                w--;
            continue;
        }
        p[w++] = '/';
        memmove(p + w, p + s, n);
        w += n;
    }
    if (w == 0)
        p[w++] = '/';
    p[w] = '\0';
    return 0;
}

/* Make path absolute (against dirfd or the cwd) into out[PATH_MAX]. */
static int ins_absolute(int dirfd, const char *path, char *out)
{
    size_t len = strlen(path);
    if (path[0] == '/') {
        if (len >= PATH_MAX)
            return -1;
        memcpy(out, path, len + 1);
        return 0;
    }
    size_t base;
    if (dirfd == AT_FDCWD) {
        if (getcwd(out, PATH_MAX) == NULL)
            return -1;
        base = strlen(out);
    } else {
        char link[32];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, out, PATH_MAX - 1);
        if (n <= 0)
            return -1;
        out[n] = '\0';
        base = (size_t)n;
    }
    if (out[0] != '/' || base + 1 + len >= PATH_MAX)
        return -1;
    out[base] = '/';
    memcpy(out + base + 1, path, len + 1);
    return 0;
}

static int ins_under(const char *abs, const char *dir, size_t dir_len, size_t *key_off)
{
    if (dir_len == 0)
        return 0;
    if (dir_len == 1) { /* managed directory is "/" */
        if (abs[1] == '\0')
            return 0;
        *key_off = 1;
        return 1;
    }
    if (strncmp(abs, dir, dir_len) != 0 || abs[dir_len] != '/' || abs[dir_len + 1] == '\0')
        return 0;
    *key_off = dir_len + 1;
    return 1;
}

/* Reserved names are instride's own: any component starting with ".instride",
 * or a temp file ".<name>.instride-<pid>-<hex>.tmp". */
static int ins_reserved(const char *key)
{
    const char *c = key;
    for (;;) {
        const char *end = strchr(c, '/');
        size_t n = end ? (size_t)(end - c) : strlen(c);
        if (n >= 9 && strncmp(c, ".instride", 9) == 0)
            return 1;
        if (end == NULL) {
            if (n > 4 && c[0] == '.' && strcmp(c + n - 4, ".tmp") == 0 &&
                strstr(c, ".instride-") != NULL)
                return 1;
            return 0;
        }
        c = end + 1;
    }
}

/* An absolute path with no "//", "/./" or "/../" is its own normal form. */
static int ins_clean_abs(const char *p)
{
    for (const char *s = p; (s = strchr(s, '/')) != NULL; s++) {
        if (s[1] == '/')
            return 0;
        if (s[1] == '.' && (s[2] == '/' || s[2] == '\0' ||
                            (s[2] == '.' && (s[3] == '/' || s[3] == '\0'))))
            return 0;
    }
    return 1;
}

static int ins_prefix(const char *p, const char *dir, size_t dir_len)
{
    return dir_len > 0 && strncmp(p, dir, dir_len) == 0 && (p[dir_len] == '/' || dir_len == 1);
}

int ins_classify(int dirfd, const char *path, struct ins_path *out)
{
    if (path == NULL || path[0] == '\0' || ins_cfg.dir_len == 0)
        return INS_UNMANAGED;
    size_t len = strlen(path);
    if (path[len - 1] == '/') /* "key/" names a directory, never a key */
        return INS_UNMANAGED;
    /* Fast path: most paths are absolute, clean and elsewhere: no copy. */
    if (path[0] == '/' && !ins_prefix(path, ins_cfg.dir, ins_cfg.dir_len) &&
        !ins_prefix(path, ins_cfg.dir_real, ins_cfg.dir_real_len) && ins_clean_abs(path))
        return INS_UNMANAGED;
    if (ins_absolute(dirfd, path, out->abs) != 0)
        return INS_UNMANAGED;
    ins_normalize(out->abs);
    if (!ins_under(out->abs, ins_cfg.dir, ins_cfg.dir_len, &out->key_off) &&
        !ins_under(out->abs, ins_cfg.dir_real, ins_cfg.dir_real_len, &out->key_off))
        return INS_UNMANAGED;
    if (ins_reserved(out->abs + out->key_off))
        return INS_RESERVED;
    return INS_MANAGED;
}

/* ---- configuration ------------------------------------------------------- */

static int ins_env_true(const char *name)
{
    const char *v = getenv(name);
    if (v == NULL)
        return 0;
    return strcmp(v, "1") == 0 || strcasecmp(v, "true") == 0 || strcasecmp(v, "yes") == 0 ||
           strcasecmp(v, "on") == 0;
}

static void ins_read_config(void)
{
    struct ins_config *c = &ins_cfg;
    char buf[PATH_MAX];
    const char *d = getenv("INSTRIDE_DIR");
    memset(c, 0, sizeof *c);
    if (d != NULL && d[0] != '\0') {
        snprintf(buf, sizeof buf, "%s", d);
    } else {
        struct stat st;
        unsigned uid = (unsigned)getuid();
        if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK | X_OK) == 0) {
            snprintf(buf, sizeof buf, "/dev/shm/instride-%u", uid);
        } else {
            const char *t = getenv("TMPDIR");
            if (t == NULL || t[0] == '\0')
                t = "/tmp";
            snprintf(buf, sizeof buf, "%s/instride-%u", t, uid);
        }
    }
    if (ins_absolute(AT_FDCWD, buf, c->dir) == 0 && ins_normalize(c->dir) == 0)
        c->dir_len = strlen(c->dir);

    /* The kernel hands back physical paths for dirfds: also know the real one. */
    if (c->dir_len > 0) {
        char real[PATH_MAX];
        if (realpath(c->dir, real) == NULL) {
            /* Not created yet: resolve its parent. */
            char parent[PATH_MAX];
            memcpy(parent, c->dir, c->dir_len + 1);
            char *slash = strrchr(parent, '/');
            if (slash != NULL && slash != parent) {
                *slash = '\0';
                if (realpath(parent, real) != NULL &&
                    strlen(real) + strlen(slash + 1) + 2 < sizeof real) {
                    strcat(real, "/");
                    strcat(real, slash + 1);
                } else {
                    real[0] = '\0';
                }
            } else {
                real[0] = '\0';
            }
        }
        if (real[0] == '/' && strcmp(real, c->dir) != 0) {
            memcpy(c->dir_real, real, strlen(real) + 1);
            c->dir_real_len = strlen(real);
        }
    }

    const char *s = getenv("INSTRIDE_SOCKET");
    if (s != NULL && s[0] != '\0')
        snprintf(c->socket_path, sizeof c->socket_path, "%s", s);
    else if (c->dir_len > 0 && c->dir_len + 20 < sizeof c->socket_path)
        snprintf(c->socket_path, sizeof c->socket_path, "%s/.instride/node.sock", c->dir);

    const char *t = getenv("INSTRIDE_TIMEOUT");
    c->timeout = 0.0;
    if (t != NULL && t[0] != '\0') {
        char *end = NULL;
        double v = strtod(t, &end);
        if (end != t && v == v && v > 0.0 && v < 1e9)
            c->timeout = v;
    }
    c->fsync = ins_env_true("INSTRIDE_FSYNC");
    c->overwrite = ins_env_true("INSTRIDE_OVERWRITE");
    const char *r = getenv("INSTRIDE_REDIS_URL");
    c->cluster = r != NULL && r[0] != '\0';
}

static void ins_alloc_table(void)
{
    struct rlimit rl;
    size_t n = 1024;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rlim_t m = rl.rlim_max;
        if (m == RLIM_INFINITY || m > (1u << 20))
            m = 1u << 20;
        if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur > m)
            m = rl.rlim_cur > (1u << 20) ? (1u << 20) : rl.rlim_cur;
        if ((size_t)m > n)
            n = (size_t)m;
    }
    void *p = mmap(NULL, n * sizeof *ins_table, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return; /* no table: managed writes fail with EMFILE, reads still work */
    ins_table = p;
    ins_table_size = n;
}

static void ins_init_once(void)
{
    ins_busy = 1;
#define INS_RESOLVE(name, ret, args)                                                \
    *(void **)(&ins_real_##name) = dlsym(RTLD_NEXT, #name);
    INS_FOR_EACH_REAL(INS_RESOLVE)
#undef INS_RESOLVE
    ins_read_config();
    ins_alloc_table();
    ins_inotify_setup();
    pthread_atfork(ins_atfork_prepare, ins_atfork_parent, ins_atfork_child);
    ins_busy = 0;
    atomic_store_explicit(&ins_ready, 1, memory_order_release);
}

void ins_init(void)
{
    if (ins_busy) /* called from inside our own initialisation */
        return;
    int saved = errno;
    pthread_once(&ins_once, ins_init_once);
    errno = saved;
}

__attribute__((constructor)) static void ins_ctor(void) { ins_init(); }
