/*
 * no_links.c -- an LD_PRELOAD library that makes the file system look like one with neither
 * hard links nor renameat2(RENAME_NOREPLACE) (as some FUSE file systems are): link and
 * linkat fail with EPERM, renameat2 with RENAME_NOREPLACE fails with EINVAL. Everything
 * else runs as usual. Placed after libinstride_preload.so in LD_PRELOAD.
 */
#define _GNU_SOURCE 1
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>

int link(const char *old, const char *new)
{
    (void)old;
    (void)new;
    errno = EPERM;
    return -1;
}

int linkat(int olddirfd, const char *old, int newdirfd, const char *new, int flags)
{
    (void)olddirfd;
    (void)old;
    (void)newdirfd;
    (void)new;
    (void)flags;
    errno = EPERM;
    return -1;
}

int renameat2(int olddirfd, const char *old, int newdirfd, const char *new, unsigned int flags)
{
    if (flags & RENAME_NOREPLACE) {
        errno = EINVAL;
        return -1;
    }
    int (*real)(int, const char *, int, const char *, unsigned int) =
        (int (*)(int, const char *, int, const char *, unsigned int))dlsym(RTLD_NEXT, "renameat2");
    return real(olddirfd, old, newdirfd, new, flags);
}
