/*
 * isl_local.h -- what libinstride_local's sources share: the frame format's constants (see
 * instride/frames.py) and the waits' clock helpers.
 */
#ifndef ISL_LOCAL_H
#define ISL_LOCAL_H

#include <string.h>
#include <sys/inotify.h>
#include <sys/types.h>
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

/* Read a batch of got bytes of inotify events: *named = the lowest index of the n keys an
 * event names (-1: none). Returns the number of watch descriptors gone away (written to
 * gone), or -1 when every watch must be re-armed (the queue overflowed, or more went away
 * than gone_cap). Every event of the batch is looked at: no gone watch is lost. */
static inline int isl_events(const char *buf, ssize_t got, const char *const *keys, int n,
                             int *gone, int gone_cap, int *named)
{
    int ngone = 0, overflow = 0;
    *named = -1;
    for (const char *q = buf; q < buf + got;) {
        const struct inotify_event *ev = (const struct inotify_event *)q;
        q += sizeof *ev + ev->len;
        if (ev->mask & IN_Q_OVERFLOW)
            overflow = 1;
        else if (ev->mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF)) {
            if (ngone < gone_cap)
                gone[ngone++] = ev->wd;
            else
                overflow = 1; /* more than we can report: re-arm everything */
        }
        for (int i = 0; ev->len && i < n && (*named < 0 || i < *named); i++)
            if (strcmp(ev->name, isl_base(keys[i])) == 0)
                *named = i;
    }
    return overflow ? -1 : ngone;
}

#endif
