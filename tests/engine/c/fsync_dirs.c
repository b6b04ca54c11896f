/* fsync_dirs.c -- LD_PRELOAD observer for the tests: every fsync of a directory is reported
 * on stderr ("fsync-dir <path>") and then done by the C library's own fsync. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

int fsync(int fd)
{
    static int (*real)(int);
    if (real == NULL)
        *(void **)&real = dlsym(RTLD_NEXT, "fsync");
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        char link[64], path[PATH_MAX];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, path, sizeof path - 1);
        if (n > 0) {
            path[n] = '\0';
            dprintf(2, "fsync-dir %s\n", path);
        }
    }
    return real(fd);
}
