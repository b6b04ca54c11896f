/*
 * libinstride_tcp, client half: receive a fetched body into its destination file (or memory).
 *
 * The body arrives on a socket in pieces; each piece is hashed (xxh3-64, streaming, while it
 * is in the CPU cache) and written to the destination file, without the Python loop around
 * recv/hash/write that cost more than the bytes themselves. Called through ctypes (the GIL is
 * released for the call). Whoever calls it checks the digest against the record.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../common/ins_frame.h"
#include "../common/ins_xxh.h"
#include "tcp.h"

#define ISC_API __attribute__((visibility("default")))
/* Bytes taken from the socket per recv: each piece is hashed and written while it is still in
 * the CPU's L2 cache. With 1 MiB pieces a JAC frame (644 KiB) went through memory three times
 * (recv, hash, write), ~250 µs more per frame on a VM after an idle pause. */
#define ISC_CHUNK (1 << 17)
#define ISC_LOWAT (1 << 20) /* most bytes waited for at once (SO_RCVLOWAT) */
/* The pace a reply must keep once it began: bytes per second of waiting for them, reckoned over
 * each stall time of waiting. A stall (nothing for stall_ms) alone let a peer that sent a byte
 * just before each stall hold a transfer for as long as it went on. A data server sends at
 * 50 MB/s or gives up (iss_start's send_rate), ~760 times this: the floor only bounds a transfer
 * (a 28.5 MiB frame: 7.6 min at most), and a link shared by many transfers stays above it. */
#define ISC_MIN_RATE (64 << 10)

enum { ISC_AT_RECV = 0, ISC_AT_WRITE = 1 };

/* The library's calling convention (ISC_ABI, tcp.h), checked by the Python binding. */
ISC_API int isc_abi(void) {
    return ISC_ABI;
}

/* ISC_MIN_RATE, for the Python binding's own receives (a reply's head read there). */
ISC_API int isc_min_rate(void) {
    return ISC_MIN_RATE;
}

/* Receive size bytes from sock into dest (at its current offset), hashing them from byte
 * hash_from on (0: all of them; a frame file's header, which carries the checksum of what
 * follows it, is left out with hash_from = its size).
 *
 * Returns 0 and the digest as 16 lowercase hex digits in hex (xxhash's canonical form, as
 * Python's xxhash.xxh3_64_hexdigest), or a negative errno: -ETIMEDOUT when nothing arrived
 * for stall_ms, -ETIME when the bytes came slower than ISC_MIN_RATE (pace_came), -ECONNRESET
 * when the peer closed the connection early, another -errno from recv or write. *got says
 * how many bytes were received, *where whether the failure was on the socket (0) or the file
 * (1). head (NULL, or hash_from bytes): also receives a copy of the bytes before hash_from (a
 * frame's header, which the caller checks: a file opened only for writing cannot be read
 * back). */
static int recv_file(int sock, int dest, char *mem, uint64_t size, uint64_t hash_from,
                     int stall_ms, char *hex, uint64_t *got, int *where, int *lowat_set,
                     char *head);

/* The count of receives under way in this process (isc_count_receives; NULL: not counted):
 * a helper making a file ahead waits while it is above 0 and for 2 ms after the last
 * (libinstride_local's isl_spare_yield_to), so that its zeros do not compete with the bytes for memory bandwidth. */
static int64_t *volatile receiving;

/* Count receives in count[0] and stamp count[1] with the end of the last (CLOCK_MONOTONIC, ns). */
ISC_API void isc_count_receives(int64_t *count) {
    receiving = count;
}

static void receive_ended(int64_t *count) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    __atomic_store_n(&count[1], (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec, __ATOMIC_RELAXED);
    __atomic_fetch_sub(&count[0], 1, __ATOMIC_RELEASE); /* (the stamp seen with the count) */
}

static int recv_restoring(int sock, int dest, char *mem, uint64_t size, uint64_t hash_from,
                          int stall_ms, char *hex, uint64_t *got, int *where, char *head) {
    int lowat_set = 0;
    int64_t *count = receiving;
    if (count != NULL)
        __atomic_fetch_add(&count[0], 1, __ATOMIC_RELAXED);
    int rc = recv_file(sock, dest, mem, size, hash_from, stall_ms, hex, got, where, &lowat_set,
                       head);
    if (count != NULL)
        receive_ended(count);
    if (lowat_set) { /* the connection is kept alive: leave it as it was */
        int one = 1;
        setsockopt(sock, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    }
    return rc;
}

ISC_API int isc_recv_file(int sock, int dest, uint64_t size, uint64_t hash_from, int stall_ms,
                          char *hex, uint64_t *got, int *where, char *head) {
    return recv_restoring(sock, dest, NULL, size, hash_from, stall_ms, hex, got, where, head);
}

/* The same into memory at mem (size bytes writable, e.g. a shared mapping of a memory file):
 * each piece lands where it belongs, no copy through a buffer and no write. */
ISC_API int isc_recv_mem(int sock, char *mem, uint64_t size, uint64_t hash_from, int stall_ms,
                         char *hex, uint64_t *got) {
    int where = ISC_AT_RECV;
    return recv_restoring(sock, -1, mem, size, hash_from, stall_ms, hex, got, &where, NULL);
}

/* The thread's piece buffer, freed when the thread ends (a key's destructor). */
static pthread_key_t chunk_key;
static pthread_once_t chunk_once = PTHREAD_ONCE_INIT;

static void chunk_key_make(void) {
    pthread_key_create(&chunk_key, free);
}

static char *thread_chunk(void) {
    static __thread char *chunk;
    if (chunk == NULL) {
        pthread_once(&chunk_once, chunk_key_make);
        char *c = malloc(ISC_CHUNK);
        if (c != NULL && pthread_setspecific(chunk_key, c) != 0) {
            free(c);
            c = NULL;
        }
        chunk = c;
    }
    return chunk;
}

/* Milliseconds left of a wait of ms (-1: no limit) that began at *start (CLOCK_MONOTONIC ms;
 * 0: it begins now, and *start is set): a wait a signal interrupted goes on for what is left,
 * not for ms again (signals coming more often than ms would make it endless). */
static int ms_left(int ms, long long *start) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    long long now = (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
    if (*start == 0)
        *start = now;
    if (ms < 0)
        return -1;
    long long left = *start + ms - now;
    return left > 0 ? (int)left : 0;
}

static long long mono_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* What a transfer brought while it was waited for, since its pace was last reckoned. */
typedef struct {
    long long waited; /* ms spent waiting for bytes (in poll: not the receiver's own work) */
    uint64_t came;    /* bytes that came meanwhile */
} pace;

/* A poll of the transfer that began at t0 (mono_ms) is over: counted as waiting. */
static void pace_waited(pace *p, long long t0) {
    p->waited += mono_ms() - t0;
}

/* n more bytes came on sock: 0, or -ETIME once stall_ms (>= 0) of waiting went by with fewer
 * than ISC_MIN_RATE per second of it (the transfer then not done: the caller checks that).
 * Bytes already in the socket count as come: a receiver that did not run for a while (stopped,
 * a frozen VM) counted that time as waiting, and was cut after one piece with megabytes
 * queued behind it. */
static int pace_came(pace *p, uint64_t n, int stall_ms, int sock) {
    p->came += n;
    if (stall_ms < 0 || p->waited < stall_ms)
        return 0;
    uint64_t need = (uint64_t)ISC_MIN_RATE * (uint64_t)p->waited;
    int queued = 0;
    int slow = p->came * 1000 < need &&
               (ioctl(sock, FIONREAD, &queued) != 0 || (p->came + (uint64_t)queued) * 1000 < need);
    p->waited = 0, p->came = 0;
    return slow ? -ETIME : 0;
}

static int recv_file(int sock, int dest, char *mem, uint64_t size, uint64_t hash_from,
                     int stall_ms, char *hex, uint64_t *got, int *where, int *lowat_set,
                     char *head) {
    char *chunk = NULL;
    *got = 0;
    *where = ISC_AT_RECV;
    if (mem == NULL && (chunk = thread_chunk()) == NULL)
        return -ENOMEM;
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    int cur_lowat = 1;
    long long waiting = 0; /* when the stall clock began (0: not waiting) */
    int seen = 0;          /* bytes the last look found queued, below the low-water mark */
    pace kept = {0, 0};
    while (*got < size) {
        size_t want = size - *got < ISC_CHUNK ? (size_t)(size - *got) : ISC_CHUNK;
        char *buf = mem != NULL ? mem + *got : chunk;
        ssize_t n = recv(sock, buf, want, MSG_DONTWAIT);
        if (n == 0)
            return -ECONNRESET;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN)
                return -errno;
            /* Sleep until a large piece is there, not the next packet: on a VM every wake-up
             * of a sleeping thread costs ~100-400 µs, and a drained socket wakes us per packet. */
            uint64_t left = size - *got;
            int lowat = (int)(left < ISC_LOWAT ? left : ISC_LOWAT);
            if (lowat != cur_lowat && setsockopt(sock, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat) == 0)
                cur_lowat = lowat, *lowat_set = 1;
            struct pollfd p = {sock, POLLIN, 0};
            long long t0 = mono_ms();
            int left_ms = ms_left(stall_ms, &waiting), wait_ms = left_ms;
            if (cur_lowat > 1 && stall_ms > 0) {
                /* A low-water mark above 1 hides bytes that came, fewer than it, from poll: a
                 * look at the queue every quarter of the stall time tells when they came (more
                 * than at the look before), and the loop takes them (a receive without waiting
                 * takes what is there, whatever the mark). Looked at only when the stall time
                 * had passed, bytes that came right after the last ones and then silence went
                 * unnoticed for up to twice the stall time (the clock began again there). */
                int quarter = stall_ms / 4 > 0 ? stall_ms / 4 : 1;
                if (wait_ms > quarter)
                    wait_ms = quarter;
            }
            int r = poll(&p, 1, wait_ms);
            pace_waited(&kept, t0);
            if (r == 0) {
                int queued = 0;
                if (cur_lowat > 1 && ioctl(sock, FIONREAD, &queued) == 0 && queued > seen) {
                    seen = queued;
                    waiting = 0; /* (bytes came since the last look: at most a quarter ago) */
                    continue;
                }
                if (left_ms > wait_ms)
                    continue; /* a look, not yet the stall */
                return -ETIMEDOUT;
            }
            if (r < 0 && errno != EINTR)
                return -errno;
            continue;
        }
        if (head != NULL && *got < hash_from) { /* (the part before it, copied) */
            uint64_t k = hash_from - *got < (uint64_t)n ? hash_from - *got : (uint64_t)n;
            memcpy(head + *got, buf, (size_t)k);
        }
        if (*got + (uint64_t)n > hash_from) { /* (the part from hash_from on) */
            uint64_t skip = *got < hash_from ? hash_from - *got : 0;
            INS_XXH3_UPDATE(&state, buf + skip, (size_t)((uint64_t)n - skip));
        }
        size_t done = mem != NULL ? (size_t)n : 0; /* (in memory: where it belongs already) */
        while (done < (size_t)n) {
            ssize_t w = write(dest, buf + done, (size_t)n - done);
            if (w < 0) {
                if (errno == EINTR)
                    continue;
                *where = ISC_AT_WRITE;
                return -errno;
            }
            done += (size_t)w;
        }
        *got += (uint64_t)n;
        waiting = 0, seen = 0;
        int slow = pace_came(&kept, (uint64_t)n, stall_ms, sock);
        if (slow != 0 && *got < size)
            return slow;
    }
    snprintf(hex, 17, "%016llx", (unsigned long long)XXH3_64bits_digest(&state));
    return 0;
}

/* Read exactly len bytes of a reply's head into buf; the first byte may take first_ms (a held
 * fetch's reply comes when its key is published), each later one stall_ms, and once the first
 * came they keep the pace (ISC_MIN_RATE: -ETIME; began: bytes of the reply came before buf's,
 * whose pace goes on in *kept). A signal while
 * waiting for the first byte returns -EINTR (nothing read: the caller runs its handlers, then
 * calls again); later ones are waited through. */
static int recv_head(int sock, char *buf, size_t len, int first_ms, int stall_ms, size_t *have,
                     int interruptible, int began, pace *kept) {
    long long waiting = 0; /* when the wait for the next bytes began (0: not waiting) */
    while (*have < len) {
        ssize_t n = recv(sock, buf + *have, len - *have, MSG_DONTWAIT);
        if (n > 0) {
            *have += (size_t)n;
            waiting = 0;
            int slow = pace_came(kept, (uint64_t)n, stall_ms, sock);
            if (slow != 0 && *have < len)
                return slow;
            continue;
        }
        if (n == 0)
            return -ECONNRESET;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN)
            return -errno;
        struct pollfd p = {sock, POLLIN, 0};
        long long t0 = mono_ms();
        int r = poll(&p, 1, ms_left(*have == 0 ? first_ms : stall_ms, &waiting));
        if (began || *have > 0) /* (the wait for a reply's first byte is no transfer's) */
            pace_waited(kept, t0);
        if (r == 0)
            return -ETIMEDOUT;
        if (r < 0 && (errno != EINTR || (interruptible && *have == 0)))
            return -errno;
    }
    return 0;
}

/* The body size a successful reply announces ({"ok":true,...,"size":N,...}, as both servers
 * write it), or -1 for any other reply (an error, another shape: the caller parses it). */
static long long reply_size(const char *h, size_t len) {
    static const char ok[] = "{\"ok\":true,", sz[] = "\"size\":";
    if (len < sizeof ok - 1 || memcmp(h, ok, sizeof ok - 1) != 0)
        return -1;
    const char *at = memmem(h, len, sz, sizeof sz - 1);
    if (at == NULL)
        return -1;
    const char *p = at + sizeof sz - 1, *end = h + len;
    long long v = 0;
    int digits = 0;
    for (; p < end && *p >= '0' && *p <= '9' && digits < 18; p++, digits++)
        v = v * 10 + (*p - '0');
    return digits > 0 && p < end && (*p == ',' || *p == '}') ? v : -1;
}

/* One reply of a held fetch, its body into memory: the length prefix and the JSON header
 * (copied into hdr, *hdrlen bytes), then, when the header says ok with a body of at most
 * memcap bytes, the body into mem as isc_recv_mem receives it (*size: its size). One call
 * instead of an interpreter loop around four reads, a poll and two changes of the socket's
 * timeout per frame of a stream's remote reader.
 *
 * Returns 0: header and body received (hex: the body's digest from hash_from on); 1: the
 * header alone (an error reply, or a body that does not fit: the caller goes on from there);
 * -EBADMSG: a header length out of range (*hdrlen: that length); -EINTR: a signal came before
 * any of the reply (nothing read: call again once its handler ran); another negative errno as
 * isc_recv_mem (*hdrlen < 0: it happened before the whole header was there, and *got is then
 * the bytes of the reply that came before it broke off: 0 is no reply at all, more is a reply
 * cut short -- a transfer that began, as a body cut short). */
ISC_API int isc_recv_reply(int sock, int first_ms, int stall_ms, char *hdr, uint32_t hdrcap,
                           int32_t *hdrlen, char *mem, uint64_t memcap, uint64_t hash_from,
                           char *hex, uint64_t *got, uint64_t *size) {
    unsigned char prefix[4];
    size_t have = 0;
    *hdrlen = -1;
    *got = 0;
    *size = 0;
    pace kept = {0, 0};
    int rc = recv_head(sock, (char *)prefix, 4, first_ms, stall_ms, &have, 1, 0, &kept);
    if (rc != 0) {
        *got = have; /* (some of the prefix: the reply began) */
        return rc;
    }
    uint32_t n = (uint32_t)prefix[0] << 24 | (uint32_t)prefix[1] << 16 | (uint32_t)prefix[2] << 8 |
                 prefix[3];
    if (n == 0 || n > hdrcap) {
        *hdrlen = (int32_t)(n > INT32_MAX ? INT32_MAX : n);
        return -EBADMSG;
    }
    have = 0;
    rc = recv_head(sock, hdr, n, stall_ms, stall_ms, &have, 0, 1, &kept);
    if (rc != 0) {
        *got = 4 + have;
        return rc;
    }
    *hdrlen = (int32_t)n;
    long long body = reply_size(hdr, n);
    if (body < 0 || mem == NULL || (uint64_t)body > memcap)
        return 1;
    *size = (uint64_t)body;
    int where = ISC_AT_RECV;
    return recv_restoring(sock, -1, mem, (uint64_t)body, hash_from, stall_ms, hex, got, &where,
                          NULL);
}

static int digit(char c) {
    return c >= '0' && c <= '9';
}

/* Whether [p, end) is exactly a number of JSON's grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?
 * ([eE][+-]?[0-9]+)? */
static int json_number(const char *p, const char *end) {
    if (p < end && *p == '-')
        p++;
    if (p >= end || !digit(*p))
        return 0;
    if (*p++ != '0')
        while (p < end && digit(*p))
            p++;
    if (p < end && *p == '.') {
        if (++p >= end || !digit(*p))
            return 0;
        while (p < end && digit(*p))
            p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        if (++p < end && (*p == '+' || *p == '-'))
            p++;
        if (p >= end || !digit(*p))
            return 0;
        while (p < end && digit(*p))
            p++;
    }
    return p == end;
}

/* A stream reader's next frame, asked for ahead (the request went with an earlier key's,
 * "count"): isc_recv_reply into mem, hashed from the frame's header on, then -- when the reply
 * is the ok-reply for key exactly as the servers write it ({"ok":true,"key":KEY,"size":N,
 * "published":T}) and its body came whole -- the body checked as a frame file: its header as
 * decode_header checks it, and its payload's xxh3 (computed on the way in) against the one the
 * header carries. One call for what the reader's interpreter did in some hundred steps per
 * frame (parse the reply's JSON, compare it, decode and check the header, compare digests).
 *
 * Returns isc_recv_reply's codes, but for its 0: 0 -- a frame that passed (*published: T,
 * hex: the payload's digest); 2 -- reply and body received, the reply not that exact shape
 * (the caller parses the header, as after isc_recv_reply's 0); 3 -- the exact reply and the
 * whole body, which is not a frame that passes (the caller refuses it). */
ISC_API int isc_recv_frame(int sock, int first_ms, int stall_ms, const char *key, char *hdr,
                           uint32_t hdrcap, int32_t *hdrlen, char *mem, uint64_t memcap,
                           char *hex, uint64_t *got, uint64_t *size, double *published) {
    *published = 0.0;
    int rc = isc_recv_reply(sock, first_ms, stall_ms, hdr, hdrcap, hdrlen, mem, memcap,
                            INS_HEADER_SIZE, hex, got, size);
    if (rc != 0)
        return rc;
    size_t n = (size_t)*hdrlen;
    char want[64 + 4096];
    int w = snprintf(want, sizeof want, "{\"ok\":true,\"key\":\"%s\",\"size\":%llu,\"published\":",
                     key, (unsigned long long)*size);
    if (w <= 0 || (size_t)w >= sizeof want || n <= (size_t)w || n >= hdrcap ||
        memcmp(hdr, want, (size_t)w) != 0 || hdr[n - 1] != '}')
        return 2;
    /* a JSON number (the servers write "%.6f"), finite: strtod alone would also take spaces,
     * '+', "nan", "inf", hex and leading zeros, which JSON does not. strtod reads it in the C
     * locale's form unless the program changed LC_NUMERIC (a comma locale: every reply then
     * goes to the caller's parse, rc 2 -- slower, not wrong). */
    if (!json_number(hdr + w, hdr + n - 1))
        return 2;
    char saved = hdr[n - 1], *end = NULL;
    hdr[n - 1] = '\0'; /* (strtod stops at the closing brace, which must end the number) */
    errno = 0;
    double t = strtod(hdr + w, &end);
    int number = errno == 0 && end == hdr + n - 1 && end > hdr + w && isfinite(t);
    hdr[n - 1] = saved;
    if (!number)
        return 2;
    *published = t;
    uint64_t psum;
    char *tail = NULL;
    unsigned long long digest = strtoull(hex, &tail, 16);
    if (!ins_frame_header_ok((const unsigned char *)mem, (int64_t)*size, &psum) || tail == hex ||
        digest != psum)
        return 3;
    return 0;
}
