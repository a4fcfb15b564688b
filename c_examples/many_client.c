/*
 * rbr_many_client: one thread that connects to many servers at once, without
 * blocking, and checks echoes on every connection.
 *
 * Shows the non-blocking connect: rbr_connect_start returns at once with
 * the connection connecting, and its outcome arrives on the completion
 * queue as an RBR_OP_CONNECTED record - so a single thread starts every
 * connection first (an all-to-all start-up pays one round trip, not N) and
 * then serves one queue.  Each connection's receive is posted while it
 * connects (the library hands it over once the connection is up, so the
 * server's first message always finds one); its first message goes out when
 * its RBR_OP_CONNECTED record says it is established.  A connection that
 * cannot be established gets a failed RBR_OP_CONNECTED record as its last:
 * rbr_conn_status then says why (refused, rejected, timed out, ...).
 *
 * Each connection sends MSGS messages of SIZE bytes, one at a time, and
 * checks every echo against the pattern of common.h (connection i numbers
 * its messages from i * MSGS), then disconnects and waits for its
 * RBR_OP_DISCONNECTED record.
 *
 * Usage: rbr_many_client [-a ADDR]... [-n CONNS] [-m MSGS] [-s SIZE]
 *                        [-t SECS] [-v]
 *   -a ADDR    a server (repeat for more; connections go round-robin;
 *              default shm://rdmabridge-demo)
 *   -n CONNS   connections started at once (default 64)
 *   -m MSGS    messages per connection (default 10)
 *   -s SIZE    message size in bytes, K/M suffixes (default 64)
 *   -t SECS    time limit for the whole run (default 60)
 *   -v         one line per connection
 *
 * Prints how long starting every connection took, how long until all were
 * established, and the longest single rbr_connect_start call.  Exit status 0
 * only if every connection was established, verified every echo and ended in
 * order within the time limit.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_SERVERS 64
#define POLL_BATCH 64

struct many_opts {
    const char *addrs[MAX_SERVERS];
    int naddrs;
    uint32_t conns;
    uint64_t msgs;
    size_t size;
    uint64_t secs;
    int verbose;
};

/* One connection; the library hands it back as conn_context. */
struct peer {
    rbr_conn *conn;
    uint32_t index;
    uint64_t sent;
    uint64_t echoed;
    int up;
    int done; /* its last record came */
    int failed;
};

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-a ADDR]... [-n CONNS] [-m MSGS] [-s SIZE] [-t SECS] [-v]\n"
            "  -a ADDR   a server (repeat for more; default %s)\n"
            "  -n CONNS  connections started at once (default 64)\n"
            "  -m MSGS   messages per connection (default 10)\n"
            "  -s SIZE   message size in bytes (default 64)\n"
            "  -t SECS   time limit (default 60)\n"
            "  -v        one line per connection\n",
            argv0, EX_DEFAULT_ADDR);
}

static int parse_opts(int argc, char **argv, struct many_opts *o)
{
    uint64_t v;
    int ch;

    memset(o, 0, sizeof *o);
    o->conns = 64;
    o->msgs = 10;
    o->size = 64;
    o->secs = 60;
    while ((ch = getopt(argc, argv, "a:n:m:s:t:vh")) != -1) {
        switch (ch) {
        case 'a':
            if (o->naddrs == MAX_SERVERS) {
                ex_error("at most %d servers", MAX_SERVERS);
                return -1;
            }
            o->addrs[o->naddrs++] = optarg;
            break;
        case 'n':
            if (ex_parse_size(optarg, &v) || v == 0 || v > 65536) {
                ex_error("-n: 1 to 65536 connections");
                return -1;
            }
            o->conns = (uint32_t)v;
            break;
        case 'm':
            if (ex_parse_size(optarg, &v) || v == 0) {
                ex_error("-m: at least one message");
                return -1;
            }
            o->msgs = v;
            break;
        case 's':
            if (ex_parse_size(optarg, &v) || v > (64u << 20)) {
                ex_error("-s: 0 to 64M bytes");
                return -1;
            }
            o->size = (size_t)v;
            break;
        case 't':
            if (ex_parse_size(optarg, &v) || v == 0) {
                ex_error("-t: at least one second");
                return -1;
            }
            o->secs = v;
            break;
        case 'v':
            o->verbose = 1;
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
    if (o->naddrs == 0)
        o->addrs[o->naddrs++] = EX_DEFAULT_ADDR;
    return 0;
}

struct run {
    const struct many_opts *o;
    rbr_ctx *ctx;
    rbr_cq *cq;
    rbr_mr *mr; /* per connection: a send slot, then a receive slot */
    uint8_t *base;
    size_t stride;
    struct peer *peers;
    uint32_t established;
    uint32_t finished;
    uint32_t failed;
    uint64_t t0;
    uint64_t all_up_ns;
};

static size_t send_off(const struct run *r, const struct peer *p)
{
    return (size_t)p->index * 2 * r->stride;
}

static size_t recv_off(const struct run *r, const struct peer *p)
{
    return send_off(r, p) + r->stride;
}

static void peer_fail(struct run *r, struct peer *p, const char *what)
{
    (void)r;
    if (!p->failed)
        ex_error("connection %u: %s", (unsigned)p->index, what);
    p->failed = 1;
    rbr_conn_disconnect(p->conn);
}

/* Sends the connection's next message (its pattern in the send slot). */
static void send_next(struct run *r, struct peer *p)
{
    uint64_t k = (uint64_t)p->index * r->o->msgs + p->sent;

    ex_fill_pattern(r->base + send_off(r, p), r->o->size, k);
    if (ex_check(rbr_conn_post_recv(p->conn, r->mr, recv_off(r, p), r->o->size, 0),
                 "rbr_conn_post_recv") ||
        ex_check(rbr_conn_post_send(p->conn, r->mr, send_off(r, p), r->o->size, 1, 0),
                 "rbr_conn_post_send")) {
        peer_fail(r, p, "a post failed");
        return;
    }
    p->sent++;
}

static void handle(struct run *r, const rbr_completion *c)
{
    struct peer *p = c->conn_context;

    switch (c->opcode) {
    case RBR_OP_CONNECTED:
        if (c->status != RBR_WC_SUCCESS) {
            rbr_status why = rbr_conn_status(p->conn);
            ex_error("connection %u to %s: not established: %s (%s)", (unsigned)p->index,
                     r->o->addrs[p->index % r->o->naddrs], rbr_status_str(why),
                     rbr_last_error());
            p->failed = 1;
            p->done = 1; /* its last record */
            r->finished++;
            return;
        }
        p->up = 1;
        if (++r->established == r->o->conns)
            r->all_up_ns = ex_now_ns() - r->t0;
        send_next(r, p);
        return;
    case RBR_OP_RECV:
        if (c->status == RBR_WC_FLUSHED)
            return;
        if (c->status != RBR_WC_SUCCESS || c->byte_len != r->o->size ||
            ex_verify_pattern(r->base + recv_off(r, p), r->o->size,
                              (uint64_t)p->index * r->o->msgs + p->echoed) != 0) {
            peer_fail(r, p, "an echo did not verify");
            return;
        }
        p->echoed++;
        if (r->o->verbose && p->echoed == r->o->msgs)
            printf("connection %u: %llu echoes verified\n", (unsigned)p->index,
                   (unsigned long long)p->echoed);
        if (p->echoed == r->o->msgs)
            rbr_conn_disconnect(p->conn);
        else
            send_next(r, p);
        return;
    case RBR_OP_DISCONNECTED:
        if (c->status != RBR_WC_SUCCESS || p->echoed != r->o->msgs)
            peer_fail(r, p, "the connection ended early");
        p->done = 1;
        r->finished++;
        return;
    default:
        if (c->status != RBR_WC_SUCCESS && c->status != RBR_WC_FLUSHED)
            peer_fail(r, p, "a send failed");
        return;
    }
}

int main(int argc, char **argv)
{
    struct many_opts o;
    struct run r;
    rbr_completion wc[POLL_BATCH];
    uint64_t deadline;
    uint64_t longest_start = 0;
    uint64_t started_ns;
    uint32_t i;
    int rc = EXIT_FAILURE;

    ex_set_progname(argv[0]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse_opts(argc, argv, &o))
        return EXIT_FAILURE;
    memset(&r, 0, sizeof r);
    r.o = &o;
    r.stride = ex_slot_stride(o.size);
    r.peers = calloc(o.conns, sizeof *r.peers);
    if (r.peers == NULL) {
        ex_error("out of memory");
        return EXIT_FAILURE;
    }
    if (EX_CHECK(rbr_ctx_create(&r.ctx)))
        goto out_peers;
    if (EX_CHECK(rbr_cq_create(&r.cq)))
        goto out_ctx;
    if (EX_CHECK(rbr_mr_alloc(r.ctx, 2 * r.stride * o.conns, RBR_ACCESS_LOCAL_WRITE, &r.mr)))
        goto out_cq;
    r.base = rbr_mr_addr(r.mr);

    /* Start every connection; none of these calls waits for a server. */
    r.t0 = ex_now_ns();
    deadline = r.t0 + o.secs * 1000000000u;
    for (i = 0; i < o.conns; i++) {
        struct peer *p = &r.peers[i];
        rbr_conn_options co;
        uint64_t t = ex_now_ns();

        p->index = i;
        rbr_conn_options_init(&co);
        co.private_data = EX_CLIENT_HELLO;
        co.private_data_len = strlen(EX_CLIENT_HELLO);
        co.timeout_ms = (int32_t)(o.secs * 1000);
        co.context = p;
        if (ex_check(rbr_connect_start(r.ctx, o.addrs[i % o.naddrs], r.cq, &co, &p->conn),
                     "rbr_connect_start")) {
            p->conn = NULL;
            p->failed = 1;
            p->done = 1;
            r.finished++;
            continue;
        }
        t = ex_now_ns() - t;
        if (t > longest_start)
            longest_start = t;
    }
    started_ns = ex_now_ns() - r.t0;

    /* Serve the queue until every connection has had its last record. */
    while (r.finished < o.conns) {
        size_t n = 0;
        size_t k;
        rbr_status st;

        if (ex_now_ns() >= deadline) {
            ex_error("gave up after %llu s: %u of %u connections established, %u finished",
                     (unsigned long long)o.secs, (unsigned)r.established, (unsigned)o.conns,
                     (unsigned)r.finished);
            goto out_conns;
        }
        st = rbr_cq_poll_wait(r.cq, wc, POLL_BATCH, &n, 1000);
        if (st == RBR_ERR_TIMEOUT)
            continue;
        if (ex_check(st, "rbr_cq_poll_wait"))
            goto out_conns;
        for (k = 0; k < n; k++)
            handle(&r, &wc[k]);
    }
    for (i = 0; i < o.conns; i++)
        r.failed += r.peers[i].failed;
    printf("%u connections to %d servers: all started in %.2f ms (longest "
           "rbr_connect_start %.1f us), all established after %.2f ms, %u failed\n",
           (unsigned)o.conns, o.naddrs, started_ns / 1e6, longest_start / 1e3,
           r.all_up_ns / 1e6, (unsigned)r.failed);
    if (r.failed == 0)
        rc = EXIT_SUCCESS;

out_conns:
    for (i = 0; i < o.conns; i++)
        rbr_conn_destroy(r.peers[i].conn);
    rbr_mr_destroy(r.mr);
out_cq:
    rbr_cq_destroy(r.cq);
out_ctx:
    rbr_ctx_destroy(r.ctx);
out_peers:
    free(r.peers);
    return rc;
}
