/* A preloaded library whose fsync always fails with EIO (a disk's write-back error): loaded
 * before the instride shim, it stands in for libc's. */
#define _GNU_SOURCE
#include <errno.h>
#include <unistd.h>

int fsync(int fd)
{
    (void)fd;
    errno = EIO;
    return -1;
}
