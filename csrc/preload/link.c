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
 * directory go to libc unchanged, but for a key hard-linked out: EXDEV (through that name its
 * published bytes could be changed in place, which no open of the key allows).
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

/* Is old (olddirfd, flags) a key hard-linked to a name outside the managed directory (newdirfd,
 * new)? Through that name the program could change the published key's bytes in place, which
 * no open of the key allows. (A key linked to one of instride's own names -- a bounded stream's
 * frame given back to its pool -- is libc's: only a new name outside is refused.) */
static int ins_link_out_refused(int olddirfd, const char *old, int flags, int newdirfd,
                                const char *new)
{
    struct ins_path p;
    if (ins_busy || new == NULL || old == NULL || ((flags & AT_EMPTY_PATH) && old[0] == '\0'))
        return 0;
    int saved = errno;
    struct stat st;
    int out = ins_classify(newdirfd, new, &p) == INS_UNMANAGED &&
              ins_classify(olddirfd, old, &p) == INS_MANAGED &&
              fstatat(olddirfd, old, &st, (flags & AT_SYMLINK_FOLLOW) ? 0 : AT_SYMLINK_NOFOLLOW) ==
                  0 &&
              S_ISREG(st.st_mode);
    errno = saved;
    return out;
}

static int ins_fail_link_out(const char *old)
{
    return ins_fail(EXDEV, "%.300s: a key is not hard-linked out of the managed directory (its "
                    "published bytes could be changed through the new name): copy it", old);
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
    if (ins_link_out_refused(AT_FDCWD, old, 0, AT_FDCWD, new))
        return ins_fail_link_out(old);
    return ins_real_link(old, new);
}

INS_WRAPPER(int, linkat, (int olddirfd, const char *old, int newdirfd, const char *new, int flags))
{
    INS_MAP_OR_FAIL(linkat, -1);
    if (ins_link_refused(olddirfd, old, flags, newdirfd, new))
        return ins_fail_link(new);
    if (ins_link_out_refused(olddirfd, old, flags, newdirfd, new))
        return ins_fail_link_out(old);
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
