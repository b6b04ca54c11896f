/*
 * protocol.c -- the publish / consume protocol of instride, as the shim runs it.
 *
 * Local mode: a produced file is written under a hidden temp name in the key's
 * directory and published by link(tmp, final) + unlink(tmp) (write-once) or
 * rename(tmp, final) (INSTRIDE_OVERWRITE=1). A consumer stats the final name,
 * and if it is not there, arms inotify on the key's directory, re-checks, and
 * polls with the remaining INSTRIDE_TIMEOUT.
 *
 * Cluster mode (INSTRIDE_REDIS_URL set): the node's data server is asked over
 * its Unix socket, one connection per request, one line each way:
 *     CONSUME <timeout_ms|-1> <key>\n  ->  OK <path>\n | ERR <errno> <msg>\n
 *     PUBLISH <key>\n                  ->  OK <path>\n | ERR <errno> <msg>\n
 *     OVERWRITE <key>\n                ->  OK <path>\n | ERR <errno> <msg>\n
 * PUBLISH records the key write-once (ERR 17 and the local file removed when
 * another node published it first); OVERWRITE (INSTRIDE_OVERWRITE=1) records a
 * new version replacing any earlier one.
 */
#include "instride_preload.h"

#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

/* ---- small helpers ------------------------------------------------------- */

static double ins_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Milliseconds left before deadline (deadline < 0: forever -> -1). */
static int ins_remaining_ms(double deadline)
{
    if (deadline < 0)
        return -1;
    double left = deadline - ins_now();
    if (left <= 0)
        return 0;
    double ms = ceil(left * 1000.0);
    return ms > 2e9 ? 2000000000 : (int)ms;
}

static uint64_t ins_random64(void)
{
    uint64_t x = 0;
    if (getrandom(&x, sizeof x, GRND_NONBLOCK) == (ssize_t)sizeof x)
        return x;
    static atomic_uint_fast64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ ((uint64_t)getpid() << 16) ^
        atomic_fetch_add(&counter, 0x9e3779b97f4a7c15ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

/* mkdir -p of buf (modified temporarily, restored). */
static int ins_mkdir_p(char *buf)
{
    if (mkdir(buf, 0777) == 0 || errno == EEXIST)
        return 0;
    if (errno != ENOENT)
        return -1;
    for (char *s = buf + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        int rc = mkdir(buf, 0777);
        *s = '/';
        if (rc != 0 && errno != EEXIST)
            return -1;
    }
    if (mkdir(buf, 0777) != 0 && errno != EEXIST)
        return -1;
    return 0;
}

int ins_mkdir_parents(const char *abs)
{
    char buf[PATH_MAX];
    size_t n = strlen(abs);
    memcpy(buf, abs, n + 1);
    char *slash = strrchr(buf, '/');
    if (slash == NULL || slash == buf)
        return 0;
    *slash = '\0';
    return ins_mkdir_p(buf);
}

int ins_temp_name(const struct ins_path *p, char tmp[PATH_MAX])
{
    const char *base = strrchr(p->abs, '/') + 1;
    size_t dir_len = (size_t)(base - p->abs); /* includes the slash */
    size_t base_len = strlen(base);
    /* Keep the temp's own name within NAME_MAX: shorten the copied basename. */
    if (base_len > 200)
        base_len = 200;
    if (dir_len + base_len + 64 >= PATH_MAX) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(tmp, p->abs, dir_len);
    int n = snprintf(tmp + dir_len, PATH_MAX - dir_len, ".%.*s.instride-%ld-%016llx.tmp",
                     (int)base_len, base, (long)getpid(), (unsigned long long)ins_random64());
    if (n < 0 || (size_t)n >= PATH_MAX - dir_len) {
        errno = ENAMETOOLONG;
        return -1;
    }
    return 0;
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
    if (stat(p->abs, &st) == 0) {
        if ((flags & (O_CREAT | O_EXCL)) == (O_CREAT | O_EXCL) || !ins_cfg.overwrite) {
            errno = EEXIST; /* write-once: a published key is never replaced */
            return -1;
        }
        if (!(flags & O_TRUNC)) {
            errno = EPERM; /* would modify a published key in place */
            return -1;
        }
        *mode = st.st_mode & 07777;
    } else if (errno == ENOENT) {
        if (!(flags & O_CREAT)) {
            errno = ENOENT;
            return -1;
        }
    }
    if (ins_mkdir_parents(p->abs) != 0)
        return -1;
    return ins_temp_name(p, tmp);
}

/* ---- cluster mode: the node server's Unix socket ------------------------- */

/* One request, one reply line. wait_ms < 0: no bound. */
static int ins_server_request(const char *req, char *reply, size_t cap, int wait_ms)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    size_t plen = strlen(ins_cfg.socket_path);
    if (plen == 0 || plen >= sizeof sa.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(sa.sun_path, ins_cfg.socket_path, plen + 1);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) {
        errno = EIO;
        return -1;
    }
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int e = errno;
        ins_real_close(s);
        errno = (e == ENOENT || e == ECONNREFUSED) ? ECONNREFUSED : EIO;
        return -1;
    }
    size_t len = strlen(req), off = 0;
    while (off < len) {
        ssize_t n = send(s, req + off, len - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            ins_real_close(s);
            errno = EIO;
            return -1;
        }
        off += (size_t)n;
    }
    double deadline = wait_ms < 0 ? -1.0 : ins_now() + wait_ms / 1000.0;
    size_t got = 0;
    for (;;) {
        struct pollfd pfd = {.fd = s, .events = POLLIN};
        int prc = poll(&pfd, 1, ins_remaining_ms(deadline));
        if (prc < 0 && errno == EINTR)
            continue;
        if (prc == 0) {
            ins_real_close(s);
            errno = ETIMEDOUT;
            return -1;
        }
        if (prc < 0 || got + 1 >= cap) {
            ins_real_close(s);
            errno = EIO;
            return -1;
        }
        ssize_t n = recv(s, reply + got, cap - 1 - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            ins_real_close(s);
            errno = EIO;
            return -1;
        }
        got += (size_t)n;
        reply[got] = '\0';
        char *nl = memchr(reply, '\n', got);
        if (nl != NULL) {
            *nl = '\0';
            break;
        }
    }
    ins_real_close(s);
    return 0;
}

/* Parse "OK <path>" (path copied to out, may be NULL) or "ERR <n> <msg>". */
static int ins_parse_reply(const char *reply, char *out)
{
    if (strncmp(reply, "OK", 2) == 0 && (reply[2] == ' ' || reply[2] == '\0')) {
        const char *path = reply[2] ? reply + 3 : "";
        if (out != NULL) {
            size_t n = strlen(path);
            if (n == 0 || path[0] != '/' || n >= PATH_MAX) {
                errno = EIO;
                return -1;
            }
            memcpy(out, path, n + 1);
        }
        return 0;
    }
    if (strncmp(reply, "ERR ", 4) == 0) {
        char *end = NULL;
        long e = strtol(reply + 4, &end, 10);
        errno = (end != reply + 4 && e > 0 && e < 4096) ? (int)e : EIO;
        return -1;
    }
    errno = EIO;
    return -1;
}

static int ins_key_ok(const char *key)
{
    if (strchr(key, '\n') != NULL || strchr(key, '\r') != NULL) {
        errno = EINVAL;
        return 0;
    }
    return 1;
}

/* How long to wait for the server's reply: it bounds a CONSUME by the timeout
 * we send; we allow it 5 s of grace on top. No INSTRIDE_TIMEOUT: no bound. */
static int ins_reply_wait_ms(void)
{
    if (ins_cfg.timeout > 0)
        return (int)(ins_cfg.timeout * 1000.0) + 5000;
    return -1;
}

/* Register a key published locally; overwrite selects OVERWRITE over PUBLISH. */
int ins_notify_publish_as(const struct ins_path *p, int overwrite)
{
    if (!ins_cfg.cluster)
        return 0;
    const char *key = p->abs + p->key_off;
    if (!ins_key_ok(key))
        return -1;
    char req[PATH_MAX + 32], reply[PATH_MAX + 128];
    snprintf(req, sizeof req, "%s %s\n", overwrite ? "OVERWRITE" : "PUBLISH", key);
    if (ins_server_request(req, reply, sizeof reply, ins_reply_wait_ms()) != 0)
        return -1;
    return ins_parse_reply(reply, NULL);
}

int ins_notify_publish(const struct ins_path *p)
{
    return ins_notify_publish_as(p, ins_cfg.overwrite);
}

static int ins_consume_cluster(const struct ins_path *p, char open_path[PATH_MAX])
{
    const char *key = p->abs + p->key_off;
    if (!ins_key_ok(key))
        return -1;
    char req[PATH_MAX + 64], reply[PATH_MAX + 128];
    long long tms = ins_cfg.timeout > 0 ? (long long)ceil(ins_cfg.timeout * 1000.0) : -1;
    snprintf(req, sizeof req, "CONSUME %lld %s\n", tms, key);
    if (ins_server_request(req, reply, sizeof reply, ins_reply_wait_ms()) != 0)
        return -1;
    return ins_parse_reply(reply, open_path);
}

/* ---- local mode: consume ------------------------------------------------- */

/* Closing an inotify fd waits for an RCU grace period in the kernel (measured
 * ~5 ms here), which would dominate the wake-up latency. Each thread therefore
 * keeps one inotify fd for its whole life, marked in the fd table so that an
 * application closing that number (close/dup2/close_range) is noticed and a
 * fresh one is made; it is closed at thread exit and forgotten after fork. */
static INS_TLS int ins_ifd = -1;
static INS_TLS int ins_wd = -1; /* watch left on the directory of the last wait */
static pthread_key_t ins_ifd_key;
static int ins_ifd_key_ok;

static void ins_ifd_release(void *arg)
{
    int fd = (int)(intptr_t)arg - 1;
    if (fd >= 0 && ins_table_is_internal(fd)) {
        ins_table_mark_internal(fd, 0);
        ins_real_close(fd);
    }
    ins_ifd = -1;
    ins_wd = -1;
}

void ins_inotify_setup(void)
{
    ins_ifd_key_ok = pthread_key_create(&ins_ifd_key, ins_ifd_release) == 0;
}

void ins_inotify_forget(void)
{
    int fd = ins_ifd;
    ins_ifd = -1;
    ins_wd = -1;
    if (fd >= 0 && ins_table_is_internal(fd)) {
        ins_table_mark_internal(fd, 0);
        ins_real_close(fd); /* drops only the child's reference: no grace period */
    }
    if (ins_ifd_key_ok)
        pthread_setspecific(ins_ifd_key, NULL);
}

/* This thread's inotify fd. *cached = 0 when it could not be cached (the
 * caller then closes it after use). */
static int ins_inotify_get(int *cached)
{
    *cached = 1;
    if (ins_ifd >= 0 && ins_table_is_internal(ins_ifd))
        return ins_ifd;
    ins_ifd = -1; /* none yet, or the application closed it */
    ins_wd = -1;
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0)
        return -1;
    if (!ins_ifd_key_ok || ins_table_mark_internal(fd, 1) != 0) {
        *cached = 0;
        return fd;
    }
    ins_ifd = fd;
    pthread_setspecific(ins_ifd_key, (void *)(intptr_t)(fd + 1));
    return fd;
}

static void ins_inotify_drain(int ifd)
{
    char ev[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    while (read(ifd, ev, sizeof ev) > 0)
        ;
}

/* Done waiting. A cached fd keeps its watch (the next wait is most often in
 * the same directory, and inotify_add_watch then returns the same wd), only
 * its queued events are dropped. */
static void ins_inotify_put(int ifd, int wd, int cached)
{
    int e = errno;
    if (!cached)
        ins_real_close(ifd);
    else
        ins_inotify_drain(ifd);
    (void)wd;
    errno = e;
}

/* Watch dir (creating it if needed) on this thread's inotify fd; a watch
 * left on another directory by an earlier wait is removed. */
static int ins_watch(int ifd, int cached, char *dir)
{
    const uint32_t mask = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR;
    int wd = inotify_add_watch(ifd, dir, mask);
    if (wd < 0 && errno == ENOENT && ins_mkdir_p(dir) == 0)
        wd = inotify_add_watch(ifd, dir, mask);
    if (wd < 0)
        return -1;
    if (cached) {
        if (ins_wd >= 0 && ins_wd != wd)
            inotify_rm_watch(ifd, ins_wd);
        ins_wd = wd;
    }
    ins_inotify_drain(ifd); /* events from before now are of no interest */
    return wd;
}

int ins_consume(const struct ins_path *p, char open_path[PATH_MAX])
{
    if (ins_cfg.cluster)
        return ins_consume_cluster(p, open_path);

    memcpy(open_path, p->abs, strlen(p->abs) + 1);
    struct stat st;
    if (stat(p->abs, &st) == 0)
        return 0;
    if (errno != ENOENT)
        return -1;

    double deadline = ins_cfg.timeout > 0 ? ins_now() + ins_cfg.timeout : -1.0;
    char dir[PATH_MAX];
    memcpy(dir, p->abs, strlen(p->abs) + 1);
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        slash[1] = '\0';
    else
        *slash = '\0';
    int cached = 0;
    int ifd = ins_inotify_get(&cached);
    if (ifd < 0)
        return -1;
    int wd = ins_watch(ifd, cached, dir);
    if (wd < 0) {
        ins_inotify_put(ifd, -1, cached);
        return -1;
    }
    /* Armed: from here no publication can be missed. Check, then wait. */
    int rc = -1;
    for (;;) {
        if (stat(p->abs, &st) == 0) {
            rc = 0;
            break;
        }
        if (errno != ENOENT)
            break;
        int ms = ins_remaining_ms(deadline);
        if (ms == 0) {
            errno = ETIMEDOUT;
            break;
        }
        struct pollfd pfd = {.fd = ifd, .events = POLLIN};
        int prc = poll(&pfd, 1, ms);
        if (prc < 0 && errno != EINTR)
            break;
        if (prc <= 0)
            continue;
        char ev[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
        int rewatch = 0;
        for (;;) {
            ssize_t n = read(ifd, ev, sizeof ev);
            if (n <= 0)
                break;
            for (char *q = ev; q < ev + n;) {
                struct inotify_event *ie = (struct inotify_event *)q;
                if (ie->wd == wd && (ie->mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF)))
                    rewatch = 1;
                q += sizeof *ie + ie->len;
            }
        }
        if (rewatch) { /* the directory went away: recreate it and watch again */
            if ((wd = ins_watch(ifd, cached, dir)) < 0)
                break;
        }
    }
    ins_inotify_put(ifd, wd, cached);
    return rc;
}

/* ---- publish -------------------------------------------------------------- */

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
    int fd = ins_real_open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        ins_real_close(fd);
    }
}

int ins_publish(const char *tmp, const struct ins_path *p, int noreplace)
{
    if (ins_cfg.overwrite && !noreplace) {
        if (rename(tmp, p->abs) != 0) {
            int e = errno;
            unlink(tmp);
            errno = e;
            return -1;
        }
    } else if (link(tmp, p->abs) == 0) {
        unlink(tmp);
    } else {
        int e = errno;
        /* File systems without hard links: an atomic no-replace rename. */
        int done = 0;
        if ((e == EPERM || e == EOPNOTSUPP || e == EMLINK || e == ENOSYS) &&
            ins_real_renameat2 != NULL) {
            if (ins_real_renameat2(AT_FDCWD, tmp, AT_FDCWD, p->abs, RENAME_NOREPLACE) == 0)
                done = 1;
            else
                e = errno;
        }
        if (!done) {
            unlink(tmp);
            errno = e;
            return -1;
        }
    }
    if (ins_cfg.fsync)
        ins_fsync_dir_of(p->abs);
    return ins_notify_publish_as(p, ins_cfg.overwrite && !noreplace);
}
