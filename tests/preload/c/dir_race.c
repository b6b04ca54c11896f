/* A producer writing DIR/d<i>/k for i < N while a consumer (INSTRIDE_TIMEOUT=0) tries to open
 * each before it exists: the consumer's failed wait removes the directory it made, maybe
 * while the producer is about to create its file there. Prints the number of failed opens
 * of the role given ("produce" or "consume"). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    int produce = strcmp(argv[1], "produce") == 0, n = atoi(argv[3]), failed = 0;
    char path[4096];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/d%d/k", argv[2], i);
        int fd = produce ? open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644) : open(path, O_RDONLY);
        if (fd < 0) {
            failed++;
            continue;
        }
        if (produce && write(fd, "x", 1) != 1)
            failed++;
        if (close(fd) != 0 && produce)
            failed++;
    }
    printf("%d\n", failed);
    return 0;
}
