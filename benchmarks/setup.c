/*
 * rbr_setup: connection setup rate, as a program that opens a connection per
 * request pays it.  The client, N times: connects, posts a receive, sends a
 * first message, waits for the server's answer (the connection now carries
 * data both ways), closes the connection and waits for its last record.  With
 * -c 1 (the default) it does so one connection after another with the blocking
 * rbr_connect; with -c C it keeps C connections in flight from one thread with
 * rbr_connect_start, starting the next as each one's last record comes.  The
 * server, one thread that never blocks on a peer: takes requests with
 * rbr_listener_get_request (timeout 0 while it has connections), accepts them
 * with rbr_request_accept_start, posts a receive, answers each first message,
 * and destroys each connection once the client has closed it.
 *
 * usage: rbr_setup -r server [-a ADDR] [-T SEC]
 *        rbr_setup -r client [-a ADDR] [-n N] [-c C] [-s SIZE] [-T SEC]
 *   -a ADDR  shm://NAME or rdma://IP:PORT (default shm://rbr-setup)
 *   -n N     connections (default 1000)
 *   -c C     connections in flight (1..4096, default 1: one after another)
 *   -s SIZE  bytes of the first message and of the answer (16..1024,
 *            default 64; sent inline)
 *   -T SEC   give up after SEC seconds of waiting for any one step (default 30)
 *
 * The client prints one line:
 *   RESULT setup SIZE conns=N inflight=C rate_per_s=X first_p50_us=X
 *          first_p99_us=X cycle_p50_us=X cycle_p99_us=X
 * rate: N over the whole loop; first: from the start of rbr_connect (or
 * rbr_connect_start) to the answer's arrival; cycle: the same to the close's
 * last record.  The server prints "listening on ADDR" once it listens, and
 * exits once it has answered as many connections as the client's first
 * messages say it opens and all of them are gone.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

#define MAX_SIZE 1024
#define MAX_INFLIGHT 4096
/* Completions taken per poll, and requests taken per turn of the server. */
#define BATCH 64
/* How long the server sleeps on its queue before it looks for requests again
 * (a request that comes while it sleeps waits at most this long). */
#define SERVER_WAIT_MS 1

/* The first message: which connection, how many the client opens, a pattern. */
struct hello {
    uint64_t index;
    uint64_t total;
};

static int timeout_ms = 30000;

/* Waits for the next record of `cq`, which must be a success of `opcode`. */
static int expect(rbr_cq *cq, uint32_t opcode, rbr_completion *c)
{
    return ex_expect(cq, timeout_ms, opcode, c);
}

static void fill(uint8_t *buf, uint32_t size, uint64_t index, uint64_t total)
{
    struct hello h = {index, total};

    ex_fill_pattern(buf, size, index);
    memcpy(buf, &h, size < sizeof h ? size : sizeof h);
}

/* Checks a message of connection `index`; its total goes into *total. */
static int check(const uint8_t *buf, uint32_t got, uint32_t size,
                 uint64_t index, uint64_t *total)
{
    uint8_t want[MAX_SIZE];
    struct hello h = {0, 0};

    if (got != size) {
        ex_error("connection %llu: %u bytes where %u were sent",
                 (unsigned long long)index, got, size);
        return -1;
    }
    memcpy(&h, buf, size < sizeof h ? size : sizeof h);
    fill(want, size, index, h.total);
    if (memcmp(buf, want, size) != 0 || h.total == 0 || index >= h.total) {
        ex_error("connection %llu: the message is not what was sent",
                 (unsigned long long)index);
        return -1;
    }
    if (total)
        *total = h.total;
    return 0;
}

/* Says what a record that was not expected was (for a connection that could
 * not be set up - its receive flushed, or its CONNECTED failed - why), and
 * fails. */
static int unexpected(const char *who, rbr_conn *conn, const rbr_completion *c)
{
    rbr_status st = rbr_conn_status(conn);

    if (st < 0)
        ex_error("%s: setting a connection up failed: %s: %s", who,
                 rbr_status_str(st), rbr_last_error());
    else
        ex_report_completion(who, c);
    return -1;
}

/* The server's connection: its receive buffer is one slot of a region. */
struct peer {
    rbr_conn *conn;
    rbr_mr *mr;
    size_t offset;
    struct peer *next_free;
};

/* Peers, made in chunks of BATCH that share one region, and reused. */
struct peer_pool {
    struct peer_chunk {
        struct peer peers[BATCH];
        rbr_mr *mr;
        struct peer_chunk *next;
    } *chunks;
    struct peer *free;
};

static struct peer *peer_get(rbr_ctx *ctx, struct peer_pool *pool)
{
    struct peer *p = pool->free;

    if (!p) {
        struct peer_chunk *ch = calloc(1, sizeof *ch);

        if (!ch) {
            ex_error("out of memory");
            return NULL;
        }
        if (EX_CHECK(rbr_mr_alloc(ctx, BATCH * MAX_SIZE,
                                  RBR_ACCESS_LOCAL_WRITE, &ch->mr))) {
            free(ch);
            return NULL;
        }
        for (size_t i = 0; i < BATCH; i++) {
            ch->peers[i].mr = ch->mr;
            ch->peers[i].offset = i * MAX_SIZE;
            ch->peers[i].next_free = i + 1 < BATCH ? &ch->peers[i + 1] : NULL;
        }
        ch->next = pool->chunks;
        pool->chunks = ch;
        p = &ch->peers[0];
    }
    pool->free = p->next_free;
    p->conn = NULL;
    return p;
}

static void peer_put(struct peer_pool *pool, struct peer *p)
{
    rbr_conn_destroy(p->conn);
    p->conn = NULL;
    p->next_free = pool->free;
    pool->free = p;
}

/* Destroys what is left: the connections of peers in use, then the regions. */
static void pool_destroy(struct peer_pool *pool)
{
    while (pool->chunks) {
        struct peer_chunk *ch = pool->chunks;

        for (size_t i = 0; i < BATCH; i++)
            rbr_conn_destroy(ch->peers[i].conn);
        rbr_mr_destroy(ch->mr);
        pool->chunks = ch->next;
        free(ch);
    }
}

/* Takes the requests that are there (waiting for the first if the server has
 * no connection); returns the number accepted, or -1. */
static int take_requests(rbr_ctx *ctx, rbr_listener *l, rbr_cq *cq,
                         struct peer_pool *pool, int wait)
{
    int taken = 0;

    while (taken < BATCH) {
        rbr_request *req = NULL;
        rbr_conn_options o;
        struct peer *p;
        rbr_status st =
            rbr_listener_get_request(l, wait && taken == 0 ? timeout_ms : 0, &req);

        if (st == RBR_EMPTY)
            break;
        if (EX_CHECK(st))
            return -1;
        p = peer_get(ctx, pool);
        if (!p) {
            rbr_request_destroy(req);
            return -1;
        }
        rbr_conn_options_init(&o);
        o.context = p;
        st = rbr_request_accept_start(req, cq, &o, &p->conn);
        rbr_request_destroy(req);
        if (EX_CHECK(st) ||
            EX_CHECK(rbr_conn_post_recv(p->conn, p->mr, p->offset, MAX_SIZE, 0))) {
            peer_put(pool, p);
            return -1;
        }
        taken++;
    }
    return taken;
}

static int serve(rbr_ctx *ctx, const char *addr)
{
    struct peer_pool pool = {NULL, NULL};
    rbr_listener *l = NULL;
    rbr_cq *cq = NULL;
    uint8_t out[MAX_SIZE];
    uint64_t total = 0, answered = 0, live = 0, idle_since = 0;
    int rc = 1;

    if (EX_CHECK(rbr_cq_create(&cq)) ||
        EX_CHECK(rbr_listen(ctx, addr, MAX_INFLIGHT, &l)))
        goto out;
    printf("listening on %s\n", addr);
    fflush(stdout);
    while (total == 0 || answered < total || live > 0) {
        rbr_completion wc[BATCH];
        size_t got = 0;
        int taken = take_requests(ctx, l, cq, &pool, live == 0);

        if (taken < 0)
            goto out;
        live += (uint64_t)taken;
        if (live == 0)
            continue;
        rbr_status st = rbr_cq_poll_wait(cq, wc, BATCH, &got, SERVER_WAIT_MS);
        if (st == RBR_ERR_TIMEOUT) {
            uint64_t now = ex_now_ns();

            if (idle_since == 0)
                idle_since = now;
            else if (now - idle_since > (uint64_t)timeout_ms * 1000000u) {
                ex_error("nothing happened for %d ms", timeout_ms);
                goto out;
            }
            continue;
        }
        if (EX_CHECK(st))
            goto out;
        idle_since = 0;
        for (size_t k = 0; k < got; k++) {
            const rbr_completion *c = &wc[k];
            struct peer *p = c->conn_context;
            const uint8_t *buf;
            uint64_t index, sent_total;

            if (c->opcode == RBR_OP_CONNECTED && c->status == RBR_WC_SUCCESS)
                continue;
            if (c->opcode == RBR_OP_DISCONNECTED && c->status == RBR_WC_SUCCESS) {
                peer_put(&pool, p);
                live--;
                continue;
            }
            if (c->opcode != RBR_OP_RECV || c->status != RBR_WC_SUCCESS) {
                unexpected("server", p->conn, c);
                goto out;
            }
            buf = (const uint8_t *)rbr_mr_addr(p->mr) + p->offset;
            memcpy(&index, buf, sizeof index);
            if (c->byte_len < sizeof(struct hello) ||
                check(buf, c->byte_len, c->byte_len, index, &sent_total))
                goto out;
            if (total != 0 && sent_total != total) {
                ex_error("connection %llu: says %llu connections, others %llu",
                         (unsigned long long)index,
                         (unsigned long long)sent_total,
                         (unsigned long long)total);
                goto out;
            }
            total = sent_total;
            /* The answer is the same message: the client checks it. */
            fill(out, c->byte_len, index, total);
            if (EX_CHECK(rbr_conn_post_send_inline(p->conn, out, c->byte_len, 0, 0)))
                goto out;
            answered++;
        }
    }
    rc = 0;
out:
    rbr_listener_destroy(l);
    pool_destroy(&pool);
    rbr_cq_destroy(cq);
    return rc;
}

static void report(uint64_t n, uint64_t inflight, uint32_t size, uint64_t start,
                   uint64_t *first, uint64_t *cycle)
{
    double secs = (double)(ex_now_ns() - start) / 1e9;

    printf("RESULT setup %u conns=%llu inflight=%llu rate_per_s=%.1f "
           "first_p50_us=%.1f first_p99_us=%.1f cycle_p50_us=%.1f "
           "cycle_p99_us=%.1f\n",
           size, (unsigned long long)n, (unsigned long long)inflight,
           (double)n / secs, (double)ex_percentile(first, n, 50) / 1e3,
           (double)ex_percentile(first, n, 99) / 1e3,
           (double)ex_percentile(cycle, n, 50) / 1e3,
           (double)ex_percentile(cycle, n, 99) / 1e3);
}

/* One connection after another, each with the blocking rbr_connect. */
static int connect_in_turn(rbr_ctx *ctx, const char *addr, rbr_cq *cq,
                           rbr_mr *mr, uint64_t n, uint32_t size,
                           uint64_t *first, uint64_t *cycle)
{
    uint8_t msg[MAX_SIZE];
    rbr_conn_options o;

    rbr_conn_options_init(&o);
    o.timeout_ms = timeout_ms;
    uint64_t start = ex_now_ns();
    for (uint64_t i = 0; i < n; i++) {
        rbr_conn *conn = NULL;
        rbr_completion c;
        uint64_t t0 = ex_now_ns();

        fill(msg, size, i, n);
        if (EX_CHECK(rbr_connect(ctx, addr, cq, &o, &conn)))
            return -1;
        if (EX_CHECK(rbr_conn_post_recv(conn, mr, 0, MAX_SIZE, 0)) ||
            EX_CHECK(rbr_conn_post_send_inline(conn, msg, size, 0, 0)) ||
            expect(cq, RBR_OP_RECV, &c) ||
            check(rbr_mr_addr(mr), c.byte_len, size, i, NULL)) {
            rbr_conn_destroy(conn);
            return -1;
        }
        first[i] = ex_now_ns() - t0;
        rbr_conn_destroy(conn);
        if (expect(cq, RBR_OP_DISCONNECTED, &c))
            return -1;
        cycle[i] = ex_now_ns() - t0;
    }
    report(n, 1, size, start, first, cycle);
    return 0;
}

/* A connection in flight; its receive buffer is one slot of the region. */
struct slot {
    rbr_conn *conn;
    uint64_t index;
    uint64_t t0;
    size_t offset;
    int answered;
};

static int start_slot(rbr_ctx *ctx, const char *addr, rbr_cq *cq, rbr_mr *mr,
                      struct slot *s, uint64_t index)
{
    rbr_conn_options o;

    rbr_conn_options_init(&o);
    o.timeout_ms = timeout_ms;
    o.context = s;
    s->index = index;
    s->answered = 0;
    s->t0 = ex_now_ns();
    if (EX_CHECK(rbr_connect_start(ctx, addr, cq, &o, &s->conn)))
        return -1;
    /* Posted while it connects: the answer always finds it. */
    return EX_CHECK(rbr_conn_post_recv(s->conn, mr, s->offset, MAX_SIZE, 0));
}

/* `inflight` connections at once from this thread, each started with
 * rbr_connect_start: the first message goes on its CONNECTED record, the
 * answer closes it, and its last record starts the next. */
static int connect_in_flight(rbr_ctx *ctx, const char *addr, rbr_cq *cq,
                             rbr_mr *mr, uint64_t n, uint64_t inflight,
                             uint32_t size, uint64_t *first, uint64_t *cycle)
{
    struct slot *slots = calloc(inflight, sizeof *slots);
    uint8_t msg[MAX_SIZE];
    uint64_t next = 0, done = 0;
    int rc = -1;

    if (!slots) {
        ex_error("out of memory");
        return -1;
    }
    uint64_t start = ex_now_ns();
    for (uint64_t k = 0; k < inflight && next < n; k++) {
        slots[k].offset = k * MAX_SIZE;
        if (start_slot(ctx, addr, cq, mr, &slots[k], next++))
            goto out;
    }
    while (done < n) {
        rbr_completion wc[BATCH];
        size_t got = 0;

        if (EX_CHECK(ex_wait_completions(cq, wc, BATCH, &got, timeout_ms)))
            goto out;
        for (size_t k = 0; k < got; k++) {
            const rbr_completion *c = &wc[k];
            struct slot *s = c->conn_context;
            uint64_t now;

            if (c->status != RBR_WC_SUCCESS) {
                unexpected("client", s->conn, c);
                goto out;
            }
            switch (c->opcode) {
            case RBR_OP_CONNECTED:
                fill(msg, size, s->index, n);
                if (EX_CHECK(rbr_conn_post_send_inline(s->conn, msg, size, 0, 0)))
                    goto out;
                break;
            case RBR_OP_RECV:
                if (check((const uint8_t *)rbr_mr_addr(mr) + s->offset,
                          c->byte_len, size, s->index, NULL))
                    goto out;
                first[s->index] = ex_now_ns() - s->t0;
                s->answered = 1;
                if (EX_CHECK(rbr_conn_disconnect(s->conn)))
                    goto out;
                break;
            case RBR_OP_DISCONNECTED:
                now = ex_now_ns();
                if (!s->answered) {
                    ex_error("connection %llu closed before its answer",
                             (unsigned long long)s->index);
                    goto out;
                }
                cycle[s->index] = now - s->t0;
                rbr_conn_destroy(s->conn);
                s->conn = NULL;
                done++;
                if (next < n && start_slot(ctx, addr, cq, mr, s, next++))
                    goto out;
                break;
            default:
                unexpected("client", s->conn, c);
                goto out;
            }
        }
    }
    report(n, inflight, size, start, first, cycle);
    rc = 0;
out:
    for (uint64_t k = 0; k < inflight; k++)
        rbr_conn_destroy(slots[k].conn);
    free(slots);
    return rc;
}

static int run_client(rbr_ctx *ctx, const char *addr, uint64_t n,
                      uint64_t inflight, uint32_t size)
{
    rbr_cq *cq = NULL;
    rbr_mr *mr = NULL;
    uint64_t *first = calloc(n, sizeof *first);
    uint64_t *cycle = calloc(n, sizeof *cycle);
    int rc = 1;

    if (!first || !cycle) {
        ex_error("out of memory");
        goto out;
    }
    if (EX_CHECK(rbr_cq_create(&cq)) ||
        EX_CHECK(rbr_mr_alloc(ctx, inflight * MAX_SIZE, RBR_ACCESS_LOCAL_WRITE, &mr)))
        goto out;
    if (inflight == 1)
        rc = connect_in_turn(ctx, addr, cq, mr, n, size, first, cycle) ? 1 : 0;
    else
        rc = connect_in_flight(ctx, addr, cq, mr, n, inflight, size, first,
                               cycle) ? 1 : 0;
out:
    rbr_mr_destroy(mr);
    rbr_cq_destroy(cq);
    free(first);
    free(cycle);
    return rc;
}

int main(int argc, char **argv)
{
    const char *role = NULL, *addr = "shm://rbr-setup";
    uint64_t n = 1000, inflight = 1, size = 64, secs = 30;
    rbr_ctx *ctx = NULL;
    int opt, rc;

    ex_set_progname(argv[0]);
    while ((opt = getopt(argc, argv, "r:a:n:c:s:T:")) != -1) {
        switch (opt) {
        case 'r':
            role = optarg;
            break;
        case 'a':
            addr = optarg;
            break;
        case 'n':
            if (ex_parse_size(optarg, &n) == 0 && n > 0)
                break;
            goto usage;
        case 'c':
            if (ex_parse_size(optarg, &inflight) == 0 && inflight > 0 &&
                inflight <= MAX_INFLIGHT)
                break;
            goto usage;
        case 's':
            if (ex_parse_size(optarg, &size) == 0 &&
                size >= sizeof(struct hello) && size <= MAX_SIZE)
                break;
            goto usage;
        case 'T':
            if (ex_parse_size(optarg, &secs) == 0 && secs > 0 && secs < 86400)
                break;
            goto usage;
        default:
            goto usage;
        }
    }
    if (!role || (strcmp(role, "server") != 0 && strcmp(role, "client") != 0))
        goto usage;
    timeout_ms = (int)(secs * 1000);
    if (EX_CHECK(rbr_ctx_create(&ctx)))
        return 1;
    rc = strcmp(role, "server") == 0
             ? serve(ctx, addr)
             : run_client(ctx, addr, n, inflight, (uint32_t)size);
    rbr_ctx_destroy(ctx);
    return rc;
usage:
    fprintf(stderr,
            "usage: %s -r server|client [-a ADDR] [-n N] [-c 1..%d] "
            "[-s SIZE 16..1024] [-T SEC]\n",
            argv[0], MAX_INFLIGHT);
    return 2;
}
