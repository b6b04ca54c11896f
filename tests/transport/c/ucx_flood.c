/*
 * ucx_flood.c -- a UCX peer that sends a data server many requests without waiting for the
 * replies (no instride client does: each waits for its reply), to check that the server bounds
 * what it queues per connection. Usage: ucx_flood HOST PORT COUNT. Sends COUNT active messages
 * of the request id (7) with an 8-byte id and a small header, then progresses for 3 s and
 * prints "replies N closed C": the replies it got, and whether the server closed the
 * connection (1) or not (0). Run with INSTRIDE_UCX_PEER_ERRORS-like failure handling (PEER).
 */
#define _GNU_SOURCE 1
#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

static int replies, closed;

static ucs_status_t on_reply(void *arg, const void *header, size_t header_length, void *data,
                             size_t length, const ucp_am_recv_param_t *param)
{
    (void)arg, (void)header, (void)header_length, (void)data, (void)length, (void)param;
    replies++;
    return UCS_OK;
}

static void on_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)arg, (void)ep, (void)status;
    closed = 1;
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    int count = atoi(argv[3]);
    ucp_config_t *config;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_ep_h ep;
    if (ucp_config_read(NULL, NULL, &config) != UCS_OK)
        return 3;
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM};
    if (ucp_init(&params, config, &ctx) != UCS_OK)
        return 3;
    ucp_config_release(config);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(ctx, &wp, &worker) != UCS_OK)
        return 3;
    ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
                                 .id = 8, .cb = on_reply, .flags = UCP_AM_FLAG_WHOLE_MSG};
    if (ucp_worker_set_am_recv_handler(worker, &hp) != UCS_OK)
        return 3;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2]))};
    inet_pton(AF_INET, argv[1], &sa.sin_addr);
    ucp_ep_params_t ep_params = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .sockaddr = {.addr = (const struct sockaddr *)&sa, .addrlen = sizeof sa},
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = on_error, .arg = NULL}};
    if (ucp_ep_create(worker, &ep_params, &ep) != UCS_OK)
        return 4;
    static char msg[8 + 64];
    memcpy(msg + 8, "{\"op\":\"ping\"}", 13);
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_AM_SEND_FLAG_REPLY};
    for (int i = 0; i < count; i++) {
        uint64_t id = (uint64_t)i + 1;
        memcpy(msg, &id, 8);
        void *req = ucp_am_send_nbx(ep, 7, msg, 8 + 13, NULL, 0, &p);
        if (UCS_PTR_IS_PTR(req)) {
            while (ucp_request_check_status(req) == UCS_INPROGRESS)
                ucp_worker_progress(worker);
            ucp_request_free(req);
        }
    }
    for (double end = now() + 3.0; now() < end;)
        ucp_worker_progress(worker);
    printf("replies %d closed %d\n", replies, closed);
    fflush(stdout);
    _exit(0); /* (the endpoint and worker left to the process's end) */
}
