/* A key open for writing; the main loop dups and closes it while a SIGALRM handler, every
 * millisecond, does dup2 (async-signal-safe): the handler must never wait for a lock its own
 * thread holds. Prints "done" and publishes the key: argv[1]. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

static int nullfd = -1;

static void on_alarm(int sig)
{
    (void)sig;
    dup2(nullfd, 100);
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    nullfd = open("/dev/null", O_WRONLY);
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || nullfd < 0)
        return 1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval every = {{0, 1000}, {0, 1000}};
    setitimer(ITIMER_REAL, &every, NULL);
    for (int i = 0; i < 300000; i++) {
        int d = dup(fd);
        if (d >= 0)
            close(d);
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    if (write(fd, "x", 1) != 1 || close(fd) != 0)
        return 1;
    puts("done");
    return 0;
}
