/* A thread's cached inotify fd (the preload library keeps one per thread) whose number the
 * program closes (closefrom) under it. argv[1]: the managed directory, argv[2]: a file to link
 * in as keys (by the raw linkat system call, which the library does not see -- its link()
 * refuses a key -- so that the keys appear without it).
 *
 * "share": the main thread waits once (caches its fd), the program closes its fds, thread T2
 * waits in b/ (its new fd gets the freed number), the main thread waits again in a/. The main
 * thread took T2's fd for its own (the number alone named it): it removed T2's watch and ate
 * its events, and T2 never woke. Prints T2's wait in ms (its key appears at 300 ms).
 *
 * "spin": a thread waits for a key that never comes; the program closes its fds under it and
 * makes an event in the directory. The wait spun on POLLNVAL until its deadline. Prints the
 * process's CPU ms over the wait. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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
    if (syscall(SYS_linkat, AT_FDCWD, src, AT_FDCWD, dst, 0) != 0)
        perror("linkat");
}

struct later {
    const char *key;
    int ms;
};

static void *publish_later(void *arg)
{
    struct later *p = arg;
    usleep((useconds_t)p->ms * 1000);
    appear(p->key);
    return NULL;
}

static int wait_for(const char *key)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, key);
    int fd = open(path, O_RDONLY);
    if (fd >= 0)
        close(fd);
    return fd >= 0 ? 0 : errno;
}

static double t2_ms = -1;

static void *t2(void *arg)
{
    (void)arg;
    double t0 = now();
    if (wait_for("b/k2") == 0)
        t2_ms = (now() - t0) * 1000;
    return NULL;
}

static void *waits_in_vain(void *arg)
{
    (void)arg;
    wait_for("c/never");
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    dir = argv[1];
    src = argv[2];
    pthread_t a, b, c;
    if (strcmp(argv[3], "share") == 0) {
        struct later k1 = {"a/k1", 50}, k2 = {"b/k2", 300}, k3 = {"a/k3", 50};
        pthread_create(&a, NULL, publish_later, &k1);
        if (wait_for("a/k1") != 0)
            return 1;
        pthread_join(a, NULL);
        closefrom(3);
        pthread_create(&a, NULL, publish_later, &k2);
        pthread_create(&b, NULL, t2, NULL);
        usleep(100000);
        pthread_create(&c, NULL, publish_later, &k3);
        if (wait_for("a/k3") != 0)
            return 1;
        pthread_join(c, NULL);
        pthread_join(b, NULL);
        pthread_join(a, NULL);
        printf("%.0f\n", t2_ms);
        return 0;
    }
    pthread_create(&a, NULL, waits_in_vain, NULL);
    usleep(200000);
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    closefrom(3);
    usleep(100000);
    appear("c/other"); /* an event in the directory */
    pthread_join(a, NULL);
    getrusage(RUSAGE_SELF, &r1);
    double cpu = (double)(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec + r1.ru_stime.tv_sec -
                          r0.ru_stime.tv_sec) * 1000 +
                 (double)(r1.ru_utime.tv_usec - r0.ru_utime.tv_usec + r1.ru_stime.tv_usec -
                          r0.ru_stime.tv_usec) / 1000;
    printf("%.0f\n", cpu);
    return 0;
}
