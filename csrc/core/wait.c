/*
 * wait.c -- local mode: wait for a key with inotify on its directory. stat the
 * key; if missing, arm a watch (IN_CREATE | IN_MOVED_TO) on its directory
 * (created if needed), stat again (no publication can be missed from then on),
 * and sleep in poll until it appears or INSTRIDE_TIMEOUT runs out. When no inotify
 * instance or watch can be had (the per-user limits), the key is polled instead.
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

/* errno of inotify_init1 / inotify_add_watch when the limits are reached: the user's
 * fs.inotify.max_user_instances (often 128, shared by all of the user's processes on the node:
 * each waiting thread here holds one) or max_user_watches, the process's or the system's fds,
 * or memory. The Python package's waits (store/wait.py, _NO_INOTIFY) poll then, too. */
static int ins_no_inotify(int e)
{
    return e == EMFILE || e == ENFILE || e == ENOSPC || e == ENOMEM;
}

/* Watch dir (creating it if needed) on this thread's inotify fd; a watch
 * left on another directory by an earlier wait is removed. -1 with errno when
 * none could be had; *limited = 1 when inotify_add_watch refused it for a limit
 * (not when the directory could not be made). */
static int ins_watch(int ifd, int cached, char *dir, int *limited)
{
    const uint32_t mask = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR;
    int wd;
    /* (made again if another waiter's failed wait removed it, empty, in between: a few times) */
    for (int tries = 0;; tries++) {
        wd = inotify_add_watch(ifd, dir, mask);
        if (wd >= 0 || errno != ENOENT || tries == 5)
            break;
        if (ins_mkdir_p(dir) != 0)
            return -1;
    }
    if (wd < 0) {
        *limited = ins_no_inotify(errno);
        return -1;
    }
    if (cached) {
        if (ins_wd >= 0 && ins_wd != wd)
            inotify_rm_watch(ifd, ins_wd);
        ins_wd = wd;
    }
    ins_inotify_drain(ifd); /* events from before now are of no interest */
    return wd;
}

/* How often a waiter looks whether the key's directory is still the one it watches. */
#define INS_LOOK_MS 1000

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

/* A new fd for this thread, watching dir: 0, or -1 (*ifd < 0: none could be made; *limited
 * as ins_watch's, also for the fd). */
static int ins_rewatch(int *ifd, int *cached, char *dir, int *wd, int *limited)
{
    *ifd = ins_inotify_get(cached);
    if (*ifd < 0) {
        *limited = ins_no_inotify(errno);
        return -1;
    }
    *wd = ins_watch(*ifd, *cached, dir, limited);
    return *wd < 0 ? -1 : 0;
}

/* Wait for abs by looking at it (lstat, as the inotify path) every 1 ms, doubling to 50 ms,
 * until deadline (< 0: none): 0, or -1 with errno (ETIMEDOUT). The wait ends as one with
 * inotify would, at most 50 ms late; the thread's next wait tries inotify again (the limit
 * may have been freed meanwhile). */
static int ins_poll_key(const char *abs, double deadline)
{
    struct stat st;
    int delay = 1; /* ms */
    for (;;) {
        if (lstat(abs, &st) == 0)
            return 0;
        if (errno != ENOENT)
            return -1;
        int ms = ins_remaining_ms(deadline);
        if (ms == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        poll(NULL, 0, ms < 0 || ms > delay ? delay : ms); /* (EINTR: just looks again) */
        delay = delay * 2 > 50 ? 50 : delay * 2;
    }
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
    int cached = 0, rc = -1, limited = 0, wd = -1;
    int ifd = ins_inotify_get(&cached);
    if (ifd < 0) {
        limited = ins_no_inotify(errno);
        goto lost;
    }
    if ((wd = ins_watch(ifd, cached, dir, &limited)) < 0)
        goto no_watch;
    struct stat watched; /* the directory the watch is on (its inode, wherever it goes) */
    int known = stat(dir, &watched) == 0;
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
            if (ins_rewatch(&ifd, &cached, dir, &wd, &limited) != 0)
                goto lost;
            known = stat(dir, &watched) == 0;
            continue;
        }
        struct pollfd pfd = {.fd = ifd, .events = POLLIN};
        int prc = poll(&pfd, 1, ms < 0 || ms > INS_LOOK_MS ? INS_LOOK_MS : ms);
        if (prc < 0 && errno != EINTR)
            break;
        if (prc == 0) {
            /* A directory above the key's renamed (a restart's clean-up moving the run away,
             * a new one made in its place): the watch went with the old directory, which gets
             * no events, and the wait slept for good while the key was published at its path.
             * A look every INS_LOOK_MS: the directory at the path another one now, the watch
             * moves there (the loop looks at the key first). */
            struct stat now;
            if (!known || stat(dir, &now) != 0 || now.st_ino != watched.st_ino ||
                now.st_dev != watched.st_dev) {
                if ((wd = ins_watch(ifd, cached, dir, &limited)) < 0)
                    goto no_watch;
                known = stat(dir, &watched) == 0;
            }
            continue;
        }
        if (prc < 0)
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
            if (ins_rewatch(&ifd, &cached, dir, &wd, &limited) != 0)
                goto lost;
            known = stat(dir, &watched) == 0;
            continue;
        }
        /* the directory went away: recreate it and watch again */
        if (ins_dir_gone(ifd, wd)) {
            if ((wd = ins_watch(ifd, cached, dir, &limited)) < 0)
                goto no_watch;
            known = stat(dir, &watched) == 0;
        }
    }
    ins_inotify_put(ifd, cached);
    return rc;
lost: /* no fd could be made (none to put back), or no watch on a new one */
    if (ifd < 0)
        return limited ? ins_poll_key(abs, deadline) : -1;
no_watch: /* (errno kept by ins_inotify_put) */
    ins_inotify_put(ifd, cached);
    /* out of inotify instances or watches: the key is polled (the Python package's waits do
     * the same), rather than failing a wait that can end well */
    return limited ? ins_poll_key(abs, deadline) : -1;
}
