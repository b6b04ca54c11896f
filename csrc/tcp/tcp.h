/*
 * tcp.h -- internal declarations of libinstride_tcp (the tcp transport's C engine).
 *
 *   serve.c    -> replay.c, request.c   the data server: connections, fast path, API
 *   replay.c                            the replay guard (each nonce accepted once)
 *   request.c                           plain signed requests: JSON fields, keys
 *   recv.c                              the client's receive loop (recv, xxh3, write)
 *
 * Everything here is hidden (the library exports only iss_* and isc_*).
 */
#ifndef INSTRIDE_TCP_H
#define INSTRIDE_TCP_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* The calling convention of the library's exported functions (iss_* and isc_*), returned by
 * isc_abi() and checked by the Python binding (instride.transport.tcp.engine.ABI): bump both
 * with any change to an exported signature, so a library left from an older build is refused,
 * never called with the wrong arguments. 2: isc_recv_file / isc_recv_mem take hash_from;
 * 3: isc_recv_reply; 4: isc_recv_file copies the bytes before hash_from to head;
 * 5: iss_preempt_after; 6: iss_replay_held; 7: the decide callback takes spent;
 * 8: isc_recv_frame; 9: isc_min_rate (and -ETIME from the receives: a reply too slow). */
#define ISC_ABI 9

/* ---- replay.c ---------------------------------------------------------------- */

typedef struct entry entry;

typedef struct {
    pthread_mutex_t mu;
    entry **table;
    size_t nbuckets, count, capacity;
    entry **heap; /* min-heap by ts */
    size_t heap_cap;
    double floor, window;
} guard;

int guard_init(guard *g, size_t capacity, double window);
void guard_free(guard *g);
/* 0: fresh (remembered now); 1: replayed; 2: too old for the window; <0: out of memory. */
int guard_check(guard *g, const char *nonce, size_t len, double ts, double now);
/* The number of nonces remembered. */
size_t guard_held(guard *g);

/* ---- request.c ----------------------------------------------------------------- */

#define ISS_PROTOCOL 1
#define ISS_MAX_KEY 200

typedef struct {
    const char *op, *key, *nonce, *mac; /* into the header buffer, NUL-terminated in place */
    size_t op_len, key_len, nonce_len, mac_len;
    const char *until; /* with "wait": a name beside the key that ends the wait (or NULL) */
    size_t until_len;
    double ts;
    int has_ts, has_v;
    int has_wait, wait_ms; /* "wait": hold a fetch of an absent key this long (ms) */
    int count;             /* "count" (with "wait"): also send the next count - 1 numbered keys */
} request;

/* Most keys one request may ask for ("count"). */
#define ISS_MAX_COUNT 64

/* Longest wait a request may ask for (ms). */
#define ISS_MAX_WAIT_MS 60000

/* Parse a plain request header in place (writes NULs into it); 0, or -1 when it is not plain. */
int parse_plain(char *p, size_t len, request *r);
/* Is k a key that keys.normalize_key returns unchanged? */
int plain_key(const char *k, size_t len);
/* Only lowercase hexadecimal digits? */
int lower_hex(const char *s, size_t len);

#endif
