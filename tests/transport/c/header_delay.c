/*
 * header_delay.c -- an LD_PRELOAD library for a data server under test: a recv that returns
 * bytes of a request for a key holding "slowpoke" (the first time) creates the file
 * $HEADER_DELAY_MARK and sleeps 2 s before it returns, as a thread preempted just after
 * reading a request would: the window between the read of a connection's first request and
 * the moment the server counts the connection as served, widened.
 */
#define _GNU_SOURCE 1
#include <dlfcn.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static atomic_int done;

ssize_t recv(int fd, void *buf, size_t len, int flags)
{
    static ssize_t (*real)(int, void *, size_t, int);
    if (real == NULL)
        real = (ssize_t (*)(int, void *, size_t, int))dlsym(RTLD_NEXT, "recv");
    ssize_t n = real(fd, buf, len, flags);
    const char *mark = getenv("HEADER_DELAY_MARK");
    if (n > 0 && mark != NULL && (flags & MSG_PEEK) == 0 &&
        memmem(buf, (size_t)n, "slowpoke", 8) != NULL && memmem(buf, (size_t)n, "\"mac\"", 5) &&
        atomic_exchange(&done, 1) == 0) {
        int m = open(mark, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (m >= 0)
            close(m);
        usleep(2000000);
    }
    return n;
}
