/* Round 45's wrapper cases; argv[1]: the managed directory, argv[2]: the case. Prints "ok" or
 * what went wrong.
 *
 * unlink / remove: a key written, then unlinked before its close (a "write, fail, unlink,
 *   close" path): the unlink failed (ENOENT, only the temp existed) and the close published
 *   the data meant to be thrown away.
 * fsize: a stream whose flush failed (the file size limit), then more written and closed: the
 *   close's own flush succeeded and a file with a hole was published.
 * maprename: a key whose only reference left is a shared mapping, renamed: ENOENT, and its
 *   munmap published it under the old name.
 * maprace: two threads each write a key through a shared mapping (open, ftruncate, mmap,
 *   close, store, munmap): a key must not exist before its munmap, and must right after.
 * errno: a call that succeeds keeps errno, also where the library's own look at the path
 *   failed (open("..") in a removed working directory: getcwd fails, the open does not). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *dir;
static char bad[256];

static void path(char *out, size_t n, const char *key)
{
    snprintf(out, n, "%s/%s", dir, key);
}

static int exists(const char *key)
{
    char p[4096];
    struct stat st;
    path(p, sizeof p, key);
    return stat(p, &st) == 0;
}

static int t_unlink(int use_remove)
{
    char p[4096];
    path(p, sizeof p, "gone.dat");
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, "partial", 7) != 7)
        return printf("open/write failed\n"), 1;
    int rc = use_remove ? remove(p) : unlink(p);
    if (rc != 0)
        return printf("unlink: %s\n", strerror(errno)), 1;
    if (close(fd) != 0)
        return printf("close: %s\n", strerror(errno)), 1;
    if (exists("gone.dat"))
        return printf("published after its unlink\n"), 1;
    return printf("ok\n"), 0;
}

static int t_fsize(void)
{
    char p[4096];
    path(p, sizeof p, "short.dat");
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = 1000;
    setrlimit(RLIMIT_FSIZE, &lim);
    FILE *fp = fopen(p, "w");
    if (fp == NULL)
        return printf("fopen: %s\n", strerror(errno)), 1;
    static char buf[10000];
    memset(buf, 'x', sizeof buf);
    fwrite(buf, 1, sizeof buf, fp); /* (the flush fails past 1000 bytes) */
    setrlimit(RLIMIT_FSIZE, &old);
    fprintf(fp, "end\n");
    int rc = fclose(fp);
    if (exists("short.dat"))
        return printf("published with a hole (fclose %d)\n", rc), 1;
    if (rc != EOF)
        return printf("fclose returned %d\n", rc), 1;
    return printf("ok\n"), 0;
}

static int t_maprename(void)
{
    char a[4096], b[4096];
    path(a, sizeof a, "x.tmp");
    path(b, sizeof b, "x");
    int fd = open(a, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ftruncate(fd, 4096) != 0)
        return printf("open: %s\n", strerror(errno)), 1;
    char *m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
        return printf("mmap: %s\n", strerror(errno)), 1;
    close(fd);
    memcpy(m, "data", 4);
    if (rename(a, b) != 0)
        return printf("rename: %s\n", strerror(errno)), 1;
    munmap(m, 4096);
    if (!exists("x") || exists("x.tmp"))
        return printf("published as x: %d, as x.tmp: %d\n", exists("x"), exists("x.tmp")), 1;
    return printf("ok\n"), 0;
}

static volatile int stop;

static void *writer(void *arg)
{
    long id = (long)arg;
    char key[64], p[4096];
    for (long i = 0; !stop; i++) {
        snprintf(key, sizeof key, "race/t%ld-%ld", id, i);
        path(p, sizeof p, key);
        int fd = open(p, O_RDWR | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || ftruncate(fd, 65536) != 0) {
            snprintf(bad, sizeof bad, "open %s: %s", key, strerror(errno));
            return NULL;
        }
        char *m = mmap(NULL, 65536, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (m == MAP_FAILED) {
            snprintf(bad, sizeof bad, "mmap: %s", strerror(errno));
            return NULL;
        }
        memset(m, 'a', 65536);
        if (exists(key))
            snprintf(bad, sizeof bad, "%s published before its munmap", key);
        munmap(m, 65536);
        if (!exists(key))
            snprintf(bad, sizeof bad, "%s not published after its munmap", key);
        char *slash = strrchr(p, '/');
        (void)slash;
        unlink(p); /* (published: the file goes, the directory stays small) */
    }
    return NULL;
}

static int t_maprace(void)
{
    char d[4096];
    path(d, sizeof d, "race");
    mkdir(d, 0755);
    pthread_t a, b;
    pthread_create(&a, NULL, writer, (void *)1L);
    pthread_create(&b, NULL, writer, (void *)2L);
    sleep(3);
    stop = 1;
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    if (bad[0])
        return printf("%s\n", bad), 1;
    return printf("ok\n"), 0;
}

static int t_errno(void)
{
    char d[4096];
    path(d, sizeof d, "cwd-gone");
    if (mkdir(d, 0755) != 0 || chdir(d) != 0 || rmdir(d) != 0)
        return printf("setup: %s\n", strerror(errno)), 1;
    errno = 0;
    int fd = open("..", O_RDONLY);
    int e = errno;
    if (fd < 0)
        return printf("open: %s\n", strerror(e)), 1;
    close(fd);
    if (e != 0)
        return printf("errno %d after a call that succeeded\n", e), 1;
    return printf("ok\n"), 0;
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    dir = argv[1];
    if (strcmp(argv[2], "unlink") == 0)
        return t_unlink(0);
    if (strcmp(argv[2], "remove") == 0)
        return t_unlink(1);
    if (strcmp(argv[2], "fsize") == 0)
        return t_fsize();
    if (strcmp(argv[2], "maprename") == 0)
        return t_maprename();
    if (strcmp(argv[2], "maprace") == 0)
        return t_maprace();
    if (strcmp(argv[2], "errno") == 0)
        return t_errno();
    return 2;
}
