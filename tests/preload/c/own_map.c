/* "Map, write, close, rename": the renamer's own shared mapping of the file (its descriptor,
 * opened for writing, closed), then the file renamed to a key under the preload library -- the
 * renamer's own writer, which moves as before (not "open for writing elsewhere"). The kernel
 * counts such a mapping as a writer whatever its protection now.
 * usage: own_map SRC KEY rw|ro|mprotect|rdonly (a writable mapping; a read-only one; a writable
 * one made read-only since -- each through a descriptor opened for writing --; or a read-only
 * one through a read-only descriptor, which is no writer); prints "renamed" or the errno's
 * text. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    int rdonly = strcmp(argv[3], "rdonly") == 0;
    int fd = open(argv[1], rdonly ? O_RDONLY : O_RDWR);
    if (fd < 0)
        return 3;
    int ro = rdonly || strcmp(argv[3], "ro") == 0;
    char *m = mmap(NULL, 5, ro ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
        return 4;
    close(fd);
    if (!ro)
        m[0] = 'X';
    if (strcmp(argv[3], "mprotect") == 0 && mprotect(m, 5, PROT_READ) != 0)
        return 5;
    if (rename(argv[1], argv[2]) == 0)
        printf("renamed\n");
    else
        printf("%s\n", strerror(errno));
    return 0;
}
