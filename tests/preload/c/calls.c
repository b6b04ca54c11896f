/*
 * calls.c -- exercises every call libinstride_preload.so wraps, one scenario
 * per invocation:  calls <scenario> <managed_dir> <outside_dir>
 * Run with LD_PRELOAD set. Prints "PASS <scenario>" and exits 0, or prints the
 * failed check and exits 1. The pytest side re-checks the results on disk
 * without the shim.
 */
#define _GNU_SOURCE 1
#include <dirent.h>
#include <pthread.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *M, *OUT;
static int failures;

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "FAIL %s:%d: %s (errno=%d %s)\n", __FILE__, __LINE__, #cond, \
                    errno, strerror(errno));                                        \
            failures++;                                                             \
            return;                                                                 \
        }                                                                           \
    } while (0)

static char *mp(const char *key)
{
    static char bufs[8][4096];
    static int i;
    char *b = bufs[i++ % 8];
    snprintf(b, 4096, "%s/%s", M, key);
    return b;
}

static char *op(const char *name)
{
    static char bufs[8][4096];
    static int i;
    char *b = bufs[i++ % 8];
    snprintf(b, 4096, "%s/%s", OUT, name);
    return b;
}

static int exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

/* Number of instride temp files left in the directory of path. */
static int temps_in(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    if (d == NULL)
        return 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".instride-") != NULL)
            n++;
    closedir(d);
    return n;
}

/* The temp files in dir that a writer holds locked (what `instride gc` leaves alone). */
static int temps_locked(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    if (d == NULL)
        return 0;
    struct dirent *e;
    char path[4096];
    while ((e = readdir(d)) != NULL) {
        if (strstr(e->d_name, ".instride-") == NULL)
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        if (flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK)
            n++;
        close(fd);
    }
    closedir(d);
    return n;
}

static int read_all(int fd, char *buf, size_t cap)
{
    size_t got = 0;
    for (;;) {
        ssize_t n = read(fd, buf + got, cap - 1 - got);
        if (n < 0)
            return -1;
        if (n == 0)
            break;
        got += (size_t)n;
    }
    buf[got] = '\0';
    return (int)got;
}

static int file_is(const char *path, const char *want)
{
    char buf[4096];
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return 0;
    int n = read_all(fd, buf, sizeof buf);
    close(fd);
    return n >= 0 && strcmp(buf, want) == 0;
}

static int wr(int fd, const char *s) { return write(fd, s, strlen(s)) == (ssize_t)strlen(s); }

/* ---- scenarios ----------------------------------------------------------- */

static void t_open(void)
{
    const char *f = mp("open/a.txt");
    errno = 12345;
    int fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0640);
    CHECK(fd >= 0);
    CHECK(errno == 12345); /* errno preserved on success */
    CHECK(wr(fd, "via open\n"));
    CHECK(!exists(f)); /* not visible before close */
    CHECK(temps_in(mp("open")) == 1);
    errno = 54321;
    CHECK(close(fd) == 0);
    CHECK(errno == 54321);
    CHECK(exists(f));
    CHECK(temps_in(mp("open")) == 0);
    struct stat st;
    CHECK(stat(f, &st) == 0 && (st.st_mode & 0777) == (0640 & ~022 & 0777));
    CHECK(file_is(f, "via open\n"));
}

static void t_open64(void)
{
    const char *f = mp("open64/a.txt");
    int fd = open64(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    CHECK(wr(fd, "via open64\n"));
    CHECK(!exists(f));
    CHECK(close(fd) == 0);
    int rfd = open64(f, O_RDONLY);
    CHECK(rfd >= 0);
    char buf[64];
    CHECK(read_all(rfd, buf, sizeof buf) == 11 && strcmp(buf, "via open64\n") == 0);
    CHECK(close(rfd) == 0);
}

static void t_openat(void)
{
    CHECK(mkdir(M, 0777) == 0 || errno == EEXIST);
    int dfd = open(M, O_RDONLY | O_DIRECTORY);
    CHECK(dfd >= 0);
    int fd = openat(dfd, "openat/a.txt", O_WRONLY | O_CREAT | O_EXCL, 0644);
    CHECK(fd >= 0);
    CHECK(wr(fd, "via openat\n"));
    CHECK(!exists(mp("openat/a.txt")));
    CHECK(close(fd) == 0);
    CHECK(file_is(mp("openat/a.txt"), "via openat\n"));
    int rfd = openat(dfd, "openat/../openat/./a.txt", O_RDONLY);
    CHECK(rfd >= 0);
    char buf[64];
    CHECK(read_all(rfd, buf, sizeof buf) > 0 && strcmp(buf, "via openat\n") == 0);
    close(rfd);
    close(dfd);
    /* beneath a directory removed since it was opened: ENOENT, as without the library (the
     * kernel names it "... (deleted)": taken as its path, a key was published under a new
     * directory of that name) */
    CHECK(mkdir(mp("openat/gone"), 0777) == 0);
    dfd = open(mp("openat/gone"), O_RDONLY | O_DIRECTORY);
    CHECK(dfd >= 0 && rmdir(mp("openat/gone")) == 0);
    errno = 0;
    CHECK(openat(dfd, "k", O_WRONLY | O_CREAT | O_TRUNC, 0644) == -1 && errno == ENOENT);
    CHECK(!exists(mp("openat/gone (deleted)")));
    close(dfd);
}

/* O_RDONLY|O_CREAT, as util-linux flock(1) opens its lock file: a missing key is made (empty,
 * published at the last close), a published one opened; it waited for good before. */
static void t_rdonly_creat(void)
{
    int fd = open(mp("rc/lock"), O_RDONLY | O_CREAT, 0644);
    CHECK(fd >= 0);
    struct stat st; /* (published at once, empty: every such open has the one file) */
    CHECK(stat(mp("rc/lock"), &st) == 0 && st.st_size == 0);
    CHECK(flock(fd, LOCK_EX) == 0);
    int other = open(mp("rc/lock"), O_RDONLY | O_CREAT, 0644);
    CHECK(other >= 0 && flock(other, LOCK_EX | LOCK_NB) == -1 && errno == EWOULDBLOCK);
    close(other);
    CHECK(close(fd) == 0);
    fd = open(mp("rc/lock"), O_RDONLY | O_CREAT, 0644);
    CHECK(fd >= 0 && flock(fd, LOCK_EX) == 0);
    close(fd);
    errno = 0;
    CHECK(open(mp("rc/lock"), O_RDONLY | O_CREAT | O_EXCL, 0644) == -1 && errno == EEXIST);
}

static void t_openat64(void)
{
    int fd = openat64(AT_FDCWD, mp("openat64/a.txt"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    CHECK(wr(fd, "via openat64\n"));
    CHECK(!exists(mp("openat64/a.txt")));
    CHECK(close(fd) == 0);
    CHECK(file_is(mp("openat64/a.txt"), "via openat64\n"));
}

static void t_relative(void)
{
    CHECK(mkdir(M, 0777) == 0 || errno == EEXIST);
    CHECK(chdir(M) == 0);
    int fd = open("rel/./x/../a.txt", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    CHECK(wr(fd, "relative\n"));
    CHECK(!exists("rel/a.txt"));
    CHECK(close(fd) == 0);
    CHECK(file_is(mp("rel/a.txt"), "relative\n"));
}

static void t_creat(void)
{
    int fd = creat(mp("creat/a.txt"), 0644);
    CHECK(fd >= 0);
    CHECK(wr(fd, "via creat\n"));
    CHECK(!exists(mp("creat/a.txt")));
    CHECK(close(fd) == 0);
    CHECK(file_is(mp("creat/a.txt"), "via creat\n"));
    fd = creat64(mp("creat/b.txt"), 0644);
    CHECK(fd >= 0);
    CHECK(wr(fd, "via creat64\n"));
    CHECK(!exists(mp("creat/b.txt")));
    CHECK(close(fd) == 0);
    CHECK(file_is(mp("creat/b.txt"), "via creat64\n"));
}

static void t_fopen(void)
{
    FILE *fp = fopen(mp("fopen/a.txt"), "w");
    CHECK(fp != NULL);
    CHECK(fprintf(fp, "via fopen %d\n", 42) > 0);
    CHECK(fflush(fp) == 0);
    CHECK(!exists(mp("fopen/a.txt")));
    CHECK(fclose(fp) == 0);
    CHECK(file_is(mp("fopen/a.txt"), "via fopen 42\n"));
    fp = fopen64(mp("fopen/b.txt"), "wbx");
    CHECK(fp != NULL);
    CHECK(fputs("via fopen64\n", fp) >= 0);
    CHECK(!exists(mp("fopen/b.txt")));
    CHECK(fclose(fp) == 0);
    char line[64];
    fp = fopen(mp("fopen/b.txt"), "rb");
    CHECK(fp != NULL);
    CHECK(fgets(line, sizeof line, fp) != NULL && strcmp(line, "via fopen64\n") == 0);
    CHECK(fclose(fp) == 0);
    /* w+: write then read back through the same stream, then publish */
    fp = fopen(mp("fopen/c.txt"), "w+");
    CHECK(fp != NULL);
    CHECK(fputs("w+ data\n", fp) >= 0);
    rewind(fp);
    CHECK(fgets(line, sizeof line, fp) != NULL && strcmp(line, "w+ data\n") == 0);
    CHECK(fclose(fp) == 0);
    CHECK(file_is(mp("fopen/c.txt"), "w+ data\n"));
}

static void t_freopen(void)
{
    FILE *fp = fopen(op("freopen-start.txt"), "w");
    CHECK(fp != NULL);
    fp = freopen(mp("freopen/a.txt"), "w", fp);
    CHECK(fp != NULL);
    CHECK(fputs("via freopen\n", fp) >= 0);
    CHECK(!exists(mp("freopen/a.txt")));
    /* reopening the stream closes (publishes) the key, and consumes the next */
    fp = freopen(mp("freopen/a.txt"), "r", fp);
    CHECK(fp != NULL);
    char line[64];
    CHECK(fgets(line, sizeof line, fp) != NULL && strcmp(line, "via freopen\n") == 0);
    CHECK(fclose(fp) == 0);
    fp = fopen(op("freopen-start2.txt"), "w");
    CHECK(fp != NULL);
    fp = freopen64(mp("freopen/b.txt"), "w", fp);
    CHECK(fp != NULL);
    CHECK(fputs("via freopen64\n", fp) >= 0);
    CHECK(temps_locked(mp("freopen")) == 1); /* (gc leaves it: it used to be unlocked) */
    CHECK(fclose(fp) == 0);
    CHECK(file_is(mp("freopen/b.txt"), "via freopen64\n"));
}

static void t_dup(void)
{
    const char *f = mp("dup/a.txt");
    int fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    int d1 = dup(fd);
    CHECK(d1 >= 0);
    int d2 = dup2(fd, 100);
    CHECK(d2 == 100);
    int d3 = dup3(fd, 101, O_CLOEXEC);
    CHECK(d3 == 101);
    int d4 = fcntl(fd, F_DUPFD, 200);
    CHECK(d4 >= 200);
    int d5 = fcntl(fd, F_DUPFD_CLOEXEC, 300);
    CHECK(d5 >= 300);
    CHECK(wr(fd, "a"));
    CHECK(wr(d1, "b"));
    CHECK(wr(d2, "c"));
    CHECK(wr(d3, "d"));
    CHECK(wr(d4, "e"));
    CHECK(wr(d5, "f"));
    CHECK(close(fd) == 0);
    CHECK(!exists(f));
    CHECK(close(d1) == 0);
    CHECK(close(d2) == 0);
    CHECK(close(d3) == 0);
    CHECK(close(d4) == 0);
    CHECK(!exists(f));
    CHECK(close(d5) == 0); /* the last close publishes */
    CHECK(exists(f));
    CHECK(file_is(f, "abcdef"));

    /* dup2 over a produced fd is that fd's close: it publishes */
    const char *g = mp("dup/b.txt");
    int gfd = open(g, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(gfd >= 0);
    CHECK(wr(gfd, "dup2 victim"));
    int nul = open("/dev/null", O_WRONLY);
    CHECK(nul >= 0);
    CHECK(dup2(nul, gfd) == gfd);
    CHECK(file_is(g, "dup2 victim"));
    CHECK(close(gfd) == 0);
    CHECK(close(nul) == 0);
}

static void t_rdwr(void)
{
    const char *f = mp("rdwr/a.bin");
    int fd = open(f, O_RDWR | O_CREAT, 0644);
    CHECK(fd >= 0);
    CHECK(wr(fd, "read me back"));
    CHECK(lseek(fd, 0, SEEK_SET) == 0);
    char buf[64];
    CHECK(read_all(fd, buf, sizeof buf) == 12 && strcmp(buf, "read me back") == 0);
    CHECK(!exists(f));
    CHECK(close(fd) == 0);
    CHECK(file_is(f, "read me back"));
}

static void write_outside(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        (void)!write(fd, text, strlen(text));
        close(fd);
    }
}

static void t_rename(void)
{
    write_outside(op("ren-src.txt"), "renamed in\n");
    CHECK(rename(op("ren-src.txt"), mp("ren/a.txt")) == 0);
    CHECK(!exists(op("ren-src.txt")));
    CHECK(file_is(mp("ren/a.txt"), "renamed in\n"));
    /* write-once: renaming onto a published key fails, the source stays */
    write_outside(op("ren-src2.txt"), "second\n");
    errno = 0;
    CHECK(rename(op("ren-src2.txt"), mp("ren/a.txt")) == -1 && errno == EEXIST);
    CHECK(exists(op("ren-src2.txt")));
    CHECK(file_is(mp("ren/a.txt"), "renamed in\n"));
    /* a published key renamed onto itself: nothing happens, and that succeeds (POSIX) */
    CHECK(rename(mp("ren/a.txt"), mp("ren/a.txt")) == 0);
    CHECK(file_is(mp("ren/a.txt"), "renamed in\n"));
    /* renameat with dir fds */
    int od = open(OUT, O_RDONLY | O_DIRECTORY);
    CHECK(mkdir(mp("ren"), 0777) == 0 || errno == EEXIST);
    int nd = open(mp("ren"), O_RDONLY | O_DIRECTORY);
    CHECK(od >= 0 && nd >= 0);
    CHECK(renameat(od, "ren-src2.txt", nd, "b.txt") == 0);
    CHECK(file_is(mp("ren/b.txt"), "second\n"));
    write_outside(op("ren-src3.txt"), "third\n");
    CHECK(renameat2(od, "ren-src3.txt", nd, "c.txt", 0) == 0);
    CHECK(file_is(mp("ren/c.txt"), "third\n"));
    close(od);
    close(nd);
    /* a rename between two non-managed paths is plain libc */
    write_outside(op("plain-a.txt"), "plain\n");
    CHECK(rename(op("plain-a.txt"), op("plain-b.txt")) == 0);
    CHECK(file_is(op("plain-b.txt"), "plain\n"));
}

/* write x.tmp, rename it to x while still open, then close: x is published by the close */
static void t_rename_open(void)
{
    char tmp[4096], key[4096]; /* (mp's buffers are reused) */
    snprintf(tmp, sizeof tmp, "%s", mp("reno/x.tmp"));
    snprintf(key, sizeof key, "%s", mp("reno/x"));
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && wr(fd, "part one, "));
    int other = dup(fd);
    CHECK(other >= 0);
    errno = 777;
    CHECK(rename(tmp, key) == 0 && errno == 777);
    CHECK(!exists(tmp) && !exists(key)); /* published by the close, complete */
    CHECK(wr(fd, "part two") && close(fd) == 0);
    CHECK(!exists(key));
    CHECK(close(other) == 0);
    CHECK(file_is(key, "part one, part two"));
    CHECK(!exists(tmp));
    /* a stream, renamed into another directory */
    FILE *fp = fopen(mp("reno/y.tmp"), "w");
    CHECK(fp != NULL && fputs("streamed", fp) >= 0);
    CHECK(rename(mp("reno/y.tmp"), mp("reno/sub/y")) == 0);
    CHECK(fclose(fp) == 0);
    CHECK(file_is(mp("reno/sub/y"), "streamed") && !exists(mp("reno/y.tmp")));
    /* write-once: onto a published key it fails at once, the file keeps its own name;
     * INSTRIDE_OVERWRITE=1: the close replaces the key */
    int overwrite = getenv("INSTRIDE_OVERWRITE") != NULL;
    fd = open(mp("reno/z.tmp"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && wr(fd, "zed"));
    errno = 0;
    CHECK(overwrite ? rename(mp("reno/z.tmp"), key) == 0
                    : rename(mp("reno/z.tmp"), key) == -1 && errno == EEXIST);
    CHECK(close(fd) == 0);
    if (overwrite)
        CHECK(file_is(key, "zed") && !exists(mp("reno/z.tmp")));
    else
        CHECK(file_is(mp("reno/z.tmp"), "zed") && file_is(key, "part one, part two"));
    /* a key that is neither published nor open: ENOENT, as libc */
    errno = 0;
    CHECK(rename(mp("reno/none.tmp"), mp("reno/none")) == -1 && errno == ENOENT);
    CHECK(temps_in(mp("reno")) == 0 && temps_in(mp("reno/sub")) == 0);
}

static void t_rename_xdev(void)
{
    /* OUT and M are on different file systems (the test arranges it) */
    write_outside(op("xdev.txt"), "across file systems\n");
    CHECK(rename(op("xdev.txt"), mp("xdev/a.txt")) == 0);
    CHECK(!exists(op("xdev.txt")));
    CHECK(file_is(mp("xdev/a.txt"), "across file systems\n"));
    CHECK(temps_in(mp("xdev")) == 0);
}

static void t_fork(void)
{
    const char *f = mp("fork/a.txt");
    int fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    CHECK(wr(fd, "parent"));
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(fd); /* the child does not own the file: nothing is published */
        _exit(exists(f) ? 3 : 0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(!exists(f));
    CHECK(close(fd) == 0);
    CHECK(file_is(f, "parent"));
}

/* A vfork child shares its parent's memory: what it closes and dups (Python's subprocess
 * does close_range(3, ...) there before exec) must leave the parent's keys alone. */
static void t_vfork(void)
{
    const char *f = mp("vfork/a.txt");
    const char *g = mp("vfork/child.txt");
    int fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && wr(fd, "parent"));
    int other = dup(fd);
    CHECK(other >= 0);
    pid_t pid = vfork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int ok = dup2(fd, other) == other && close(fd) == 0 && close_range(3, ~0U, 0) == 0;
        closefrom(3);
        /* it cannot write a key: that would need the parent's table */
        ok = ok && open(g, O_WRONLY | O_CREAT | O_TRUNC, 0644) == -1 && errno == EPERM;
        _exit(ok ? 0 : 3);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(!exists(f) && !exists(g));
    CHECK(wr(other, " and more"));
    CHECK(close(other) == 0);
    CHECK(!exists(f)); /* fd still holds it */
    CHECK(close(fd) == 0);
    CHECK(file_is(f, "parent and more"));
    CHECK(temps_in(mp("vfork")) == 0);
}

static void t_eexist(void)
{
    const char *f = mp("once/a.txt");
    int a = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int b = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(a >= 0 && b >= 0);
    CHECK(wr(a, "first"));
    CHECK(wr(b, "second"));
    CHECK(close(a) == 0);
    errno = 0;
    CHECK(close(b) == -1 && errno == EEXIST); /* the loser's close reports it */
    CHECK(file_is(f, "first"));
    CHECK(temps_in(mp("once")) == 0);
    errno = 0;
    CHECK(open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644) == -1 && errno == EEXIST);
    errno = 0;
    CHECK(fopen(f, "w") == NULL && errno == EEXIST);
    errno = 0;
    CHECK(creat(f, 0644) == -1 && errno == EEXIST);
    CHECK(file_is(f, "first"));
}

static void t_refuse(void)
{
    const char *f = mp("imm/a.txt");
    int fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && wr(fd, "immutable") && close(fd) == 0);
    errno = 0;
    CHECK(open(f, O_WRONLY | O_APPEND) == -1 && errno == EPERM);
    errno = 0;
    CHECK(open(f, O_WRONLY | O_CREAT | O_APPEND, 0644) == -1 && errno == EPERM);
    errno = 0;
    CHECK(open(f, O_RDWR) == -1 && errno == EROFS); /* read-write: read-only (EROFS) */
    errno = 0;
    CHECK(open(f, O_RDWR | O_CREAT, 0644) == -1 && errno == EROFS);
    errno = 0;
    CHECK(open(f, O_WRONLY) == -1 && errno == EPERM);
    errno = 0;
    CHECK(fopen(f, "a") == NULL && errno == EPERM);
    errno = 0;
    CHECK(fopen(f, "r+") == NULL && errno == EROFS);
    errno = 0;
    CHECK(open(f, O_RDONLY | O_TRUNC) == -1 && errno == EPERM);
    CHECK(file_is(f, "immutable"));
    /* the same for a key that is not published yet: nothing is created */
    const char *g = mp("imm/not-yet.txt");
    errno = 0;
    CHECK(open(g, O_WRONLY | O_CREAT | O_APPEND, 0644) == -1 && errno == EPERM);
    errno = 0;
    CHECK(fopen(g, "a+") == NULL && errno == EPERM);
    errno = 0;
    CHECK(open(g, O_RDWR) == -1 && errno == EROFS);
    CHECK(!exists(g));
    /* append on a fresh file (O_TRUNC) cannot touch published bytes: allowed */
    fd = open(mp("imm/fresh.txt"), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    CHECK(fd >= 0 && wr(fd, "fresh") && close(fd) == 0);
    CHECK(file_is(mp("imm/fresh.txt"), "fresh"));
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void t_timeout(void)
{
    double t0 = now();
    errno = 0;
    CHECK(open(mp("never/a.txt"), O_RDONLY) == -1 && errno == ETIMEDOUT);
    double dt = now() - t0;
    CHECK(dt >= 0.45 && dt < 3.0);
    errno = 0;
    CHECK(fopen(mp("never/b.txt"), "r") == NULL && errno == ETIMEDOUT);
}

/* dup2 over the last fd of a written key publishes it, but cannot report a failure (as
 * POSIX dup2 loses close errors): the loser's temp is removed, nothing is replaced. */
static void t_dup2_eexist(void)
{
    const char *f = mp("d2/a.txt");
    int a = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int b = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int null = open("/dev/null", O_RDONLY);
    CHECK(a >= 0 && b >= 0 && null >= 0 && wr(a, "first") && wr(b, "second"));
    CHECK(close(a) == 0 && file_is(f, "first"));
    errno = 31;
    CHECK(dup2(null, b) == b && errno == 31);
    CHECK(file_is(f, "first") && temps_in(mp("d2")) == 0);
    close(b);
    close(null);
}

/* Run with INSTRIDE_TIMEOUT=-1 (refused), bad/a.txt published: every read of a key fails
 * with EINVAL, also of a published one and through stdio. */
static void t_timeout_bad(void)
{
    const char *f = mp("bad/a.txt");
    CHECK(exists(f));
    errno = 0;
    CHECK(open(f, O_RDONLY) == -1 && errno == EINVAL);
    errno = 0;
    CHECK(fopen(f, "r") == NULL && errno == EINVAL);
    errno = 0;
    CHECK(fopen(f, "rb") == NULL && errno == EINVAL);
    FILE *fp = fopen(op("bad-stream.txt"), "w");
    CHECK(fp != NULL);
    errno = 0;
    CHECK(freopen(f, "r", fp) == NULL && errno == EINVAL);
}

/* Built with -O2 -D_FORTIFY_SOURCE=2 (and once more with _FILE_OFFSET_BITS=64),
 * open() with non-constant flags and no mode becomes __open_2 / __open64_2. */
static void t_fortified(void)
{
    volatile int rd = O_RDONLY;
    const char *f = mp("fort/a.txt");
    int fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && wr(fd, "fortified") && close(fd) == 0);
    fd = open(f, rd);
    CHECK(fd >= 0);
    char buf[64];
    CHECK(read_all(fd, buf, sizeof buf) == 9 && strcmp(buf, "fortified") == 0);
    close(fd);
    fd = openat(AT_FDCWD, f, rd);
    CHECK(fd >= 0);
    close(fd);
    /* intercepted reads wait (here: time out) instead of failing with ENOENT */
    errno = 0;
    CHECK(open(mp("fort/never.txt"), rd) == -1 && errno == ETIMEDOUT);
    errno = 0;
    CHECK(openat(AT_FDCWD, mp("fort/never.txt"), rd) == -1 && errno == ETIMEDOUT);
}

/* A file closed from an atexit handler (as language runtimes do) is published. */
static int atexit_fd = -1;
static void close_at_exit(void) { close(atexit_fd); }
static void t_atexit(void)
{
    atexit_fd = open(mp("atexit/a.txt"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(atexit_fd >= 0 && wr(atexit_fd, "closed at exit"));
    CHECK(atexit(close_at_exit) == 0);
}

static void *publish_later(void *arg)
{
    const char *key = arg;
    usleep(200000);
    int fd = open(key, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        (void)!write(fd, "later", 5);
        close(fd);
    }
    return NULL;
}

static void wait_for(const char *key)
{
    pthread_t th;
    CHECK(pthread_create(&th, NULL, publish_later, (void *)key) == 0);
    int fd = open(key, O_RDONLY);
    CHECK(fd >= 0);
    char buf[16];
    CHECK(read_all(fd, buf, sizeof buf) == 5 && strcmp(buf, "later") == 0);
    close(fd);
    pthread_join(th, NULL);
}

/* The application closes every fd, including the shim's cached inotify fd,
 * and reuses the numbers: waits still work, the app's fds are left alone. */
static void t_ifd_closed(void)
{
    wait_for(mp("ifd/a.txt"));
    CHECK(failures == 0);
    for (int fd = 3; fd < 256; fd++)
        close(fd);
    int mine[8];
    for (int i = 0; i < 8; i++) {
        char name[64];
        snprintf(name, sizeof name, "plain-%d.txt", i);
        mine[i] = open(op(name), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        CHECK(mine[i] >= 0);
    }
    wait_for(mp("ifd/b.txt"));
    CHECK(failures == 0);
    CHECK(close_range(3, 255, 0) == 0);
    wait_for(mp("ifd/c.txt"));
    CHECK(failures == 0);
    for (int i = 0; i < 8; i++) { /* reopen: numbers are reused again */
        char name[64];
        snprintf(name, sizeof name, "plain-%d.txt", i);
        mine[i] = open(op(name), O_WRONLY | O_APPEND);
        CHECK(mine[i] >= 0);
    }
    wait_for(mp("ifd/d.txt"));
    CHECK(failures == 0);
    for (int i = 0; i < 8; i++) {
        char name[64];
        snprintf(name, sizeof name, "plain-%d.txt", i);
        CHECK(wr(mine[i], "mine") && close(mine[i]) == 0);
        CHECK(file_is(op(name), "mine"));
    }
}

/* libgfortran's OPEN without ACTION= (io/unix.c, regular_file2): read-write first, read-only
 * on EACCES/EROFS (STATUS='UNKNOWN' then without O_CREAT), write-only on EACCES/ENOENT. */
static int gfortran_open(const char *path, int unknown, int *action_read)
{
    int crflag = (unknown ? O_CREAT : 0) | O_CLOEXEC;
    *action_read = 0;
    int fd = open(path, O_RDWR | crflag, 0666);
    if (fd >= 0 || (errno != EACCES && errno != EROFS))
        return fd;
    fd = open(path, O_RDONLY | (unknown ? crflag & ~O_CREAT : crflag), 0666);
    if (fd >= 0) {
        *action_read = 1;
        return fd;
    }
    if (errno != EACCES && errno != ENOENT)
        return fd;
    return open(path, O_WRONLY | crflag, 0666);
}

static void t_fortran(void)
{
    char key[4096], late[4096]; /* (mp's buffers are reused) */
    snprintf(key, sizeof key, "%s", mp("fortran/in.dat"));
    snprintf(late, sizeof late, "%s", mp("fortran/late.dat"));
    int fd = open(key, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && wr(fd, "published") && close(fd) == 0);
    for (int unknown = 0; unknown < 2; unknown++) { /* STATUS='OLD', STATUS='UNKNOWN' */
        int ro = 0;
        char buf[64];
        fd = gfortran_open(key, unknown, &ro);
        CHECK(fd >= 0 && ro);
        CHECK(read_all(fd, buf, sizeof buf) == 9 && strcmp(buf, "published") == 0);
        CHECK(close(fd) == 0);
    }
    CHECK(file_is(key, "published"));
    /* STATUS='OLD' before the producer: the read-only retry waits for it */
    pthread_t th;
    CHECK(pthread_create(&th, NULL, publish_later, late) == 0);
    int ro = 0;
    char buf[16];
    fd = gfortran_open(late, 0, &ro);
    CHECK(fd >= 0 && ro);
    CHECK(read_all(fd, buf, sizeof buf) == 5 && strcmp(buf, "later") == 0);
    close(fd);
    pthread_join(th, NULL);
    CHECK(temps_in(mp("fortran")) == 0);
}

/* A key written through a shared writable mapping is published when its fd is closed
 * and the mapping unmapped, whichever comes last: never before its bytes are there. */
static void t_mmap(void)
{
    long pg = sysconf(_SC_PAGESIZE);
    char key[4096];
    snprintf(key, sizeof key, "%s", mp("mmap/a.bin"));
    int fd = open(key, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && ftruncate(fd, 3 * pg) == 0);
    char *p = mmap(NULL, 3 * pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(p != MAP_FAILED);
    errno = 4242;
    CHECK(close(fd) == 0 && errno == 4242);
    CHECK(!exists(key)); /* the mapping still writes it */
    memset(p, 'a', 3 * pg);
    CHECK(munmap(p + pg, pg) == 0); /* a hole: two ranges left */
    CHECK(!exists(key));
    CHECK(munmap(p, pg) == 0 && !exists(key));
    CHECK(munmap(p + 2 * pg, pg) == 0);
    CHECK(exists(key));
    struct stat st;
    CHECK(stat(key, &st) == 0 && st.st_size == 3 * pg);
    int rfd = open(key, O_RDONLY);
    char c = 0;
    CHECK(rfd >= 0 && pread(rfd, &c, 1, 3 * pg - 1) == 1 && c == 'a' && close(rfd) == 0);
    /* unmapped first: the close publishes */
    snprintf(key, sizeof key, "%s", mp("mmap/b.bin"));
    fd = open(key, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && ftruncate(fd, 5) == 0);
    p = mmap(NULL, 5, PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(p != MAP_FAILED);
    memcpy(p, "bytes", 5);
    CHECK(munmap(p, 5) == 0 && !exists(key));
    CHECK(close(fd) == 0 && file_is(key, "bytes"));
    /* a MAP_FIXED mapping made over it unmaps it */
    snprintf(key, sizeof key, "%s", mp("mmap/c.bin"));
    fd = open(key, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && ftruncate(fd, 2 * pg) == 0);
    p = mmap(NULL, 2 * pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(p != MAP_FAILED && close(fd) == 0);
    p[0] = 'c';
    CHECK(mmap(p, 2 * pg, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == p);
    CHECK(exists(key));
    CHECK(munmap(p, 2 * pg) == 0);
    /* read-only and private mappings do not write the key: the close publishes */
    snprintf(key, sizeof key, "%s", mp("mmap/d.bin"));
    fd = open(key, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && wr(fd, "plain"));
    char *r = mmap(NULL, 5, PROT_READ, MAP_SHARED, fd, 0);
    char *q = mmap(NULL, 5, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    CHECK(r != MAP_FAILED && q != MAP_FAILED);
    CHECK(close(fd) == 0 && file_is(key, "plain"));
    CHECK(munmap(r, 5) == 0 && munmap(q, 5) == 0);
    CHECK(temps_in(mp("mmap")) == 0);
}

/* mkstemp & co. under the managed directory write a key like any other. */
static void t_mkstemp(void)
{
    char t[4096];
    struct stat st;
    snprintf(t, sizeof t, "%s", mp("mks/outXXXXXX"));
    errno = 99;
    int fd = mkstemp(t);
    CHECK(fd >= 0 && errno == 99);
    CHECK(strstr(t, "XXXXXX") == NULL && strstr(t, "/mks/out") != NULL);
    CHECK(!exists(t)); /* no empty file under the key */
    CHECK(fstat(fd, &st) == 0 && (st.st_mode & 0777) == 0600);
    CHECK(wr(fd, "made by mkstemp") && close(fd) == 0);
    CHECK(file_is(t, "made by mkstemp"));
    /* mkostemps: a suffix and flags */
    snprintf(t, sizeof t, "%s", mp("mks/dataXXXXXX.bin"));
    fd = mkostemps(t, 4, O_CLOEXEC);
    CHECK(fd >= 0 && strcmp(t + strlen(t) - 4, ".bin") == 0 && strstr(t, "XXXXXX") == NULL);
    CHECK((fcntl(fd, F_GETFD) & FD_CLOEXEC) && wr(fd, "s") && close(fd) == 0);
    CHECK(file_is(t, "s"));
    /* a bad template: EINVAL, as libc */
    snprintf(t, sizeof t, "%s", mp("mks/badXXXX"));
    errno = 0;
    CHECK(mkstemp(t) == -1 && errno == EINVAL);
    /* a suffix that leaves the random part's component ("/", ".."): EINVAL, not another file
     * than the template names (it made directory mks/<random>aaa/ and a key in it) */
    snprintf(t, sizeof t, "%s", mp("mks/aaaaaaaaaa/XXXXXX/../k"));
    errno = 0;
    CHECK(mkstemps(t, 5) == -1 && errno == EINVAL);
    CHECK(strstr(t, "/XXXXXX/") != NULL); /* (left as it was) */
    /* GROMACS's gmx_tmpnam: mkstemp, close, then the name reopened for writing: write-once
     * refuses that (the empty file was published by the close); INSTRIDE_OVERWRITE=1
     * replaces it */
    snprintf(t, sizeof t, "%s", mp("mks/gmxXXXXXX"));
    fd = mkstemp(t);
    CHECK(fd >= 0 && close(fd) == 0 && file_is(t, ""));
    errno = 0;
    FILE *fp = fopen(t, "w");
    if (getenv("INSTRIDE_OVERWRITE") != NULL)
        CHECK(fp != NULL && fputs("replaced", fp) >= 0 && fclose(fp) == 0 &&
              file_is(t, "replaced"));
    else
        CHECK(fp == NULL && errno == EEXIST);
    CHECK(temps_in(mp("mks")) == 0);
    /* outside: libc's own */
    snprintf(t, sizeof t, "%s", op("plainXXXXXX"));
    fd = mkstemp(t);
    CHECK(fd >= 0 && exists(t) && close(fd) == 0);
}

/* Exit with the mapping still there: never published (its temp is left for gc). */
static void t_mmap_exit(void)
{
    int fd = open(mp("mmap/exit.bin"), O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && ftruncate(fd, 4) == 0);
    char *p = mmap(NULL, 4, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(p != MAP_FAILED && close(fd) == 0);
    memcpy(p, "exit", 4);
    CHECK(!exists(mp("mmap/exit.bin")));
}

static void t_unmanaged(void)
{
    const char *f = op("plain/append.txt");
    CHECK(mkdir(op("plain"), 0777) == 0 || errno == EEXIST);
    int fd = open(f, O_WRONLY | O_CREAT | O_APPEND, 0644);
    CHECK(fd >= 0);
    CHECK(exists(f)); /* non-managed files exist at once, under their own name */
    CHECK(wr(fd, "one "));
    CHECK(close(fd) == 0);
    fd = open(f, O_WRONLY | O_APPEND);
    CHECK(fd >= 0 && wr(fd, "two") && close(fd) == 0);
    CHECK(file_is(f, "one two"));
    FILE *fp = fopen(f, "r+");
    CHECK(fp != NULL && fputs("ONE", fp) >= 0 && fclose(fp) == 0);
    CHECK(file_is(f, "ONE two"));
    errno = 0;
    CHECK(open(op("plain/missing"), O_RDONLY) == -1 && errno == ENOENT); /* no wait */
    CHECK(temps_in(op("plain")) == 0);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: calls <scenario> <managed_dir> <outside_dir>\n");
        return 2;
    }
    M = argv[2];
    OUT = argv[3];
    struct {
        const char *name;
        void (*fn)(void);
    } tests[] = {
        {"open", t_open},         {"open64", t_open64},   {"openat", t_openat},
        {"openat64", t_openat64}, {"relative", t_relative}, {"creat", t_creat},
        {"fopen", t_fopen},       {"freopen", t_freopen}, {"dup", t_dup},
        {"rdwr", t_rdwr},         {"rename", t_rename},   {"rename_xdev", t_rename_xdev},
        {"rename_open", t_rename_open},
        {"fork", t_fork},         {"vfork", t_vfork},     {"eexist", t_eexist},   {"refuse", t_refuse},
        {"timeout", t_timeout},   {"unmanaged", t_unmanaged}, {"fortified", t_fortified},
        {"atexit", t_atexit},     {"ifd_closed", t_ifd_closed}, {"fortran", t_fortran},
        {"mmap", t_mmap},         {"mmap_exit", t_mmap_exit}, {"mkstemp", t_mkstemp},
        {"timeout_bad", t_timeout_bad}, {"dup2_eexist", t_dup2_eexist},
        {"rdonly_creat", t_rdonly_creat},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
        if (strcmp(tests[i].name, argv[1]) == 0) {
            tests[i].fn();
            if (failures)
                return 1;
            printf("PASS %s\n", argv[1]);
            return 0;
        }
    }
    fprintf(stderr, "unknown scenario %s\n", argv[1]);
    return 2;
}
