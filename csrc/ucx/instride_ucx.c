/*
 * libinstride_ucx: the UCX engine of instride's `ucx` transport.
 *
 * A small C layer over UCP active messages (AM), driven from Python through ctypes (the
 * calls release the GIL). Both halves:
 *
 *   server  one UCP worker with a listener on ip:port. A request is an AM (id ISU_AM_REQ)
 *           whose header is an 8-byte request id followed by the signed JSON request of
 *           instride's wire protocol; the AM carries the REPLY flag, so the server answers on
 *           the endpoint it came from. Python authenticates the request and opens the file;
 *           the reply is an AM (id ISU_AM_REP) whose header is the request id and a JSON
 *           reply, and whose data is the file, memory-mapped (zero copy; UCX picks eager or
 *           rendezvous by size: on InfiniBand rendezvous is an RDMA read or write).
 *   client  one UCP worker per Python thread, one endpoint per owner (kept alive). A fetch is
 *           two calls: isu_client_request() (send, wait for the reply header) and
 *           isu_client_receive() (receive the body into a buffer the caller chose after
 *           checking the header).
 *
 * Only the thread that owns a worker touches it; isu_server_wake() is the one call another
 * thread may make (it writes an eventfd). Every wait has a deadline; waits sleep in poll()
 * on the worker's event fd (UCP_FEATURE_WAKEUP), they never spin.
 *
 * Return codes: 0 or a positive count on success, a negative errno on failure, with a
 * message in the caller's `err` buffer.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#define ISU_API __attribute__((visibility("default")))
#define ISU_AM_REQ 7
#define ISU_AM_REP 8
#define ISU_ID_BYTES 8
#define ISU_MAX_HEADER (16 * 1024)
#define ISU_MAX_CONNS 512
/* requests a connection may have queued or being answered: a client waits for each reply,
 * so more is a peer flooding the server (its connection goes) */
#define ISU_MAX_PENDING 8
#define ISU_CLOSE_WAIT_NS (2LL * 1000000000LL)
/* keep polling this long after the last activity before sleeping on the event fd */
#define ISU_SPIN_NS (100LL * 1000LL)

/* ------------------------------------------------------------------ common */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t deadline_after_ms(int64_t ms) {
    return ms < 0 ? -1 : now_ns() + ms * 1000000LL;
}

static void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

typedef struct {
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd;  /* the worker's event fd */
    int wake; /* eventfd: another thread interrupts a wait */
    int64_t active; /* when progress last did something */
} isu_base;

/* One operation we wait for (send, receive, close). */
typedef struct {
    volatile int done;
    ucs_status_t status;
} isu_op;

static void op_send_cb(void *request, ucs_status_t status, void *user_data) {
    (void)request;
    isu_op *op = user_data;
    op->status = status;
    op->done = 1;
}

static void op_recv_cb(void *request, ucs_status_t status, size_t length, void *user_data) {
    (void)request;
    (void)length;
    isu_op *op = user_data;
    op->status = status;
    op->done = 1;
}

static int base_init(isu_base *b, char *err, size_t errlen) {
    memset(b, 0, sizeof(*b));
    b->efd = -1;
    b->wake = -1;
    ucp_config_t *config = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &config); /* honours UCX_* variables */
    if (st != UCS_OK) {
        set_err(err, errlen, "ucp_config_read: %s", ucs_status_string(st));
        return -EINVAL;
    }
    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    st = ucp_init(&params, config, &b->ctx);
    ucp_config_release(config);
    if (st != UCS_OK) {
        set_err(err, errlen, "ucp_init: %s", ucs_status_string(st));
        b->ctx = NULL;
        return -EIO;
    }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    st = ucp_worker_create(b->ctx, &wp, &b->worker);
    if (st != UCS_OK) {
        set_err(err, errlen, "ucp_worker_create: %s", ucs_status_string(st));
        ucp_cleanup(b->ctx);
        b->ctx = NULL;
        return -EIO;
    }
    st = ucp_worker_get_efd(b->worker, &b->efd);
    if (st != UCS_OK) {
        set_err(err, errlen, "ucp_worker_get_efd: %s", ucs_status_string(st));
        ucp_worker_destroy(b->worker);
        ucp_cleanup(b->ctx);
        b->ctx = NULL;
        return -EIO;
    }
    b->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (b->wake < 0) {
        int e = errno;
        set_err(err, errlen, "eventfd: %s", strerror(e));
        ucp_worker_destroy(b->worker);
        ucp_cleanup(b->ctx);
        b->ctx = NULL;
        return -e;
    }
    return 0;
}

static void base_fini(isu_base *b) {
    if (b->worker != NULL)
        ucp_worker_destroy(b->worker);
    if (b->ctx != NULL)
        ucp_cleanup(b->ctx);
    if (b->wake >= 0)
        close(b->wake);
    b->worker = NULL;
    b->ctx = NULL;
    b->wake = -1;
}

/*
 * Progress the worker, then sleep until it has events, `wake` is written, or `deadline`
 * (-1: no deadline; the sleep is sliced to 100 ms anyway). Returns 0, -ETIMEDOUT past the
 * deadline, or -EINTR when woken through `wake`.
 *
 * Right after progress did something we poll again at once (yielding the CPU) for
 * ISU_SPIN_NS. `busy`: an operation of ours is in flight (a send, a body). The worker's event
 * fd signals only incoming traffic, not that a socket became writable or a connection
 * completed, so while busy a sleep lasts at most 1 ms.
 */
static int base_step(isu_base *b, int64_t deadline, int busy) {
    int64_t now = now_ns();
    if (ucp_worker_progress(b->worker) != 0) {
        while (ucp_worker_progress(b->worker) != 0) {
        }
        b->active = now;
    }
    if (now - b->active < ISU_SPIN_NS) {
        if (deadline >= 0 && now_ns() >= deadline)
            return -ETIMEDOUT;
        struct pollfd w = {.fd = b->wake, .events = POLLIN};
        if (poll(&w, 1, 0) > 0) {
            uint64_t v;
            if (read(b->wake, &v, sizeof(v)) < 0) {
            }
            return -EINTR;
        }
        sched_yield();
        return 0;
    }
    ucs_status_t st = ucp_worker_arm(b->worker);
    if (st == UCS_ERR_BUSY)
        return 0; /* more events already: the caller re-checks, then calls again */
    int timeout_ms = busy ? 1 : 100;
    if (deadline >= 0) {
        int64_t left = deadline - now_ns();
        if (left <= 0)
            return -ETIMEDOUT;
        if (left / 1000000LL < timeout_ms)
            timeout_ms = (int)(left / 1000000LL) + 1;
    }
    struct pollfd fds[2] = {{.fd = b->efd, .events = POLLIN}, {.fd = b->wake, .events = POLLIN}};
    int n = poll(fds, 2, timeout_ms);
    if (n > 0 && (fds[1].revents & POLLIN)) {
        uint64_t v;
        if (read(b->wake, &v, sizeof(v)) < 0) {
            /* nothing to do: the eventfd was drained already */
        }
        return -EINTR;
    }
    return 0;
}

/* Progress until op->done or the deadline. */
static int wait_op(isu_base *b, isu_op *op, int64_t deadline) {
    while (!op->done) {
        int rc = base_step(b, deadline, 1);
        if (rc == -ETIMEDOUT && !op->done) {
            while (ucp_worker_progress(b->worker) != 0) {
            }
            if (!op->done)
                return rc;
        }
    }
    return 0;
}

/*
 * Close an endpoint (flush unless forced) and wait a bounded time for it. The operation
 * record is on the heap: if the close does not finish in time it is left to UCX (leaked)
 * rather than freed under a request that may still complete.
 */
static int close_ep(isu_base *b, ucp_ep_h ep, int force) {
    if (ep == NULL)
        return 1;
    isu_op *op = calloc(1, sizeof(*op));
    if (op == NULL)
        return 0;
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                     UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    p.cb.send = op_send_cb;
    p.user_data = op;
    void *req = ucp_ep_close_nbx(ep, &p);
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        free(op);
        return 1;
    }
    wait_op(b, op, now_ns() + ISU_CLOSE_WAIT_NS);
    if (!op->done)
        return 0;
    ucp_request_free(req);
    free(op);
    return 1;
}

static int fill_sockaddr(struct sockaddr_in *sa, const char *host, int port, char *err,
                         size_t errlen) {
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &sa->sin_addr) != 1) {
        set_err(err, errlen, "not an IPv4 address: %s", host);
        return -EINVAL;
    }
    return 0;
}

/*
 * Whether `addr` (IPv4) is an address of this network namespace: a peer on the same host.
 *
 * UCX 1.13 keeps the shared-memory transports (posix, sysv, cma) out of endpoints that ask
 * for peer-failure handling, so endpoints between processes of one host use no error
 * handling (both sides apply this same rule, as UCX requires); a dead local peer is then
 * noticed by the deadlines of every wait. Endpoints to other hosts handle peer failure.
 */
static int is_local_ip(const struct sockaddr_in *addr) {
    if ((ntohl(addr->sin_addr.s_addr) >> 24) == 127)
        return 1;
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        return 0;
    int local = 0;
    for (struct ifaddrs *i = ifs; i != NULL && !local; i = i->ifa_next) {
        if (i->ifa_addr != NULL && i->ifa_addr->sa_family == AF_INET &&
            ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr == addr->sin_addr.s_addr)
            local = 1;
    }
    freeifaddrs(ifs);
    return local;
}

static ucp_err_handling_mode_t err_mode_for(const struct sockaddr_in *peer) {
    if (getenv("INSTRIDE_UCX_PEER_ERRORS") != NULL) /* force failure handling (no shm) */
        return UCP_ERR_HANDLING_MODE_PEER;
    return is_local_ip(peer) ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
}

/* ================================================================== client */

typedef struct isu_ep {
    char host[64];
    int port;
    ucp_ep_h ep;
    volatile int failed;
    int stale; /* abandoned after a timeout: never reused, closed with the client */
    int peer_errors; /* UCP_ERR_HANDLING_MODE_PEER: a force-close is defined, the server told */
    ucs_status_t status;
    struct isu_ep *next;
} isu_ep;

typedef struct {
    isu_base b;
    isu_ep *eps;
    isu_ep *cur; /* endpoint of the pending fetch */
    uint64_t next_id;
    uint64_t want_id;
    int have_reply;
    char *reply;       /* JSON reply header (malloc) */
    size_t reply_len;
    void *data;        /* body: rndv descriptor, persistent eager data or malloc copy */
    size_t data_len;
    int data_kind;     /* 0 none, 1 rndv descriptor, 2 persistent eager, 3 malloc copy */
} isu_client;

enum { DATA_NONE = 0, DATA_RNDV = 1, DATA_UCP = 2, DATA_COPY = 3 };

static void client_drop_reply(isu_client *c) {
    if (c->data_kind == DATA_RNDV || c->data_kind == DATA_UCP)
        ucp_am_data_release(c->b.worker, c->data);
    else if (c->data_kind == DATA_COPY)
        free(c->data);
    free(c->reply);
    c->reply = NULL;
    c->reply_len = 0;
    c->data = NULL;
    c->data_len = 0;
    c->data_kind = DATA_NONE;
    c->have_reply = 0;
}

static ucs_status_t client_am_reply(void *arg, const void *header, size_t header_length,
                                    void *data, size_t length,
                                    const ucp_am_recv_param_t *param) {
    isu_client *c = arg;
    uint64_t id;
    if (header_length < ISU_ID_BYTES || header_length > ISU_ID_BYTES + ISU_MAX_HEADER)
        return UCS_OK; /* malformed: dropped */
    memcpy(&id, header, sizeof(id));
    if (c->have_reply || id != c->want_id)
        return UCS_OK; /* the reply of an abandoned request: dropped */
    size_t n = header_length - ISU_ID_BYTES;
    char *copy = malloc(n + 1);
    if (copy == NULL)
        return UCS_OK;
    memcpy(copy, (const char *)header + ISU_ID_BYTES, n);
    copy[n] = '\0';
    ucs_status_t ret = UCS_OK;
    c->data_kind = DATA_NONE;
    c->data = NULL;
    c->data_len = length;
    if (length > 0) {
        if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
            c->data_kind = DATA_RNDV;
            c->data = data;
            ret = UCS_INPROGRESS;
        } else if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) {
            c->data_kind = DATA_UCP;
            c->data = data;
            ret = UCS_INPROGRESS;
        } else {
            void *buf = malloc(length);
            if (buf == NULL) {
                free(copy);
                return UCS_OK;
            }
            memcpy(buf, data, length);
            c->data_kind = DATA_COPY;
            c->data = buf;
        }
    }
    c->reply = copy;
    c->reply_len = n;
    c->have_reply = 1;
    return ret;
}

static void client_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    isu_ep *e = arg;
    e->failed = 1;
    e->status = status;
}

ISU_API isu_client *isu_client_new(char *err, size_t errlen) {
    isu_client *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        set_err(err, errlen, "out of memory");
        return NULL;
    }
    if (base_init(&c->b, err, errlen) != 0) {
        free(c);
        return NULL;
    }
    ucp_am_handler_param_t hp;
    memset(&hp, 0, sizeof(hp));
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = ISU_AM_REP;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = client_am_reply;
    hp.arg = c;
    ucs_status_t st = ucp_worker_set_am_recv_handler(c->b.worker, &hp);
    if (st != UCS_OK) {
        set_err(err, errlen, "ucp_worker_set_am_recv_handler: %s", ucs_status_string(st));
        base_fini(&c->b);
        free(c);
        return NULL;
    }
    return c;
}

static int client_forget_ep(isu_client *c, isu_ep *e, int force) {
    isu_ep **pp = &c->eps;
    while (*pp != NULL && *pp != e)
        pp = &(*pp)->next;
    if (*pp == e)
        *pp = e->next;
    if (c->cur == e)
        c->cur = NULL;
    int closed = close_ep(&c->b, e->ep, force || e->failed);
    free(e);
    return closed;
}

/*
 * Abandon an endpoint after a timeout. One with peer failure handling (another host's) is
 * force-closed now: kept, it held one of the owner's max_peers places until the thread ended,
 * and an overloaded owner got more connections with every timeout. One without (the same
 * host's, over shared memory) is not: force-closing such an endpoint is undefined in UCX's
 * API, and crashed UCX 1.13 later, when its peer died (in ucp_worker_destroy). It stays in
 * the list, unused, and is closed with the client.
 */
static void client_retire_ep(isu_client *c, isu_ep *e) {
    if (e->peer_errors) {
        client_forget_ep(c, e, 1);
        return;
    }
    e->stale = 1;
    if (c->cur == e)
        c->cur = NULL;
}

static isu_ep *client_ep(isu_client *c, const char *host, int port, int *reused, char *err,
                         size_t errlen) {
    for (isu_ep *e = c->eps; e != NULL; e = e->next) {
        if (e->port == port && strcmp(e->host, host) == 0 && !e->stale) {
            if (!e->failed) {
                *reused = 1;
                return e;
            }
            client_forget_ep(c, e, 1);
            break;
        }
    }
    *reused = 0;
    struct sockaddr_in sa;
    if (fill_sockaddr(&sa, host, port, err, errlen) != 0)
        return NULL;
    isu_ep *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        set_err(err, errlen, "out of memory");
        return NULL;
    }
    snprintf(e->host, sizeof(e->host), "%s", host);
    e->port = port;
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = (const struct sockaddr *)&sa;
    ep.sockaddr.addrlen = sizeof(sa);
    ep.err_mode = err_mode_for(&sa);
    e->peer_errors = ep.err_mode == UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = client_ep_error;
    ep.err_handler.arg = e;
    ucs_status_t st = ucp_ep_create(c->b.worker, &ep, &e->ep);
    if (st != UCS_OK) {
        set_err(err, errlen, "cannot connect to %s:%d: %s", host, port, ucs_status_string(st));
        free(e);
        return NULL;
    }
    e->next = c->eps;
    c->eps = e;
    return e;
}

/*
 * Send the request `req` (signed JSON) to host:port and wait for the reply header.
 * On success returns 0, copies the JSON reply into `out` (NUL-terminated, truncated to
 * `cap` - 1) and the body size into `*body`. Errors: -ECONNRESET (peer failed or
 * unreachable; `*reused` tells whether a kept-alive endpoint failed, worth one retry),
 * -EAGAIN (the server rejected the connection: at its max_peers, every connection answering),
 * -ETIMEDOUT (no reply within `timeout_ms`; the endpoint is dropped), -EINVAL.
 */
ISU_API int isu_client_request(isu_client *c, const char *host, int port, const char *req,
                               size_t reqlen, char *out, size_t cap, uint64_t *body,
                               int *reused, int64_t timeout_ms, char *err, size_t errlen) {
    *reused = 0;
    if (reqlen > ISU_MAX_HEADER) {
        set_err(err, errlen, "request header of %zu bytes exceeds %d", reqlen, ISU_MAX_HEADER);
        return -EINVAL;
    }
    if (c->have_reply)
        client_drop_reply(c);
    isu_ep *e = client_ep(c, host, port, reused, err, errlen);
    if (e == NULL)
        return -ECONNRESET;
    c->cur = e;
    uint64_t id = ++c->next_id;
    c->want_id = id;
    size_t hlen = ISU_ID_BYTES + reqlen;
    char *hdr = malloc(hlen);
    if (hdr == NULL) {
        set_err(err, errlen, "out of memory");
        return -ENOMEM;
    }
    memcpy(hdr, &id, ISU_ID_BYTES);
    memcpy(hdr + ISU_ID_BYTES, req, reqlen);
    isu_op *op = calloc(1, sizeof(*op));
    if (op == NULL) {
        free(hdr);
        set_err(err, errlen, "out of memory");
        return -ENOMEM;
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                     UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    p.cb.send = op_send_cb;
    p.user_data = op;
    void *sreq = ucp_am_send_nbx(e->ep, ISU_AM_REQ, hdr, hlen, NULL, 0, &p);
    if (UCS_PTR_IS_ERR(sreq)) {
        free(hdr);
        free(op);
        set_err(err, errlen, "send to %s:%d failed: %s", host, port,
                ucs_status_string(UCS_PTR_STATUS(sreq)));
        client_forget_ep(c, e, 1);
        return -ECONNRESET;
    }
    if (sreq == NULL)
        op->done = 1;
    int64_t deadline = deadline_after_ms(timeout_ms);
    int rc = 0;
    while (!c->have_reply && !e->failed) {
        rc = base_step(&c->b, deadline, !op->done);
        if (rc == -ETIMEDOUT || rc == -EINTR)
            break;
        rc = 0;
    }
    int held = 1; /* the send's request, record and header are still ours to free */
    if (op->done) {
        if (sreq != NULL)
            ucp_request_free(sreq);
        free(op);
        free(hdr);
        held = 0;
    } else if (e->failed) {
        ucs_status_t why = e->status;
        client_forget_ep(c, e, 1); /* completes the send (with an error) */
        e = NULL;
        if (op->done) {
            ucp_request_free(sreq);
            free(op);
            free(hdr);
            held = 0;
        } /* else: leaked with its request, which UCX may still complete */
        if (!c->have_reply) {
            set_err(err, errlen, "connection to %s:%d failed: %s", host, port,
                    ucs_status_string(why));
            return why == UCS_ERR_REJECTED ? -EAGAIN : -ECONNRESET;
        }
    }
    if (c->have_reply)
        goto ok;
    if (e->failed) {
        ucs_status_t why = e->status;
        set_err(err, errlen, "connection to %s:%d failed: %s", host, port,
                ucs_status_string(why));
        client_forget_ep(c, e, 1);
        /* (a server at its max_peers rejects the connection: it may have room soon) */
        return why == UCS_ERR_REJECTED ? -EAGAIN : -ECONNRESET;
    }
    /* timed out: a send still in flight on a silent peer stays with UCX (leaked) unless the
       endpoint's close completes it */
    client_retire_ep(c, e);
    if (held && op->done) {
        ucp_request_free(sreq);
        free(op);
        free(hdr);
    }
    if (rc == -EINTR) {
        set_err(err, errlen, "interrupted");
        return -EINTR;
    }
    set_err(err, errlen, "no reply from %s:%d within %lld ms", host, port, (long long)timeout_ms);
    return -ETIMEDOUT;
ok:
    if (cap > 0) {
        size_t n = c->reply_len < cap - 1 ? c->reply_len : cap - 1;
        memcpy(out, c->reply, n);
        out[n] = '\0';
    }
    *body = c->data_len;
    return 0;
}

/*
 * Receive the body of the reply returned by the last isu_client_request() into `buf`
 * (`size` must be the announced size). Returns 0; -ECONNRESET when the peer fails
 * mid-transfer; -ETIMEDOUT past `timeout_ms` (the endpoint is dropped); -EBUSY when the
 * buffer may still be written by UCX (the caller must then never reuse or free it).
 */
static int client_receive(isu_client *c, void *buf, uint64_t size, int64_t timeout_ms,
                          char *err, size_t errlen);

/* The count of receives under way in this process (isu_count_receives; NULL: not counted):
 * a helper making a file ahead waits while it is above 0 and for 2 ms after the last
 * (libinstride_local's isl_spare_yield_to), so that its zeros do not compete with the bytes for memory bandwidth. */
static int64_t *volatile receiving;

/* Count receives in count[0] and stamp count[1] with the end of the last (CLOCK_MONOTONIC, ns). */
ISU_API void isu_count_receives(int64_t *count) { receiving = count; }

ISU_API int isu_client_receive(isu_client *c, void *buf, uint64_t size, int64_t timeout_ms,
                               char *err, size_t errlen) {
    int64_t *count = receiving;
    if (count != NULL)
        __atomic_fetch_add(&count[0], 1, __ATOMIC_RELAXED);
    int rc = client_receive(c, buf, size, timeout_ms, err, errlen);
    if (count != NULL) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        __atomic_store_n(&count[1], (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec, __ATOMIC_RELAXED);
        __atomic_fetch_sub(&count[0], 1, __ATOMIC_RELEASE); /* (the stamp seen with the count) */
    }
    return rc;
}

static int client_receive(isu_client *c, void *buf, uint64_t size, int64_t timeout_ms,
                          char *err, size_t errlen) {
    if (!c->have_reply || size != c->data_len) {
        set_err(err, errlen, "no pending body of %llu bytes", (unsigned long long)size);
        return -EINVAL;
    }
    isu_ep *e = c->cur;
    int kind = c->data_kind;
    if (kind == DATA_COPY || kind == DATA_UCP) {
        memcpy(buf, c->data, size);
        client_drop_reply(c);
        return 0;
    }
    if (kind == DATA_NONE) {
        client_drop_reply(c);
        return 0;
    }
    /* rendezvous: UCP takes the descriptor over */
    void *desc = c->data;
    c->data = NULL;
    c->data_kind = DATA_NONE;
    client_drop_reply(c);
    isu_op *op = calloc(1, sizeof(*op));
    if (op == NULL) {
        ucp_am_data_release(c->b.worker, desc);
        set_err(err, errlen, "out of memory");
        return -ENOMEM;
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_contig(1);
    p.cb.recv_am = op_recv_cb;
    p.user_data = op;
    void *rreq = ucp_am_recv_data_nbx(c->b.worker, desc, buf, size, &p);
    if (UCS_PTR_IS_ERR(rreq)) {
        free(op);
        set_err(err, errlen, "receive failed: %s", ucs_status_string(UCS_PTR_STATUS(rreq)));
        if (e != NULL)
            client_forget_ep(c, e, 1);
        return -ECONNRESET;
    }
    if (rreq == NULL) {
        free(op);
        return 0;
    }
    int64_t deadline = deadline_after_ms(timeout_ms);
    while (!op->done && !(e != NULL && e->failed)) {
        if (base_step(&c->b, deadline, 1) == -ETIMEDOUT)
            break;
    }
    if (!op->done) {
        /* stalled or failed: drop the endpoint, which should complete the receive */
        int failed = e != NULL && e->failed;
        if (e != NULL)
            client_forget_ep(c, e, 1);
        wait_op(&c->b, op, now_ns() + ISU_CLOSE_WAIT_NS);
        if (!op->done) {
            set_err(err, errlen, "body stalled and could not be cancelled");
            return -EBUSY; /* the request, its record and the buffer stay with UCX */
        }
        ucp_request_free(rreq);
        free(op);
        if (failed) {
            set_err(err, errlen, "the peer failed during the body");
            return -ECONNRESET;
        }
        set_err(err, errlen, "body not received within %lld ms", (long long)timeout_ms);
        return -ETIMEDOUT;
    }
    ucs_status_t status = op->status;
    ucp_request_free(rreq);
    free(op);
    if (status != UCS_OK) {
        set_err(err, errlen, "body transfer failed: %s", ucs_status_string(status));
        if (e != NULL)
            client_forget_ep(c, e, 1);
        return -ECONNRESET;
    }
    return 0;
}

/* Drop the body of the last reply without receiving it. */
ISU_API void isu_client_discard(isu_client *c) {
    if (c->have_reply)
        client_drop_reply(c);
}

/* Describe the endpoint to host:port (the transports UCX chose); 0 or -ENOENT. */
ISU_API int isu_client_ep_info(isu_client *c, const char *host, int port, char *out, size_t cap) {
    for (isu_ep *e = c->eps; e != NULL; e = e->next) {
        if (e->port == port && strcmp(e->host, host) == 0 && !e->failed) {
            char *text = NULL;
            size_t len = 0;
            FILE *fh = open_memstream(&text, &len);
            if (fh == NULL)
                return -ENOMEM;
            ucp_ep_print_info(e->ep, fh);
            fclose(fh);
            snprintf(out, cap, "%s", text ? text : "");
            free(text);
            return 0;
        }
    }
    return -ENOENT;
}

/*
 * Close every endpoint and the worker. Endpoints abandoned after a timeout, or whose close
 * does not finish, may still hold requests; UCX 1.13 aborts (pending requests) or crashes
 * (sockcm cleanup) when such a worker is destroyed, so the worker is then left to the
 * process (its memory and sockets are released at exit).
 */
ISU_API void isu_client_close(isu_client *c) {
    if (c == NULL)
        return;
    if (c->have_reply)
        client_drop_reply(c);
    int clean = 1;
    while (c->eps != NULL) {
        isu_ep *e = c->eps;
        if (e->stale) {
            c->eps = e->next;
            free(e);
            clean = 0;
        } else if (!client_forget_ep(c, e, 0)) {
            clean = 0;
        }
    }
    if (clean)
        base_fini(&c->b);
    free(c);
}

/* ================================================================== server */

typedef struct isu_conn {
    ucp_ep_h ep;
    volatile int failed;
    int sends;     /* sends in flight on it */
    int closing;   /* close once its sends are done (it sent a malformed request) */
    int requests;  /* requests it sent */
    int pending;   /* of which queued or being answered */
    int peer_errors; /* UCP_ERR_HANDLING_MODE_PEER: its client learns that it was closed */
    int64_t last;  /* now_ns() of its connection, or of its last request */
    struct isu_conn *next;
} isu_conn;

typedef struct isu_item {
    uint64_t id;
    ucp_ep_h ep;
    struct isu_conn *conn; /* (NULL once the connection is gone) */
    char *hdr;
    size_t len;
    struct isu_item *next;
} isu_item;

typedef struct isu_send {
    isu_op op;
    void *req;
    void *hdr;
    void *map;
    size_t len;
    int fd;
    isu_conn *conn;
    int64_t deadline;
    struct isu_send *next;
} isu_send;

typedef struct {
    isu_base b;
    ucp_listener_h listener;
    int port;
    isu_conn *conns;
    int nconns;
    isu_item *head, *tail;
    isu_item *current; /* the request returned by the last isu_server_next() */
    isu_send *sends;
    int max_conns;
    uint64_t refused;
    uint64_t busy; /* connections rejected: max_conns reached */
    uint64_t sent_bytes;
    uint64_t failed_sends;
    int64_t first_ns; /* a connection's first request within this, or it is closed (< 0: no bound) */
    int64_t idle_ns;  /* a connection idle this long is closed (< 0: no bound) */
    int64_t scan_at;  /* now_ns() of the next look for such connections */
    uint64_t idle_closed;
    uint64_t evicted; /* idle connections closed to make room for a new one */
} isu_server;

static isu_conn *server_conn(isu_server *s, ucp_ep_h ep) {
    for (isu_conn *k = s->conns; k != NULL; k = k->next)
        if (k->ep == ep)
            return k;
    return NULL;
}

static void server_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    (void)status;
    isu_conn *k = arg;
    k->failed = 1;
}

/*
 * At max_conns, the connection to close for a new one: the one idle the longest among those
 * that sent a request, have none queued, no reply in flight, and whose client learns of the
 * close (peer failure handling: its next request fails at once and goes again on a new
 * connection; without it, as over shared memory, the client would wait out its timeout).
 * Clients keep their connections for their next request, so without this a server whose
 * places were all taken by idle kept-alive connections rejected every new client. NULL when
 * every connection is answering.
 */
static isu_conn *server_victim(isu_server *s) {
    isu_conn *best = NULL;
    for (isu_conn *k = s->conns; k != NULL; k = k->next) {
        if (k->failed || k->closing || k->sends > 0 || k->pending > 0 || k->requests == 0 ||
            !k->peer_errors)
            continue;
        if (best == NULL || k->last < best->last)
            best = k;
    }
    return best;
}

static void server_conn_cb(ucp_conn_request_h conn_request, void *arg) {
    isu_server *s = arg;
    int live = 0;
    for (isu_conn *k = s->conns; k != NULL; k = k->next)
        live += !k->failed; /* (failed ones go at the next housekeeping) */
    if (live >= s->max_conns) {
        isu_conn *victim = server_victim(s);
        if (victim == NULL) {
            s->busy++;
            ucp_listener_reject(s->listener, conn_request);
            return;
        }
        victim->failed = 1; /* closed by the next housekeeping, right after this progress */
        s->evicted++;
    }
    isu_conn *k = calloc(1, sizeof(*k));
    if (k == NULL) {
        ucp_listener_reject(s->listener, conn_request);
        return;
    }
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.conn_request = conn_request;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ucp_conn_request_attr_t ca;
    memset(&ca, 0, sizeof(ca));
    ca.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ucp_conn_request_query(conn_request, &ca) == UCS_OK && ca.client_address.ss_family == AF_INET)
        ep.err_mode = err_mode_for((const struct sockaddr_in *)&ca.client_address);
    k->peer_errors = ep.err_mode == UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = server_ep_error;
    ep.err_handler.arg = k;
    if (ucp_ep_create(s->b.worker, &ep, &k->ep) != UCS_OK) {
        free(k);
        return;
    }
    k->last = now_ns();
    k->next = s->conns;
    s->conns = k;
    s->nconns++;
}

static ucs_status_t server_am_request(void *arg, const void *header, size_t header_length,
                                      void *data, size_t length,
                                      const ucp_am_recv_param_t *param) {
    (void)data;
    (void)length;
    isu_server *s = arg;
    isu_conn *k = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) && param->reply_ep != NULL
                      ? server_conn(s, param->reply_ep)
                      : NULL;
    if (k != NULL) {
        k->last = now_ns();
        k->requests++;
    }
    if (k == NULL || header_length <= ISU_ID_BYTES || header_length > ISU_ID_BYTES + ISU_MAX_HEADER) {
        s->refused++;
        if (k != NULL)
            k->closing = 1; /* (no reply to a malformed request: the connection goes) */
        return UCS_OK;
    }
    if (k->failed)
        return UCS_OK; /* (closed at the next housekeeping: its requests are answered by nobody) */
    if (k->pending >= ISU_MAX_PENDING) {
        /* a client waits for each reply: a peer sending more is flooding the server, whose
           queue would grow without bound; it goes, its queued requests unanswered */
        s->refused++;
        k->failed = 1;
        return UCS_OK;
    }
    isu_item *it = calloc(1, sizeof(*it));
    if (it == NULL)
        return UCS_OK;
    it->len = header_length - ISU_ID_BYTES;
    it->hdr = malloc(it->len + 1);
    if (it->hdr == NULL) {
        free(it);
        return UCS_OK;
    }
    memcpy(&it->id, header, ISU_ID_BYTES);
    memcpy(it->hdr, (const char *)header + ISU_ID_BYTES, it->len);
    it->hdr[it->len] = '\0';
    it->ep = param->reply_ep;
    it->conn = k;
    k->pending++;
    if (s->tail != NULL)
        s->tail->next = it;
    else
        s->head = it;
    s->tail = it;
    return UCS_OK;
}

/*
 * Listen on host:port (port 0: any free port, see isu_server_port) and accept at most
 * `max_conns` connections at once (<= 0 or more than ISU_MAX_CONNS: ISU_MAX_CONNS); more are
 * rejected and counted as busy.
 */
ISU_API isu_server *isu_server_start(const char *host, int port, int max_conns, char *err,
                                     size_t errlen) {
    struct sockaddr_in sa;
    if (fill_sockaddr(&sa, host, port, err, errlen) != 0)
        return NULL;
    isu_server *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        set_err(err, errlen, "out of memory");
        return NULL;
    }
    s->max_conns = max_conns > 0 && max_conns < ISU_MAX_CONNS ? max_conns : ISU_MAX_CONNS;
    s->first_ns = s->idle_ns = -1;
    if (base_init(&s->b, err, errlen) != 0) {
        free(s);
        return NULL;
    }
    ucp_am_handler_param_t hp;
    memset(&hp, 0, sizeof(hp));
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = ISU_AM_REQ;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = server_am_request;
    hp.arg = s;
    ucs_status_t st = ucp_worker_set_am_recv_handler(s->b.worker, &hp);
    if (st != UCS_OK) {
        set_err(err, errlen, "ucp_worker_set_am_recv_handler: %s", ucs_status_string(st));
        base_fini(&s->b);
        free(s);
        return NULL;
    }
    ucp_listener_params_t lp;
    memset(&lp, 0, sizeof(lp));
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = (const struct sockaddr *)&sa;
    lp.sockaddr.addrlen = sizeof(sa);
    lp.conn_handler.cb = server_conn_cb;
    lp.conn_handler.arg = s;
    st = ucp_listener_create(s->b.worker, &lp, &s->listener);
    if (st != UCS_OK) {
        set_err(err, errlen, "cannot listen on %s:%d: %s", host, port, ucs_status_string(st));
        base_fini(&s->b);
        free(s);
        return NULL;
    }
    ucp_listener_attr_t la;
    memset(&la, 0, sizeof(la));
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s->port = port;
    if (ucp_listener_query(s->listener, &la) == UCS_OK)
        s->port = ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    return s;
}

ISU_API int isu_server_port(isu_server *s) { return s->port; }

/* Counters: bytes sent, failed sends, refused requests, busy rejections, connections now. */
ISU_API void isu_server_stats(isu_server *s, uint64_t *out5) {
    out5[0] = s->sent_bytes;
    out5[1] = s->failed_sends;
    out5[2] = s->refused;
    out5[3] = s->busy;
    out5[4] = (uint64_t)s->nconns;
}

/* Connections closed for sending no request in time (first_ms) or for idling (idle_ms). */
ISU_API uint64_t isu_server_idle_closed(isu_server *s) { return s->idle_closed; }

/* Idle connections closed at max_conns to make room for a new one. */
ISU_API uint64_t isu_server_evicted(isu_server *s) { return s->evicted; }

/* A connection must send its first request within first_ms of its connection, and is closed
 * after idle_ms without one (< 0: no bound): a connection nobody uses never holds one of the
 * max_conns places for long. (A client's kept endpoint to a server that closed it is not told
 * so on every transport of UCX 1.13: its next request would wait for a reply that never
 * comes. So the node server bounds the first request alone.) */
ISU_API void isu_server_limits(isu_server *s, int64_t first_ms, int64_t idle_ms) {
    s->first_ns = first_ms < 0 ? -1 : first_ms * 1000000LL;
    s->idle_ns = idle_ms < 0 ? -1 : idle_ms * 1000000LL;
}



/* Another thread interrupts isu_server_next() (and only that). */
ISU_API void isu_server_wake(isu_server *s) {
    uint64_t one = 1;
    if (write(s->b.wake, &one, sizeof(one)) < 0) {
        /* the counter is saturated: a wake-up is pending anyway */
    }
}

static void send_free(isu_send *x) {
    if (x->req != NULL)
        ucp_request_free(x->req);
    if (x->map != NULL && x->map != MAP_FAILED)
        munmap(x->map, x->len);
    if (x->fd >= 0)
        close(x->fd);
    free(x->hdr);
    free(x);
}

/* Reap finished sends, drop failed connections and sends past their deadline. */
ISU_API int isu_server_pending(isu_server *s);

static void server_housekeeping(isu_server *s) {
    int64_t now = now_ns();
    for (isu_send *x = s->sends; x != NULL; x = x->next) {
        if (!x->op.done && x->conn != NULL && !x->conn->failed && x->deadline >= 0 &&
            now > x->deadline)
            x->conn->failed = 1; /* the peer stopped reading: drop it */
    }
    for (isu_conn *k = now >= s->scan_at ? s->conns : NULL; k != NULL; k = k->next) {
        if (k->failed || k->sends > 0 || k->pending > 0)
            continue;
        int64_t bound = k->requests == 0 ? s->first_ns : s->idle_ns;
        if (k->closing) {
            k->failed = 1;
        } else if (bound >= 0 && now - k->last > bound) {
            k->failed = 1;
            s->idle_closed++;
        }
    }
    if (now >= s->scan_at)
        s->scan_at = now + 100000000LL; /* (bounds of seconds: a look every 100 ms) */
    isu_conn **kp = &s->conns;
    while (*kp != NULL) {
        isu_conn *k = *kp;
        if (k->failed) {
            *kp = k->next;
            s->nconns--;
            /* pending requests of this endpoint are answered by nobody */
            for (isu_item *it = s->head; it != NULL; it = it->next)
                if (it->ep == k->ep)
                    it->ep = NULL, it->conn = NULL;
            if (s->current != NULL && s->current->ep == k->ep)
                s->current->ep = NULL, s->current->conn = NULL;
            close_ep(&s->b, k->ep, 1); /* completes its sends with an error */
            for (isu_send *x = s->sends; x != NULL; x = x->next)
                if (x->conn == k)
                    x->conn = NULL;
            free(k);
        } else {
            kp = &k->next;
        }
    }
    isu_send **xp = &s->sends;
    while (*xp != NULL) {
        isu_send *x = *xp;
        if (x->op.done) {
            *xp = x->next;
            if (x->op.status == UCS_OK)
                s->sent_bytes += x->len;
            else
                s->failed_sends++;
            if (x->conn != NULL)
                x->conn->sends--;
            send_free(x);
        } else {
            xp = &x->next;
        }
    }
}

static void item_free(isu_item *it) {
    if (it != NULL) {
        if (it->conn != NULL)
            it->conn->pending--;
        free(it->hdr);
        free(it);
    }
}

/*
 * Wait for the next request. Returns its JSON header length (> 0) and copies it into `out`
 * (NUL-terminated; a header longer than `cap` - 1 is truncated), 0 when `timeout_ms` passed
 * with no request, -EINTR when woken by isu_server_wake().
 */
ISU_API int isu_server_next(isu_server *s, char *out, size_t cap, int64_t timeout_ms) {
    item_free(s->current);
    s->current = NULL;
    int64_t deadline = deadline_after_ms(timeout_ms);
    for (;;) {
        server_housekeeping(s);
        if (s->head != NULL) {
            isu_item *it = s->head;
            s->head = it->next;
            if (s->head == NULL)
                s->tail = NULL;
            it->next = NULL;
            s->current = it;
            if (cap > 0) {
                size_t n = it->len < cap - 1 ? it->len : cap - 1;
                memcpy(out, it->hdr, n);
                out[n] = '\0';
            }
            return (int)it->len;
        }
        int rc = base_step(&s->b, deadline, isu_server_pending(s) > 0);
        if (rc == -ETIMEDOUT)
            return 0;
        if (rc == -EINTR)
            return -EINTR;
    }
}

/*
 * Answer the request returned by the last isu_server_next(): the JSON `reply` and, when
 * `fd` >= 0, the first `size` bytes of that file as the body. The file descriptor is taken
 * over (closed when the send ends). `deadline_ms` bounds the send (-1: none): a peer that
 * does not take the body by then is disconnected. Returns 0, or a negative errno (the
 * request's peer is gone, mmap failed...).
 */
ISU_API int isu_server_reply(isu_server *s, const char *reply, size_t len, int fd, uint64_t size,
                             int64_t deadline_ms, char *err, size_t errlen) {
    isu_item *it = s->current;
    if (it == NULL || it->ep == NULL || len > ISU_MAX_HEADER) {
        if (fd >= 0)
            close(fd);
        set_err(err, errlen, it == NULL ? "no current request" : "the peer is gone");
        return -ENOTCONN;
    }
    isu_send *x = calloc(1, sizeof(*x));
    if (x == NULL) {
        if (fd >= 0)
            close(fd);
        set_err(err, errlen, "out of memory");
        return -ENOMEM;
    }
    x->fd = fd;
    x->hdr = malloc(ISU_ID_BYTES + len);
    if (x->hdr == NULL) {
        send_free(x);
        set_err(err, errlen, "out of memory");
        return -ENOMEM;
    }
    memcpy(x->hdr, &it->id, ISU_ID_BYTES);
    memcpy((char *)x->hdr + ISU_ID_BYTES, reply, len);
    if (fd >= 0 && size > 0) {
        x->map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
        if (x->map == MAP_FAILED) {
            int e = errno;
            x->map = NULL;
            send_free(x);
            set_err(err, errlen, "mmap: %s", strerror(e));
            return -e;
        }
        x->len = size;
    }
    x->conn = server_conn(s, it->ep);
    x->deadline = deadline_after_ms(deadline_ms);
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_contig(1);
    p.cb.send = op_send_cb;
    p.user_data = &x->op;
    void *req = ucp_am_send_nbx(it->ep, ISU_AM_REP, x->hdr, ISU_ID_BYTES + len, x->map, x->len,
                                &p);
    if (UCS_PTR_IS_ERR(req)) {
        s->failed_sends++;
        set_err(err, errlen, "send failed: %s", ucs_status_string(UCS_PTR_STATUS(req)));
        send_free(x);
        return -ECONNRESET;
    }
    if (req == NULL) {
        x->op.done = 1;
        x->op.status = UCS_OK;
    }
    x->req = req;
    if (x->conn != NULL)
        x->conn->sends++;
    x->next = s->sends;
    s->sends = x;
    return 0;
}

/* Close the connection of the request returned by the last isu_server_next() once its reply
 * is sent (a refused request: wrong token, malformed header). Kept open, a refused peer held
 * its place among max_peers for good -- one that never sent a valid request, too. */
ISU_API void isu_server_close_after(isu_server *s) {
    if (s->current != NULL && s->current->conn != NULL)
        s->current->conn->closing = 1;
}

/* Sends in flight. */
ISU_API int isu_server_pending(isu_server *s) {
    int n = 0;
    for (isu_send *x = s->sends; x != NULL; x = x->next)
        n += !x->op.done;
    return n;
}

/*
 * Stop: stop listening, give sends in flight up to `grace_ms` to finish, disconnect every
 * peer and free everything. Call from the thread that ran isu_server_next().
 */
ISU_API void isu_server_close(isu_server *s, int64_t grace_ms) {
    if (s == NULL)
        return;
    if (s->listener != NULL)
        ucp_listener_destroy(s->listener);
    s->listener = NULL;
    int64_t deadline = deadline_after_ms(grace_ms < 0 ? 0 : grace_ms);
    while (isu_server_pending(s) > 0) {
        server_housekeeping(s);
        if (base_step(&s->b, deadline, 1) == -ETIMEDOUT)
            break;
    }
    for (isu_conn *k = s->conns; k != NULL; k = k->next)
        k->failed = 1;
    server_housekeeping(s);
    /* sends not completed by the forced closes (should not happen): leak them rather than
       free memory UCX may still read */
    item_free(s->current);
    while (s->head != NULL) {
        isu_item *it = s->head;
        s->head = it->next;
        item_free(it);
    }
    if (s->sends == NULL)
        base_fini(&s->b);
    free(s);
}
