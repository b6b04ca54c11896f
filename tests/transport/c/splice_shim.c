/*
 * splice_shim.c -- an LD_PRELOAD library for tests of the tcp engine's receive loop: counts
 * the splice calls that write into a regular file (splice_into_files, read by the test through
 * ctypes) and, with SPLICE_SHIM_REFUSE=1 in the environment, refuses them with EINVAL, as a
 * file system that cannot take a splice does.
 */
#define _GNU_SOURCE 1
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int splice_into_files;

ssize_t splice(int fd_in, loff_t *off_in, int fd_out, loff_t *off_out, size_t len,
               unsigned int flags)
{
    static ssize_t (*real)(int, loff_t *, int, loff_t *, size_t, unsigned int);
    if (real == NULL)
        real = (ssize_t(*)(int, loff_t *, int, loff_t *, size_t, unsigned int))dlsym(RTLD_NEXT,
                                                                                    "splice");
    struct stat st;
    if (fstat(fd_out, &st) == 0 && S_ISREG(st.st_mode)) {
        __atomic_fetch_add(&splice_into_files, 1, __ATOMIC_RELAXED);
        const char *refuse = getenv("SPLICE_SHIM_REFUSE");
        if (refuse != NULL && strcmp(refuse, "1") == 0) {
            errno = EINVAL;
            return -1;
        }
    }
    return real(fd_in, off_in, fd_out, off_out, len, flags);
}
