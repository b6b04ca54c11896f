/* "Map, write, close, rename": the renamer's own shared writable mapping of the file (its
 * descriptor closed), then the file renamed to a key under the preload library -- the
 * renamer's own writer, which moves as before (not "open for writing elsewhere").
 * usage: own_map SRC KEY; prints "renamed" or the errno's text. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    int fd = open(argv[1], O_RDWR);
    if (fd < 0)
        return 3;
    char *m = mmap(NULL, 5, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
        return 4;
    close(fd);
    m[0] = 'X';
    if (rename(argv[1], argv[2]) == 0)
        printf("renamed\n");
    else
        printf("%s\n", strerror(errno));
    return 0;
}
