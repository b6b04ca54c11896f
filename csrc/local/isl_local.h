/*
 * isl_local.h -- what libinstride_local's sources share: the frame format's constants (see
 * instride/frames.py) and the waits' clock helpers.
 */
#ifndef ISL_LOCAL_H
#define ISL_LOCAL_H

#include <string.h>
#include <time.h>

#define ISL_EXPORT __attribute__((visibility("default")))

#define HEADER_SIZE 128
#define HEADER_FIELDS 120 /* bytes covered by the header checksum */

enum { LAYOUT_XYZ32 = 1, LAYOUT_PAPER = 2, LAYOUT_SOA = 3 };

/* Microseconds on the monotonic clock. */
static inline long long isl_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* The last component of a key (what inotify names in its events). */
static inline const char *isl_base(const char *key)
{
    const char *slash = strrchr(key, '/');
    return slash ? slash + 1 : key;
}

/* A timespec of left microseconds (none when left <= 0). */
static inline struct timespec isl_span(long long left)
{
    struct timespec ts = {.tv_sec = left > 0 ? left / 1000000 : 0,
                          .tv_nsec = left > 0 ? (left % 1000000) * 1000 : 0};
    return ts;
}

#endif
