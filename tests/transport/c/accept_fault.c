/*
 * accept_fault.c -- an LD_PRELOAD library for a data server under test: the first connection
 * accepted on a TCP listening socket is closed at once and accept4 fails with EPROTO instead,
 * as it does for a connection that had a network error before it was accepted (accept(2):
 * such errors are to be treated like EAGAIN, by accepting again). Other sockets (the node's
 * unix socket) are left alone.
 */
#define _GNU_SOURCE 1
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <unistd.h>

static atomic_int failed;

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags)
{
    static int (*real)(int, struct sockaddr *, socklen_t *, int);
    if (real == NULL)
        real = (int (*)(int, struct sockaddr *, socklen_t *, int))dlsym(RTLD_NEXT, "accept4");
    int got = real(fd, addr, len, flags);
    struct sockaddr_storage own;
    socklen_t own_len = sizeof own;
    if (got >= 0 && getsockname(fd, (struct sockaddr *)&own, &own_len) == 0 &&
        (own.ss_family == AF_INET || own.ss_family == AF_INET6) &&
        atomic_exchange(&failed, 1) == 0) {
        close(got);
        errno = EPROTO;
        return -1;
    }
    return got;
}
