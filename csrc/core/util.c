/*
 * util.c -- monotonic clock and deadlines, random temp-name suffixes, mkdir -p, descriptors
 * of our own out of the application's way.
 */
#include "ins_core.h"

#include <fcntl.h>
#include <math.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* The lowest number for a descriptor the library keeps: half the soft limit, at most 1024
 * (an application that closes 0 and opens expects to get 0 back, not to find ours there). */
static int ins_high_fd(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return 1024;
    rlim_t half = rl.rlim_cur / 2;
    return half > 1024 ? 1024 : (int)half;
}

int ins_dup_high(int fd)
{
    /* the raw system call: no wrapper of ours (fcntl's F_DUPFD) may count it as a file */
    int saved = errno;
    int high = (int)syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, ins_high_fd());
    if (high < 0) /* (no room up there: the lowest free number, as before) */
        high = (int)syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 0);
    errno = saved;
    return high;
}

int ins_move_high(int fd)
{
    int high = ins_dup_high(fd);
    if (high < 0)
        return fd;
    int saved = errno;
    ins_sys.close(fd);
    errno = saved;
    return high;
}

double ins_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int ins_remaining_ms(double deadline)
{
    if (deadline < 0)
        return -1;
    double left = deadline - ins_now();
    if (left <= 0)
        return 0;
    double ms = ceil(left * 1000.0);
    return ms > 2e9 ? 2000000000 : (int)ms;
}

uint64_t ins_random64(void)
{
    uint64_t x = 0;
    if (getrandom(&x, sizeof x, GRND_NONBLOCK) == (ssize_t)sizeof x)
        return x;
    static atomic_uint_fast64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ ((uint64_t)getpid() << 16) ^
        atomic_fetch_add(&counter, 0x9e3779b97f4a7c15ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

/* The mode of a directory made at path: the managed directory itself is private (0700,
 * as instride/store/dirs.py makes it), the others the usual 0777 less the umask. */
static mode_t ins_dir_mode(const char *path)
{
    size_t len;
    const char *root = ins_root(&len);
    if (strcmp(path, root) == 0 || (ins_cfg.dir_len > 0 && strcmp(path, ins_cfg.dir) == 0))
        return 0700;
    return 0777;
}

int ins_mkdir_p(char *buf)
{
    if (mkdir(buf, ins_dir_mode(buf)) == 0 || errno == EEXIST)
        return 0;
    if (errno != ENOENT)
        return -1;
    for (char *s = buf + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        int rc = mkdir(buf, ins_dir_mode(buf));
        *s = '/';
        if (rc != 0 && errno != EEXIST)
            return -1;
    }
    if (mkdir(buf, ins_dir_mode(buf)) != 0 && errno != EEXIST)
        return -1;
    return 0;
}
