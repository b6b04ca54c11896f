/*
 * consume.c -- make a key available locally before it is opened: wait for it
 * (local mode) or ask the node server for it (cluster mode).
 */
#include "ins_core.h"

#include <string.h>

int ins_consume(const struct ins_path *p, char open_path[PATH_MAX])
{
    const char *key = ins_key(p);
    if (ins_cfg.cluster)
        return ins_agent_consume(key, open_path);

    memcpy(open_path, p->abs, strlen(p->abs) + 1);
    if (ins_wait_local(p->abs) == 0)
        return 0;
    if (errno == ETIMEDOUT)
        return ins_fail(ETIMEDOUT, "key %.300s was not published within INSTRIDE_TIMEOUT=%g s",
                        key, ins_cfg.timeout);
    return ins_fail(errno, "cannot wait for key %.300s: %s", key, strerror(errno));
}
