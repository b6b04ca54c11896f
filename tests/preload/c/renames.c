/* Renames of directories, and RENAME_EXCHANGE, under the managed directory; argv[1]: the
 * managed directory, argv[2]: a directory outside it, argv[3]: the case. Prints "ok" or what
 * went wrong.
 *
 * Made by the test: a published key argv[1]/pub/k.txt ("published") and argv[1]/pub/k2.txt
 * ("second"), argv[2]/res/f.txt ("result") with argv[2]/res/sub/g.txt, the empty directory
 * argv[2]/empty, and argv[2]/src.txt ("outside") with argv[2]/other.txt ("other"); for the case
 * "root" only the outside ones (the managed directory is empty).
 *
 * dir: a directory renamed to under the managed directory (from outside, or from a name there
 *   to another) went to libc: its files appeared as keys without publication (no record in
 *   cluster mode, no write-once check), or the keys changed names without their records.
 *   EXDEV (the managed directory is another file system to it: mv and shutil.move then copy
 *   the tree file by file, which publishes each file), nothing moved -- also with a trailing
 *   slash, through directory fds, with RENAME_NOREPLACE, and for an empty directory. A
 *   directory renamed onto itself, or outside the managed directory, stays libc's.
 * root: a directory renamed over the (empty) managed directory itself replaced it: EXDEV too.
 * exchange: renameat2(RENAME_EXCHANGE) swapped a published key's file with another file (its
 *   bytes replaced, no write-once check, no record): EINVAL when either name is under the
 *   managed directory (what a file system that cannot exchange answers), both untouched; an
 *   exchange outside stays libc's.
 * whiteout: renameat2(RENAME_WHITEOUT) (ext4, tmpfs, with CAP_MKNOD) went to libc: a file
 *   renamed over a published key replaced it (no write-once check, no record), and a key
 *   renamed away left a whiteout (a character device) as the key, which every reader refuses.
 *   EINVAL when either name is under the managed directory (what a file system without
 *   whiteouts answers), both untouched. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif
#ifndef RENAME_WHITEOUT
#define RENAME_WHITEOUT (1 << 2)
#endif

static const char *dir, *outside;

/* base/name, kept to the end (a small test program: never freed). */
static char *in_dir(const char *base, const char *name)
{
    char *b = malloc(strlen(base) + strlen(name) + 2);
    if (b == NULL)
        exit(3);
    sprintf(b, "%s/%s", base, name);
    return b;
}

static int missing(const char *p)
{
    struct stat st;
    return lstat(p, &st) != 0 && errno == ENOENT;
}

/* The file p holds exactly want. */
static int holds(const char *p, const char *want)
{
    char buf[64] = {0};
    int fd = open(p, O_RDONLY);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    return n == (ssize_t)strlen(want) && memcmp(buf, want, (size_t)n) == 0;
}

#define FAIL(...) return printf(__VA_ARGS__), 1

/* A rename expected to fail with err, leaving no name at p (NULL: not checked). */
static int refused(int rc, int err, const char *what, const char *p)
{
    if (rc == 0)
        FAIL("%s succeeded (expected errno %d)\n", what, err);
    if (errno != err)
        FAIL("%s: errno %d %s (expected %d)\n", what, errno, strerror(errno), err);
    if (p != NULL && !missing(p))
        FAIL("%s: %s exists\n", what, p);
    return 0;
}

/* Nothing moved: the tree outside and the published keys are all still there. */
static int intact(const char *what)
{
    if (!holds(in_dir(outside, "res/f.txt"), "result") ||
        !holds(in_dir(outside, "res/sub/g.txt"), "sub"))
        FAIL("%s: the directory outside changed\n", what);
    if (!holds(in_dir(dir, "pub/k.txt"), "published") || !holds(in_dir(dir, "pub/k2.txt"), "second"))
        FAIL("%s: a published key changed\n", what);
    return 0;
}

static int t_dir(void)
{
    const char *res = in_dir(outside, "res"), *to = in_dir(dir, "res");
    if (refused(rename(res, to), EXDEV, "rename(dir in)", to) || intact("rename(dir in)"))
        return 1;
    char slash[4096];
    snprintf(slash, sizeof slash, "%s/", to); /* (the kernel renames a directory to "new/") */
    if (refused(rename(res, slash), EXDEV, "rename(dir in, slash)", to) || intact("slash"))
        return 1;
    if (refused(renameat2(AT_FDCWD, res, AT_FDCWD, to, RENAME_NOREPLACE), EXDEV,
                "renameat2(dir in, NOREPLACE)", to) || intact("renameat2"))
        return 1;
    int ofd = open(outside, O_RDONLY | O_DIRECTORY), dfd = open(dir, O_PATH | O_DIRECTORY);
    if (ofd < 0 || dfd < 0)
        FAIL("open dirs: %s\n", strerror(errno));
    if (refused(renameat(ofd, "res", dfd, "res"), EXDEV, "renameat(dir fds)", to) ||
        intact("renameat"))
        return 1;
    close(ofd);
    close(dfd);
    const char *empty = in_dir(outside, "empty"), *eto = in_dir(dir, "e");
    if (refused(rename(empty, eto), EXDEV, "rename(empty dir in)", eto) || missing(empty))
        FAIL("rename(empty dir in): refused, and the directory still there expected\n");
    /* within: keys would change names without their records */
    const char *pub = in_dir(dir, "pub"), *moved = in_dir(dir, "moved");
    if (refused(rename(pub, moved), EXDEV, "rename(dir within)", moved) || intact("within"))
        return 1;
    if (refused(rename(pub, in_dir(dir, "pub/../deeper/")), EXDEV, "rename(dir within, ..)",
                in_dir(dir, "deeper")))
        return 1;
    if (rename(pub, pub) != 0) /* onto itself: nothing to do (POSIX) */
        FAIL("rename(dir, itself): %s\n", strerror(errno));
    /* outside the managed directory: libc's */
    const char *res2 = in_dir(outside, "res2");
    if (rename(res, res2) != 0 || rename(res2, res) != 0)
        FAIL("rename(dir outside): %s\n", strerror(errno));
    return intact("outside");
}

static int t_root(void)
{
    const char *res = in_dir(outside, "res");
    if (refused(rename(res, dir), EXDEV, "rename(dir, managed dir)", NULL))
        return 1;
    char slash[4096];
    snprintf(slash, sizeof slash, "%s/", dir);
    if (refused(rename(res, slash), EXDEV, "rename(dir, managed dir/)", NULL))
        return 1;
    if (!holds(in_dir(outside, "res/f.txt"), "result") || !missing(in_dir(dir, "f.txt")))
        FAIL("rename(dir, managed dir): the directory moved\n");
    return 0;
}

static int t_exchange(void)
{
    const char *src = in_dir(outside, "src.txt"), *key = in_dir(dir, "pub/k.txt");
    struct {
        const char *a, *b, *what;
    } cases[] = {
        {src, key, "exchange(outside file, key)"},
        {key, src, "exchange(key, outside file)"},
        {key, in_dir(dir, "pub/k2.txt"), "exchange(key, key)"},
        {in_dir(outside, "res"), in_dir(dir, "pub"), "exchange(dir outside, dir inside)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (refused(renameat2(AT_FDCWD, cases[i].a, AT_FDCWD, cases[i].b, RENAME_EXCHANGE),
                    EINVAL, cases[i].what, NULL) ||
            intact(cases[i].what))
            return 1;
        if (!holds(src, "outside"))
            FAIL("%s: the file outside changed\n", cases[i].what);
    }
    const char *other = in_dir(outside, "other.txt");
    if (renameat2(AT_FDCWD, src, AT_FDCWD, other, RENAME_EXCHANGE) != 0)
        FAIL("exchange outside: %s\n", strerror(errno));
    if (!holds(src, "other") || !holds(other, "outside"))
        FAIL("exchange outside: not swapped\n");
    return 0;
}

static int t_whiteout(void)
{
    const char *src = in_dir(outside, "src.txt"), *key = in_dir(dir, "pub/k.txt");
    struct {
        const char *a, *b;
        unsigned int flags;
        const char *what;
    } cases[] = {
        {src, key, RENAME_WHITEOUT, "whiteout(outside file, key)"},
        {src, in_dir(dir, "pub/new.txt"), RENAME_WHITEOUT, "whiteout(outside file, new key)"},
        {src, key, RENAME_WHITEOUT | RENAME_NOREPLACE, "whiteout|noreplace(outside, key)"},
        {key, in_dir(outside, "taken.txt"), RENAME_WHITEOUT, "whiteout(key, outside)"},
        {key, in_dir(dir, "pub/k3.txt"), RENAME_WHITEOUT, "whiteout(key, key)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (refused(renameat2(AT_FDCWD, cases[i].a, AT_FDCWD, cases[i].b, cases[i].flags),
                    EINVAL, cases[i].what, NULL) ||
            intact(cases[i].what))
            return 1;
        if (!holds(src, "outside") || !missing(in_dir(dir, "pub/new.txt")) ||
            !missing(in_dir(dir, "pub/k3.txt")) || !missing(in_dir(outside, "taken.txt")))
            FAIL("%s: a file moved\n", cases[i].what);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 4)
        return fprintf(stderr, "usage: renames <managed dir> <outside dir> <case>\n"), 2;
    dir = argv[1];
    outside = argv[2];
    const char *c = argv[3];
    int rc;
    if (!strcmp(c, "dir"))
        rc = t_dir();
    else if (!strcmp(c, "root"))
        rc = t_root();
    else if (!strcmp(c, "exchange"))
        rc = t_exchange();
    else if (!strcmp(c, "whiteout"))
        rc = t_whiteout();
    else
        return fprintf(stderr, "unknown case %s\n", c), 2;
    if (rc == 0)
        printf("ok\n");
    return rc;
}
