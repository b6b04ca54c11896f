/*
 * libinstride_tcp: the replay guard of the data server.
 *
 * A signed request carries a random nonce and a timestamp; the server accepts timestamps within
 * 300 s of its clock. The guard remembers every nonce it accepted for as long as its timestamp is
 * inside that window, so a captured request sent again is refused. Memory is bounded: at most
 * `capacity` nonces; past that the oldest are forgotten and the guard raises its floor to their
 * timestamp, and a request not newer than the floor is refused as too old — nothing replayable
 * is ever forgotten (the rules of src/instride/transport/replay.py). Nonces are kept as 128 bits
 * of their SHA-256, in a hash table (lookup) and a min-heap by timestamp (expiry).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "tcp.h"

struct entry {
    uint8_t h[16];
    double ts;
    struct entry *next; /* hash chain */
};

static void nonce_hash(const char *nonce, size_t len, uint8_t out[16]) {
    uint8_t full[32];
    unsigned int n = 0;
    EVP_Digest(nonce, len, full, &n, EVP_sha256(), NULL);
    memcpy(out, full, 16);
}

static size_t bucket_of(const guard *g, const uint8_t h[16]) {
    uint64_t x;
    memcpy(&x, h, sizeof x);
    return (size_t)(x % g->nbuckets);
}

static void heap_swap(entry **a, size_t i, size_t j) {
    entry *t = a[i];
    a[i] = a[j];
    a[j] = t;
}

static int heap_push(guard *g, entry *e) {
    if (g->count == g->heap_cap) {
        size_t cap = g->heap_cap ? g->heap_cap * 2 : 1024;
        entry **h = realloc(g->heap, cap * sizeof *h);
        if (h == NULL)
            return -ENOMEM;
        g->heap = h;
        g->heap_cap = cap;
    }
    size_t i = g->count;
    g->heap[i] = e;
    while (i > 0 && g->heap[(i - 1) / 2]->ts > g->heap[i]->ts) {
        heap_swap(g->heap, i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
    return 0;
}

/* Remove the oldest entry (heap top) from heap and table; count-- ; returns its ts. */
static double heap_pop(guard *g) {
    entry *top = g->heap[0];
    size_t n = g->count - 1;
    g->heap[0] = g->heap[n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && g->heap[l]->ts < g->heap[m]->ts)
            m = l;
        if (r < n && g->heap[r]->ts < g->heap[m]->ts)
            m = r;
        if (m == i)
            break;
        heap_swap(g->heap, i, m);
        i = m;
    }
    entry **p = &g->table[bucket_of(g, top->h)];
    while (*p != NULL && *p != top)
        p = &(*p)->next;
    if (*p == top)
        *p = top->next;
    double ts = top->ts;
    free(top);
    g->count = n;
    return ts;
}

int guard_init(guard *g, size_t capacity, double window) {
    memset(g, 0, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    g->capacity = capacity;
    g->window = window;
    g->floor = -INFINITY;
    g->nbuckets = 1 << 16;
    g->table = calloc(g->nbuckets, sizeof *g->table);
    return g->table == NULL ? -ENOMEM : 0;
}

void guard_free(guard *g) {
    while (g->count > 0)
        heap_pop(g);
    free(g->table);
    free(g->heap);
    pthread_mutex_destroy(&g->mu);
}

size_t guard_held(guard *g) {
    pthread_mutex_lock(&g->mu);
    size_t n = g->count;
    pthread_mutex_unlock(&g->mu);
    return n;
}

int guard_check(guard *g, const char *nonce, size_t len, double ts, double now) {
    uint8_t h[16];
    nonce_hash(nonce, len, h);
    pthread_mutex_lock(&g->mu);
    int rc = 0;
    while (g->count > 0 && g->heap[0]->ts < now - g->window) {
        /* forgotten: anything not newer is refused from now on (another thread's later
         * clock expired a nonce that this request's window check, an instant earlier, still
         * let through: its replay was served again) */
        double gone = heap_pop(g);
        if (gone > g->floor)
            g->floor = gone;
    }
    if (ts <= g->floor) {
        rc = 2;
        goto out;
    }
    for (entry *e = g->table[bucket_of(g, h)]; e != NULL; e = e->next)
        if (memcmp(e->h, h, 16) == 0) {
            rc = 1;
            goto out;
        }
    entry *e = malloc(sizeof *e);
    if (e == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    memcpy(e->h, h, 16);
    e->ts = ts; /* (before heap_push, which places the entry by it) */
    if (heap_push(g, e) != 0) {
        free(e);
        rc = -ENOMEM;
        goto out;
    }
    size_t b = bucket_of(g, h);
    e->next = g->table[b];
    g->table[b] = e;
    g->count++;
    while (g->count > g->capacity) {
        double old = heap_pop(g);
        if (old > g->floor)
            g->floor = old;
    }
out:
    pthread_mutex_unlock(&g->mu);
    return rc;
}

