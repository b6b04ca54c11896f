/* Keys written and closed with close_range while another thread opens and closes files: the
 * other thread's open may get the number close_range just freed. Prints the keys of the N
 * (argv[2]) written under argv[1] that were not published. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static atomic_int stop;

static void *churn(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop)) {
        int fd = open("/dev/null", O_RDONLY);
        if (fd >= 0)
            close(fd);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    int n = atoi(argv[2]), lost = 0;
    pthread_t t;
    pthread_create(&t, NULL, churn, NULL);
    char path[4096];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/cr%d", argv[1], i);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || write(fd, "x", 1) != 1 || close_range((unsigned)fd, (unsigned)fd, 0) != 0)
            return 1;
    }
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/cr%d", argv[1], i);
        if (access(path, F_OK) != 0)
            lost++;
    }
    printf("%d\n", lost);
    return 0;
}
