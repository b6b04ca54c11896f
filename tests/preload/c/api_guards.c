/*
 * api_guards.c -- the guards of the C API (include/instride/instride.h), one scenario per run:
 *   api_guards fork <managed> <outside>       a forked child's commit/abort of an inherited writer:
 *                                             EPERM / nothing; the parent publishes, whole
 *   api_guards publish_same <managed> <outside>  instride_publish onto the source's own inode
 *                                             through a symbolic link inside the managed dir: ELOOP
 *   api_guards publish_refused <managed> <outside>  (INSTRIDE_TIMEOUT=-1) every publication,
 *                                             also of the key's own file onto itself: EINVAL
 *   api_guards long_name <managed> <outside>  a component over NAME_MAX: ENAMETOOLONG, a message
 * Run WITHOUT the preload library. Prints "PASS <scenario>" and exits 0, or the failed check.
 */
#define _GNU_SOURCE 1
#include <instride/instride.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *M, *OUT;

#define CHECK(cond)                                                                       \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            fprintf(stderr, "FAIL %s:%d: %s (errno=%d %s; %s)\n", __FILE__, __LINE__, #cond, \
                    errno, strerror(errno), instride_last_error());                       \
            return 1;                                                                     \
        }                                                                                 \
    } while (0)

static char *join(const char *dir, const char *name)
{
    static char bufs[8][4096];
    static int i;
    char *b = bufs[i++ % 8];
    snprintf(b, 4096, "%s/%s", dir, name);
    return b;
}

static int exists(const char *p)
{
    struct stat st;
    return lstat(p, &st) == 0;
}

static int content_is(const char *p, const char *want)
{
    char buf[256];
    int fd = open(p, O_RDONLY);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0)
        return 0;
    buf[n] = '\0';
    return strcmp(buf, want) == 0;
}

static int wr(int fd, const char *s) { return write(fd, s, strlen(s)) == (ssize_t)strlen(s); }

/* The child tries both on inherited writers: commit must say EPERM, abort must leave the
 * temp; exit status 0 when each did. */
static int child(instride_writer *a, instride_writer *b)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", instride_writer_path(b));
    int e = instride_commit(a);
    if (e != EPERM || strstr(instride_last_error(), "process") == NULL)
        return 1;
    instride_abort(b);
    return exists(tmp) ? 0 : 2;
}

static int fork_scenario(void)
{
    instride_writer *a, *b;
    CHECK(instride_create(join(M, "fork/a.txt"), 0, 0644, &a) == 0);
    CHECK(instride_create(join(M, "fork/b.txt"), 0, 0644, &b) == 0);
    CHECK(wr(instride_writer_fd(a), "part 1\n") && wr(instride_writer_fd(b), "b\n"));
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0)
        _exit(child(a, b));
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(!exists(join(M, "fork/a.txt")) && !exists(join(M, "fork/b.txt")));
    CHECK(exists(instride_writer_path(b))); /* the child's abort left the parent's temp */
    CHECK(wr(instride_writer_fd(a), "part 2\n"));
    CHECK(instride_commit(a) == 0);
    CHECK(content_is(join(M, "fork/a.txt"), "part 1\npart 2\n"));
    CHECK(instride_commit(b) == 0);
    CHECK(content_is(join(M, "fork/b.txt"), "b\n"));
    return 0;
}

static int publish_same(void)
{
    /* M/link -> OUT: the key M/link/f reaches OUT/f's inode only by following a link */
    CHECK(symlink(OUT, join(M, "link")) == 0);
    int fd = open(join(OUT, "f"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && wr(fd, "x") && close(fd) == 0);
    CHECK(instride_publish(join(OUT, "f"), join(M, "link/f"), 0) == ELOOP);
    CHECK(strstr(instride_last_error(), "link/f") != NULL);
    CHECK(exists(join(OUT, "f"))); /* left where it was */
    /* its own file onto itself (no link): still "nothing to do" */
    instride_writer *w;
    CHECK(instride_create(join(M, "own.txt"), 0, 0644, &w) == 0);
    CHECK(wr(instride_writer_fd(w), "own") && instride_commit(w) == 0);
    CHECK(instride_publish(join(M, "own.txt"), join(M, "own.txt"), 0) == 0);
    CHECK(content_is(join(M, "own.txt"), "own"));
    return 0;
}

static int publish_refused(void)
{
    /* made beforehand by the test (this process refuses every publication) */
    CHECK(instride_publish(join(M, "k"), join(M, "k"), 0) == EINVAL);
    CHECK(strstr(instride_last_error(), "INSTRIDE_TIMEOUT") != NULL);
    return 0;
}

static int long_name(void)
{
    char name[301], key[4096];
    memset(name, 'x', 300);
    name[300] = '\0';
    snprintf(key, sizeof key, "%s/%s", M, name);
    instride_writer *w = NULL;
    CHECK(instride_create(key, 0, 0644, &w) == ENAMETOOLONG);
    CHECK(strstr(instride_last_error(), "xxxxxxxx") != NULL); /* names the key */
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: api_guards <scenario> <managed_dir> <outside_dir>\n");
        return 2;
    }
    M = argv[2];
    OUT = argv[3];
    const char *s = argv[1];
    int rc = strcmp(s, "fork") == 0              ? fork_scenario()
             : strcmp(s, "publish_same") == 0    ? publish_same()
             : strcmp(s, "publish_refused") == 0 ? publish_refused()
             : strcmp(s, "long_name") == 0       ? long_name()
                                                 : 2;
    if (rc == 0)
        printf("PASS %s\n", s);
    return rc;
}
