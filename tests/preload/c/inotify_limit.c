/* Waits for keys when no inotify instance or watch can be had. The test runs this program in
 * a user namespace of its own whose inotify limits (/proc/sys/user/max_inotify_instances,
 * max_inotify_watches) it lowered, so that only this program feels them.
 *
 * argv[1]: the managed directory, argv[2]: a file to link in as keys (by the raw linkat system
 * call, which the library does not see), argv[3]: the case. Built plain, the waits are the
 * preload library's open(); built with -DUSE_API, the C API's instride_open_read() (no preload).
 * Prints "ok" when every wait ended as it should, else a line saying what went wrong.
 *
 * "one":     (limit: no instance or no watch) one wait, its key linked in at 300 ms.
 * "threads": (limit: one instance) 6 threads each wait for their own key, linked in at 300 ms.
 * "timeout": (limit: no instance) a wait for a key that never comes ends in ETIMEDOUT after
 *            INSTRIDE_TIMEOUT (1 s), and the directory it made is gone.
 * "retry":   (limit: one instance) the program holds the one instance itself while the main
 *            thread waits for a key (polled), then lets it go: the thread's next wait has an
 *            inotify instance again: the preload library keeps it (one anon_inode:inotify fd
 *            in the process after it), the C API closed it (none). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#ifdef USE_API
#include <instride/instride.h>
#endif

static const char *dir, *src;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void appear(const char *key)
{
    char dst[4096];
    snprintf(dst, sizeof dst, "%s/%s", dir, key);
    *strrchr(dst, '/') = '\0'; /* (its directory, should the waiter not have made it yet) */
    syscall(SYS_mkdirat, AT_FDCWD, dst, 0755);
    snprintf(dst, sizeof dst, "%s/%s", dir, key);
    if (syscall(SYS_linkat, AT_FDCWD, src, AT_FDCWD, dst, 0) != 0)
        perror("linkat");
}

struct later {
    char key[64];
    int ms;
};

static void *publish_later(void *arg)
{
    struct later *p = arg;
    usleep((useconds_t)p->ms * 1000);
    appear(p->key);
    return NULL;
}

static pthread_t later(struct later *p, const char *key, int ms)
{
    pthread_t t;
    snprintf(p->key, sizeof p->key, "%s", key);
    p->ms = ms;
    pthread_create(&t, NULL, publish_later, p);
    return t;
}

/* Wait for key and read it: 0, or the errno of the failure. */
static int wait_for(const char *key)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, key);
    int fd = -1;
#ifdef USE_API
    int rc = instride_open_read(path, &fd);
    if (rc != 0)
        return rc;
#else
    fd = open(path, O_RDONLY);
    if (fd < 0)
        return errno;
#endif
    char buf[16];
    ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    return n == 4 && memcmp(buf, "data", 4) == 0 ? 0 : EIO;
}

static int inotify_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    struct dirent *e;
    char link[4096], target[4096];
    while (d != NULL && (e = readdir(d)) != NULL) {
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t len = readlink(link, target, sizeof target - 1);
        if (len > 0) {
            target[len] = '\0';
            n += strstr(target, "inotify") != NULL;
        }
    }
    if (d != NULL)
        closedir(d);
    return n;
}

static int fail(const char *what, int err)
{
    printf("%s: %s\n", what, strerror(err));
    return 1;
}

static int one(void)
{
    struct later p;
    pthread_t t = later(&p, "a/k", 300);
    int err = wait_for("a/k");
    pthread_join(t, NULL);
    return err ? fail("wait for a/k", err) : 0;
}

#define THREADS 6
static int thread_err[THREADS];

static void *waiter(void *arg)
{
    int i = (int)(long)arg;
    char key[64];
    snprintf(key, sizeof key, "t/k%d", i);
    thread_err[i] = wait_for(key);
    return NULL;
}

static int threads(void)
{
    pthread_t w[THREADS], t[THREADS];
    struct later p[THREADS];
    char key[64];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&w[i], NULL, waiter, (void *)(long)i);
    for (int i = 0; i < THREADS; i++) {
        snprintf(key, sizeof key, "t/k%d", i);
        t[i] = later(&p[i], key, 300);
    }
    int bad = 0;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(w[i], NULL);
        pthread_join(t[i], NULL);
        if (thread_err[i] != 0) {
            printf("thread %d: %s\n", i, strerror(thread_err[i]));
            bad = 1;
        }
    }
    return bad;
}

static int timeout(void)
{
    double t0 = now();
    int err = wait_for("never/k");
    double s = now() - t0;
    char made[4096];
    struct stat st;
    snprintf(made, sizeof made, "%s/never", dir);
    if (err != ETIMEDOUT)
        return fail("wait for never/k (expected ETIMEDOUT)", err);
    if (s < 0.9 || s > 20) {
        printf("timed out after %.3f s (INSTRIDE_TIMEOUT=1)\n", s);
        return 1;
    }
    if (lstat(made, &st) == 0) {
        printf("the failed wait left its directory never/ behind\n");
        return 1;
    }
    return 0;
}

static int retry(void)
{
    int mine = inotify_init1(IN_CLOEXEC); /* the namespace's only instance */
    if (mine < 0)
        return fail("inotify_init1", errno);
    struct later p;
    pthread_t t = later(&p, "r/k1", 300);
    int err = wait_for("r/k1");
    pthread_join(t, NULL);
    if (err)
        return fail("wait for r/k1 (no instance left)", err);
    close(mine);
    usleep(200 * 1000); /* (the instance is counted until the kernel freed it) */
    t = later(&p, "r/k2", 300);
    err = wait_for("r/k2");
    pthread_join(t, NULL);
    if (err)
        return fail("wait for r/k2", err);
    /* the preload library keeps the thread's instance, made by the second wait; the C API
     * closes each wait's own */
#ifdef USE_API
    const int expected = 0;
#else
    const int expected = 1;
#endif
    if (inotify_fds() != expected) {
        printf("%d inotify fds after the second wait (expected %d)\n", inotify_fds(), expected);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s DIR SRC CASE\n", argv[0]);
        return 2;
    }
    dir = argv[1];
    src = argv[2];
    const char *c = argv[3];
    int rc = strcmp(c, "one") == 0       ? one()
             : strcmp(c, "threads") == 0 ? threads()
             : strcmp(c, "timeout") == 0 ? timeout()
             : strcmp(c, "retry") == 0   ? retry()
                                         : 2;
    if (rc == 0)
        puts("ok");
    return rc;
}
