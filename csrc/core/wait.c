/*
 * wait.c -- local mode: wait for a key with inotify on its directory. stat the
 * key; if missing, arm a watch (IN_CREATE | IN_MOVED_TO) on its directory
 * (created if needed), stat again (no publication can be missed from then on),
 * and sleep in poll until it appears or INSTRIDE_TIMEOUT runs out.
 */
#include "ins_core.h"

#include <poll.h>
#include <string.h>
#include <sys/inotify.h>

/* Closing an inotify fd waits for an RCU grace period in the kernel (measured
 * ~5 ms here), which would dominate the wake-up latency. With hooks (the
 * preload library), each thread keeps one inotify fd for its whole life,
 * marked as internal so that an application closing that number
 * (close/dup2/close_range) is noticed and a fresh one is made; it is closed at
 * thread exit and forgotten after fork. */
static struct ins_fd_hooks ins_hooks; /* all NULL: no caching */
static INS_TLS int ins_ifd = -1;
static INS_TLS int ins_wd = -1; /* watch left on the directory of the last wait */
/* The thread's token (its address: one per thread) its cached fd is marked with: the
 * number alone named any thread's fd -- after the application closed a thread's fd, another
 * thread's new one could get that number, and the first took it for its own (removing the
 * other's watch, eating its events: a wait that never woke). */
static INS_TLS int ins_token;
#define INS_TOKEN ((const void *)&ins_token)
static pthread_key_t ins_ifd_key;
static int ins_ifd_key_ok;

static void ins_ifd_release(void *arg)
{
    int fd = (int)(intptr_t)arg - 1;
    if (fd >= 0 && ins_hooks.is_internal(fd, INS_TOKEN)) {
        ins_hooks.mark_internal(fd, NULL);
        ins_sys.close(fd);
    }
    ins_ifd = -1;
    ins_wd = -1;
}

void ins_inotify_setup(const struct ins_fd_hooks *hooks)
{
    if (hooks == NULL || hooks->is_internal == NULL || hooks->mark_internal == NULL)
        return;
    ins_hooks = *hooks;
    ins_ifd_key_ok = pthread_key_create(&ins_ifd_key, ins_ifd_release) == 0;
}

void ins_inotify_forget(void)
{
    int fd = ins_ifd;
    ins_ifd = -1;
    ins_wd = -1;
    if (fd >= 0 && ins_hooks.is_internal(fd, INS_TOKEN)) {
        ins_hooks.mark_internal(fd, NULL);
        ins_sys.close(fd); /* drops only the child's reference: no grace period */
    }
    if (ins_ifd_key_ok)
        pthread_setspecific(ins_ifd_key, NULL);
}

/* This thread's inotify fd. *cached = 0 when it could not be cached (the
 * caller then closes it after use). */
static int ins_inotify_get(int *cached)
{
    if (ins_hooks.foreign != NULL && ins_hooks.foreign()) {
        /* a vfork child: the cache (thread-local, in its parent's memory) is not its own */
        *cached = 0;
        return inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    }
    *cached = 1;
    if (ins_ifd_key_ok && ins_ifd >= 0 && ins_hooks.is_internal(ins_ifd, INS_TOKEN))
        return ins_ifd;
    ins_ifd = -1; /* none yet, or the application closed it */
    ins_wd = -1;
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0)
        return -1;
    fd = ins_move_high(fd); /* (kept for the thread's life: not on a number the app reuses) */
    if (!ins_ifd_key_ok || ins_hooks.mark_internal(fd, INS_TOKEN) != 0) {
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
static void ins_inotify_put(int ifd, int cached)
{
    int e = errno;
    if (!cached)
        ins_sys.close(ifd);
    else if (ins_hooks.is_internal(ifd, INS_TOKEN)) /* (not a number the app reused since) */
        ins_inotify_drain(ifd);
    errno = e;
}

/* Whether the cached fd `ifd` is no longer this thread's: the application closed its number
 * (close, closefrom, dup2 over it) during the wait, perhaps reused it since. */
static int ins_inotify_lost(int ifd, int cached)
{
    return cached && !ins_hooks.is_internal(ifd, INS_TOKEN);
}

/* Watch dir (creating it if needed) on this thread's inotify fd; a watch
 * left on another directory by an earlier wait is removed. */
static int ins_watch(int ifd, int cached, char *dir)
{
    const uint32_t mask = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR;
    int wd = inotify_add_watch(ifd, dir, mask);
    /* (made again if another waiter's failed wait removed it, empty, in between: a few times) */
    for (int tries = 0; wd < 0 && errno == ENOENT && tries < 5 && ins_mkdir_p(dir) == 0; tries++)
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

/* Read the queued events; 1 when the watched directory went away. */
static int ins_dir_gone(int ifd, int wd)
{
    char ev[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    int gone = 0;
    for (;;) {
        ssize_t n = read(ifd, ev, sizeof ev);
        if (n <= 0)
            break;
        for (char *q = ev; q < ev + n;) {
            struct inotify_event *ie = (struct inotify_event *)q;
            if (ie->wd == wd && (ie->mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF)))
                gone = 1;
            q += sizeof *ie + ie->len;
        }
    }
    return gone;
}

/* A new fd for this thread, watching dir: 0, or -1 (*ifd < 0: none could be made). */
static int ins_rewatch(int *ifd, int *cached, char *dir, int *wd)
{
    *ifd = ins_inotify_get(cached);
    if (*ifd < 0)
        return -1;
    *wd = ins_watch(*ifd, *cached, dir);
    return *wd < 0 ? -1 : 0;
}

int ins_wait_local(const char *abs)
{
    struct stat st; /* lstat: a symbolic link under the key ends the wait (and is refused) */
    if (lstat(abs, &st) == 0)
        return 0;
    if (errno != ENOENT)
        return -1;

    double deadline = ins_cfg.timeout >= 0 ? ins_now() + ins_cfg.timeout : -1.0; /* 0: no wait */
    char dir[PATH_MAX];
    memcpy(dir, abs, strlen(abs) + 1);
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        slash[1] = '\0';
    else
        *slash = '\0';
    int cached = 0, rc = -1;
    int ifd = ins_inotify_get(&cached);
    if (ifd < 0)
        return -1;
    int wd = ins_watch(ifd, cached, dir);
    if (wd < 0)
        goto cleanup;
    /* Armed: from here no publication can be missed. Check, then wait. */
    for (;;) {
        if (lstat(abs, &st) == 0) {
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
        if (ins_inotify_lost(ifd, cached)) {
            /* closed (and its number perhaps reused by a file that is never readable) since
             * the last look: a new fd, before the poll, which would sleep on that file */
            if (ins_rewatch(&ifd, &cached, dir, &wd) != 0)
                goto lost;
            continue;
        }
        struct pollfd pfd = {.fd = ifd, .events = POLLIN};
        int prc = poll(&pfd, 1, ms);
        if (prc < 0 && errno != EINTR)
            break;
        if (prc <= 0)
            continue;
        int lost = ins_inotify_lost(ifd, cached);
        if (lost || (pfd.revents & (POLLNVAL | POLLERR))) {
            /* closed under the wait (POLLNVAL: spun until the deadline), or its number now
             * another file's (its data would have been read as events): a new fd, watched
             * again; the loop looks at the key again before it sleeps */
            if (!lost && cached)
                ins_hooks.mark_internal(ifd, NULL);
            if (!lost && !(pfd.revents & POLLNVAL))
                ins_sys.close(ifd); /* (ours still, in error) */
            if (ins_rewatch(&ifd, &cached, dir, &wd) != 0)
                goto lost;
            continue;
        }
        /* the directory went away: recreate it and watch again */
        if (ins_dir_gone(ifd, wd) && (wd = ins_watch(ifd, cached, dir)) < 0)
            break;
    }
cleanup:
    ins_inotify_put(ifd, cached);
    return rc;
lost: /* (no fd to put back where a new one could not be made) */
    if (ifd < 0)
        return -1;
    goto cleanup;
}
