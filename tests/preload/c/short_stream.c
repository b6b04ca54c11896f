/* A stream whose buffered bytes cannot reach its file when it is closed: nothing of it may be
 * published under its key.
 *
 *   short_stream KEY fclose-eintr   fwrite, then every write(2) of the file fails with EINTR
 *                                   (an interrupted NFS/FUSE write; seccomp), then fclose
 *   short_stream KEY freopen-efbig  fwrite past RLIMIT_FSIZE (1000 bytes), then freopen onto
 *                                   another file (/dev/null)
 *
 * Prints what the call returned ("fclose -1 Interrupted system call", "freopen NULL ...")
 * and whether KEY exists ("published N" or "absent"). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static char buf[3000];

static void fail_writes_of(int fd)
{
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_write, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)fd, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EINTR),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        perror("seccomp");
        _exit(2);
    }
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    memset(buf, 'A', sizeof buf);
    if (strcmp(argv[2], "freopen-efbig") == 0) {
        signal(SIGXFSZ, SIG_IGN);
        struct rlimit rl = {1000, 1000};
        setrlimit(RLIMIT_FSIZE, &rl);
    }
    FILE *fp = fopen(argv[1], "w");
    if (fp == NULL) {
        perror("fopen");
        return 2;
    }
    fwrite(buf, 1, sizeof buf, fp); /* (most of it still buffered) */
    if (strcmp(argv[2], "fclose-eintr") == 0) {
        fail_writes_of(fileno(fp));
        errno = 0;
        int rc = fclose(fp);
        printf("fclose %d %s\n", rc, strerror(errno));
    } else {
        errno = 0;
        FILE *r = freopen("/dev/null", "w", fp);
        printf("freopen %s %s\n", r == NULL ? "NULL" : "ok", strerror(errno));
    }
    struct stat st;
    if (stat(argv[1], &st) == 0)
        printf("published %lld\n", (long long)st.st_size);
    else
        printf("absent\n");
    return 0;
}
