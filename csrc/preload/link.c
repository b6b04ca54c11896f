/*
 * link.c -- link, linkat, symlink, symlinkat whose new name is under the managed directory.
 *
 * A key appears only by publication: complete at once, write-once checked, recorded in
 * cluster mode. A hard link made there by libc gave a key a name without any of it (other
 * nodes never saw the key), and the key shared its inode with the file linked, which the
 * program may still change in place (or, a stream's frame, which retention rewrites): a
 * published key changing under its readers. So the managed directory is another file system
 * to link(): EXDEV ("Invalid cross-device link"), on which tools that link fall back to a copy
 * and a rename (git, rsync, ...), and that rename publishes. A symbolic link there would be a
 * key every reader refuses (ELOOP) and that blocks the key's publication (EEXIST): EPERM, what
 * a file system without symbolic links answers. instride's own names -- one of its temp files
 * linked as its key, the Python package's publication -- and new names outside the managed
 * directory (also of a key) go to libc unchanged.
 */
#include "instride_preload.h"

/* Is the new name (newdirfd, new) one to refuse: under the managed directory (a key, or a path
 * there too long to confine)? old (olddirfd, flags): the file hard-linked, NULL for a symbolic
 * link; one of instride's own names is libc's. */
static int ins_link_refused(int olddirfd, const char *old, int flags, int newdirfd,
                            const char *new)
{
    struct ins_path p;
    if (ins_busy || new == NULL)
        return 0;
    int saved = errno;
    int kind = ins_classify(newdirfd, new, &p);
    if (kind == INS_MANAGED && old != NULL && !((flags & AT_EMPTY_PATH) && old[0] == '\0') &&
        ins_classify(olddirfd, old, &p) == INS_RESERVED)
        kind = INS_RESERVED;
    errno = saved;
    return kind == INS_MANAGED || kind == INS_TOOLONG;
}

static int ins_fail_link(const char *new)
{
    return ins_fail(EXDEV, "%.300s: a hard link cannot make a key under the managed directory "
                    "(it would appear unpublished, sharing the linked file's bytes): copy the "
                    "file there, or rename it in, to publish it", new);
}

static int ins_fail_symlink(const char *new)
{
    return ins_fail(EPERM, "%.300s: no symbolic link is made under the managed directory (a key "
                    "that is one is refused by every reader)", new);
}

INS_WRAPPER(int, link, (const char *old, const char *new))
{
    INS_MAP_OR_FAIL(link, -1);
    if (ins_link_refused(AT_FDCWD, old, 0, AT_FDCWD, new))
        return ins_fail_link(new);
    return ins_real_link(old, new);
}

INS_WRAPPER(int, linkat, (int olddirfd, const char *old, int newdirfd, const char *new, int flags))
{
    INS_MAP_OR_FAIL(linkat, -1);
    if (ins_link_refused(olddirfd, old, flags, newdirfd, new))
        return ins_fail_link(new);
    return ins_real_linkat(olddirfd, old, newdirfd, new, flags);
}

INS_WRAPPER(int, symlink, (const char *target, const char *new))
{
    INS_MAP_OR_FAIL(symlink, -1);
    if (ins_link_refused(AT_FDCWD, NULL, 0, AT_FDCWD, new))
        return ins_fail_symlink(new);
    return ins_real_symlink(target, new);
}

INS_WRAPPER(int, symlinkat, (const char *target, int newdirfd, const char *new))
{
    INS_MAP_OR_FAIL(symlinkat, -1);
    if (ins_link_refused(AT_FDCWD, NULL, 0, newdirfd, new))
        return ins_fail_symlink(new);
    return ins_real_symlinkat(target, newdirfd, new);
}
