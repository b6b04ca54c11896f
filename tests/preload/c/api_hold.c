/*
 * api_hold.c -- the C API's instride_open_read holding what it opened:
 *     api_hold <path of a key under the managed directory>
 * Run WITHOUT the preload library. Opens the key with instride_open_read, reads it
 * whole, prints "read", waits for a line on stdin, reads it again from the start and
 * prints "same" or "changed". Exits 1 (and says why) when the open fails.
 */
#define _GNU_SOURCE 1
#include <instride/instride.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static size_t slurp(int fd, char *buf, size_t cap)
{
    size_t n = 0;
    ssize_t got;
    while (n < cap && (got = pread(fd, buf + n, cap - n, (off_t)n)) > 0)
        n += (size_t)got;
    return n;
}

int main(int argc, char **argv)
{
    enum { CAP = 1 << 22 };
    int fd = -1;
    if (argc != 2) {
        fprintf(stderr, "usage: api_hold <path>\n");
        return 2;
    }
    if (instride_open_read(argv[1], &fd) != 0) {
        fprintf(stderr, "instride_open_read: %s\n", instride_last_error());
        return 1;
    }
    char *first = malloc(CAP), *again = malloc(CAP);
    char line[64];
    if (first == NULL || again == NULL)
        return 1;
    size_t n = slurp(fd, first, CAP);
    printf("read\n");
    fflush(stdout);
    if (fgets(line, sizeof line, stdin) == NULL)
        return 1;
    size_t m = slurp(fd, again, CAP);
    printf("%s\n", n > 0 && m == n && memcmp(first, again, n) == 0 ? "same" : "changed");
    free(first);
    free(again);
    close(fd);
    return 0;
}
