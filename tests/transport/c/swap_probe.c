/*
 * swap_probe.c -- an LD_PRELOAD library for a data server under test: the first time the
 * server takes a shared lock on the file named $SWAP_PROBE_PATH, the name is first given to
 * another file (the locked one renamed to "<path>.retired", a new file with the bytes "new"
 * made under the name), as a stream's producer retiring a frame and publishing another under
 * that key would between the server's open and its lock. Then the real flock runs. The marker
 * file "<path>.swapped" says it happened (once).
 */
#define _GNU_SOURCE 1
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

int flock(int fd, int op)
{
    static int (*real)(int, int);
    if (real == NULL)
        real = (int (*)(int, int))dlsym(RTLD_NEXT, "flock");
    const char *want = getenv("SWAP_PROBE_PATH");
    if (want != NULL && (op & LOCK_SH) != 0) {
        char link[64], path[PATH_MAX], aside[PATH_MAX + 16], marker[PATH_MAX + 16];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, path, sizeof path - 1);
        snprintf(marker, sizeof marker, "%s.swapped", want);
        if (n > 0) {
            path[n] = '\0';
            if (strcmp(path, want) == 0 && access(marker, F_OK) != 0) {
                snprintf(aside, sizeof aside, "%s.retired", want);
                rename(want, aside);
                int out = open(want, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
                if (out >= 0) {
                    if (write(out, "new", 3) != 3)
                        unlink(want);
                    close(out);
                }
                close(open(marker, O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
            }
        }
    }
    return real(fd, op);
}
