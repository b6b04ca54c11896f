/*
 * libinstride_tcp: plain signed requests, the only ones the data server answers on its own.
 *
 * A plain request is a JSON object whose strings are printable ASCII without escapes and whose
 * known fields (v, op, key, nonce, mac, ts, version, wait, until, count) each appear once (wait:
 * a whole number of milliseconds, 0 to ISS_MAX_WAIT_MS; until: one plain name, with a wait;
 * count: 2 to ISS_MAX_COUNT, with a wait); its
 * key is one that
 * keys.normalize_key returns unchanged. Anything else is not parsed here: the server hands it
 * to Python, where the protocol's rules and messages live.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tcp.h"


static const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}

/* A plain JSON string at p ('"' expected): printable ASCII, no escapes. Terminates it with a
 * NUL in place of the closing quote. Returns the position after it, or NULL. */
static char *plain_string(char *p, char *end, const char **out, size_t *len) {
    if (p >= end || *p != '"')
        return NULL;
    char *start = ++p;
    while (p < end && *p != '"') {
        unsigned char c = (unsigned char)*p;
        if (c == '\\' || c < 0x20 || c > 0x7e)
            return NULL;
        p++;
    }
    if (p >= end)
        return NULL;
    *out = start;
    *len = (size_t)(p - start);
    *p = '\0';
    return p + 1;
}

/* A JSON number; returns the position after it, or NULL. */
static char *plain_number(char *p, char *end, double *out) {
    char buf[64];
    char *q = p;
    if (q < end && *q == '-')
        q++;
    if (q >= end || *q < '0' || *q > '9')
        return NULL;
    while (q < end && ((*q >= '0' && *q <= '9') || *q == '.' || *q == 'e' || *q == 'E' || *q == '+' ||
                       *q == '-'))
        q++;
    size_t n = (size_t)(q - p);
    if (n >= sizeof buf)
        return NULL;
    memcpy(buf, p, n);
    buf[n] = '\0';
    char *stop;
    errno = 0;
    double v = strtod(buf, &stop);
    if (*stop != '\0' || errno != 0 || !isfinite(v))
        return NULL;
    *out = v;
    return q;
}

/* Parse a plain request header in place; 0, or -1 when it is not plain (the callback decides). */
int parse_plain(char *p, size_t len, request *r) {
    char *end = p + len;
    memset(r, 0, sizeof *r);
    p = (char *)skip_ws(p, end);
    if (p >= end || *p != '{')
        return -1;
    p++;
    for (;;) {
        p = (char *)skip_ws(p, end);
        const char *name;
        size_t nlen;
        if ((p = plain_string(p, end, &name, &nlen)) == NULL)
            return -1;
        p = (char *)skip_ws(p, end);
        if (p >= end || *p != ':')
            return -1;
        p = (char *)skip_ws(p + 1, end);
        const char **sv = NULL;
        size_t *sl = NULL;
        if (strcmp(name, "op") == 0)
            sv = &r->op, sl = &r->op_len;
        else if (strcmp(name, "key") == 0)
            sv = &r->key, sl = &r->key_len;
        else if (strcmp(name, "nonce") == 0)
            sv = &r->nonce, sl = &r->nonce_len;
        else if (strcmp(name, "mac") == 0)
            sv = &r->mac, sl = &r->mac_len;
        else if (strcmp(name, "until") == 0)
            sv = &r->until, sl = &r->until_len;
        if (sv != NULL) {
            if (*sv != NULL || (p = plain_string(p, end, sv, sl)) == NULL)
                return -1;
        } else if (strcmp(name, "ts") == 0) {
            if (r->has_ts || (p = plain_number(p, end, &r->ts)) == NULL)
                return -1;
            r->has_ts = 1;
        } else if (strcmp(name, "wait") == 0) {
            /* digits only (as Python's json writes an int): 100.0, 1e2, -0 go to the callback,
             * which refuses them, as it would after a wait */
            int v = 0, digits = 0;
            while (p < end && *p >= '0' && *p <= '9' && digits < 6)
                v = v * 10 + (*p++ - '0'), digits++;
            if (r->has_wait || digits == 0 || (p < end && *p >= '0' && *p <= '9') ||
                (digits > 1 && p[-digits] == '0') || v > ISS_MAX_WAIT_MS)
                return -1;
            if (p < end && (*p == '.' || *p == 'e' || *p == 'E'))
                return -1;
            r->wait_ms = v;
            r->has_wait = 1;
        } else if (strcmp(name, "count") == 0) {
            /* digits only, 2 to ISS_MAX_COUNT (1 is a plain fetch: sent without it) */
            int v = 0, digits = 0;
            while (p < end && *p >= '0' && *p <= '9' && digits < 3)
                v = v * 10 + (*p++ - '0'), digits++;
            if (r->count || digits == 0 || (p < end && *p >= '0' && *p <= '9') ||
                p[-digits] == '0' || v < 2 || v > ISS_MAX_COUNT)
                return -1;
            if (p < end && (*p == '.' || *p == 'e' || *p == 'E'))
                return -1;
            r->count = v;
        } else if (strcmp(name, "v") == 0 || strcmp(name, "version") == 0) {
            double v;
            int *seen = name[1] == '\0' ? &r->has_v : NULL;
            if ((seen != NULL && *seen) || (p = plain_number(p, end, &v)) == NULL)
                return -1;
            if (seen != NULL) {
                if (v != ISS_PROTOCOL)
                    return -1;
                *seen = 1;
            }
        } else {
            return -1; /* a field we do not know: let the callback look */
        }
        p = (char *)skip_ws(p, end);
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == '}') {
            p = (char *)skip_ws(p + 1, end);
            break;
        }
        return -1;
    }
    if (p != end || r->op == NULL || r->key == NULL || r->nonce == NULL || r->mac == NULL || !r->has_ts)
        return -1;
    if (r->count && !r->has_wait)
        return -1; /* "count" asks for the keys that follow as they are published: with a wait */
    if (r->until != NULL && (!r->has_wait || !plain_key(r->until, r->until_len) ||
                             memchr(r->until, '/', r->until_len) != NULL))
        return -1; /* "until" is one plain name, beside a waiting fetch's key */
    return 0;
}

/* A plain key: what keys.normalize_key returns unchanged (components not starting with '.',
 * no control characters, ASCII, at most 200 bytes, not only spaces). */
int plain_key(const char *k, size_t len) {
    if (len == 0 || len > ISS_MAX_KEY)
        return 0;
    int start = 1, blank = 1;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)k[i];
        if (c < 0x20 || c >= 0x7f)
            return 0;
        if (c == '/') {
            if (start)
                return 0; /* empty component or leading '/' */
            start = 1;
            continue;
        }
        if (start && c == '.')
            return 0;
        start = 0;
        if (c != ' ' && c != '\t')
            blank = 0;
    }
    return !start && !blank;
}

int lower_hex(const char *s, size_t len) {
    for (size_t i = 0; i < len; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return 1;
}

