/* Links and truncate under the managed directory; argv[1]: the managed directory, argv[2]: a
 * directory outside it, argv[3]: the case. Prints "ok" or what went wrong.
 *
 * A published key exists (argv[1]/pub/k.txt, "published", made by the test) and a file
 * outside (argv[2]/src.txt, "outside").
 *
 * link / linkat: a hard link of the file outside made as a key: libc gave the key a name
 *   without publication (no write-once check, no record in cluster mode) sharing its inode
 *   with the file outside, which the program then changed -- the "published" key with it.
 *   Refused with EXDEV, the key never there.
 * linkkey: a hard link of a published key to another key (a stream's frame is rewritten in
 *   place by retention): EXDEV too.
 * symlink / symlinkat: a symbolic link made as a key (refused with ELOOP by every reader, and
 *   blocking the key's publication): EPERM.
 * outside: links whose new name is outside the managed directory are libc's (a symbolic one
 *   also of a key); a hard link of a key to a name outside is EXDEV (through that name the
 *   program could change the published bytes in place: `echo x >> alias`).
 * truncate: truncate() of a published key emptied it in place, under its readers: EPERM,
 *   the bytes unchanged (also for a key not published yet, as a write open in place).
 * ftruncate: an fd of a published key is read-only (a write open in place is refused), so
 *   ftruncate cannot change it either. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *dir, *outside;

static char *in_dir(const char *base, const char *name)
{
    static char bufs[8][4096];
    static int i;
    char *b = bufs[i++ % 8];
    snprintf(b, 4096, "%s/%s", base, name);
    return b;
}

static int missing(const char *p)
{
    struct stat st;
    return lstat(p, &st) != 0 && errno == ENOENT;
}

/* The published key still holds exactly "published". */
static int key_intact(void)
{
    char buf[64] = {0};
    int fd = open(in_dir(dir, "pub/k.txt"), O_RDONLY);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    return n == 9 && memcmp(buf, "published", 9) == 0;
}

#define FAIL(...) return printf(__VA_ARGS__), 1

/* A call expected to fail with err, leaving no name at p. errno is restored after a success. */
static int refused(int rc, int err, const char *what, const char *p)
{
    if (rc == 0)
        FAIL("%s succeeded (expected errno %d)\n", what, err);
    if (errno != err)
        FAIL("%s: errno %d %s (expected %d)\n", what, errno, strerror(errno), err);
    if (!missing(p))
        FAIL("%s: %s exists\n", what, p);
    return 0;
}

static int t_link(int at)
{
    const char *src = in_dir(outside, "src.txt"), *key = in_dir(dir, "l/k.txt");
    int rc = at ? linkat(AT_FDCWD, src, AT_FDCWD, key, 0) : link(src, key);
    if (refused(rc, EXDEV, at ? "linkat" : "link", key))
        return 1;
    /* relative to a directory fd of the managed directory, following a symbolic link */
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd < 0)
        FAIL("open dir: %s\n", strerror(errno));
    rc = linkat(AT_FDCWD, src, dfd, "l2.txt", AT_SYMLINK_FOLLOW);
    close(dfd);
    if (refused(rc, EXDEV, "linkat(dirfd)", in_dir(dir, "l2.txt")))
        return 1;
    /* the program goes on to change its file: no key changes with it */
    int fd = open(src, O_WRONLY | O_TRUNC);
    if (fd < 0 || write(fd, "changed", 7) != 7 || close(fd) != 0)
        FAIL("rewrite outside: %s\n", strerror(errno));
    if (!missing(key))
        FAIL("a key appeared\n");
    return printf("ok\n"), 0;
}

static int t_linkkey(void)
{
    const char *key = in_dir(dir, "pub/k.txt"), *other = in_dir(dir, "pub/other.txt");
    if (refused(link(key, other), EXDEV, "link of a key", other))
        return 1;
    if (!key_intact())
        FAIL("the published key changed\n");
    return printf("ok\n"), 0;
}

static int t_symlink(int at)
{
    const char *key = in_dir(dir, "s/k.txt");
    int rc = at ? symlinkat(in_dir(outside, "src.txt"), AT_FDCWD, key)
                : symlink(in_dir(outside, "src.txt"), key);
    if (refused(rc, EPERM, at ? "symlinkat" : "symlink", key))
        return 1;
    /* a link to a directory elsewhere, as a directory of keys: the same */
    if (refused(symlink(outside, in_dir(dir, "sdir")), EPERM, "symlink (dir)", in_dir(dir, "sdir")))
        return 1;
    return printf("ok\n"), 0;
}

static int t_outside(void)
{
    const char *key = in_dir(dir, "pub/k.txt");
    errno = 0;
    if (link(in_dir(outside, "src.txt"), in_dir(outside, "hard.txt")) != 0 ||
        symlink(key, in_dir(outside, "soft.txt")) != 0)
        FAIL("a link outside failed: %s\n", strerror(errno));
    if (errno != 0)
        FAIL("errno changed by calls that succeeded: %d\n", errno);
    if (linkat(AT_FDCWD, key, AT_FDCWD, in_dir(outside, "alias.txt"), 0) == 0 ||
        link(key, in_dir(outside, "alias.txt")) == 0)
        FAIL("a key hard-linked out of the managed directory\n");
    if (errno != EXDEV)
        FAIL("a key hard-linked out: errno %d %s (expected EXDEV)\n", errno, strerror(errno));
    if (access(in_dir(outside, "alias.txt"), F_OK) == 0)
        FAIL("the key's alias outside exists\n");
    return printf("ok\n"), 0;
}

static int t_truncate(void)
{
    const char *key = in_dir(dir, "pub/k.txt");
    errno = 0;
    if (truncate(key, 0) == 0)
        FAIL("truncate of a published key succeeded\n");
    if (errno != EPERM)
        FAIL("truncate: errno %d %s (expected EPERM)\n", errno, strerror(errno));
    if (!key_intact())
        FAIL("the published key changed\n");
    /* a key not published yet, and one this process is writing: the same */
    if (truncate(in_dir(dir, "pub/later.txt"), 4) == 0 || errno != EPERM)
        FAIL("truncate of a key not published: errno %d (expected EPERM)\n", errno);
    int fd = open(in_dir(dir, "pub/w.txt"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, "abcdef", 6) != 6)
        FAIL("write open: %s\n", strerror(errno));
    if (truncate(in_dir(dir, "pub/w.txt"), 2) == 0 || errno != EPERM)
        FAIL("truncate of a key being written: errno %d (expected EPERM)\n", errno);
    /* ftruncate of the open file: the program's own temp, as always */
    if (ftruncate(fd, 3) != 0 || close(fd) != 0)
        FAIL("ftruncate/close of a key being written: %s\n", strerror(errno));
    /* outside: libc's */
    errno = 0;
    if (truncate(in_dir(outside, "src.txt"), 3) != 0 || errno != 0)
        FAIL("truncate outside: %s\n", strerror(errno));
    return printf("ok\n"), 0;
}

static int t_ftruncate(void)
{
    int fd = open(in_dir(dir, "pub/k.txt"), O_RDONLY);
    if (fd < 0)
        FAIL("read open: %s\n", strerror(errno));
    if (ftruncate(fd, 0) == 0)
        FAIL("ftruncate of a read-only fd succeeded\n");
    close(fd);
    if (open(in_dir(dir, "pub/k.txt"), O_WRONLY) >= 0 || errno != EPERM)
        FAIL("a write open in place was not refused (errno %d)\n", errno);
    if (!key_intact())
        FAIL("the published key changed\n");
    return printf("ok\n"), 0;
}

int main(int argc, char **argv)
{
    if (argc != 4)
        return fprintf(stderr, "usage: links <managed dir> <outside dir> <case>\n"), 2;
    dir = argv[1];
    outside = argv[2];
    const char *c = argv[3];
    if (!strcmp(c, "link"))
        return t_link(0);
    if (!strcmp(c, "linkat"))
        return t_link(1);
    if (!strcmp(c, "linkkey"))
        return t_linkkey();
    if (!strcmp(c, "symlink"))
        return t_symlink(0);
    if (!strcmp(c, "symlinkat"))
        return t_symlink(1);
    if (!strcmp(c, "outside"))
        return t_outside();
    if (!strcmp(c, "truncate"))
        return t_truncate();
    if (!strcmp(c, "ftruncate"))
        return t_ftruncate();
    return fprintf(stderr, "unknown case %s\n", c), 2;
}
