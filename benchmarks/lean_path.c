/*
 * lean_path.c -- what a local bounded stream's per-frame path costs in C alone.
 *
 * Not part of instride: a measuring probe for benchmarks/probe_lean_path.py. A writer process
 * and a reader process do, per frame, what instride.Stream(retain=16, layout="paper-soa",
 * groups=[...]) does on one node -- with no Python in the path:
 *
 *   writer: (paced) retire the oldest frame (rename its key back into the pool), take the
 *           next pooled file (exclusive flock), copy the coordinates into its mapping and
 *           hash each chunk while in cache (xxh3), the ids, the header (digest, timestamp),
 *           drop the lock, publish with renameat2(RENAME_NOREPLACE);
 *   reader: wait for the key (inotify, or polling with argv[4] = 1), open it, shared flock,
 *           fstat, map it (mappings kept by inode), copy the coordinates into arrays of its
 *           own while hashing, verify the digest, record the group's position (pwrite),
 *           release. Latency: the writer's start of the frame to the verified copy.
 *
 * Usage: lean_path DIR NFRAMES INTERVAL_US SPIN  -- prints one JSON line {"lat_us": [...]}.
 */
#define _GNU_SOURCE
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NATOMS 23558 /* JAC */
#define HEADER 128
#define PAYLOAD (NATOMS * 28)
#define SIZE (HEADER + PAYLOAD)
#define SLOTS 17 /* retain=16 and the frame being written */
#define CHUNK 4096 /* atoms per hashed chunk (96 KiB of coordinates) */

static const char *dir;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

static void writer(int n, long interval_us) {
    double *pos = malloc((size_t)NATOMS * 24);
    int32_t *ids = malloc((size_t)NATOMS * 4);
    if (pos == NULL || ids == NULL)
        die("malloc");
    for (int a = 0; a < NATOMS; a++) {
        pos[3 * a] = pos[3 * a + 1] = pos[3 * a + 2] = a * 0.01;
        ids[a] = a;
    }
    int fd[SLOTS];
    char *mm[SLOTS], pool[SLOTS][512], key[512];
    for (int s = 0; s < SLOTS; s++) {
        snprintf(pool[s], sizeof pool[s], "%s/.pool-%d", dir, s);
        if ((fd[s] = open(pool[s], O_RDWR | O_CREAT | O_CLOEXEC, 0600)) < 0 || ftruncate(fd[s], SIZE))
            die("pool file");
        mm[s] = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd[s], 0);
        if (mm[s] == MAP_FAILED)
            die("mmap");
    }
    double t0 = now_us();
    for (int i = 0; i < n; i++) {
        double due = t0 + (double)i * interval_us;
        while (now_us() < due - 500) {
            struct timespec ts = {0, (long)((due - now_us() - 500) * 1000)};
            nanosleep(&ts, NULL);
        }
        while (now_us() < due)
            ;
        double start = now_us();
        pos[0] = i;
        if (i >= SLOTS - 1) { /* retire the oldest: its key disappears, its file is pooled */
            int old = i - (SLOTS - 1);
            snprintf(key, sizeof key, "%s/frame_%09d", dir, old);
            if (rename(key, pool[old % SLOTS]) != 0)
                die("retire");
        }
        int s = i % SLOTS;
        if (flock(fd[s], LOCK_EX) != 0) /* (waits for a reader still holding it) */
            die("flock");
        char *p = mm[s] + HEADER;
        XXH3_state_t st;
        XXH3_64bits_reset(&st);
        for (int c = 0; c < NATOMS; c += CHUNK) {
            size_t k = (size_t)((c + CHUNK < NATOMS ? c + CHUNK : NATOMS) - c) * 24;
            memcpy(p + (size_t)c * 24, pos + (size_t)c * 3, k);
            XXH3_64bits_update(&st, p + (size_t)c * 24, k);
        }
        memcpy(p + (size_t)NATOMS * 24, ids, (size_t)NATOMS * 4);
        XXH3_64bits_update(&st, p + (size_t)NATOMS * 24, (size_t)NATOMS * 4);
        uint64_t digest = XXH3_64bits_digest(&st);
        memcpy(mm[s], &digest, 8);
        memcpy(mm[s] + 8, &start, 8);
        flock(fd[s], LOCK_UN);
        snprintf(key, sizeof key, "%s/frame_%09d", dir, i);
        if (renameat2(AT_FDCWD, pool[s], AT_FDCWD, key, RENAME_NOREPLACE) != 0)
            die("publish");
    }
}

static void reader(int n, int spin, double *lat) {
    int in = inotify_init1(IN_CLOEXEC);
    if (in < 0 || inotify_add_watch(in, dir, IN_MOVED_TO) < 0)
        die("inotify");
    char cursor_path[512], key[512], ev[4096];
    snprintf(cursor_path, sizeof cursor_path, "%s/.group", dir);
    int cursor = open(cursor_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    double *xyz = malloc((size_t)NATOMS * 24);
    int32_t *ids = malloc((size_t)NATOMS * 4);
    struct {
        ino_t ino;
        char *mm;
    } maps[SLOTS + 1];
    int nmaps = 0;
    if (cursor < 0 || xyz == NULL || ids == NULL)
        die("reader setup");
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "%s/frame_%09d", dir, i);
        int fd;
        while ((fd = open(key, O_RDONLY | O_CLOEXEC)) < 0) {
            if (errno != ENOENT)
                die("open");
            if (!spin && read(in, ev, sizeof ev) < 0 && errno != EINTR)
                die("inotify read");
        }
        struct stat sb;
        if (flock(fd, LOCK_SH) != 0 || fstat(fd, &sb) != 0)
            die("lease");
        char *m = NULL;
        for (int k = 0; k < nmaps; k++)
            if (maps[k].ino == sb.st_ino)
                m = maps[k].mm;
        if (m == NULL) { /* mapped through a second open: the mapping holds no lock */
            int mfd = open(key, O_RDONLY | O_CLOEXEC);
            m = mmap(NULL, SIZE, PROT_READ, MAP_SHARED | MAP_POPULATE, mfd, 0);
            close(mfd);
            if (m == MAP_FAILED || nmaps > SLOTS)
                die("map");
            maps[nmaps].ino = sb.st_ino;
            maps[nmaps++].mm = m;
        }
        uint64_t digest;
        double start;
        memcpy(&digest, m, 8);
        memcpy(&start, m + 8, 8);
        XXH3_state_t st;
        XXH3_64bits_reset(&st);
        const char *p = m + HEADER;
        for (int c = 0; c < NATOMS; c += CHUNK) {
            size_t k = (size_t)((c + CHUNK < NATOMS ? c + CHUNK : NATOMS) - c) * 24;
            memcpy((char *)xyz + (size_t)c * 24, p + (size_t)c * 24, k);
            XXH3_64bits_update(&st, (char *)xyz + (size_t)c * 24, k);
        }
        memcpy(ids, p + (size_t)NATOMS * 24, (size_t)NATOMS * 4);
        XXH3_64bits_update(&st, ids, (size_t)NATOMS * 4);
        if (XXH3_64bits_digest(&st) != digest || xyz[0] != i) {
            fprintf(stderr, "frame %d: digest or content mismatch\n", i);
            exit(3);
        }
        lat[i] = now_us() - start;
        int64_t done = i + 1;
        if (pwrite(cursor, &done, sizeof done, 0) != sizeof done)
            die("cursor");
        close(fd); /* (releases the lease) */
        if (!spin) { /* events of frames already read: drop them */
            int fl = fcntl(in, F_GETFL);
            fcntl(in, F_SETFL, fl | O_NONBLOCK);
            while (read(in, ev, sizeof ev) > 0)
                ;
            fcntl(in, F_SETFL, fl);
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s DIR NFRAMES INTERVAL_US SPIN\n", argv[0]);
        return 1;
    }
    dir = argv[1];
    int n = atoi(argv[2]);
    long interval = atol(argv[3]);
    int spin = atoi(argv[4]);
    if (n < 1 || interval < 0)
        return 1;
    double *lat = mmap(NULL, (size_t)n * 8, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (lat == MAP_FAILED)
        die("mmap");
    pid_t r = fork();
    if (r == 0) {
        reader(n, spin, lat);
        _exit(0);
    }
    usleep(100000); /* (the reader is waiting) */
    writer(n, interval);
    int status;
    waitpid(r, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return 3;
    printf("{\"lat_us\": [");
    for (int i = 0; i < n; i++)
        printf("%s%.1f", i ? ", " : "", lat[i]);
    printf("]}\n");
    return 0;
}
