/*
 * config.c -- every INSTRIDE_* environment variable the C side reads is parsed
 * here and only here, once per process, with the names and meanings of the
 * Python package's Settings (src/instride/config.py):
 *
 *   INSTRIDE_DIR        managed directory (default /dev/shm/instride-<uid>, else
 *                       ${TMPDIR:-/tmp}/instride-<uid>)
 *   INSTRIDE_TIMEOUT    seconds a consume waits, the meaning of Python's
 *                       parse_timeout and `--timeout`: unset, empty, inf:
 *                       forever; 0: do not wait (a key not yet published fails
 *                       at once with ETIMEDOUT); negative or not a number:
 *                       refused (every consume fails with EINVAL)
 *   INSTRIDE_FSYNC      1/true/yes/on: fsync before publishing (default 0 here)
 *   INSTRIDE_OVERWRITE  1/true/yes/on: publishing replaces an existing key
 *   INSTRIDE_REDIS_URL  non-empty: cluster mode (talk to the node server)
 *   INSTRIDE_SOCKET     the node server's Unix socket
 *                       (default $INSTRIDE_DIR/.instride/node.sock)
 *   INSTRIDE_DEBUG      1/true/yes/on: print one line to stderr per failure
 */
#include "ins_core.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

INS_HIDDEN struct ins_config ins_cfg;

static pthread_once_t ins_config_once = PTHREAD_ONCE_INIT;

/* INSTRIDE_TIMEOUT: -1 (forever) when unset, empty or inf/infinity/forever/none;
 * 0 or more seconds otherwise; negative, NaN or not a number: timeout_bad. */
static void ins_parse_timeout(const char *t, struct ins_config *c)
{
    c->timeout = -1.0;
    c->timeout_bad = 0;
    if (t == NULL)
        return;
    while (*t == ' ' || *t == '\t')
        t++;
    size_t n = strlen(t);
    while (n > 0 && (t[n - 1] == ' ' || t[n - 1] == '\t' || t[n - 1] == '\n'))
        n--;
    if (n == 0)
        return;
    static const char *const forever[] = {"inf", "infinity", "forever", "none"};
    for (size_t i = 0; i < sizeof forever / sizeof forever[0]; i++)
        if (strlen(forever[i]) == n && strncasecmp(t, forever[i], n) == 0)
            return;
    char buf[64];
    if (n >= sizeof buf || (n > 1 && t[0] == '0' && (t[1] == 'x' || t[1] == 'X'))) {
        c->timeout_bad = 1;
        return;
    }
    memcpy(buf, t, n);
    buf[n] = '\0';
    char *end = NULL;
    double v = strtod(buf, &end);
    if (end == buf || *end != '\0' || v != v || v < 0.0) {
        c->timeout_bad = 1; /* "-1", "nan", "soon": refused, like Python's ConfigError */
        return;
    }
    if (v < 1e9) /* longer than ~31 years (and inf): forever */
        c->timeout = v;
}

static int ins_env_true(const char *name)
{
    const char *v = getenv(name);
    if (v == NULL)
        return 0;
    return strcmp(v, "1") == 0 || strcasecmp(v, "true") == 0 || strcasecmp(v, "yes") == 0 ||
           strcasecmp(v, "on") == 0;
}

static void ins_default_dir(char *buf, size_t cap)
{
    struct stat st;
    unsigned uid = (unsigned)getuid();
    if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK | X_OK) == 0) {
        snprintf(buf, cap, "/dev/shm/instride-%u", uid);
        return;
    }
    const char *t = getenv("TMPDIR");
    if (t == NULL || t[0] == '\0')
        t = "/tmp";
    snprintf(buf, cap, "%s/instride-%u", t, uid);
}

/* The kernel hands back physical paths for dirfds, and keys are resolved beneath
 * the real path with no symbolic link followed: know the real one. When the
 * directory does not exist yet, its longest existing ancestor is resolved and
 * the rest appended. */
static void ins_real_dir(struct ins_config *c)
{
    char probe[PATH_MAX], real[PATH_MAX];
    memcpy(probe, c->dir, c->dir_len + 1);
    size_t cut = c->dir_len; /* probe = dir[0, cut) */
    while (realpath(probe, real) == NULL) {
        char *slash = strrchr(probe, '/');
        if (slash == NULL || slash == probe) { /* nothing exists but "/" */
            memcpy(real, "/", 2);
            cut = 0;
            break;
        }
        *slash = '\0';
        cut = (size_t)(slash - probe);
    }
    const char *rest = c->dir + cut; /* "" or "/a/b" */
    size_t rlen = strlen(real);
    if (rlen == 1 && rest[0] == '/') /* real is "/" */
        rlen = 0;
    if (rlen + strlen(rest) + 1 > sizeof real)
        return;
    memcpy(real + rlen, rest, strlen(rest) + 1);
    if (real[0] == '/' && strcmp(real, c->dir) != 0) {
        memcpy(c->dir_real, real, strlen(real) + 1);
        c->dir_real_len = strlen(real);
    }
}

static void ins_read_config(void)
{
    struct ins_config *c = &ins_cfg;
    char buf[PATH_MAX];
    memset(c, 0, sizeof *c);

    const char *d = getenv("INSTRIDE_DIR");
    if (d != NULL && d[0] != '\0')
        snprintf(buf, sizeof buf, "%s", d);
    else
        ins_default_dir(buf, sizeof buf);
    if (ins_absolute(AT_FDCWD, buf, c->dir) == 0 && ins_normalize(c->dir) == 0)
        c->dir_len = strlen(c->dir);
    if (c->dir_len > 0)
        ins_real_dir(c);

    const char *s = getenv("INSTRIDE_SOCKET");
    if (s != NULL && s[0] != '\0')
        snprintf(c->socket_path, sizeof c->socket_path, "%s", s);
    else if (c->dir_len > 0 && c->dir_len + 20 < sizeof c->socket_path)
        snprintf(c->socket_path, sizeof c->socket_path, "%s/.instride/node.sock", c->dir);

    ins_parse_timeout(getenv("INSTRIDE_TIMEOUT"), c);
    c->fsync = ins_env_true("INSTRIDE_FSYNC");
    c->overwrite = ins_env_true("INSTRIDE_OVERWRITE");
    const char *r = getenv("INSTRIDE_REDIS_URL");
    c->cluster = r != NULL && r[0] != '\0';
    c->debug = ins_env_true("INSTRIDE_DEBUG");
}

void ins_config_load(void)
{
    int saved = errno;
    pthread_once(&ins_config_once, ins_read_config);
    errno = saved;
}

const char *ins_root(size_t *len)
{
    if (ins_cfg.dir_real_len > 0) {
        *len = ins_cfg.dir_real_len;
        return ins_cfg.dir_real;
    }
    *len = ins_cfg.dir_len;
    return ins_cfg.dir;
}
