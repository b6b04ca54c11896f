/*
 * consume.c -- make a key available locally before it is opened: wait for it
 * (local mode; the directories a failed wait made are removed again) or ask the
 * node server for it (cluster mode).
 */
#include "ins_core.h"

#include <string.h>

/* Local mode: the length of the longest prefix of the key's directory that exists. A
 * failed wait removes the directories it made below it (as the Python package's does). */
static size_t ins_existing_prefix(const char *abs)
{
    char dir[PATH_MAX];
    struct stat st;
    int saved = errno;
    memcpy(dir, abs, strlen(abs) + 1);
    for (;;) {
        char *slash = strrchr(dir, '/');
        if (slash == NULL || slash == dir)
            break;
        *slash = '\0';
        if (lstat(dir, &st) == 0 || errno != ENOENT) {
            errno = saved;
            return strlen(dir);
        }
    }
    errno = saved;
    return 1;
}

/* Remove the key's directories longer than keep, deepest first, while they are empty. */
static void ins_remove_made_dirs(const char *abs, size_t keep)
{
    char dir[PATH_MAX];
    int saved = errno;
    memcpy(dir, abs, strlen(abs) + 1);
    for (;;) {
        char *slash = strrchr(dir, '/');
        if (slash == NULL || (size_t)(slash - dir) <= keep)
            break;
        *slash = '\0';
        if (rmdir(dir) != 0) /* something else was made there meanwhile: it stays */
            break;
    }
    errno = saved;
}

int ins_consume(const struct ins_path *p, char open_path[PATH_MAX])
{
    const char *key = ins_key(p);
    if (ins_cfg.timeout_bad) /* a setting refused, like Python's ConfigError */
        return ins_fail(EINVAL, "cannot consume %.300s: %s", key, ins_cfg.bad_msg);
    if (p->refuse)
        return ins_fail_refused_key(p);
    /* Refuse at once a key whose directory is reached through a symbolic link;
     * in local mode, make its directory (confined) so that it can be watched. */
    size_t existing = ins_cfg.cluster ? 0 : ins_existing_prefix(p->abs);
    int pfd = ins_parent_fd(p, !ins_cfg.cluster);
    if (pfd >= 0)
        ins_sys.close(pfd);
    else if (errno != ENOENT || !ins_cfg.cluster)
        return errno == ENOENT ? ins_fail(ENOENT, "cannot make the directory of key %.300s",
                                          key)
                               : -1;
    if (ins_cfg.cluster)
        return ins_agent_consume(key, open_path);

    memcpy(open_path, p->abs, strlen(p->abs) + 1);
    if (ins_wait_local(p->abs) != 0) {
        ins_remove_made_dirs(p->abs, existing); /* a failed wait leaves nothing behind */
        if (errno == ETIMEDOUT)
            return ins_fail(ETIMEDOUT, "key %.300s was not published within "
                            "INSTRIDE_TIMEOUT=%g s", key, ins_cfg.timeout);
        return ins_fail(errno, "cannot wait for key %.300s: %s", key, strerror(errno));
    }
    struct stat st;
    if (ins_lstat_key(p, &st, 0) != 0)
        return ins_fail(errno, "key %.300s: %s", key, strerror(errno));
    return ins_check_type(p, &st);
}
