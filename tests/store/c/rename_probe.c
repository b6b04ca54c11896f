/*
 * rename_probe.c -- an LD_PRELOAD library that records, for every rename or link of an
 * instride temporary file (".<name>.instride-<pid>-<hex>.tmp"), whether a writer still holds
 * that file locked at that moment: "held <path>" or "free <path>", a line each, appended
 * to the file $RENAME_PROBE_OUT. Then the real call runs. Placed after
 * libinstride_preload.so in LD_PRELOAD, it is the "real" rename that library calls.
 */
#define _GNU_SOURCE 1
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <unistd.h>

static void probe(int dirfd, const char *path)
{
    const char *out = getenv("RENAME_PROBE_OUT");
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (out == NULL || base[0] != '.' || strstr(base, ".instride-") == NULL)
        return;
    int saved = errno;
    /* raw system calls: no wrapper of the instride library may take these for its own */
    int fd = (int)syscall(SYS_openat, dirfd, path, O_RDONLY | O_CLOEXEC);
    const char *state = "gone";
    if (fd >= 0) {
        state = flock(fd, LOCK_EX | LOCK_NB) == 0 ? "free" : "held";
        syscall(SYS_close, fd);
    }
    int o = (int)syscall(SYS_openat, AT_FDCWD, out, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC,
                         0644);
    if (o >= 0) {
        char line[4200];
        int n = snprintf(line, sizeof line, "%s %s\n", state, path);
        if (n > 0 && write(o, line, (size_t)n) < 0)
            n = 0;
        syscall(SYS_close, o);
    }
    errno = saved;
}

int rename(const char *old, const char *new)
{
    probe(AT_FDCWD, old);
    int (*real)(const char *, const char *) = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
    return real(old, new);
}

int renameat(int olddirfd, const char *old, int newdirfd, const char *new)
{
    probe(olddirfd, old);
    int (*real)(int, const char *, int, const char *) =
        (int (*)(int, const char *, int, const char *))dlsym(RTLD_NEXT, "renameat");
    return real(olddirfd, old, newdirfd, new);
}

int renameat2(int olddirfd, const char *old, int newdirfd, const char *new, unsigned int flags)
{
    probe(olddirfd, old);
    int (*real)(int, const char *, int, const char *, unsigned int) =
        (int (*)(int, const char *, int, const char *, unsigned int))dlsym(RTLD_NEXT, "renameat2");
    return real(olddirfd, old, newdirfd, new, flags);
}

int link(const char *old, const char *new)
{
    probe(AT_FDCWD, old);
    int (*real)(const char *, const char *) = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "link");
    return real(old, new);
}

int linkat(int olddirfd, const char *old, int newdirfd, const char *new, int flags)
{
    probe(olddirfd, old);
    int (*real)(int, const char *, int, const char *, int) =
        (int (*)(int, const char *, int, const char *, int))dlsym(RTLD_NEXT, "linkat");
    return real(olddirfd, old, newdirfd, new, flags);
}
