/*
 * consume.c -- make a key available locally before it is opened: wait for it
 * (local mode) or ask the node server for it (cluster mode).
 */
#include "ins_core.h"

#include <string.h>

int ins_consume(const struct ins_path *p, char open_path[PATH_MAX])
{
    const char *key = ins_key(p);
    if (ins_cfg.timeout_bad) /* a setting refused, like Python's ConfigError */
        return ins_fail(EINVAL, "cannot consume %.300s: %s", key, ins_cfg.bad_msg);
    if (p->refuse)
        return ins_fail(p->refuse, "key %.300s: its path goes back (..) through a symbolic "
                        "link inside the managed directory (refused)", key);
    /* Refuse at once a key whose directory is reached through a symbolic link;
     * in local mode, make its directory (confined) so that it can be watched. */
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
