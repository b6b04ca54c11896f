/* Writes argv[2] to argv[1] through stdio; exits 0 if fclose succeeded, else prints its errno. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    FILE *fp = fopen(argv[1], "w");
    if (fp == NULL) {
        printf("fopen %s\n", strerror(errno));
        return 1;
    }
    fputs(argv[2], fp);
    if (fclose(fp) != 0) {
        printf("fclose %s\n", strerror(errno));
        return 1;
    }
    return 0;
}
