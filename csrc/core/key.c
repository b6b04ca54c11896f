/*
 * key.c -- which paths are keys: a path is made absolute (against the cwd or a
 * directory fd), normalized lexically and compared with the managed directory
 * (and its realpath). A key's path is then rebuilt under the directory's real
 * path, where confine.c resolves it without following symbolic links.
 */
#include "ins_core.h"

#include <string.h>

static int ins_classify_errno(int dirfd, const char *path, struct ins_path *out);

/* A path whose absolute form does not fit PATH_MAX (a relative one from a deep directory, that
 * the kernel may well open): INS_TOOLONG when, lexically, it lies under the managed directory,
 * so that it is refused (ENAMETOOLONG) and never taken for a plain file outside it. Out of
 * line: the larger buffer is only on the stack on this rare path. */
/* Whether the directory dirfd (AT_FDCWD: the working directory) lies beneath the managed
 * directory, told by walking up with ".." and comparing device and inode (for a directory
 * whose path is too long to be named: getcwd fails). At most 512 levels. */
static int ins_dir_beneath_root(int dirfd)
{
    struct stat root, st;
    size_t rlen;
    if (stat(ins_root(&rlen), &root) != 0)
        return 0;
    int fd = ins_sys.openat(dirfd, ".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    for (int level = 0; fd >= 0 && level < 512; level++) {
        if (fstat(fd, &st) != 0)
            break;
        if (st.st_dev == root.st_dev && st.st_ino == root.st_ino) {
            ins_sys.close(fd);
            return 1;
        }
        int up = ins_sys.openat(fd, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
        struct stat ust;
        int top = up >= 0 && fstat(up, &ust) == 0 && ust.st_dev == st.st_dev &&
                  ust.st_ino == st.st_ino; /* ("/": its own parent) */
        ins_sys.close(fd);
        fd = top ? -1 : up;
        if (top)
            ins_sys.close(up);
    }
    if (fd >= 0)
        ins_sys.close(fd);
    return 0;
}

static __attribute__((noinline)) int ins_classify_long(int dirfd, const char *path)
{
    char abs[2 * PATH_MAX + 2];
    size_t off;
    if (strlen(path) >= PATH_MAX)
        return INS_UNMANAGED; /* (a path the kernel refuses too) */
    if (ins_absolute_cap(dirfd, path, abs, sizeof abs) != 0) {
        /* the directory's own path is too long to be named (getcwd: ERANGE): beneath the
         * managed directory, a relative path is under it (".." aside: as the kernel would
         * resolve it, not known here: refused all the same) */
        if (path[0] != '/' && (errno == ERANGE || errno == ENAMETOOLONG) &&
            ins_dir_beneath_root(dirfd))
            return INS_TOOLONG;
        return INS_UNMANAGED;
    }
    if (ins_normalize(abs) != 0)
        return INS_UNMANAGED; /* (no directory to join) */
    if (!ins_under(abs, ins_cfg.dir, ins_cfg.dir_len, &off) &&
        !ins_under(abs, ins_cfg.dir_real, ins_cfg.dir_real_len, &off))
        return INS_UNMANAGED;
    return INS_TOOLONG;
}

/* Whether the last component of path (of length len > 0) is "." or "..". */
static int ins_ends_in_dot(const char *path, size_t len)
{
    size_t n = 0;
    while (n < len && path[len - 1 - n] != '/')
        n++;
    const char *last = path + len - n;
    return (n == 1 && last[0] == '.') || (n == 2 && last[0] == '.' && last[1] == '.');
}

/* Whether the last component name (of length n) is a temporary file's name, exactly as
 * Python's keys.TMP_PATTERN reads it: ".<name>.instride-<pid>-<hex>.tmp", a name of one
 * character or more, <pid> of digits, <hex> of lowercase hex digits (the names publish.c and
 * keys.tmp_name make). A hidden name with ".instride-" in it is a key otherwise: Python
 * publishes it, so the C side must not take it for instride's own. Read from the end: the
 * hex, then the pid, run back to a "-" each (neither has one), so there is one split. */
static int ins_is_temp_name(const char *name, size_t n)
{
    static const char mark[] = ".instride-";
    const size_t m = sizeof mark - 1;
    if (n < 4 || name[0] != '.' || memcmp(name + n - 4, ".tmp", 4) != 0)
        return 0;
    size_t hex_end = n - 4, hex = hex_end;
    while (hex > 0 && ((name[hex - 1] >= '0' && name[hex - 1] <= '9') ||
                       (name[hex - 1] >= 'a' && name[hex - 1] <= 'f')))
        hex--;
    if (hex == hex_end || hex == 0 || name[hex - 1] != '-')
        return 0;
    size_t pid_end = hex - 1, pid = pid_end;
    while (pid > 0 && name[pid - 1] >= '0' && name[pid - 1] <= '9')
        pid--;
    /* ".instride-" right before the pid, and the dot and a name of one character before it */
    return pid < pid_end && pid >= m + 2 && memcmp(name + pid - m, mark, m) == 0;
}

/* Whether key (normalized: no empty, "." or ".." component) is one of instride's own names,
 * as Python's keys.normalize_key refuses them: a component starting with ".instride"
 * (config.INTERNAL_DIRNAME: the node socket, markers...), or a last component that is a
 * temporary file's name. (An earlier version took every hidden "*.instride-*.tmp" name.) */
static int ins_reserved_key(const char *key)
{
    for (const char *c = key;;) {
        const char *end = strchr(c, '/');
        if (strncmp(c, ".instride", 9) == 0) /* (stops at the "/" ending a shorter one) */
            return 1;
        if (end == NULL)
            return ins_is_temp_name(c, strlen(c));
        c = end + 1;
    }
}

/* Python's str.isspace() of the code point c (normalize_key strips those: a key of nothing
 * else is an "empty name"): ASCII's, U+0085, U+00A0 and the Unicode spaces and separators. */
static int ins_py_space(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

/* The length of the UTF-8 sequence at s that is not ASCII, its code point in *cp; 0 where
 * Python's strict decoder refuses it (an overlong form, a surrogate, above U+10FFFF, a
 * stray or missing continuation byte: the string's NUL ends it). */
static size_t ins_utf8(const unsigned char *s, uint32_t *cp)
{
    size_t n;
    uint32_t c, min;
    if (s[0] >= 0xc2 && s[0] <= 0xdf) {
        n = 2, c = s[0] & 0x1f, min = 0x80;
    } else if (s[0] >= 0xe0 && s[0] <= 0xef) {
        n = 3, c = s[0] & 0x0f, min = 0x800;
    } else if (s[0] >= 0xf0 && s[0] <= 0xf4) {
        n = 4, c = s[0] & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        c = c << 6 | (s[i] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    *cp = c;
    return n;
}

/* Why key (normalized, not reserved) is one Python's keys.normalize_key refuses, with the
 * errno to refuse it with in *err (EINVAL; ENAMETOOLONG for the lengths); NULL when it is a
 * key. The same rules, so that no C program publishes a file no Python consumer can name:
 * no control character ([\x00-\x1f\x7f]), valid UTF-8, not of whitespace only, components
 * of at most MAX_COMPONENT_BYTES (200) and a key of at most MAX_KEY_BYTES (1024) bytes. One
 * pass, no system call (every open of a key classifies it). */
static const char *ins_key_invalid(const char *key, int *err)
{
    const unsigned char *s = (const unsigned char *)key;
    size_t i = 0, comp = 0;
    int one = 1, blank = 1; /* one component so far, of whitespace only so far */
    int too_long = 0; /* a component over 200 bytes: said unless a character is refused */
    *err = EINVAL;
    while (s[i] != '\0') {
        uint32_t c = s[i];
        size_t n = 1;
        if (c == '/') {
            one = 0, comp = 0, i++;
            continue;
        }
        /* (these win over a length met before them: Python checks the whole name for them
         * first, so the same name gets the same errno from both) */
        if (c < 0x20 || c == 0x7f)
            return "contains a control character";
        if (c >= 0x80 && (n = ins_utf8(s + i, &c)) == 0)
            return "is not valid UTF-8";
        blank = blank && ins_py_space(c);
        comp += n;
        i += n;
        too_long = too_long || comp > 200;
    }
    *err = ENAMETOOLONG;
    if (too_long)
        return "has a component longer than 200 bytes";
    if (i > 1024)
        return "is longer than 1024 bytes";
    /* (after the lengths: Python, given the absolute path, finds it "empty" last) */
    *err = EINVAL;
    return one && blank ? "is an empty name (whitespace only)" : NULL;
}

const char *ins_refusal(const struct ins_path *p)
{
    int err;
    const char *why = p->refuse == ELOOP ? NULL : ins_key_invalid(ins_key(p), &err);
    return why != NULL ? why
                       : "(its path) goes back (..) through a symbolic link inside the managed "
                         "directory";
}

int ins_fail_refused_key(const struct ins_path *p)
{
    return ins_fail(p->refuse, "key %.300s %s (refused)", ins_key(p), ins_refusal(p));
}

/* errno is kept: a lookup that failed here (getcwd of a removed working directory, a
 * readlink) says nothing of the call being classified, which may well succeed -- and errno
 * must stay as it was on every call that succeeds. */
int ins_classify(int dirfd, const char *path, struct ins_path *out)
{
    int saved = errno;
    int kind = ins_classify_errno(dirfd, path, out);
    errno = saved;
    return kind;
}

static int ins_classify_errno(int dirfd, const char *path, struct ins_path *out)
{
    if (path == NULL || path[0] == '\0' || ins_cfg.dir_len == 0)
        return INS_UNMANAGED;
    size_t len = strlen(path);
    if (path[len - 1] == '/') /* "key/" names a directory, never a key */
        return INS_UNMANAGED;
    /* "key/." and "dir/missing/.." name a directory too (libc fails them: ENOENT, ENOTDIR),
     * whatever their lexical normalization names: the call goes to libc as it is. */
    if (ins_ends_in_dot(path, len))
        return INS_UNMANAGED;
    /* Fast path: most paths are absolute, clean and elsewhere: no copy. */
    if (path[0] == '/' && !ins_prefix(path, ins_cfg.dir, ins_cfg.dir_len) &&
        !ins_prefix(path, ins_cfg.dir_real, ins_cfg.dir_real_len) && ins_clean_abs(path))
        return INS_UNMANAGED;
    if (ins_absolute(dirfd, path, out->abs) != 0)
        return errno == ENAMETOOLONG || errno == ERANGE ? ins_classify_long(dirfd, path)
                                                       : INS_UNMANAGED;
    out->refuse = 0;
    int dotdot = strstr(out->abs, "/..") != NULL;
    if (dotdot && ins_dotdot_through_link(out->abs))
        out->refuse = ELOOP;
    ins_normalize(out->abs);
    if (!ins_under(out->abs, ins_cfg.dir, ins_cfg.dir_len, &out->key_off) &&
        !ins_under(out->abs, ins_cfg.dir_real, ins_cfg.dir_real_len, &out->key_off))
        return INS_UNMANAGED;
    if (ins_reserved_key(out->abs + out->key_off))
        return INS_RESERVED;
    /* A name Python refuses is a key all the same (never written in place as a plain file:
     * instride_is_key says 1, as for a path too long), refused by every call on it. */
    int invalid;
    if (!out->refuse && ins_key_invalid(out->abs + out->key_off, &invalid) != NULL)
        out->refuse = invalid;
    /* Work under the directory's real path: resolution there follows no link. */
    size_t rlen;
    const char *root = ins_root(&rlen);
    size_t base = rlen == 1 ? 0 : rlen; /* the managed directory "/" */
    if (out->key_off != base + 1 || strncmp(out->abs, root, base) != 0) {
        size_t klen = strlen(out->abs + out->key_off);
        if (base + 1 + klen >= PATH_MAX) /* (re-rooted under the real path: too long) */
            return INS_TOOLONG;
        memmove(out->abs + base + 1, out->abs + out->key_off, klen + 1);
        memcpy(out->abs, root, base);
        out->abs[base] = '/';
        out->key_off = base + 1;
    }
    return INS_MANAGED;
}
