/*
 * path.c -- lexical path helpers: absolute paths, normalization, prefixes,
 * instride's reserved names. No instride state.
 */
#include "ins_core.h"

#include <string.h>

int ins_normalize(char *p)
{
    size_t r = 0, w = 0;
    if (p[0] != '/')
        return -1;
    while (p[r]) {
        while (p[r] == '/')
            r++;
        if (!p[r])
            break;
        size_t s = r;
        while (p[r] && p[r] != '/')
            r++;
        size_t n = r - s;
        if (n == 1 && p[s] == '.')
            continue;
        if (n == 2 && p[s] == '.' && p[s + 1] == '.') {
            while (w > 0 && p[w - 1] != '/')
                w--;
            if (w > 0)
                w--;
            continue;
        }
        p[w++] = '/';
        memmove(p + w, p + s, n);
        w += n;
    }
    if (w == 0)
        p[w++] = '/';
    p[w] = '\0';
    return 0;
}

int ins_absolute(int dirfd, const char *path, char *out)
{
    return ins_absolute_cap(dirfd, path, out, PATH_MAX);
}

int ins_absolute_cap(int dirfd, const char *path, char *out, size_t cap)
{
    size_t len = strlen(path);
    if (path[0] == '/') {
        if (len >= cap) {
            errno = ENAMETOOLONG;
            return -1;
        }
        memcpy(out, path, len + 1);
        return 0;
    }
    size_t base;
    /* (the directory itself is at most PATH_MAX long, as the kernel names it) */
    size_t dcap = cap < PATH_MAX ? cap : PATH_MAX;
    if (dirfd == AT_FDCWD) {
        if (getcwd(out, dcap) == NULL)
            return -1;
        base = strlen(out);
    } else {
        char link[32];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, out, dcap - 1);
        if (n <= 0)
            return -1;
        out[n] = '\0';
        base = (size_t)n;
        /* A directory removed since it was opened: the kernel names it "... (deleted)", which
         * is no path (taken as one, a key was published under a new directory of that name).
         * Not a path then: the call goes to libc, which fails it as without the library. */
        static const char gone[] = " (deleted)";
        struct stat st;
        if (base > sizeof gone - 1 && memcmp(out + base - (sizeof gone - 1), gone,
                                             sizeof gone - 1) == 0 &&
            fstat(dirfd, &st) == 0 && st.st_nlink == 0) {
            errno = ENOENT;
            return -1;
        }
    }
    if (out[0] != '/')
        return -1;
    if (base + 1 + len >= cap) {
        errno = ENAMETOOLONG;
        return -1;
    }
    out[base] = '/';
    memcpy(out + base + 1, path, len + 1);
    return 0;
}

int ins_under(const char *abs, const char *dir, size_t dir_len, size_t *key_off)
{
    if (dir_len == 0)
        return 0;
    if (dir_len == 1) { /* managed directory is "/" */
        if (abs[1] == '\0')
            return 0;
        *key_off = 1;
        return 1;
    }
    if (strncmp(abs, dir, dir_len) != 0 || abs[dir_len] != '/' || abs[dir_len + 1] == '\0')
        return 0;
    *key_off = dir_len + 1;
    return 1;
}

int ins_clean_abs(const char *p)
{
    for (const char *s = p; (s = strchr(s, '/')) != NULL; s++) {
        if (s[1] == '/')
            return 0;
        if (s[1] == '.' && (s[2] == '/' || s[2] == '\0' ||
                            (s[2] == '.' && (s[3] == '/' || s[3] == '\0'))))
            return 0;
    }
    return 1;
}

int ins_prefix(const char *p, const char *dir, size_t dir_len)
{
    return dir_len > 0 && strncmp(p, dir, dir_len) == 0 && (p[dir_len] == '/' || dir_len == 1);
}
