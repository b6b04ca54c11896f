/*
 * wait.c -- libinstride_local: the sleeping part of a local-mode wait, in C.
 *
 * Python keeps one inotify descriptor per thread with watches on the awaited keys'
 * directories (instride/store/wait.py); this library sleeps on it, reads the events and
 * checks the awaited files itself, so a consumer woken by a publication runs no Python
 * until the key is known to be there. Measured on the development VM (publication ->
 * the consumer's return, 4 KiB keys): the events parsed in Python and the confinement
 * checks re-done in Python after the wake-up cost ~50 us of cold interpreter; here they
 * are a few system calls. Loaded with ctypes, which releases the GIL for the call.
 *
 * Exported: isl_state, isl_wait (everything else is hidden).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "isl_local.h"

/* isl_wait's results (>= 0); a negative result is -errno of a failed poll or read. */
enum {
    ISL_FOUND = 0,       /* *found: the index of a key that is there */
    ISL_TIMEOUT = 1,     /* nothing within timeout_us */
    ISL_INTERRUPTED = 2, /* a signal arrived: Python runs its handlers, then waits again */
    ISL_REARM = 3,       /* watches went away: gone[0..*found) holds their descriptors, or
                            *found = -1: the queue overflowed, every watch must be re-armed */
    ISL_CHECK = 4,       /* *found: a key with something else than a regular file or a
                            directory on its way (a link, a FIFO...): Python names it */
};

/* Whether the file of key is there.
 *
 * confined = 1: root/key, every component lstat'ed: 1 a regular file reached through
 * directories only, 0 nothing there (yet), -1 something else on the way.
 * confined = 0: key is a full path; 1 when stat() finds it (links followed, like
 * os.path.exists), else 0. */
ISL_EXPORT int isl_state(const char *root, const char *key, int confined)
{
    struct stat st;
    if (!confined)
        return stat(key, &st) == 0;
    char path[4096];
    size_t rl = strlen(root), kl = strlen(key);
    if (rl + 1 + kl >= sizeof path)
        return -1;
    memcpy(path, root, rl);
    path[rl] = '/';
    memcpy(path + rl + 1, key, kl + 1);
    for (char *s = path + rl + 1; (s = strchr(s, '/')) != NULL; s++) {
        *s = '\0';
        int rc = lstat(path, &st);
        *s = '/';
        if (rc != 0)
            return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
        if (!S_ISDIR(st.st_mode))
            return -1;
    }
    if (lstat(path, &st) != 0)
        return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
    return S_ISREG(st.st_mode) ? 1 : -1;
}

/* Sleep on the inotify descriptor ifd (its watches armed by the caller, the files checked
 * after arming) until an event names one of the n keys and that key is there (see
 * isl_state), at most timeout_us (>= 0) microseconds. Events of other files are skipped.
 * Every event of a batch is read before returning: a watch that went away is reported
 * (ISL_REARM), never lost, so that its directory is watched again.
 *
 * The timeout is kept to the microsecond (ppoll): a wait in whole milliseconds ends up to
 * ~1 ms late, longer than a hybrid-polling reader's window opens before a frame is due
 * (Stream(spin="auto") sleeps until then, and would sleep through the window). */
ISL_EXPORT int isl_wait(int ifd, const char *root, const char *const *keys, int n, int confined,
                        long long timeout_us, int *found, int *gone, int gone_cap)
{
    char buf[8192] __attribute__((aligned(__alignof__(struct inotify_event))));
    long long deadline = isl_now_us() + timeout_us;
    struct pollfd pfd = {.fd = ifd, .events = POLLIN};
    for (;;) {
        long long left = deadline - isl_now_us();
        struct timespec ts = isl_span(left);
        int rc = ppoll(&pfd, 1, &ts, NULL);
        if (rc == 0)
            return ISL_TIMEOUT;
        if (rc < 0)
            return errno == EINTR ? ISL_INTERRUPTED : -errno;
        ssize_t got = read(ifd, buf, sizeof buf);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return errno == EINTR ? ISL_INTERRUPTED : -errno;
        }
        int named, ngone = isl_events(buf, got, keys, n, gone, gone_cap, &named);
        if (ngone != 0) {
            *found = ngone; /* (-1: the queue overflowed) */
            return ISL_REARM;
        }
        if (named < 0)
            continue;
        for (int i = 0; i < n; i++) {
            int state = isl_state(root, keys[i], confined);
            if (state != 0) {
                *found = i;
                return state > 0 ? ISL_FOUND : ISL_CHECK;
            }
        }
    }
}
