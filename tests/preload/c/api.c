/*
 * api.c -- exercises the C API of include/instride/instride.h (libinstride.so),
 * one scenario per invocation:  api <scenario> <managed_dir> <outside_dir>
 * Run WITHOUT the preload library. Prints "PASS <scenario>" and exits 0, or the
 * failed check and exits 1. INSTRIDE_TIMEOUT is 0.5 s (set by the test).
 */
#define _GNU_SOURCE 1
#include <instride/instride.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *M, *OUT;
static int failures;

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "FAIL %s:%d: %s (errno=%d %s; %s)\n", __FILE__, __LINE__, #cond, \
                    errno, strerror(errno), instride_last_error());                 \
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
    return lstat(p, &st) == 0;
}

static int wr(int fd, const char *s) { return write(fd, s, strlen(s)) == (ssize_t)strlen(s); }

static int file_is(const char *path, const char *want)
{
    char buf[4096];
    FILE *fp = fopen(path, "r");
    if (fp == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, fp);
    fclose(fp);
    buf[n] = '\0';
    return strcmp(buf, want) == 0;
}

static int temps_in(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    if (d == NULL)
        return 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += strstr(e->d_name, ".instride-") != NULL;
    closedir(d);
    return n;
}

/* Produce key with content through the API. */
static int produce(const char *key, const char *content)
{
    instride_writer *w = NULL;
    if (instride_create(mp(key), 0, 0644, &w) != 0)
        return -1;
    if (!wr(instride_writer_fd(w), content)) {
        instride_abort(w);
        return -1;
    }
    return instride_commit(w) == 0 ? 0 : -1;
}

static void t_settings(void)
{
    struct instride_settings s;
    CHECK(instride_settings(&s) == 0);
    char real[4096];
    CHECK(realpath(M, real) != NULL);
    CHECK(strcmp(s.dir, M) == 0 || strcmp(s.dir, real) == 0);
    CHECK(s.timeout > 0.49 && s.timeout < 0.51);
    CHECK(s.cluster == 0 && s.overwrite == 0);
    CHECK(instride_is_key(mp("a/b.bin")) == 1);
    CHECK(instride_is_key(op("x")) == 0);
    CHECK(instride_is_key(mp("a/")) == 0);
    CHECK(instride_is_key(mp(".instride/x")) == 0);
    CHECK(strstr(instride_strerror(ETIMEDOUT), "INSTRIDE_TIMEOUT") != NULL);
}

static void t_produce(void)
{
    instride_writer *w = NULL;
    errno = 0;
    CHECK(instride_create(mp("run/frame_1.bin"), 0, 0640, &w) == 0);
    CHECK(strcmp(instride_writer_key(w), "run/frame_1.bin") == 0);
    CHECK(strstr(instride_writer_path(w), ".instride-") != NULL);
    CHECK(exists(instride_writer_path(w)));
    CHECK(wr(instride_writer_fd(w), "frame one\n"));
    CHECK(!exists(mp("run/frame_1.bin"))); /* not visible before commit */
    CHECK(instride_commit(w) == 0);
    CHECK(file_is(mp("run/frame_1.bin"), "frame one\n"));
    CHECK(temps_in(mp("run")) == 0);
    struct stat st;
    CHECK(stat(mp("run/frame_1.bin"), &st) == 0 && (st.st_mode & 0777) == (0640 & ~022));
    /* write-once */
    CHECK(instride_create(mp("run/frame_1.bin"), 0, 0644, &w) == EEXIST && errno == EEXIST);
    CHECK(strstr(instride_last_error(), "run/frame_1.bin") != NULL);
    /* consume of a published key: at once, its own path */
    char where[4096];
    CHECK(instride_consume(mp("run/frame_1.bin"), where, sizeof where) == 0);
    CHECK(file_is(where, "frame one\n"));
    CHECK(instride_consume(mp("run/frame_1.bin"), where, 4) == ERANGE);
}

static void t_abort(void)
{
    instride_writer *w = NULL;
    CHECK(instride_create(mp("ab/x.bin"), 0, 0644, &w) == 0);
    CHECK(wr(instride_writer_fd(w), "partial"));
    instride_abort(w);
    CHECK(!exists(mp("ab/x.bin")));
    CHECK(temps_in(mp("ab")) == 0);
}

static void t_wait(void)
{
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        struct timespec ts = {0, 150 * 1000 * 1000};
        nanosleep(&ts, NULL);
        _exit(produce("late/k.bin", "late\n") == 0 ? 0 : 1);
    }
    int fd = -1;
    CHECK(!exists(mp("late/k.bin")));
    CHECK(instride_open_read(mp("late/k.bin"), &fd) == 0); /* waits for the child */
    char buf[64] = {0};
    CHECK(read(fd, buf, sizeof buf - 1) == 5 && strcmp(buf, "late\n") == 0);
    close(fd);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static void t_timeout(void)
{
    int fd = -1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CHECK(instride_open_read(mp("never/k.bin"), &fd) == ETIMEDOUT && errno == ETIMEDOUT);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double dt = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    CHECK(dt > 0.4);
    CHECK(strstr(instride_last_error(), "never/k.bin") != NULL);
    CHECK(strstr(instride_last_error(), "not published within INSTRIDE_TIMEOUT") != NULL);
}

static void t_not_key(void)
{
    instride_writer *w = NULL;
    char where[4096];
    CHECK(instride_create(op("x.bin"), 0, 0644, &w) == EINVAL);
    CHECK(strstr(instride_last_error(), "not a key") != NULL);
    CHECK(!exists(op("x.bin")));
    CHECK(instride_consume(op("x.bin"), where, sizeof where) == EINVAL);
    CHECK(instride_create(mp("d/"), 0, 0644, &w) == EINVAL);
    CHECK(instride_create(mp(".instride/x"), 0, 0644, &w) == EINVAL);
}

static void t_publish(void)
{
    const char *src = op("made.bin");
    FILE *fp = fopen(src, "w");
    CHECK(fp != NULL && fputs("made elsewhere\n", fp) >= 0 && fclose(fp) == 0);
    CHECK(instride_publish(src, mp("pub/made.bin"), 0) == 0);
    CHECK(file_is(mp("pub/made.bin"), "made elsewhere\n"));
    CHECK(!exists(src));
    fp = fopen(src, "w");
    CHECK(fp != NULL && fputs("again\n", fp) >= 0 && fclose(fp) == 0);
    CHECK(instride_publish(src, mp("pub/made.bin"), 0) == EEXIST);
    CHECK(exists(src)); /* the source is left in place */
    CHECK(file_is(mp("pub/made.bin"), "made elsewhere\n"));
    CHECK(instride_publish(op("missing.bin"), mp("pub/m.bin"), 0) == ENOENT);
    CHECK(instride_publish(OUT, mp("pub/dir.bin"), 0) == EINVAL); /* not a regular file */
    /* a key published onto itself: nothing to do, as rename(2) of it under the preload
     * library (it was EEXIST) */
    CHECK(instride_publish(mp("pub/made.bin"), mp("pub/made.bin"), 0) == 0);
    CHECK(file_is(mp("pub/made.bin"), "made elsewhere\n"));
}

static void t_overwrite(void) /* run with INSTRIDE_OVERWRITE=1 */
{
    instride_writer *w = NULL;
    CHECK(produce("ow/k.bin", "one") == 0);
    CHECK(produce("ow/k.bin", "two") == 0);
    CHECK(file_is(mp("ow/k.bin"), "two"));
    CHECK(instride_create(mp("ow/k.bin"), INSTRIDE_NOREPLACE, 0644, &w) == EEXIST);
    CHECK(temps_in(mp("ow")) == 0);
}

/* Set up by the test: s/link -> <outside>/elsewhere (holding y), lk -> <outside>/elsewhere/y,
 * adir/ a directory, fifo a FIFO. */
static void t_confine(void)
{
    instride_writer *w = NULL;
    char where[4096];
    int fd = -1;
    CHECK(instride_create(mp("s/link/new.bin"), 0, 0644, &w) == ELOOP);
    CHECK(strstr(instride_last_error(), "symbolic link") != NULL);
    CHECK(!exists(op("elsewhere/new.bin")));
    CHECK(instride_create(mp("s/link/sub/new.bin"), 0, 0644, &w) == ELOOP);
    CHECK(!exists(op("elsewhere/sub")));
    CHECK(instride_create(mp("s/link/../new.bin"), 0, 0644, &w) == ELOOP);
    CHECK(!exists(mp("s/new.bin")) && !exists(op("new.bin")));
    CHECK(instride_consume(mp("s/link/y"), where, sizeof where) == ELOOP);
    CHECK(instride_open_read(mp("lk"), &fd) == ELOOP);
    CHECK(instride_create(mp("lk"), 0, 0644, &w) == ELOOP);
    CHECK(instride_open_read(mp("adir"), &fd) == EISDIR);
    CHECK(instride_create(mp("adir"), 0, 0644, &w) == EISDIR);
    CHECK(instride_open_read(mp("fifo"), &fd) == EINVAL); /* at once, never blocks */
    CHECK(strstr(instride_last_error(), "not a regular file") != NULL);
    const char *src = op("src.bin");
    FILE *fp = fopen(src, "w");
    CHECK(fp != NULL && fputs("x", fp) >= 0 && fclose(fp) == 0);
    CHECK(instride_publish(src, mp("s/link/pub.bin"), 0) == ELOOP);
    CHECK(!exists(op("elsewhere/pub.bin")) && exists(src));
    CHECK(file_is(op("elsewhere/y"), "outside\n")); /* untouched */
}

/* Run with M = <outside>/late/ln/d, none of it existing: the settings are read
 * first, then <outside>/late/ln is made a symbolic link (above the managed
 * directory: the user's choice), then a key is produced and read back. */
static void t_late_link(void)
{
    CHECK(instride_is_key(mp("k/x")) == 1); /* settings read now */
    CHECK(mkdir(op("late"), 0777) == 0 && mkdir(op("late/real"), 0777) == 0);
    CHECK(symlink("real", op("late/ln")) == 0);
    CHECK(produce("k/x", "late link\n") == 0);
    CHECK(file_is(op("late/real/d/k/x"), "late link\n"));
    int fd = -1;
    CHECK(instride_open_read(mp("k/x"), &fd) == 0);
    close(fd);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: api <scenario> <managed_dir> <outside_dir>\n");
        return 2;
    }
    M = argv[2];
    OUT = argv[3];
    struct {
        const char *name;
        void (*fn)(void);
    } tests[] = {
        {"settings", t_settings}, {"produce", t_produce}, {"abort", t_abort},
        {"wait", t_wait},         {"timeout", t_timeout}, {"not_key", t_not_key},
        {"publish", t_publish},   {"overwrite", t_overwrite}, {"confine", t_confine},
        {"late_link", t_late_link},
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
