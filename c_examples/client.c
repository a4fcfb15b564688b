/*
 * rbr_client: latency and throughput client for the rdmabridge C API.
 *
 * Shows how a client connects with private data and reads the server's
 * answer (rbr_conn_private_data), pre-posts receives into slots of one
 * library-allocated memory region, and runs two phases against rbr_server:
 *   1. ping-pong: COUNT times send one message and wait for its echo;
 *      prints the median and 99th percentile one-way latency (RTT / 2);
 *   2. streaming: COUNT messages with up to WINDOW of them outstanding;
 *      prints throughput in MB/s and messages/s (one direction's bytes).
 * It then disconnects, waits for RBR_OP_DISCONNECTED (the receives still
 * posted come back flushed first) and tears everything down in reverse
 * order.
 *
 * With -P it talks to a plain peer, a server that knows nothing of
 * rbr_server's message pattern, private data or two phases - such as
 * rdma_server from rdmacm-utils, which receives one 16-byte message, sends
 * one 16-byte message back (not an echo) and disconnects:
 *     rdma_server -p 7471
 *     rbr_client -P -a rdma://198.18.0.1:7471 -n 1 -s 16
 * The client then runs only the ping-pong phase, ignores the server's
 * private data and the replies' content (each reply must still be SIZE
 * bytes long), and accepts that the server may disconnect first: the
 * RBR_OP_DISCONNECTED record may come before or after its own
 * rbr_conn_disconnect, but exactly one must come, with RBR_WC_SUCCESS.
 *
 * Usage: rbr_client [-a ADDR] [-n COUNT] [-s SIZE] [-w WINDOW] [-v] [-q] [-P]
 *                   [-p MODE] [-S US]
 *   -a ADDR    server address (default shm://rdmabridge-demo)
 *   -n COUNT   messages per phase (default 10000)
 *   -s SIZE    message size in bytes, 0 allowed, K/M suffixes (default 64)
 *   -w WINDOW  messages in flight in phase 2 (default 32; at most the
 *              default queue depth, which the server uses for receives);
 *              also the number of receives kept posted
 *   -v         fill every message with the test pattern and verify every
 *              echo (give -v to the server too, or to neither: without it
 *              the payload is not written, so timings exclude the fill;
 *              not with -P)
 *   -q         quiet: print only errors
 *   -P         plain peer: ping-pong only, content and private data not
 *              checked, the server may disconnect first
 *   -p MODE    completion progress: caller (the library's default: this
 *              thread takes completions from the device) or thread (the
 *              library's one thread per context does)
 *   -S US      rbr_cq_wait polls US microseconds before it sleeps
 *
 * Messages are numbered 0..2*COUNT-1 across both phases, in each direction.
 * Exit status 0 only if every echo arrived (and verified, with -v); with -P,
 * only if COUNT replies of SIZE bytes arrived, every send succeeded, the
 * receives still posted came back flushed and exactly one
 * RBR_OP_DISCONNECTED record with RBR_WC_SUCCESS followed them.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CONNECT_TIMEOUT_MS 5000
#define ECHO_TIMEOUT_MS 10000       /* longest wait for any completion */
#define DISCONNECT_TIMEOUT_MS 10000
#define POLL_BATCH 64

struct client_opts {
    const char *addr;
    uint64_t count;
    size_t size;
    uint32_t window;
    int verify;
    int quiet;
    struct ex_cq_opts cq; /* -p, -S */
    int plain;   /* -P: the server is a plain peer */
};

struct client_state {
    const struct client_opts *o;
    rbr_cq *cq;
    rbr_conn *conn;
    uint64_t conn_id;
    const rbr_mr *send_mr;
    const rbr_mr *recv_mr;
    uint8_t *send_base;
    uint8_t *recv_base;
    size_t stride;
    uint32_t slots;        /* send slots = receive slots = window */
    uint64_t total;        /* echoes expected: 2 * count, or count with -P */
    uint64_t next_send;    /* pattern number of the next message sent */
    uint64_t next_echo;    /* pattern number of the next echo expected */
    uint64_t recv_posted;  /* receives posted in total */
    uint32_t *free_send;   /* stack of free send slots */
    uint32_t n_free_send;
};

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-a ADDR] [-n COUNT] [-s SIZE] [-w WINDOW] [-v] [-q] "
            "[-P] [-p MODE] [-S US]\n"
            "  -a ADDR    server address (default %s)\n"
            "  -n COUNT   messages per phase (default 10000)\n"
            "  -s SIZE    message size in bytes (default 64)\n"
            "  -w WINDOW  messages in flight while streaming (default 32)\n"
            "  -v         write and verify the test pattern\n"
            "  -q         quiet\n"
            "  -P         plain peer (e.g. rdma_server): ping-pong only, do\n"
            "             not check the replies' content or the server's\n"
            "             private data, let the server disconnect first\n"
            "             (not with -v)\n" EX_CQ_OPTS_USAGE,
            argv0, EX_DEFAULT_ADDR);
}

static int parse_opts(int argc, char **argv, struct client_opts *o)
{
    uint64_t v;
    int ch;

    o->addr = EX_DEFAULT_ADDR;
    o->count = 10000;
    o->size = 64;
    o->window = 32;
    o->verify = 0;
    o->quiet = 0;
    o->plain = 0;
    ex_cq_opts_init(&o->cq);
    while ((ch = getopt(argc, argv, "a:n:s:w:vqPp:S:h")) != -1) {
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
        case 'w':
            if (ex_parse_size(optarg, &v) != 0 || v == 0 || v > UINT32_MAX) {
                ex_error("bad window '%s'", optarg);
                return -1;
            }
            o->window = (uint32_t)v;
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
        ex_error("-v and -P exclude each other: a plain server does not "
                 "echo the test pattern");
        return -1;
    }
    return 0;
}

static int post_recv_slot(struct client_state *s, uint32_t slot)
{
    if (ex_check(rbr_conn_post_recv(s->conn, s->recv_mr,
                                    (size_t)slot * s->stride, s->o->size,
                                    slot),
                 "rbr_conn_post_recv"))
        return -1;
    s->recv_posted++;
    return 0;
}

/* Sends the next message from a free send slot (the caller checked that
 * one is free). */
static int send_next(struct client_state *s)
{
    uint32_t slot = s->free_send[--s->n_free_send];
    uint8_t *buf = s->send_base + (size_t)slot * s->stride;

    if (s->o->verify)
        ex_fill_pattern(buf, s->o->size, s->next_send);
    if (ex_check(rbr_conn_post_send(s->conn, s->send_mr,
                                    (size_t)slot * s->stride, s->o->size,
                                    slot, RBR_SEND_SIGNALED),
                 "rbr_conn_post_send"))
        return -1;
    s->next_send++;
    return 0;
}

/* Checks that a completion belongs to our connection and succeeded. */
static int check_completion(const struct client_state *s,
                            const rbr_completion *c)
{
    if (c->opcode == RBR_OP_DISCONNECTED) {
        ex_error("server disconnected after %llu echoes",
                 (unsigned long long)s->next_echo);
        return -1;
    }
    if (c->conn_id != s->conn_id) {
        ex_error("completion for connection %llu, expected %llu",
                 (unsigned long long)c->conn_id,
                 (unsigned long long)s->conn_id);
        return -1;
    }
    if (c->status == RBR_WC_FLUSHED) {
        ex_error("connection went down after %llu of %llu echoes",
                 (unsigned long long)s->next_echo,
                 (unsigned long long)s->total);
        ex_report_completion("work request flushed", c);
        return -1;
    }
    if (c->status != RBR_WC_SUCCESS) {
        ex_report_completion("failed work request", c);
        return -1;
    }
    if (c->opcode != RBR_OP_SEND && c->opcode != RBR_OP_RECV) {
        ex_report_completion("unexpected completion", c);
        return -1;
    }
    if (c->wr_id >= s->slots) {
        ex_report_completion("completion with a wr_id never posted", c);
        return -1;
    }
    return 0;
}

/* A send completed: its slot is free again. */
static int handle_send(struct client_state *s, const rbr_completion *c)
{
    if (s->n_free_send >= s->slots) {
        ex_report_completion("send completion that matches no posted send", c);
        return -1;
    }
    s->free_send[s->n_free_send++] = (uint32_t)c->wr_id;
    return 0;
}

/*
 * An echo arrived: check it against the next expected message number and
 * give its buffer back to the connection.  With -P the buffer goes back only
 * until one receive more than the expected replies has been posted (that one
 * catches a surplus reply), and never after the last reply: a plain server
 * disconnects right after it, and a receive posted then would fail with
 * RBR_ERR_DISCONNECTED.
 */
static int handle_echo(struct client_state *s, const rbr_completion *c)
{
    uint32_t slot = (uint32_t)c->wr_id;

    if (s->next_echo >= s->next_send) {
        ex_report_completion("echo of a message never sent", c);
        return -1;
    }
    if (c->byte_len != s->o->size) {
        ex_error("echo %llu: %u bytes, expected %zu",
                 (unsigned long long)s->next_echo, (unsigned)c->byte_len,
                 s->o->size);
        return -1;
    }
    if (s->o->verify &&
        ex_verify_pattern(s->recv_base + (size_t)slot * s->stride,
                          c->byte_len, s->next_echo))
        return -1;
    s->next_echo++;
    if (s->o->plain &&
        (s->recv_posted > s->total || s->next_echo == s->total))
        return 0;
    return post_recv_slot(s, slot);
}

static int wait_batch(struct client_state *s, rbr_completion *wc, size_t max,
                      size_t *n)
{
    rbr_status st = ex_wait_completions(s->cq, wc, max, n, ECHO_TIMEOUT_MS);

    if (st == RBR_ERR_TIMEOUT) {
        ex_error("no completion for %d ms: sent %llu, echoes %llu",
                 ECHO_TIMEOUT_MS, (unsigned long long)s->next_send,
                 (unsigned long long)s->next_echo);
        return -1;
    }
    return ex_check(st, "waiting for completions");
}

/*
 * Phase 1: one message in flight; per-round-trip times go to rtt[].  With -P
 * completions are taken one at a time: a plain server disconnects right after
 * its last reply, so the flushed receives and RBR_OP_DISCONNECTED may queue
 * up behind that reply, and they are disconnect()'s to take.
 */
static int ping_pong(struct client_state *s, uint64_t *rtt)
{
    rbr_completion wc[POLL_BATCH];
    size_t batch = s->o->plain ? 1 : POLL_BATCH;
    uint64_t i;

    for (i = 0; i < s->o->count; i++) {
        uint64_t want_echo = s->next_echo + 1;
        uint64_t t0;
        uint64_t t1 = 0;

        /* Every send of the previous round has completed, so a slot is
         * free. */
        t0 = ex_now_ns();
        if (send_next(s))
            return -1;
        /* After a plain server's last reply the send's own completion may
         * come after the server's disconnect has flushed the receives (the
         * reply proves the send arrived): disconnect() takes it. */
        while (s->next_echo < want_echo ||
               (s->n_free_send < s->slots &&
                !(s->o->plain && s->next_echo == s->total))) {
            size_t n = 0;
            size_t j;

            if (wait_batch(s, wc, batch, &n))
                return -1;
            for (j = 0; j < n; j++) {
                if (check_completion(s, &wc[j]))
                    return -1;
                if (wc[j].opcode == RBR_OP_RECV) {
                    t1 = ex_now_ns();
                    if (handle_echo(s, &wc[j]))
                        return -1;
                } else if (handle_send(s, &wc[j])) {
                    return -1;
                }
            }
        }
        rtt[i] = t1 - t0;
    }
    return 0;
}

/* Phase 2: up to `window` messages in flight. */
static int stream(struct client_state *s)
{
    rbr_completion wc[POLL_BATCH];
    uint64_t first = s->next_send;
    uint64_t end = first + s->o->count;

    while (s->next_echo < end || s->n_free_send < s->slots) {
        size_t n = 0;
        size_t j;

        /* At most `window` echoes outstanding, and a send slot must be
         * free: a send may complete after its echo arrives. */
        while (s->next_send < end && s->n_free_send > 0 &&
               s->next_send - s->next_echo < s->slots)
            if (send_next(s))
                return -1;
        if (wait_batch(s, wc, POLL_BATCH, &n))
            return -1;
        for (j = 0; j < n; j++) {
            if (check_completion(s, &wc[j]))
                return -1;
            if (wc[j].opcode == RBR_OP_RECV) {
                if (handle_echo(s, &wc[j]))
                    return -1;
            } else if (handle_send(s, &wc[j])) {
                return -1;
            }
        }
    }
    return 0;
}

/*
 * Disconnects and waits for RBR_OP_DISCONNECTED.  The receives still posted
 * must come back flushed before it; nothing else may arrive.  A plain server
 * (-P) disconnects by itself after its last reply, so the record and the
 * flushed receives may already be queued, or be on their way, when
 * rbr_conn_disconnect is called; the call then does nothing and the loop
 * below takes them all the same.
 */
static int disconnect(struct client_state *s)
{
    uint64_t deadline;
    uint64_t outstanding = s->recv_posted - s->next_echo;
    uint64_t flushed = 0;

    if (EX_CHECK(rbr_conn_disconnect(s->conn)))
        return -1;
    deadline = ex_now_ns() + (uint64_t)DISCONNECT_TIMEOUT_MS * 1000000u;
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
            ex_error("no RBR_OP_DISCONNECTED within %d ms of "
                     "rbr_conn_disconnect", DISCONNECT_TIMEOUT_MS);
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
        if (c.opcode == RBR_OP_RECV && c.status == RBR_WC_FLUSHED &&
            c.wr_id < s->slots) {
            flushed++;
            continue;
        }
        /* The last send to a plain server, whose reply came before it
         * (ping_pong stopped waiting for it): it completes, or is flushed
         * by the server's disconnect, once. */
        if (s->o->plain && c.opcode == RBR_OP_SEND && c.wr_id < s->slots &&
            s->n_free_send < s->slots &&
            (c.status == RBR_WC_SUCCESS || c.status == RBR_WC_FLUSHED)) {
            s->n_free_send++;
            continue;
        }
        ex_report_completion("unexpected completion after the last echo", &c);
        return -1;
    }
    if (flushed != outstanding) {
        ex_error("%llu receives were posted at the disconnect but %llu "
                 "came back flushed",
                 (unsigned long long)outstanding, (unsigned long long)flushed);
        return -1;
    }
    if (s->n_free_send != s->slots) {
        ex_error("%u sends never completed before RBR_OP_DISCONNECTED",
                 (unsigned)(s->slots - s->n_free_send));
        return -1;
    }
    return 0;
}

/* Fails if any completion is still queued (after RBR_OP_DISCONNECTED). */
static int expect_no_more(const struct client_state *s)
{
    rbr_completion wc[POLL_BATCH];
    size_t n = 0;
    size_t i;
    rbr_status st = rbr_cq_poll(s->cq, wc, POLL_BATCH, &n);

    if (st == RBR_EMPTY)
        return 0;
    if (ex_check(st, "rbr_cq_poll"))
        return -1;
    for (i = 0; i < n; i++)
        ex_report_completion("completion after RBR_OP_DISCONNECTED", &wc[i]);
    return -1;
}

int main(int argc, char **argv)
{
    struct client_opts o;
    struct client_state s;
    rbr_ctx *ctx = NULL;
    rbr_cq *cq = NULL;
    rbr_mr *send_mr = NULL;
    rbr_mr *recv_mr = NULL;
    rbr_conn *conn = NULL;
    rbr_conn_options copts;
    rbr_conn_info info;
    char pdata[RBR_PRIVATE_DATA_RECV_MAX];
    size_t pdata_len = 0;
    uint64_t *rtt = NULL;
    uint64_t t0;
    uint64_t t1;
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
    s.slots = o.window;
    s.total = o.plain ? o.count : 2 * o.count;
    s.stride = ex_slot_stride(o.size);

    rbr_conn_options_init(&copts);
    copts.timeout_ms = CONNECT_TIMEOUT_MS;
    copts.private_data = EX_CLIENT_HELLO;
    copts.private_data_len = strlen(EX_CLIENT_HELLO);
    /* The server keeps the default number of receives posted, so the
     * window may not exceed it; our own queues are the defaults too. */
    if (o.window > copts.recv_queue_depth || o.window > copts.send_queue_depth) {
        ex_error("window %u exceeds the queue depth %u", (unsigned)o.window,
                 (unsigned)(copts.recv_queue_depth < copts.send_queue_depth
                                ? copts.recv_queue_depth
                                : copts.send_queue_depth));
        return EXIT_FAILURE;
    }
    if (s.stride > SIZE_MAX / s.slots) {
        ex_error("size %zu too large", o.size);
        return EXIT_FAILURE;
    }

    s.free_send = calloc(s.slots, sizeof *s.free_send);
    rtt = calloc(o.count > 0 ? o.count : 1, sizeof *rtt);
    if (s.free_send == NULL || rtt == NULL) {
        ex_error("out of memory");
        goto out_bookkeeping;
    }
    for (i = 0; i < s.slots; i++)
        s.free_send[i] = s.slots - 1 - i;
    s.n_free_send = s.slots;

    if (EX_CHECK(rbr_ctx_create(&ctx)))
        goto out_bookkeeping;
    if (EX_CHECK(ex_cq_create(&o.cq, &cq)))
        goto out_ctx;
    s.cq = cq;
    if (ex_check(rbr_mr_alloc(ctx, s.stride * s.slots, RBR_ACCESS_LOCAL_WRITE,
                              &send_mr),
                 "rbr_mr_alloc (send slots)"))
        goto out_cq;
    if (ex_check(rbr_mr_alloc(ctx, s.stride * s.slots, RBR_ACCESS_LOCAL_WRITE,
                              &recv_mr),
                 "rbr_mr_alloc (receive slots)"))
        goto out_send_mr;
    s.send_mr = send_mr;
    s.recv_mr = recv_mr;
    s.send_base = rbr_mr_addr(send_mr);
    s.recv_base = rbr_mr_addr(recv_mr);
    if (s.send_base == NULL || s.recv_base == NULL) {
        ex_error("rbr_mr_addr returned NULL");
        goto out_recv_mr;
    }

    if (ex_check(rbr_connect(ctx, o.addr, cq, &copts, &conn), "rbr_connect"))
        goto out_recv_mr;
    s.conn = conn;
    s.conn_id = rbr_conn_id(conn);
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (EX_CHECK(rbr_conn_get_info(conn, &info)))
        goto out_conn;
    if (info.send_queue_depth < s.slots || info.recv_queue_depth < s.slots) {
        ex_error("window %u exceeds the granted queue depths %u/%u",
                 (unsigned)s.slots, (unsigned)info.send_queue_depth,
                 (unsigned)info.recv_queue_depth);
        goto out_conn;
    }
    if (!o.quiet)
        printf("connected: connection %llu over %s\n",
               (unsigned long long)s.conn_id,
               info.transport == RBR_TRANSPORT_SHM ? "shm" : "verbs");

    if (EX_CHECK(rbr_conn_private_data(conn, pdata, sizeof pdata, &pdata_len)))
        goto out_conn;
    /* A plain server answers with whatever it likes, or nothing. */
    if (!o.plain &&
        (pdata_len != strlen(EX_SERVER_HELLO) ||
         memcmp(pdata, EX_SERVER_HELLO, pdata_len) != 0)) {
        ex_error("server answered with %zu bytes of private data, "
                 "expected \"%s\"", pdata_len, EX_SERVER_HELLO);
        goto out_conn;
    }

    for (i = 0; i < s.slots; i++)
        if (post_recv_slot(&s, i))
            goto out_conn;

    /* Phase 1: ping-pong. */
    if (ping_pong(&s, rtt))
        goto out_conn;
    if (!o.quiet && o.count > 0) {
        uint64_t p50 = ex_percentile(rtt, o.count, 50.0);
        uint64_t p99 = ex_percentile(rtt, o.count, 99.0);

        printf("ping-pong: %llu x %zu bytes, one-way latency median %.2f us, "
               "p99 %.2f us\n",
               (unsigned long long)o.count, o.size, (double)p50 / 2000.0,
               (double)p99 / 2000.0);
    }

    /* Phase 2: streaming; a plain server knows only ping-pong. */
    t0 = ex_now_ns();
    if (!o.plain && stream(&s))
        goto out_conn;
    t1 = ex_now_ns();
    if (!o.plain && !o.quiet && o.count > 0) {
        double secs = (double)(t1 - t0) / 1e9;
        double bytes = (double)o.count * (double)o.size;

        printf("streaming: %llu x %zu bytes, window %u: %.1f MB/s, "
               "%.0f messages/s\n",
               (unsigned long long)o.count, o.size, (unsigned)o.window,
               secs > 0 ? bytes / secs / 1e6 : 0.0,
               secs > 0 ? (double)o.count / secs : 0.0);
    }

    if (disconnect(&s))
        goto out_conn;
    if (o.plain) {
        /* Destroying the connection waits for it to finish, so everything it
         * will ever queue is queued now: exactly one RBR_OP_DISCONNECTED
         * means the queue is empty. */
        rbr_conn_destroy(conn);
        conn = NULL;
        s.conn = NULL;
        if (expect_no_more(&s))
            goto out_conn;
    }
    if (!o.quiet)
        printf("%llu %s received%s\n", (unsigned long long)s.next_echo,
               o.plain ? "replies" : "echoes",
               o.verify ? ", all verified" : "");
    rc = EXIT_SUCCESS;

out_conn:
    rbr_conn_destroy(conn);
out_recv_mr:
    rbr_mr_destroy(recv_mr);
out_send_mr:
    rbr_mr_destroy(send_mr);
out_cq:
    rbr_cq_destroy(cq);
out_ctx:
    rbr_ctx_destroy(ctx);
out_bookkeeping:
    free(rtt);
    free(s.free_send);
    return rc;
}
