/*
 * rbr_server: an echo server for the rdmabridge C API.
 *
 * Shows how a server listens on an address, takes one connection request,
 * reads the client's private data and accepts with its own, keeps a full
 * queue of receives posted into slots of one library-allocated memory
 * region, echoes every message back unchanged from a second region (one
 * signaled send per message, with sends that cannot get a free slot queued
 * in arrival order), and finally waits for the client's disconnect - which
 * flushes the receives still posted - before tearing everything down in
 * reverse order.
 *
 * With -P it serves a plain peer, a client that knows nothing of rbr_client's
 * message pattern, private data or two phases - such as rdma_client from
 * rdmacm-utils, which sends one 16-byte message, waits for one 16-byte
 * message back and disconnects:
 *     rbr_server -P -a rdma://198.18.0.1:7471 -n 1 -s 16
 *     rdma_client -s 198.18.0.1 -p 7471
 * The server then expects COUNT messages in all (one phase, not 2*COUNT),
 * ignores the client's private data and the messages' content, echoes each
 * message back, and waits for the client's disconnect as usual.
 *
 * Usage: rbr_server [-a ADDR] [-n COUNT] [-s SIZE] [-v] [-q] [-P] [-p MODE]
 *                   [-S US]
 *   -a ADDR   address to listen on (default shm://rdmabridge-demo)
 *   -n COUNT  messages per client phase; the server echoes 2*COUNT (10000),
 *             or COUNT with -P
 *   -s SIZE   message size in bytes, 0 allowed, K/M suffixes (64)
 *   -v        verify the pattern of every received message (not with -P)
 *   -q        quiet: print only the "listening on" line and errors
 *   -P        plain peer: one phase of COUNT messages, content not checked
 *   -p MODE   completion progress: caller (the library's default) or thread
 *   -S US     rbr_cq_wait polls US microseconds before it sleeps
 *
 * The line "listening on ADDR" is printed (and flushed) once the listener
 * exists, so that scripts know when the client may connect.
 * Exit status 0 only if exactly 2*COUNT (with -P: COUNT) messages were
 * received, all of the expected size (and pattern, with -v), every echo
 * completed successfully, the client disconnected in order, and the only
 * completions that did not succeed were the receives still posted at the
 * disconnect (flushed).
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define REQUEST_TIMEOUT_MS 30000    /* wait for the client to connect */
#define IDLE_TIMEOUT_MS 30000       /* longest silence while echoing */
#define DISCONNECT_TIMEOUT_MS 10000 /* wait for the client's disconnect */
#define POLL_BATCH 64

struct server_opts {
    const char *addr;
    uint64_t count;
    size_t size;
    int verify;
    int quiet;
    struct ex_cq_opts cq; /* -p, -S */
    int plain;   /* -P: the client is a plain peer */
};

/* Everything the echo loop needs about the connection and its buffers. */
struct echo_state {
    const struct server_opts *o;
    rbr_cq *cq;
    rbr_conn *conn;
    uint64_t conn_id;
    const rbr_mr *recv_mr;
    const rbr_mr *send_mr;
    uint8_t *recv_base;
    uint8_t *send_base;
    size_t stride;
    uint32_t recv_depth;
    uint32_t send_depth;
    uint64_t total;        /* messages to echo: 2 * count, or count with -P */
    uint64_t received;     /* successful receive completions */
    uint64_t echoed;       /* sends posted */
    uint64_t sent_done;    /* successful send completions */
    uint64_t recv_posted;  /* receives posted in total */
    uint32_t *free_send;   /* stack of free send slots */
    uint32_t n_free_send;
    uint32_t *backlog;     /* FIFO of receive slots waiting for a send slot */
    uint32_t backlog_head;
    uint32_t backlog_len;
};

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-a ADDR] [-n COUNT] [-s SIZE] [-v] [-q] [-P] "
            "[-p MODE] [-S US]\n"
            "  -a ADDR   listen address (default %s)\n"
            "  -n COUNT  messages per client phase (default 10000)\n"
            "  -s SIZE   message size in bytes (default 64)\n"
            "  -v        verify every message\n"
            "  -q        quiet\n"
            "  -P        plain peer (e.g. rdma_client): expect COUNT\n"
            "            messages in one phase, do not check their content\n"
            "            or the client's private data (not with -v)\n"
            EX_CQ_OPTS_USAGE,
            argv0, EX_DEFAULT_ADDR);
}

static int parse_opts(int argc, char **argv, struct server_opts *o)
{
    uint64_t v;
    int ch;

    o->addr = EX_DEFAULT_ADDR;
    o->count = 10000;
    o->size = 64;
    o->verify = 0;
    o->quiet = 0;
    o->plain = 0;
    ex_cq_opts_init(&o->cq);
    while ((ch = getopt(argc, argv, "a:n:s:vqPp:S:h")) != -1) {
        switch (ch) {
        case 'a':
            o->addr = optarg;
            break;
        case 'n':
            if (ex_parse_size(optarg, &v) != 0 || v > UINT64_MAX / 2) {
                ex_error("bad count '%s'", optarg);
                return -1;
            }
            o->count = v;
            break;
        case 's':
            /* byte_len in a completion is 32 bits wide. */
            if (ex_parse_size(optarg, &v) != 0 || v > UINT32_MAX) {
                ex_error("bad size '%s'", optarg);
                return -1;
            }
            o->size = (size_t)v;
            break;
        case 'v':
            o->verify = 1;
            break;
        case 'q':
            o->quiet = 1;
            break;
        case 'P':
            o->plain = 1;
            break;
        case 'p':
        case 'S':
            if (ex_cq_opt(ch, optarg, &o->cq) != 0)
                return -1;
            break;
        default:
            usage(argv[0]);
            return -1;
        }
    }
    if (optind != argc) {
        usage(argv[0]);
        return -1;
    }
    if (o->plain && o->verify) {
        ex_error("-v and -P exclude each other: a plain client does not "
                 "send the test pattern");
        return -1;
    }
    return 0;
}

static int post_recv_slot(struct echo_state *s, uint32_t slot)
{
    if (ex_check(rbr_conn_post_recv(s->conn, s->recv_mr,
                                    (size_t)slot * s->stride, s->o->size,
                                    slot),
                 "rbr_conn_post_recv"))
        return -1;
    s->recv_posted++;
    return 0;
}

/*
 * Copies the message in receive slot `rslot` into a free send slot, sends
 * it, and gives the receive slot back to the connection.  With -P the slot
 * goes back only until one receive more than the expected messages has been
 * posted (that one catches a surplus message), and never after the last echo:
 * a plain client may disconnect as soon as it has its last echo, and a
 * receive posted after that would fail with RBR_ERR_DISCONNECTED.
 */
static int echo_slot(struct echo_state *s, uint32_t rslot, size_t len)
{
    uint32_t sslot = s->free_send[--s->n_free_send];

    memcpy(s->send_base + (size_t)sslot * s->stride,
           s->recv_base + (size_t)rslot * s->stride, len);
    if (ex_check(rbr_conn_post_send(s->conn, s->send_mr,
                                    (size_t)sslot * s->stride, len, sslot,
                                    RBR_SEND_SIGNALED),
                 "rbr_conn_post_send"))
        return -1;
    s->echoed++;
    if (s->o->plain && (s->recv_posted > s->total || s->echoed == s->total))
        return 0;
    /* Every message the client will send has a receive already: a repost
     * now could meet the client's disconnect (it may leave as soon as the
     * last echo arrives). */
    if (s->recv_posted >= s->total)
        return 0;
    return post_recv_slot(s, rslot);
}

/* Echoes queued messages, oldest first, while send slots are free. */
static int drain_backlog(struct echo_state *s)
{
    while (s->backlog_len > 0 && s->n_free_send > 0) {
        uint32_t rslot = s->backlog[s->backlog_head];

        s->backlog_head = (s->backlog_head + 1) % s->recv_depth;
        s->backlog_len--;
        if (echo_slot(s, rslot, s->o->size))
            return -1;
    }
    return 0;
}

static int handle_recv(struct echo_state *s, const rbr_completion *c)
{
    uint32_t slot;

    if (c->wr_id >= s->recv_depth) {
        ex_report_completion("receive with a wr_id never posted", c);
        return -1;
    }
    slot = (uint32_t)c->wr_id;
    if (s->received >= s->total) {
        ex_report_completion("message beyond the expected count", c);
        return -1;
    }
    if (c->byte_len != s->o->size) {
        ex_error("message %llu: %u bytes, expected %zu",
                 (unsigned long long)s->received, (unsigned)c->byte_len,
                 s->o->size);
        return -1;
    }
    if (s->o->verify &&
        ex_verify_pattern(s->recv_base + (size_t)slot * s->stride,
                          c->byte_len, s->received))
        return -1;
    s->received++;

    /* Keep echoes in arrival order: queue behind any backlog. */
    if (s->backlog_len == 0 && s->n_free_send > 0)
        return echo_slot(s, slot, c->byte_len);
    s->backlog[(s->backlog_head + s->backlog_len) % s->recv_depth] = slot;
    s->backlog_len++;
    return 0;
}

static int handle_send(struct echo_state *s, const rbr_completion *c)
{
    if (c->wr_id >= s->send_depth || s->n_free_send >= s->send_depth) {
        ex_report_completion("send completion that matches no posted send", c);
        return -1;
    }
    s->free_send[s->n_free_send++] = (uint32_t)c->wr_id;
    s->sent_done++;
    return drain_backlog(s);
}

/* Checks that a completion belongs to our connection and succeeded. */
static int check_completion(const struct echo_state *s, const rbr_completion *c)
{
    if (c->conn_id != s->conn_id) {
        ex_error("completion for connection %llu, expected %llu",
                 (unsigned long long)c->conn_id,
                 (unsigned long long)s->conn_id);
        return -1;
    }
    if (c->status == RBR_WC_FLUSHED) {
        ex_error("connection went down after %llu of %llu messages",
                 (unsigned long long)s->received,
                 (unsigned long long)s->total);
        ex_report_completion("work request flushed", c);
        return -1;
    }
    if (c->status != RBR_WC_SUCCESS) {
        ex_report_completion("failed work request", c);
        return -1;
    }
    return 0;
}

/* Receives and echoes until all `total` echoes are posted. */
static int echo_loop(struct echo_state *s)
{
    rbr_completion wc[POLL_BATCH];

    while (s->echoed < s->total) {
        size_t n = 0;
        size_t i;
        rbr_status st = ex_wait_completions(s->cq, wc, POLL_BATCH, &n,
                                            IDLE_TIMEOUT_MS);

        if (st == RBR_ERR_TIMEOUT) {
            ex_error("no completion for %d ms: received %llu, echoed %llu "
                     "(%llu completed) of %llu",
                     IDLE_TIMEOUT_MS, (unsigned long long)s->received,
                     (unsigned long long)s->echoed,
                     (unsigned long long)s->sent_done,
                     (unsigned long long)s->total);
            return -1;
        }
        if (ex_check(st, "waiting for completions"))
            return -1;
        for (i = 0; i < n; i++) {
            const rbr_completion *c = &wc[i];

            if (c->opcode == RBR_OP_DISCONNECTED) {
                ex_error("client disconnected after %llu of %llu messages",
                         (unsigned long long)s->received,
                         (unsigned long long)s->total);
                return -1;
            }
            if (check_completion(s, c))
                return -1;
            if (c->opcode == RBR_OP_RECV) {
                if (handle_recv(s, c))
                    return -1;
            } else if (c->opcode == RBR_OP_SEND) {
                if (handle_send(s, c))
                    return -1;
            } else {
                ex_report_completion("unexpected completion", c);
                return -1;
            }
        }
    }
    return 0;
}

/*
 * After the last echo is posted: waits for the client's disconnect, which
 * may come as soon as the client has its last echo - before the sends here
 * have all reported completion.  So until RBR_OP_DISCONNECTED, successful
 * send completions still count, and the receives still posted must come
 * back flushed; nothing else may arrive.  By then every echo must have
 * completed successfully.
 */
static int wait_disconnect(struct echo_state *s)
{
    uint64_t deadline = ex_now_ns() + (uint64_t)DISCONNECT_TIMEOUT_MS * 1000000u;
    uint64_t outstanding = s->recv_posted - s->received;
    uint64_t flushed = 0;

    for (;;) {
        rbr_completion c;
        uint64_t now = ex_now_ns();
        rbr_status st;

        if (now >= deadline) {
            st = RBR_ERR_TIMEOUT;
        } else {
            st = ex_wait_one(s->cq, &c,
                             (int32_t)((deadline - now + 999999u) / 1000000u));
        }
        if (st == RBR_ERR_TIMEOUT) {
            ex_error("no disconnect from the client within %d ms of the "
                     "last echo", DISCONNECT_TIMEOUT_MS);
            return -1;
        }
        if (ex_check(st, "waiting for the disconnect"))
            return -1;
        if (c.conn_id != s->conn_id) {
            ex_error("completion for connection %llu, expected %llu",
                     (unsigned long long)c.conn_id,
                     (unsigned long long)s->conn_id);
            return -1;
        }
        if (c.opcode == RBR_OP_DISCONNECTED) {
            if (c.status != RBR_WC_SUCCESS) {
                ex_report_completion("disconnect that was not orderly", &c);
                return -1;
            }
            break;
        }
        if (c.opcode == RBR_OP_SEND && c.status == RBR_WC_SUCCESS) {
            if (handle_send(s, &c))
                return -1;
            continue;
        }
        if (c.opcode == RBR_OP_RECV && c.status == RBR_WC_FLUSHED &&
            c.wr_id < s->recv_depth) {
            flushed++;
            continue;
        }
        ex_report_completion("unexpected completion after the last echo", &c);
        return -1;
    }
    if (s->sent_done != s->total) {
        ex_error("disconnected with %llu of %llu echoes completed",
                 (unsigned long long)s->sent_done,
                 (unsigned long long)s->total);
        return -1;
    }
    if (flushed != outstanding) {
        ex_error("%llu receives were posted at the disconnect but %llu "
                 "came back flushed",
                 (unsigned long long)outstanding, (unsigned long long)flushed);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    struct server_opts o;
    struct echo_state s;
    rbr_ctx *ctx = NULL;
    rbr_cq *cq = NULL;
    rbr_listener *listener = NULL;
    rbr_request *req = NULL;
    rbr_mr *recv_mr = NULL;
    rbr_mr *send_mr = NULL;
    rbr_conn *conn = NULL;
    rbr_conn_options copts;
    rbr_conn_info info;
    char pdata[RBR_PRIVATE_DATA_RECV_MAX];
    size_t pdata_len = 0;
    uint32_t i;
    int rc = EXIT_FAILURE;

    ex_set_progname(argv[0]);
    /* Line-buffered even into a pipe or file, so that output interleaves
     * with the (unbuffered) error messages in order. */
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse_opts(argc, argv, &o))
        return EXIT_FAILURE;

    memset(&s, 0, sizeof s);
    s.o = &o;
    s.total = o.plain ? o.count : 2 * o.count;
    s.stride = ex_slot_stride(o.size);

    rbr_conn_options_init(&copts);
    copts.private_data = EX_SERVER_HELLO;
    copts.private_data_len = strlen(EX_SERVER_HELLO);
    s.recv_depth = copts.recv_queue_depth;
    s.send_depth = copts.send_queue_depth;
    if (s.recv_depth == 0 || s.send_depth == 0) {
        ex_error("default queue depths are zero (%u/%u)",
                 (unsigned)copts.send_queue_depth,
                 (unsigned)copts.recv_queue_depth);
        return EXIT_FAILURE;
    }
    if (s.stride > SIZE_MAX / s.recv_depth ||
        s.stride > SIZE_MAX / s.send_depth) {
        ex_error("size %zu too large", o.size);
        return EXIT_FAILURE;
    }

    s.free_send = calloc(s.send_depth, sizeof *s.free_send);
    s.backlog = calloc(s.recv_depth, sizeof *s.backlog);
    if (s.free_send == NULL || s.backlog == NULL) {
        ex_error("out of memory");
        goto out_bookkeeping;
    }
    for (i = 0; i < s.send_depth; i++)
        s.free_send[i] = s.send_depth - 1 - i;
    s.n_free_send = s.send_depth;

    if (EX_CHECK(rbr_ctx_create(&ctx)))
        goto out_bookkeeping;
    if (EX_CHECK(ex_cq_create(&o.cq, &cq)))
        goto out_ctx;
    s.cq = cq;
    if (ex_check(rbr_listen(ctx, o.addr, 1, &listener), "rbr_listen"))
        goto out_cq;
    printf("listening on %s\n", o.addr);
    fflush(stdout);

    if (EX_CHECK(rbr_listener_get_request(listener, REQUEST_TIMEOUT_MS, &req)))
        goto out_listener;
    if (EX_CHECK(rbr_request_private_data(req, pdata, sizeof pdata, &pdata_len)))
        goto out_request;
    /* Only reported: a plain client sends whatever it likes, or nothing. */
    if (!o.quiet)
        printf("connection request with %zu bytes of private data\n",
               pdata_len);

    if (ex_check(rbr_mr_alloc(ctx, s.stride * s.recv_depth,
                              RBR_ACCESS_LOCAL_WRITE, &recv_mr),
                 "rbr_mr_alloc (receive slots)"))
        goto out_request;
    if (ex_check(rbr_mr_alloc(ctx, s.stride * s.send_depth,
                              RBR_ACCESS_LOCAL_WRITE, &send_mr),
                 "rbr_mr_alloc (send slots)"))
        goto out_recv_mr;
    s.recv_mr = recv_mr;
    s.send_mr = send_mr;
    s.recv_base = rbr_mr_addr(recv_mr);
    s.send_base = rbr_mr_addr(send_mr);
    if (s.recv_base == NULL || s.send_base == NULL) {
        ex_error("rbr_mr_addr returned NULL");
        goto out_send_mr;
    }

    if (ex_check(rbr_request_accept(req, cq, &copts, &conn),
                 "rbr_request_accept"))
        goto out_send_mr;
    s.conn = conn;
    s.conn_id = rbr_conn_id(conn);
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (EX_CHECK(rbr_conn_get_info(conn, &info)))
        goto out_conn;
    /* The library may grant less than asked; use what it granted. */
    if (info.recv_queue_depth == 0 || info.send_queue_depth == 0) {
        ex_error("granted queue depths are zero (%u/%u)",
                 (unsigned)info.send_queue_depth,
                 (unsigned)info.recv_queue_depth);
        goto out_conn;
    }
    if (info.recv_queue_depth < s.recv_depth)
        s.recv_depth = info.recv_queue_depth;
    if (info.send_queue_depth < s.send_depth) {
        s.send_depth = info.send_queue_depth;
        for (i = 0; i < s.send_depth; i++)
            s.free_send[i] = s.send_depth - 1 - i;
        s.n_free_send = s.send_depth;
    }
    if (!o.quiet)
        printf("accepted connection %llu over %s, queue depths %u/%u\n",
               (unsigned long long)s.conn_id,
               info.transport == RBR_TRANSPORT_SHM ? "shm" : "verbs",
               (unsigned)s.send_depth, (unsigned)s.recv_depth);

    for (i = 0; i < s.recv_depth; i++)
        if (post_recv_slot(&s, i))
            goto out_conn;

    if (echo_loop(&s))
        goto out_conn;
    if (wait_disconnect(&s))
        goto out_conn;
    if (!o.quiet)
        printf("echoed %llu messages of %zu bytes%s\n",
               (unsigned long long)s.echoed, o.size,
               o.verify ? ", all verified"
                        : o.plain ? " to a plain client" : "");
    rc = EXIT_SUCCESS;

out_conn:
    rbr_conn_destroy(conn);
out_send_mr:
    rbr_mr_destroy(send_mr);
out_recv_mr:
    rbr_mr_destroy(recv_mr);
out_request:
    rbr_request_destroy(req);
out_listener:
    rbr_listener_destroy(listener);
out_cq:
    rbr_cq_destroy(cq);
out_ctx:
    rbr_ctx_destroy(ctx);
out_bookkeeping:
    free(s.backlog);
    free(s.free_send);
    return rc;
}
