/*
 * libinstride_tcp, server half: the data server of the `tcp` transport, in C.
 *
 * Serves the regular files of one managed directory to peers, speaking the wire protocol of
 * src/instride/transport/wire.py: a 4-byte big-endian length, a JSON header signed with an
 * HMAC-SHA256 of the job token; a successful fetch reply is followed by the file's bytes,
 * sent with sendfile(2). One thread per connection; every read and write has a deadline.
 *
 * Fast path, decided here: a well-formed `fetch` whose JSON is plain (ASCII strings without
 * escapes, the known fields once each), whose MAC is right, whose timestamp is inside the
 * window, whose nonce is fresh and whose key is a plain key that opens (openat2 beneath the
 * directory, no symbolic link, a regular file). Everything else — malformed, forged, replayed,
 * unknown operations, special files, keys needing normalization, missing keys — goes to the
 * `decide` callback (Python: the one place the protocol's rules and messages are written), which
 * returns the reply and, for a fetch it allows, the descriptor to send. A plain fetch with a
 * "wait" (ms) of a key not there yet is held here, in inotify on the key's directory, until the
 * key is published (then served like any fetch) or the wait ends (then the callback answers:
 * not found) -- a stream's consumer asks for its next frame before it exists. Framing errors (length
 * out of range, truncated or late headers) and "busy" are answered here.
 *
 * One replay guard (replay.c), used by both the fast path and, through iss_replay_check(), the
 * callback. What a plain request is: request.c.
 *
 * Return codes: 0 or a positive count on success, a negative errno on failure, with a message
 * in the caller's `err` buffer.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "tcp.h"

#define ISS_API __attribute__((visibility("default")))
#define ISS_MAX_HEADER (16 * 1024)
#define ISS_MAX_REPLY (16 * 1024)
#define ISS_MAX_SKEW 300.0
/* Lines a peer without the token can cause (malformed requests, refused connections): at most
 * this many a second are logged, the rest counted in one "suppressed" line, so that a flood of
 * them cannot fill the disk the log is on. */
#define ISS_PEER_LINES 20

/* What the callback returns (a bit set). */
#define ISS_KEEP 1 /* the connection may serve another request */

/* decide(ctx, header, len, peer, spent, reply, cap, *reply_len, *fd, *size) -> ISS_KEEP or 0;
 * spent: the engine verified the request and its nonce was fresh (now spent): not checked again */
typedef int (*iss_decide_fn)(void *ctx, const char *hdr, uint32_t len, const char *peer, int spent,
                             char *reply, uint32_t cap, uint32_t *reply_len, int *fd,
                             int64_t *size);
/* log(ctx, level, message): level 30 warning, 10 debug (Python's logging levels) */
typedef void (*iss_log_fn)(void *ctx, int level, const char *msg);

typedef struct {
    uint64_t fetches, bytes_sent, errors, busy, stalled, refused, peers;
} iss_stats;

/* ------------------------------------------------------------------ server state */

typedef struct conn {
    struct server *srv;
    int fd;
    int busy; /* a request is being answered (under srv->mu) */
    int dead; /* a send to the peer failed or stalled: no lingering */
    int refuse; /* over max_peers: answer "busy" and close */
    int64_t idle_since; /* waiting for its next request since (ns), once one was answered;
                         * 0: answering one, or none answered yet (under srv->mu) */
    int64_t pending_since; /* accepted at (ns), while no whole request came yet; 0 once
                            * one did (under srv->mu once its thread runs) */
    char peer[64];
    struct conn *next;
} conn;

/* Waiting fetches share one inotify instance per server: instances are few
 * (fs.inotify.max_user_instances, shared by all the user's processes: often 128), and closing
 * one waits for an RCU grace period (0.5-5 ms here). Every waiter polls it; whichever wakes
 * first reads the events and hands each to the waiters it concerns (their `seen`, and their
 * eventfd), so the usual single waiter is woken once, by the kernel, with no thread between.
 * Watches are shared by the waiters of a directory (inotify gives one watch per directory and
 * instance) and kept, idle, for the next. */
typedef struct waiter {
    int wd;           /* the watch of the key's directory */
    const char *base; /* the key's last component */
    int efd;          /* eventfd written by whichever waiter reads its events */
    int seen;         /* what they were (under mu): ISS_SEEN_* bits */
    struct waiter *next;
} waiter;

#define ISS_SEEN_KEY 1   /* an entry of the key's name appeared */
#define ISS_SEEN_OTHER 2 /* another visible name appeared */
#define ISS_SEEN_GONE 4  /* the directory went away, or events were lost */

typedef struct {
    int wd, refs; /* refs: waiters using it now (0: idle, kept for the next) */
} watch;

#define ISS_WATCHES 64 /* watches kept (in use or idle); beyond that, idle ones are removed */

typedef struct server {
    int lfd, rootfd;
    char *token;
    size_t token_len;
    int max_peers;
    int request_timeout_ms, idle_timeout_ms, send_timeout_ms;
    double send_rate;
    iss_decide_fn decide;
    iss_log_fn log;
    void *ctx;
    pthread_t acceptor;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    conn *conns;
    int threads; /* connection threads alive (under mu) */
    int inflight; /* requests being answered (under mu) */
    atomic_int closing;
    _Atomic uint64_t fetches, bytes_sent, errors, busy, stalled, refused;
    atomic_int peers;
    guard replay;
    atomic_int preempt_after_ms; /* "auto" policy: a wait this long raises the thread (-1: never) */
    int ifd;                    /* the waiting fetches' inotify instance (-1: none yet) */
    waiter *waiters;            /* (under mu) */
    watch watches[ISS_WATCHES]; /* (under mu) */
    int nwatches;
    pthread_mutex_t logmu;     /* the peer lines' limit (never held across the callback) */
    int64_t log_sec;           /* the second counted (monotonic) */
    int log_count;             /* lines logged in it */
    uint64_t log_suppressed;   /* lines not logged since the last summary */
    EVP_MD *md;               /* SHA-256, fetched once */
    EVP_MD_CTX *inner, *outer; /* the HMAC's padded-key states (read only after start) */
} server;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static void vlogf_(server *s, int level, const char *fmt, va_list ap) {
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    s->log(s->ctx, level, msg);
}

static void logf_(server *s, int level, const char *fmt, ...) {
    if (s->log == NULL)
        return;
    va_list ap;
    va_start(ap, fmt);
    vlogf_(s, level, fmt, ap);
    va_end(ap);
}

/* The "suppressed" summary of what logf_peer left out, if any. */
static void log_suppressed(server *s, uint64_t n) {
    if (n > 0)
        logf_(s, 30, "suppressed %llu more malformed or refused peer message(s) (at most %d a "
              "second are logged)", (unsigned long long)n, ISS_PEER_LINES);
}

/* logf_ (level 30) for a line any peer can cause, token or not: at most ISS_PEER_LINES a
 * second, the first ones kept; the ones left out are summed up once a later second logs again
 * (or the server stops). */
static void logf_peer(server *s, const char *fmt, ...) {
    if (s->log == NULL)
        return;
    int64_t sec = now_ns() / 1000000000LL;
    uint64_t gone = 0;
    pthread_mutex_lock(&s->logmu);
    if (sec != s->log_sec) {
        s->log_sec = sec;
        s->log_count = 0;
        gone = s->log_suppressed;
        s->log_suppressed = 0;
    }
    int keep = s->log_count < ISS_PEER_LINES;
    if (keep)
        s->log_count++;
    else
        s->log_suppressed++;
    pthread_mutex_unlock(&s->logmu);
    log_suppressed(s, gone);
    if (!keep)
        return;
    va_list ap;
    va_start(ap, fmt);
    vlogf_(s, 30, fmt, ap);
    va_end(ap);
}

/* Send all of buf within timeout_ms; 0, or -1 on failure or timeout. more: a body follows at
 * once (MSG_MORE: the kernel holds the bytes for the body's first segment, not a packet of
 * their own, which would wake the reader for the header alone). */
static int send_all(int fd, const char *buf, size_t len, int timeout_ms, int more) {
    int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000LL;
    int flags = MSG_NOSIGNAL | MSG_DONTWAIT | (more ? MSG_MORE : 0);
    while (len > 0) {
        ssize_t n = send(fd, buf, len, flags);
        if (n > 0) {
            buf += n;
            len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno != EAGAIN)
            return -1;
        int64_t left = (deadline - now_ns()) / 1000000LL;
        if (left <= 0)
            return -1;
        struct pollfd p = {fd, POLLOUT, 0};
        if (poll(&p, 1, (int)left) < 0 && errno != EINTR)
            return -1;
    }
    return 0;
}

/* Reply with a 4-byte length and the JSON body (more: as send_all's). */
static int send_reply(server *s, int fd, const char *json, size_t len, int more) {
    char buf[4 + ISS_MAX_REPLY];
    if (len > ISS_MAX_REPLY)
        len = ISS_MAX_REPLY;
    uint32_t be = htonl((uint32_t)len);
    memcpy(buf, &be, 4);
    memcpy(buf + 4, json, len);
    return send_all(fd, buf, 4 + len, s->send_timeout_ms, more);
}

/* {"ok":false,"error":ERR,"message":MSG}; MSG is plain ASCII made here (no escaping needed). */
static void send_error(server *s, int fd, const char *err, const char *msg) {
    char json[ISS_MAX_REPLY];
    int n = snprintf(json, sizeof json, "{\"ok\":false,\"error\":\"%s\",\"message\":\"%s\"}", err, msg);
    if (n > 0)
        send_reply(s, fd, json, (size_t)n < sizeof json ? (size_t)n : sizeof json - 1, 0);
}

/* Read exactly len bytes before the deadline (ns; -1: none). Returns bytes read (< len on EOF),
 * -ETIMEDOUT, or another negative errno. */
static ssize_t recv_exact(int fd, char *buf, size_t len, int64_t deadline) {
    size_t got = 0;
    while (got < len) {
        int wait_ms = -1;
        if (deadline >= 0) {
            int64_t left = (deadline - now_ns()) / 1000000LL;
            if (left <= 0)
                return -ETIMEDOUT;
            wait_ms = (int)(left > 3600000 ? 3600000 : left);
        }
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, wait_ms);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            continue; /* the deadline check above ends it */
        ssize_t n = recv(fd, buf + got, len - got, MSG_DONTWAIT);
        if (n == 0)
            return (ssize_t)got;
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return -errno;
        }
        got += (size_t)n;
    }
    return (ssize_t)got;
}

/* ------------------------------------------------------------------ the fast path */

/* HMAC-SHA256 keyed with the token: the inner and outer digests of the padded key are made
 * once (OpenSSL's one-shot HMAC() looks the algorithm up on every call: ~50 µs here). */
static int mac_init(server *s) {
    unsigned char key[64] = {0}, ipad[64], opad[64];
    s->md = EVP_MD_fetch(NULL, "SHA256", NULL);
    if (s->md == NULL)
        return -1;
    if (s->token_len > 64) {
        unsigned int n = 0;
        if (!EVP_Digest(s->token, s->token_len, key, &n, s->md, NULL))
            return -1;
    } else {
        memcpy(key, s->token, s->token_len);
    }
    for (int i = 0; i < 64; i++) {
        ipad[i] = key[i] ^ 0x36;
        opad[i] = key[i] ^ 0x5c;
    }
    s->inner = EVP_MD_CTX_new();
    s->outer = EVP_MD_CTX_new();
    if (s->inner == NULL || s->outer == NULL || !EVP_DigestInit_ex(s->inner, s->md, NULL) ||
        !EVP_DigestUpdate(s->inner, ipad, 64) || !EVP_DigestInit_ex(s->outer, s->md, NULL) ||
        !EVP_DigestUpdate(s->outer, opad, 64))
        return -1;
    OPENSSL_cleanse(key, sizeof key);
    return 0;
}

static void mac_free(server *s) {
    EVP_MD_CTX_free(s->inner);
    EVP_MD_CTX_free(s->outer);
    EVP_MD_free(s->md);
}

/* The MAC of a request, as wire.sign computes it, in lowercase hex (65 bytes with the NUL). */
static int request_mac(server *s, const request *r, char out[65]) {
    char canon[ISS_MAX_HEADER + 128];
    int n = snprintf(canon, sizeof canon, "instride/%d\n%s\n%s\n%s\n%.6f", ISS_PROTOCOL, r->op, r->key,
                     r->nonce, r->ts);
    if (n >= 0 && r->has_wait && (size_t)n < sizeof canon) /* the wait is signed too */
        n += snprintf(canon + n, sizeof canon - (size_t)n, "\nwait=%d", r->wait_ms);
    if (n >= 0 && r->until != NULL && (size_t)n < sizeof canon)
        n += snprintf(canon + n, sizeof canon - (size_t)n, "\nuntil=%s", r->until);
    if (n >= 0 && r->count && (size_t)n < sizeof canon)
        n += snprintf(canon + n, sizeof canon - (size_t)n, "\ncount=%d", r->count);
    if (n < 0 || (size_t)n >= sizeof canon)
        return -1;
    unsigned char inner[32], md[32];
    unsigned int len = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok = ctx != NULL && EVP_MD_CTX_copy_ex(ctx, s->inner) && EVP_DigestUpdate(ctx, canon, (size_t)n) &&
             EVP_DigestFinal_ex(ctx, inner, &len) && EVP_MD_CTX_copy_ex(ctx, s->outer) &&
             EVP_DigestUpdate(ctx, inner, sizeof inner) && EVP_DigestFinal_ex(ctx, md, &len) && len == 32;
    EVP_MD_CTX_free(ctx);
    if (!ok)
        return -1;
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        out[2 * i] = hex[md[i] >> 4];
        out[2 * i + 1] = hex[md[i] & 15];
    }
    out[64] = '\0';
    return 0;
}

/* ------------------------------------------------------------------ awaiting a key */

#define ISS_AWAIT_ABANDON (-3) /* the server is stopping or the peer left: close, no reply */

/* Read the events queued on the shared instance and hand each to the waiters it concerns
 * (`self`, the caller if it is one, learns from its `seen` alone: no wake-up of its own);
 * under mu. */
static void dispatch_events(server *s, const waiter *self) {
    char buf[8192] __attribute__((aligned(__alignof__(struct inotify_event))));
    for (;;) {
        ssize_t n = read(s->ifd, buf, sizeof buf);
        if (n <= 0)
            return;
        for (char *q = buf; q < buf + n;) {
            struct inotify_event *ev = (struct inotify_event *)q;
            q += sizeof *ev + ev->len;
            if (ev->mask & IN_IGNORED) { /* a watch removed (by us, or with its directory) */
                for (int i = 0; i < s->nwatches; i++)
                    if (s->watches[i].wd == ev->wd) {
                        s->watches[i] = s->watches[--s->nwatches];
                        break;
                    }
            }
            for (waiter *w = s->waiters; w != NULL; w = w->next) {
                int seen = 0;
                if (ev->mask & IN_Q_OVERFLOW)
                    seen = ISS_SEEN_GONE;
                else if (ev->wd != w->wd)
                    continue;
                else if (ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED))
                    seen = ISS_SEEN_GONE;
                else if (ev->len > 0 && strcmp(ev->name, w->base) == 0)
                    seen = ISS_SEEN_KEY;
                else if (ev->len > 0 && ev->name[0] != '.')
                    seen = ISS_SEEN_OTHER;
                if (seen) {
                    w->seen |= seen;
                    uint64_t one = 1;
                    if (w != self && write(w->efd, &one, sizeof one) < 0) { /* (full: awake) */
                    }
                }
            }
        }
    }
}

/* Register a waiter on the directory dfd (a watch shared with its other waiters); under mu.
 * Returns 0, or -1 (no waiting possible: no inotify instance, no watch). */
static int waiter_add(server *s, waiter *w, int dfd) {
    if (s->ifd < 0 && (s->ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC)) < 0)
        return -1; /* (the first waiting fetch of this server makes it) */
    dispatch_events(s, NULL); /* what happened before this waiter: to the others, if anyone's */
    char at[64];
    snprintf(at, sizeof at, "/proc/self/fd/%d", dfd); /* the directory opened beneath the root */
    int wd = inotify_add_watch(s->ifd, at, IN_MOVED_TO | IN_CREATE | IN_DELETE_SELF | IN_MOVE_SELF |
                                               IN_ONLYDIR);
    if (wd < 0)
        return -1;
    int i = 0;
    while (i < s->nwatches && s->watches[i].wd != wd)
        i++;
    if (i == s->nwatches) {
        if (s->nwatches == ISS_WATCHES) { /* full: drop an idle watch, else do not wait */
            int idle = 0;
            while (idle < s->nwatches && s->watches[idle].refs > 0)
                idle++;
            if (idle == s->nwatches) {
                inotify_rm_watch(s->ifd, wd); /* (a new one: nobody else uses it) */
                return -1;
            }
            inotify_rm_watch(s->ifd, s->watches[idle].wd);
            s->watches[idle] = s->watches[--s->nwatches];
            i = s->nwatches;
        }
        s->watches[i].wd = wd;
        s->watches[i].refs = 0;
        s->nwatches++;
    }
    s->watches[i].refs++;
    /* Idle watches of other directories would wake the waiters here for nothing: they go now
     * (the one of this directory stays across its waits, as a stream's reader asks frame after
     * frame; removing a watch is cheap, closing an instance is what is not). */
    for (int j = 0; j < s->nwatches;) {
        if (s->watches[j].refs == 0 && s->watches[j].wd != wd) {
            inotify_rm_watch(s->ifd, s->watches[j].wd);
            s->watches[j] = s->watches[--s->nwatches];
        } else {
            j++;
        }
    }
    w->wd = wd;
    w->seen = 0;
    w->next = s->waiters;
    s->waiters = w;
    return 0;
}

/* Unregister a waiter (its watch stays, idle, for the next waiter of the directory); under mu. */
static void waiter_remove(server *s, waiter *w) {
    for (waiter **p = &s->waiters; *p != NULL; p = &(*p)->next)
        if (*p == w) {
            *p = w->next;
            break;
        }
    for (int i = 0; i < s->nwatches; i++)
        if (s->watches[i].wd == w->wd) {
            s->watches[i].refs--;
            break;
        }
}

/* The "auto" scheduling policy (instride serve --sched auto): the server's threads run under
 * SCHED_BATCH, which never preempts a busy core's thread when woken -- throughput, when frames
 * come close together. A fetch that has waited for its key longer than s->preempt_after_ms is
 * a reader idle between rare frames: that thread waits on under SCHED_OTHER, so that the
 * publication's wake-up may preempt (the producer, on a node whose cores are all busy) and the
 * frame goes at once; it is back under SCHED_BATCH once the request is answered. Only a thread
 * found under SCHED_BATCH is raised (a policy set from outside, e.g. by chrt, is left alone);
 * moving between the two normal policies needs no privilege. */
static __thread int raised; /* this thread was raised from SCHED_BATCH for a long wait */

/* struct sched_attr of sched_setattr(2) (glibc before 2.41 has neither the type nor the call) */
typedef struct {
    uint32_t size, policy;
    uint64_t flags;
    int32_t nice;
    uint32_t priority;
    uint64_t runtime, deadline, period;
} sched_attr_;

/* The slice a raised thread asks for (Linux >= 6.12 takes a SCHED_OTHER thread's
 * sched_runtime as its time slice, 0.1 ms at least): a woken thread with a shorter slice than
 * the running one's may preempt it at once -- without it, the running thread keeps the core
 * to the end of its own slice (EEVDF's "run to parity": up to a few ms). Older kernels ignore
 * it; the thread is then raised to SCHED_OTHER alone. */
#define ISS_RAISED_SLICE_NS 100000ULL

/* Put the calling thread under `policy` with the time slice `slice_ns` (0: the default), its
 * nice value kept; 0 or -1 (errno). */
static int set_policy(int policy, uint64_t slice_ns) {
    sched_attr_ a = {.size = sizeof a};
    if (syscall(SYS_sched_getattr, 0, &a, sizeof a, 0) == 0) { /* (for the nice value) */
        a.size = sizeof a;
        a.policy = (uint32_t)policy;
        a.flags = 0;
        a.priority = 0;
        a.runtime = slice_ns;
        a.deadline = a.period = 0;
        if (syscall(SYS_sched_setattr, 0, &a, 0) == 0)
            return 0;
    }
    struct sched_param none = {0}; /* (no sched_setattr: the policy alone) */
    return sched_setscheduler(0, policy, &none);
}

static void raise_for_wake(void) {
    if (sched_getscheduler(0) == SCHED_BATCH && set_policy(SCHED_OTHER, ISS_RAISED_SLICE_NS) == 0)
        raised = 1;
}

static void lower_after_answer(void) {
    if (raised) {
        set_policy(SCHED_BATCH, 0); /* (refused: it stays raised, harmlessly) */
        raised = 0;
    }
}

/* A fetch with "wait" of a key not there yet: sleep in inotify on the key's directory until the
 * key opens (a publication renames it into place), the wait runs out, or another entry appears
 * in the directory (say, a stream's end marker: the client then looks the usual way). A request
 * naming "until" (a stream's end marker) is not held at all while that name exists.
 * Returns what openat2 returned (a descriptor, or -1 with errno), or ISS_AWAIT_ABANDON. */
static int await_key(server *s, int sock, const request *r, struct open_how *how) {
    const char *slash = strrchr(r->key, '/');
    char dir[ISS_MAX_KEY + 1] = ".";
    if (slash != NULL) {
        memcpy(dir, r->key, (size_t)(slash - r->key));
        dir[slash - r->key] = '\0';
    }
    struct open_how dh = {
        .flags = O_PATH | O_DIRECTORY | O_CLOEXEC,
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    int dfd = (int)syscall(SYS_openat2, s->rootfd, dir, &dh, sizeof dh);
    if (dfd < 0) {
        errno = ENOENT;
        return -1;
    }
    waiter w = {.base = slash != NULL ? slash + 1 : r->key};
    w.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    pthread_mutex_lock(&s->mu);
    int added = w.efd >= 0 && !atomic_load(&s->closing) && waiter_add(s, &w, dfd) == 0;
    pthread_mutex_unlock(&s->mu);
    int fd = -1, saved = ENOENT;
    if (!added)
        goto out;
    int64_t start = now_ns(), deadline = start + (int64_t)r->wait_ms * 1000000LL;
    if (r->until != NULL && faccessat(dfd, r->until, F_OK, AT_SYMLINK_NOFOLLOW) == 0)
        deadline = 0; /* (one look for the key below, no wait) */
    int after = atomic_load(&s->preempt_after_ms);
    int64_t raise_at = after >= 0 && !raised ? start + (int64_t)after * 1000000LL : INT64_MAX;
    for (;;) {
        fd = (int)syscall(SYS_openat2, s->rootfd, r->key, how, sizeof *how); /* after the watch */
        if (fd >= 0 || errno != ENOENT) {
            saved = errno;
            break;
        }
        int64_t left = (deadline - now_ns()) / 1000000LL;
        if (left <= 0)
            break;
        if (atomic_load(&s->closing)) {
            fd = ISS_AWAIT_ABANDON;
            break;
        }
        int64_t slice = left > 100 ? 100 : left; /* (100 ms: notice a stop) */
        if (raise_at != INT64_MAX) {
            int64_t until_raise = (raise_at - now_ns() + 999999LL) / 1000000LL;
            if (until_raise <= 0) {
                raise_for_wake();
                raise_at = INT64_MAX;
            } else if (until_raise < slice) {
                slice = until_raise;
            }
        }
        struct pollfd p[3] = {{s->ifd, POLLIN, 0}, {w.efd, POLLIN, 0}, {sock, POLLIN | POLLRDHUP, 0}};
        int k = poll(p, 3, (int)slice);
        if (k < 0 && errno != EINTR)
            break;
        if (k <= 0)
            continue;
        if (p[2].revents) { /* the peer closed, or sent before its answer: give up on it */
            fd = ISS_AWAIT_ABANDON;
            break;
        }
        uint64_t count;
        if (p[1].revents && read(w.efd, &count, sizeof count) < 0) { /* (reset it) */
        }
        pthread_mutex_lock(&s->mu);
        if (p[0].revents)
            dispatch_events(s, &w); /* (another waiter may have been first: nothing to read) */
        int seen = w.seen;
        w.seen = 0;
        pthread_mutex_unlock(&s->mu);
        if (!(seen & (ISS_SEEN_OTHER | ISS_SEEN_GONE)))
            continue; /* the key's name (or nothing new): look again */
        fd = (int)syscall(SYS_openat2, s->rootfd, r->key, how, sizeof *how);
        saved = errno;
        break; /* opened, or the directory changed otherwise: answer now */
    }
out:
    if (added) {
        pthread_mutex_lock(&s->mu);
        waiter_remove(s, &w);
        pthread_mutex_unlock(&s->mu);
    }
    if (w.efd >= 0)
        close(w.efd);
    close(dfd);
    if (fd == -1)
        errno = saved;
    return fd;
}

static int open_key(server *s, conn *c, const request *r, int64_t *size, double *published);

/* Try the fast path: returns an open regular file (its size, when it got its name) to serve,
 * -1 or -2 (delegate), or ISS_AWAIT_ABANDON (close without a reply). *spent: set once the
 * request is verified and its nonce accepted (spent) -- before any wait for its key, so that
 * the same bytes sent again meanwhile are refused at once, not held for the wait beside it. */
static int fast_path(server *s, conn *c, char *hdr, size_t len, request *r, int64_t *size,
                     double *published, int *spent) {
    if (s->token_len == 0 || parse_plain(hdr, len, r) != 0)
        return -1;
    if (r->op_len != 5 || memcmp(r->op, "fetch", 5) != 0)
        return -1;
    if (r->mac_len != 64 || !lower_hex(r->mac, 64) || !plain_key(r->key, r->key_len))
        return -1;
    char mac[65];
    if (request_mac(s, r, mac) != 0 || CRYPTO_memcmp(mac, r->mac, 64) != 0)
        return -1;
    double now = wall_now();
    if (fabs(now - r->ts) > ISS_MAX_SKEW)
        return -1;
    /* A replayed or too old one is delegated, and refused there (the guard answers the same
     * again); a request delegated before this point has not spent its nonce. */
    if (guard_check(&s->replay, r->nonce, r->nonce_len, r->ts, now) != 0)
        return -1;
    *spent = 1;
    return open_key(s, c, r, size, published);
}

/* Open r->key, a regular file beneath the directory (waiting for it as the request asks), and
 * hold it: a shared flock, kept until the descriptor is closed after the body is sent, taken
 * once the name is seen to still name the opened file. A stream's producer rewrites a
 * retired frame's file only under an exclusive lock, and retires it by renaming it away first:
 * so what is sent is the frame published under that key, never another frame written into
 * the same file meanwhile (a reader that checks frames by their own checksums relies on it).
 * Returns the descriptor, its size and its modification time (*published: seconds since the
 * epoch; a stream's producer stamps it as it publishes the frame), -2 (none: delegate or
 * answer "not found") or ISS_AWAIT_ABANDON. */
static int open_key(server *s, conn *c, const request *r, int64_t *size, double *published) {
    struct open_how how = {
        .flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK,
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    int fd = (int)syscall(SYS_openat2, s->rootfd, r->key, &how, sizeof how);
    if (fd < 0 && errno == ENOENT && r->has_wait && r->wait_ms > 0) {
        fd = await_key(s, c->fd, r, &how);
        if (fd == ISS_AWAIT_ABANDON)
            return fd;
    }
    if (fd < 0)
        return -2;
    struct stat st, named;
    /* (a file system without flock -- ENOLCK, EOPNOTSUPP, EINVAL, ENOSYS: served unheld, the
     * name check stays, as instride.store.served.NO_FLOCK; any other failure: not served) */
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        (flock(fd, LOCK_SH | LOCK_NB) != 0 && errno != ENOLCK && errno != EOPNOTSUPP &&
         errno != EINVAL && errno != ENOSYS) ||
        fstatat(s->rootfd, r->key, &named, AT_SYMLINK_NOFOLLOW) != 0 ||
        named.st_ino != st.st_ino || named.st_dev != st.st_dev) {
        close(fd); /* (being rewritten, or renamed away since the open: not that key's now) */
        return -2;
    }
    /* (from the look under the lock: the file cannot change from here on) */
    *size = (int64_t)named.st_size;
    *published = (double)named.st_mtim.tv_sec + (double)named.st_mtim.tv_nsec * 1e-9;
    return fd;
}

/* The numbered key after key, in place: its last run of digits plus one, same width.
 * 0 when there is none (no digits in its last component, or they would overflow). */
static int next_key(char *key) {
    char *base = strrchr(key, '/');
    base = base != NULL ? base + 1 : key;
    char *end = base + strlen(base), *p = end;
    while (p > base && (p[-1] < '0' || p[-1] > '9'))
        p--;
    if (p == base)
        return 0;
    for (char *q = p - 1;; q--) {
        if (*q < '9') {
            (*q)++;
            return 1;
        }
        if (q == base || q[-1] < '0' || q[-1] > '9')
            return 0; /* all nines: the next number needs another digit */
        *q = '0';
    }
}

/* ------------------------------------------------------------------ serving a body */

/* Send size bytes of file fd with sendfile, within send_timeout + size / send_rate.
 * 0: sent; -1: the peer went away or the transfer stalled (connection to be closed). */
static int send_body(server *s, int sock, int fd, int64_t size, const char *key, const char *peer) {
    double allowed = s->send_timeout_ms / 1000.0 + (double)size / s->send_rate;
    int64_t deadline = now_ns() + (int64_t)(allowed * 1e9);
    off_t off = 0;
    while (off < size) {
        ssize_t n = sendfile(sock, fd, &off, (size_t)(size - off));
        if (n > 0)
            continue;
        if (n == 0)
            return -1; /* the file shrank under us */
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN)
            return -1;
        int64_t left = (deadline - now_ns()) / 1000000LL;
        if (left > 0) {
            struct pollfd p = {sock, POLLOUT, 0};
            if (poll(&p, 1, (int)(left > 1000 ? 1000 : left)) >= 0 || errno == EINTR)
                continue;
            return -1;
        }
        atomic_fetch_add(&s->stalled, 1);
        logf_(s, 30, "transfer of %s (%lld bytes) to %s stalled; connection dropped", key,
              (long long)size, peer);
        return -1;
    }
    atomic_fetch_add(&s->fetches, 1);
    atomic_fetch_add(&s->bytes_sent, (uint64_t)size);
    return 0;
}

/* ------------------------------------------------------------------ one connection */

/* A connection that has not sent a whole request this long after it was accepted, and has
 * nothing unread, may be closed to make room (a client sends its request as it connects). */
#define ISS_PENDING_GRACE_MS 100

/* Whether a byte the next read gets is there, unread: a peek, not FIONREAD -- which counts
 * nothing past an out-of-band (urgent) byte a peer sent, while poll says readable and the read
 * gets the byte after it (the kernel leaves the urgent one out of the stream). Keeps errno. */
static int byte_unread(int fd) {
    int saved = errno;
    char b;
    ssize_t n;
    do
        n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    errno = saved;
    return n == 1;
}

/* At max_peers, a connection is shut down to make room: its thread sees the end and closes it.
 * First the one that has waited the longest for a request that never came whole (no token
 * needed to hold a place so: a port scan, a header sent a byte at a time; they took the places
 * of served clients, and every new client was told "busy", for as long as they were held),
 * then the one idle the longest between two requests (kept alive by its client for a next
 * one: finding it closed, the client sends its next request on a new connection). Whether
 * there was one (under srv->mu). */
static int evict_idle(server *s) {
    conn *pending = NULL, *oldest = NULL;
    int64_t before = now_ns() - (int64_t)ISS_PENDING_GRACE_MS * 1000000LL;
    for (conn *c = s->conns; c != NULL; c = c->next) {
        if (c->refuse)
            continue;
        if (c->pending_since > 0) {
            /* (a request there already: its thread is about to read it) */
            if (c->pending_since <= before &&
                (pending == NULL || c->pending_since < pending->pending_since) &&
                !byte_unread(c->fd))
                pending = c;
        } else if (!c->busy && c->idle_since > 0 &&
                   (oldest == NULL || c->idle_since < oldest->idle_since)) {
            oldest = c;
        }
    }
    if (pending != NULL) {
        pending->pending_since = 0; /* (once) */
        shutdown(pending->fd, SHUT_RDWR);
        return 1;
    }
    if (oldest == NULL)
        return 0;
    oldest->idle_since = 0; /* (once) */
    shutdown(oldest->fd, SHUT_RDWR);
    return 1;
}

/* The last byte of a connection's first request, read only once the connection no longer
 * counts as pending: the mark is cleared under srv->mu while the byte is there, unread, and
 * evict_idle takes (under srv->mu) only a pending connection with nothing unread -- so a
 * connection whose request came whole is never shut to make room (its thread had read the
 * whole header, and not yet cleared the mark, when the eviction looked). 1: read into *at;
 * 0: the connection was closed, or shut to make room (before its request came whole);
 * -errno: -ETIMEDOUT past deadline. */
static int recv_last_of_first(server *s, conn *c, char *at, int64_t deadline) {
    for (;;) {
        /* (whether the byte is there: a peek, as evict_idle's look -- see byte_unread -- so
         * that whenever poll below says readable, this finds what it found) */
        char peek;
        ssize_t n = -1;
        int e = EAGAIN;
        pthread_mutex_lock(&s->mu);
        int evicted = c->pending_since == 0; /* (evict_idle clears it as it shuts) */
        if (!evicted) {
            do
                n = recv(c->fd, &peek, 1, MSG_PEEK | MSG_DONTWAIT);
            while (n < 0 && errno == EINTR);
            e = errno;
            if (n == 1)
                c->pending_since = 0; /* served from here on */
        }
        pthread_mutex_unlock(&s->mu);
        if (evicted || n == 0)
            return 0; /* shut to make room, or closed: nothing more comes */
        if (n == 1) {
            do
                n = recv(c->fd, at, 1, MSG_DONTWAIT);
            while (n < 0 && errno == EINTR);
            return n == 1 ? 1 : n == 0 ? 0 : -errno;
        }
        if (e != EAGAIN && e != EWOULDBLOCK)
            return -e;
        /* nothing there: wait for it (a byte that comes is looked at again, under the lock) */
        int64_t left = (deadline - now_ns()) / 1000000LL;
        if (left <= 0)
            return -ETIMEDOUT;
        struct pollfd p = {c->fd, POLLIN, 0};
        if (poll(&p, 1, (int)(left > 3600000 ? 3600000 : left)) < 0 && errno != EINTR)
            return -errno;
    }
}

static void set_busy(server *s, conn *c, int busy) {
    pthread_mutex_lock(&s->mu);
    c->busy = busy;
    s->inflight += busy ? 1 : -1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Answer one request whose header is hdr; 1: keep the connection, 0: close it. */
static int answer(server *s, conn *c, char *hdr, uint32_t len) {
    request r;
    int64_t size = 0;
    double published = 0.0;
    char copy[ISS_MAX_HEADER];
    memcpy(copy, hdr, len); /* parse_plain writes NULs into hdr; the callback gets the original */
    int spent = 0;
    int fd = fast_path(s, c, hdr, len, &r, &size, &published, &spent);
    if (fd == ISS_AWAIT_ABANDON) {
        c->dead = 1;
        return 0;
    }
    if (fd >= 0) {
        /* "count": the numbered keys after this one too, each as it is published, each with
         * its own reply; the first one not published in time ends them ("not found") */
        char key[ISS_MAX_KEY + 1];
        snprintf(key, sizeof key, "%s", r.key);
        r.key = key;
        int keep = 1;
        for (int j = 0; keep; j++) {
            char json[ISS_MAX_REPLY];
            /* "published": when its producer published it (a stream's reader that checks
             * frames by their own checksums learns its producer's cadence from it) */
            int n = snprintf(json, sizeof json,
                             "{\"ok\":true,\"key\":\"%s\",\"size\":%lld,\"published\":%.6f}",
                             key, (long long)size, published);
            keep = send_reply(s, c->fd, json, (size_t)n, size > 0) == 0 &&
                   (size == 0 || send_body(s, c->fd, fd, size, key, c->peer) == 0);
            if (keep && size == 0) {
                atomic_fetch_add(&s->fetches, 1);
            }
            close(fd);
            if (!keep || j + 1 >= r.count)
                break;
            if (atomic_load(&s->closing)) { /* stopping: no more of what was asked ahead (the
                                             * grace is for requests in flight, not for every
                                             * frame published; the reader's next call finds
                                             * the connection closed and goes the usual way) */
                keep = 0;
                break;
            }
            fd = next_key(key) ? open_key(s, c, &r, &size, &published) : -2;
            if (fd == ISS_AWAIT_ABANDON)
                keep = 0;
            else if (fd < 0) {
                send_error(s, c->fd, "KeyNotFoundError", "not published in time");
                break;
            }
        }
        c->dead = !keep;
        return keep;
    }
    char reply[ISS_MAX_REPLY];
    uint32_t reply_len = 0;
    int out_fd = -1;
    int flags = s->decide(s->ctx, copy, len, c->peer, spent, reply, sizeof reply, &reply_len, &out_fd, &size);
    if (reply_len > sizeof reply)
        reply_len = 0;
    int keep = (flags & ISS_KEEP) != 0;
    if (reply_len == 0) {
        atomic_fetch_add(&s->errors, 1);
        send_error(s, c->fd, "WireError", "internal error");
        keep = 0;
    } else if (send_reply(s, c->fd, reply, reply_len, out_fd >= 0 && size > 0) != 0) {
        keep = 0;
        c->dead = 1;
    } else if (out_fd >= 0) {
        if (size > 0) {
            if (send_body(s, c->fd, out_fd, size, "a key", c->peer) != 0)
                keep = 0, c->dead = 1;
        } else {
            atomic_fetch_add(&s->fetches, 1);
        }
    }
    if (out_fd >= 0)
        close(out_fd);
    return keep;
}

/* Close after a reply without losing it: closing a socket with unread request bytes makes the
 * kernel reset the connection, and a reset discards the reply not yet read by the peer. So
 * half-close, then read and drop what the peer still sends (at most 1 MiB, 1 s). */
static void linger_close(int fd) {
    shutdown(fd, SHUT_WR);
    int64_t deadline = now_ns() + 1000000000LL;
    size_t drained = 0;
    char buf[16384];
    while (drained < (1u << 20)) {
        int64_t left = (deadline - now_ns()) / 1000000LL;
        if (left <= 0)
            break;
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, (int)left);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (n <= 0)
            break;
        drained += (size_t)n;
    }
    close(fd);
}

static void *conn_main(void *arg) {
    conn *c = arg;
    server *s = c->srv;
    pthread_mutex_lock(&s->mu);
    c->next = s->conns;
    s->conns = c;
    pthread_mutex_unlock(&s->mu);
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int first = 1, linger = 0, pending = 1;
    char *hdr = c->refuse ? NULL : malloc(ISS_MAX_HEADER + 1);
    if (c->refuse) { /* (in this thread, so that the acceptor never waits on a lingering close) */
        send_error(s, c->fd, "PeerUnavailable", "busy: too many connections, retry later");
        linger = 1;
    }
    while (hdr != NULL && !atomic_load(&s->closing)) {
        int wait_ms = first ? s->request_timeout_ms : s->idle_timeout_ms;
        unsigned char prefix[4];
        ssize_t got = recv_exact(c->fd, (char *)prefix, 4, now_ns() + (int64_t)wait_ms * 1000000LL);
        if (got == -ETIMEDOUT || got == 0 || got < 0)
            break; /* idle too long, closed, or stopped: close quietly */
        set_busy(s, c, 1);
        int keep = 0;
        if (got < 4) {
            atomic_fetch_add(&s->refused, 1);
            logf_peer(s, "malformed request from %s: truncated length prefix", c->peer);
            send_error(s, c->fd, "WireError", "truncated length prefix");
        } else {
            uint32_t n;
            memcpy(&n, prefix, 4);
            n = ntohl(n);
            if (n == 0 || n > ISS_MAX_HEADER) {
                char msg[128];
                snprintf(msg, sizeof msg, "header length %u out of range (1..%d)", n, ISS_MAX_HEADER);
                atomic_fetch_add(&s->refused, 1);
                logf_peer(s, "malformed request from %s: %s", c->peer, msg);
                send_error(s, c->fd, "WireError", msg);
            } else {
                int64_t deadline = now_ns() + (int64_t)s->request_timeout_ms * 1000000LL;
                /* (the first request's last byte: only once its place is no longer the first
                 * to be taken, see recv_last_of_first) */
                ssize_t h = recv_exact(c->fd, hdr, pending ? n - 1 : n, deadline);
                if (pending && h == (ssize_t)n - 1) {
                    int last = recv_last_of_first(s, c, hdr + n - 1, deadline);
                    h = last == 1 ? (ssize_t)n : last < 0 ? last : h;
                }
                if (h == (ssize_t)n) {
                    pending = 0;
                    keep = answer(s, c, hdr, n);
                    lower_after_answer();
                    first = first && !keep;
                } else {
                    char msg[128];
                    if (h == -ETIMEDOUT)
                        snprintf(msg, sizeof msg, "timed out reading the request header");
                    else
                        snprintf(msg, sizeof msg, "truncated header (%zd bytes)", h < 0 ? (ssize_t)0 : h);
                    atomic_fetch_add(&s->refused, 1);
                    logf_peer(s, "malformed request from %s: %s", c->peer, msg);
                    send_error(s, c->fd, "WireError", msg);
                }
            }
        }
        set_busy(s, c, 0);
        if (!keep) {
            linger = !c->dead; /* an error reply was sent: let the peer read it */
            break;
        }
        pthread_mutex_lock(&s->mu);
        c->idle_since = now_ns();
        pthread_mutex_unlock(&s->mu);
    }
    free(hdr);
    pthread_mutex_lock(&s->mu);
    for (conn **p = &s->conns; *p != NULL; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            break;
        }
    pthread_mutex_unlock(&s->mu);
    if (linger && !atomic_load(&s->closing))
        linger_close(c->fd);
    else
        close(c->fd);
    pthread_mutex_lock(&s->mu);
    if (!c->refuse)
        atomic_fetch_sub(&s->peers, 1);
    free(c);
    s->threads--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void *accept_main(void *arg) {
    server *s = arg;
    for (;;) {
        struct sockaddr_storage addr;
        socklen_t alen = sizeof addr;
        int fd = accept4(s->lfd, (struct sockaddr *)&addr, &alen, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (atomic_load(&s->closing)) {
            if (fd >= 0)
                close(fd);
            break;
        }
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EAGAIN)
                continue;
            if (errno == EBADF || errno == EINVAL || errno == ENOTSOCK)
                break; /* (the listening socket itself is gone) */
            /* Out of descriptors or memory, or an error of the connection being accepted
             * (accept(2): EPROTO, ENETDOWN, EHOSTUNREACH, EPERM, ...): the next connection
             * may be fine. Never stop accepting while the server runs. */
            usleep(10000);
            continue;
        }
        char host[INET6_ADDRSTRLEN] = "?", peer[64];
        int port = 0;
        if (addr.ss_family == AF_INET) {
            struct sockaddr_in *a = (struct sockaddr_in *)&addr;
            inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
            port = ntohs(a->sin_port);
        } else if (addr.ss_family == AF_INET6) {
            struct sockaddr_in6 *a = (struct sockaddr_in6 *)&addr;
            inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
            port = ntohs(a->sin6_port);
        }
        snprintf(peer, sizeof peer, "('%s', %d)", host, port);
        int refuse = atomic_load(&s->peers) >= s->max_peers;
        if (refuse) { /* (an idle kept-alive connection gives its place: not refused then) */
            pthread_mutex_lock(&s->mu);
            refuse = !evict_idle(s);
            pthread_mutex_unlock(&s->mu);
        }
        if (refuse) {
            atomic_fetch_add(&s->busy, 1);
            logf_peer(s, "refused connection from %s: %d connections already", peer,
                  atomic_load(&s->peers));
        }
        pthread_mutex_lock(&s->mu);
        int flood = refuse && s->threads >= 2 * s->max_peers + 64;
        pthread_mutex_unlock(&s->mu);
        conn *c = flood ? NULL : calloc(1, sizeof *c);
        if (c == NULL) { /* (a flood of refused connections: no reply, no thread) */
            close(fd);
            continue;
        }
        c->fd = fd;
        c->refuse = refuse;
        c->pending_since = refuse ? 0 : now_ns();
        memcpy(c->peer, peer, sizeof peer);
        c->srv = s;
        if (!refuse)
            atomic_fetch_add(&s->peers, 1);
        pthread_mutex_lock(&s->mu);
        s->threads++;
        pthread_mutex_unlock(&s->mu);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* (Python runs on it: a request the C path hands over is decided there) */
        pthread_attr_setstacksize(&attr, 2 * 1024 * 1024);
        pthread_t t;
        if (pthread_create(&t, &attr, conn_main, c) != 0) {
            if (!refuse)
                atomic_fetch_sub(&s->peers, 1);
            pthread_mutex_lock(&s->mu);
            s->threads--;
            pthread_mutex_unlock(&s->mu);
            close(fd);
            free(c);
        }
        pthread_attr_destroy(&attr);
    }
    return NULL;
}

/* ------------------------------------------------------------------ API */

ISS_API int iss_start(const char *host, int port, const char *root, const char *token,
                      size_t token_len, int max_peers,
                      int request_timeout_ms, int idle_timeout_ms, int send_timeout_ms,
                      double send_rate, iss_decide_fn decide, iss_log_fn log, void *ctx,
                      void **out, char *err, size_t errlen) {
    server *s = calloc(1, sizeof *s);
    if (s == NULL)
        return -ENOMEM;
    s->lfd = s->rootfd = s->ifd = -1;
    atomic_store(&s->preempt_after_ms, -1);
    s->rootfd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (s->rootfd < 0) {
        int e = errno;
        set_err(err, errlen, "cannot open the managed directory %s: %s", root, strerror(e));
        free(s);
        return -e;
    }
    s->token = malloc(token_len + 1);
    if (s->token == NULL) {
        close(s->rootfd);
        free(s);
        return -ENOMEM;
    }
    if (token_len > 0)
        memcpy(s->token, token, token_len);
    s->token[token_len] = '\0';
    s->token_len = token_len; /* (a token may hold any byte, NUL included) */
    s->max_peers = max_peers;
    s->request_timeout_ms = request_timeout_ms;
    s->idle_timeout_ms = idle_timeout_ms;
    s->send_timeout_ms = send_timeout_ms;
    s->send_rate = send_rate > 0 ? send_rate : 50e6;
    s->decide = decide;
    s->log = log;
    s->ctx = ctx;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->logmu, NULL);
    /* (the stop's waits are bounded on the monotonic clock: a wall-clock jump -- NTP, an
     * administrator -- stretched or cut them) */
    pthread_condattr_t cattr;
    pthread_condattr_init(&cattr);
    pthread_condattr_setclock(&cattr, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &cattr);
    pthread_condattr_destroy(&cattr);
    int rc = guard_init(&s->replay, 1000000, ISS_MAX_SKEW);
    if (rc == 0 && mac_init(s) != 0) {
        set_err(err, errlen, "cannot set up HMAC-SHA256 (OpenSSL)");
        rc = -EINVAL;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE},
                    *res = NULL;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    if (rc == 0 && (rc = getaddrinfo(host, portstr, &hints, &res)) != 0) {
        set_err(err, errlen, "cannot resolve %s: %s", host, gai_strerror(rc));
        rc = -EADDRNOTAVAIL;
    }
    if (rc == 0) {
        s->lfd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int one = 1;
        if (s->lfd < 0 || setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
            bind(s->lfd, res->ai_addr, res->ai_addrlen) != 0 || listen(s->lfd, 512) != 0) {
            rc = -errno;
            set_err(err, errlen, "cannot listen on %s:%d: %s", host, port, strerror(errno));
        }
    }
    if (res != NULL)
        freeaddrinfo(res);
    if (rc == 0 && pthread_create(&s->acceptor, NULL, accept_main, s) != 0) {
        rc = -EAGAIN;
        set_err(err, errlen, "cannot start the accepting thread");
    }
    if (rc != 0) {
        if (s->lfd >= 0)
            close(s->lfd);
        close(s->rootfd);
        guard_free(&s->replay);
        mac_free(s);
        free(s->token);
        free(s);
        return rc;
    }
    *out = s;
    return 0;
}

/* The "auto" scheduling policy: a fetch that waited for its key `ms` milliseconds waits on
 * under SCHED_OTHER, its thread back under SCHED_BATCH once it answered (see raise_for_wake);
 * -1: never (the default). Takes effect for the waits that start after it. */
ISS_API void iss_preempt_after(void *h, int ms) {
    server *s = h;
    atomic_store(&s->preempt_after_ms, ms < 0 ? -1 : ms);
}

/* The port the server listens on (useful with port 0). */
ISS_API int iss_port(void *h) {
    server *s = h;
    struct sockaddr_storage a;
    socklen_t len = sizeof a;
    if (getsockname(s->lfd, (struct sockaddr *)&a, &len) != 0)
        return -errno;
    if (a.ss_family == AF_INET)
        return ntohs(((struct sockaddr_in *)&a)->sin_port);
    return ntohs(((struct sockaddr_in6 *)&a)->sin6_port);
}

ISS_API void iss_stats_get(void *h, iss_stats *out) {
    server *s = h;
    out->fetches = atomic_load(&s->fetches);
    out->bytes_sent = atomic_load(&s->bytes_sent);
    out->errors = atomic_load(&s->errors);
    out->busy = atomic_load(&s->busy);
    out->stalled = atomic_load(&s->stalled);
    out->refused = atomic_load(&s->refused);
    out->peers = (uint64_t)atomic_load(&s->peers);
}

/* The replay guard, for requests the callback verifies: 0 fresh, 1 replayed, 2 too old. */
ISS_API int iss_replay_check(void *h, const char *nonce, size_t len, double ts, double now) {
    server *s = h;
    return guard_check(&s->replay, nonce, len, ts, now);
}

/* The number of nonces the replay guard remembers (those of the last 300 s, at most its
 * capacity). */
ISS_API size_t iss_replay_held(void *h) {
    server *s = h;
    return guard_held(&s->replay);
}

/* Stop accepting, close idle connections, give requests in flight grace_ms, then cut them.
 * Fills *final with the last counters. Returns the number of connection threads still alive
 * (0 normally; else the state is left allocated, and the callbacks must stay valid). */
ISS_API int iss_stop(void *h, int grace_ms, iss_stats *final) {
    server *s = h;
    atomic_store(&s->closing, 1);
    shutdown(s->lfd, SHUT_RDWR);
    pthread_join(s->acceptor, NULL);
    close(s->lfd);
    pthread_mutex_lock(&s->mu);
    for (conn *c = s->conns; c != NULL; c = c->next)
        if (!c->busy)
            shutdown(c->fd, SHUT_RDWR);
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until); /* (the clock of s->cv) */
    until.tv_sec += grace_ms / 1000;
    until.tv_nsec += (long)(grace_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    while (s->inflight > 0 && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {
    }
    for (conn *c = s->conns; c != NULL; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += 2;
    while (s->threads > 0 && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {
    }
    int left = s->threads;
    pthread_mutex_unlock(&s->mu);
    if (left == 0) /* (what the last second left out: no later line will report it) */
        log_suppressed(s, s->log_suppressed);
    if (final != NULL)
        iss_stats_get(s, final);
    if (left == 0) { /* (else leak the state: a thread may still touch it) */
        if (s->ifd >= 0)
            close(s->ifd);
        close(s->rootfd);
        guard_free(&s->replay);
        mac_free(s);
        OPENSSL_cleanse(s->token, s->token_len);
        free(s->token);
        pthread_mutex_destroy(&s->mu);
        pthread_mutex_destroy(&s->logmu);
        pthread_cond_destroy(&s->cv);
        free(s);
    }
    return left;
}
