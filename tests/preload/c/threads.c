/*
 * threads.c -- concurrency under the shim:  threads <managed_dir> <outside_dir> <writers> <keys>
 *
 * <writers> threads each produce <keys> keys (open/write/close, every fourth
 * through fopen/fclose, every third with a dup'ed fd) and read each one back;
 * as many reader threads consume the other writers' keys as they appear
 * (waiting in open); two more threads do non-managed I/O in <outside_dir>
 * the whole time and check it is plain libc (files exist at once, append
 * works). Exits 0 when every byte read is the byte written.
 */
#define _GNU_SOURCE 1
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *M, *OUT;
static int NW, NK;
static atomic_int errors;
static atomic_int writers_done;

#define FAIL(...)                                                                   \
    do {                                                                            \
        fprintf(stderr, __VA_ARGS__);                                               \
        atomic_fetch_add(&errors, 1);                                               \
    } while (0)

static void content(int w, int k, char *buf, size_t cap, size_t *len)
{
    /* sizes vary from a few bytes to ~40 KiB */
    size_t n = (size_t)((w * 7919 + k * 104729) % 40000) + 16;
    if (n > cap)
        n = cap;
    int h = snprintf(buf, cap, "w%d k%d|", w, k);
    for (size_t i = (size_t)h; i < n; i++)
        buf[i] = (char)('a' + (i * 31 + (size_t)w + (size_t)k) % 26);
    *len = n;
}

static int check_file(const char *path, int w, int k)
{
    static __thread char want[40100], got[40100];
    size_t len, off = 0;
    content(w, k, want, sizeof want, &len);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return -1;
    for (;;) {
        ssize_t n = read(fd, got + off, sizeof got - off);
        if (n <= 0)
            break;
        off += (size_t)n;
    }
    close(fd);
    return (off == len && memcmp(want, got, len) == 0) ? 0 : 1;
}

static void *writer(void *arg)
{
    int w = (int)(long)arg;
    static __thread char buf[40100];
    char path[4096];
    for (int k = 0; k < NK; k++) {
        size_t len;
        content(w, k, buf, sizeof buf, &len);
        snprintf(path, sizeof path, "%s/w%d/k%04d.bin", M, w, k);
        if (k % 4 == 3) {
            FILE *fp = fopen(path, "wb");
            if (fp == NULL || fwrite(buf, 1, len, fp) != len || fclose(fp) != 0) {
                FAIL("writer %d key %d fopen path: %s\n", w, k, strerror(errno));
                continue;
            }
        } else {
            int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (fd < 0) {
                FAIL("writer %d key %d open: %s\n", w, k, strerror(errno));
                continue;
            }
            int wfd = fd, d = -1;
            if (k % 3 == 0) { /* write through a dup, close both */
                d = dup(fd);
                wfd = d;
            }
            if (write(wfd, buf, len) != (ssize_t)len)
                FAIL("writer %d key %d write\n", w, k);
            if (d >= 0 && close(d) != 0)
                FAIL("writer %d key %d close dup\n", w, k);
            if (close(fd) != 0)
                FAIL("writer %d key %d close: %s\n", w, k, strerror(errno));
        }
        if (check_file(path, w, k) != 0)
            FAIL("writer %d key %d: read-back mismatch\n", w, k);
    }
    atomic_fetch_add(&writers_done, 1);
    return NULL;
}

static void *reader(void *arg)
{
    int w = (int)(long)arg;
    char path[4096];
    for (int k = NK - 1; k >= 0; k--) { /* newest first: the early ones wait */
        snprintf(path, sizeof path, "%s/w%d/k%04d.bin", M, w, k);
        int rc = check_file(path, w, k);
        if (rc != 0)
            FAIL("reader of %d key %d: %s\n", w, k, rc < 0 ? strerror(errno) : "mismatch");
    }
    return NULL;
}

static void *plain_io(void *arg)
{
    int t = (int)(long)arg;
    char path[4096];
    int rounds = 0;
    while (atomic_load(&writers_done) < NW || rounds < 50) {
        snprintf(path, sizeof path, "%s/plain%d-%d.txt", OUT, t, rounds % 8);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        struct stat st;
        if (fd < 0 || stat(path, &st) != 0) { /* must exist under its name at once */
            FAIL("plain %d: open/stat %s\n", t, strerror(errno));
            break;
        }
        int d = dup(fd);
        if (write(d, "x", 1) != 1 || close(d) != 0 || close(fd) != 0)
            FAIL("plain %d: write/close\n", t);
        fd = open(path, O_WRONLY | O_APPEND);
        if (fd < 0 || write(fd, "y", 1) != 1 || close(fd) != 0)
            FAIL("plain %d: append %s\n", t, strerror(errno));
        char b[4] = {0};
        fd = open(path, O_RDONLY);
        if (fd < 0 || read(fd, b, 3) != 2 || strcmp(b, "xy") != 0)
            FAIL("plain %d: read back '%s'\n", t, b);
        if (fd >= 0)
            close(fd);
        rounds++;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: threads <managed> <outside> <writers> <keys>\n");
        return 2;
    }
    M = argv[1];
    OUT = argv[2];
    NW = atoi(argv[3]);
    NK = atoi(argv[4]);
    pthread_t th[256];
    int n = 0;
    for (int w = 0; w < NW; w++)
        pthread_create(&th[n++], NULL, reader, (void *)(long)((w + 1) % NW));
    for (int t = 0; t < 2; t++)
        pthread_create(&th[n++], NULL, plain_io, (void *)(long)t);
    for (int w = 0; w < NW; w++)
        pthread_create(&th[n++], NULL, writer, (void *)(long)w);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    int e = atomic_load(&errors);
    if (e) {
        fprintf(stderr, "%d errors\n", e);
        return 1;
    }
    printf("PASS threads %d x %d\n", NW, NK);
    return 0;
}
