/*
 * config.c -- every INSTRIDE_* environment variable the C side reads is parsed
 * here and only here, once per process, with the names and meanings of the
 * Python package's Settings (src/instride/config.py):
 *
 *   INSTRIDE_DIR        managed directory (default /dev/shm/instride-<uid>, else
 *                       ${TMPDIR:-/tmp}/instride-<uid>)
 *   INSTRIDE_TIMEOUT    seconds a consume waits; unset, empty, 0, negative: forever
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

    const char *t = getenv("INSTRIDE_TIMEOUT");
    c->timeout = 0.0;
    if (t != NULL && t[0] != '\0') {
        char *end = NULL;
        double v = strtod(t, &end);
        if (end != t && v == v && v > 0.0 && v < 1e9)
            c->timeout = v;
    }
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
