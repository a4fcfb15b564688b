/*
 * rbr_first: what the first messages of a connection cost, and a send that
 * has to wait for the peer's receive - the two cases a steady ping-pong never
 * shows.  For each of N connections, one after another:
 *   first  from the moment rbr_connect returns, the client ping-pongs COUNT
 *          messages of SIZE bytes with the server (which posts its first
 *          receive once it has accepted, and each next one before it
 *          answers);
 *          every round trip is timed, and the run's slowest is kept;
 *   late   right after the last echo the client sends once more (signaled,
 *          unless -u), while the server sleeps 50 ms before it posts the
 *          receive for it: the send waits for that receive.  The server times
 *          its receive from the post to its completion and sends the figure
 *          back, with the time of the post, from which the client times its
 *          send's completion (both processes read the same clock).
 * Both sides busy-poll with rbr_cq_poll, or with -W wait with
 * rbr_cq_poll_wait (give it to both).
 *
 * usage: rbr_first -r server [-a ADDR] [-W] [-T SEC]
 *        rbr_first -r client [-a ADDR] [-n N] [-c COUNT] [-s SIZE] [-W] [-u]
 *                  [-T SEC] [-v]
 *   -a ADDR   shm://NAME or rdma://IP:PORT (default shm://rbr-first)
 *   -n N      connections (default 50)
 *   -c COUNT  round trips timed from the connect (default 200)
 *   -s SIZE   bytes of each message (16..1024, default 64; sent inline)
 *   -W        wait with rbr_cq_poll_wait (else busy-poll)
 *   -u        the late message unsignaled
 *   -T SEC    give up after SEC seconds of waiting for any one step (30)
 *   -v        one line per connection on stderr
 *
 * The client prints:
 *   RESULT first SIZE runs=N worst_us=X worst_p50_us=X rtt_p50_us=X over_us=X
 *          first_p50_us=X first_max_us=X
 *   RESULT late SIZE runs=N p50_us=X max_us=X min_us=X [send_p50_us=X
 *          send_max_us=X] signaled=0|1
 * first: worst is the slowest round trip of all runs, worst_p50 the median
 * over runs of each run's slowest, rtt_p50 the median of every round trip,
 * over the number of runs whose slowest took more than 200 us (-W) or
 * 1 ms (busy-polling), and first the connection's very first round trip
 * (median and slowest over runs: the slowest of 200 may be any of them, a
 * wait a steady ping-pong meets too); late: the server's receive, from its post to its
 * completion, and the client's send, from that post to its completion.  The
 * server prints "listening on ADDR" once it listens and exits after the
 * client's last connection.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define MAX_SIZE 1024
#define LATE_SLEEP_NS 50000000L

/* The late message: whether it is the client's last connection. */
struct late_msg {
    uint64_t magic;
    uint64_t last;
};
/* The server's answer to it: when it posted the receive, how long that took
 * to complete. */
struct late_answer {
    uint64_t magic;
    uint64_t posted;
    uint64_t ns;
};
#define LATE_MAGIC 0x7262726669727374ull /* "rbrfirst" */

static int timeout_ms = 30000;
static int use_wait; /* 1: rbr_cq_poll_wait; 0: busy-poll */

/* The next completion of `cq` into *c, waiting as the run says. */
static int next(rbr_cq *cq, rbr_completion *c)
{
    size_t n = 0;
    rbr_status st =
        use_wait ? ex_wait_completions(cq, c, 1, &n, timeout_ms)
                 : ex_busy_poll(cq, c, 1, &n, (int64_t)timeout_ms * 1000000);

    if (st == RBR_ERR_TIMEOUT) {
        ex_error("no completion within %d ms", timeout_ms);
        return -1;
    }
    if (ex_check(st, "waiting for a completion"))
        return -1;
    if (c->status != RBR_WC_SUCCESS) {
        ex_report_completion("unexpected completion", c);
        return -1;
    }
    return 0;
}

/* Waits for the next receive (skipping send completions). */
static int next_recv(rbr_cq *cq, rbr_completion *c)
{
    do {
        if (next(cq, c))
            return -1;
    } while (c->opcode == RBR_OP_SEND);
    if (c->opcode != RBR_OP_RECV) {
        ex_report_completion("expected a receive", c);
        return -1;
    }
    return 0;
}

/* Waits for the connection's last record. */
static int closed(rbr_cq *cq)
{
    rbr_completion c;
    size_t n = 0;

    for (;;) {
        rbr_status st = use_wait ? ex_wait_completions(cq, &c, 1, &n, timeout_ms)
                                 : ex_busy_poll(cq, &c, 1, &n,
                                                (int64_t)timeout_ms * 1000000);
        if (ex_check(st, "waiting for the disconnect"))
            return -1;
        if (c.opcode == RBR_OP_DISCONNECTED)
            return 0;
    }
}

static int serve(rbr_ctx *ctx, const char *addr)
{
    rbr_listener *l = NULL;
    rbr_cq *cq = NULL;
    rbr_mr *mr = NULL;
    int rc = 1, last = 0;

    if (EX_CHECK(rbr_cq_create(&cq)) ||
        EX_CHECK(rbr_mr_alloc(ctx, MAX_SIZE, RBR_ACCESS_LOCAL_WRITE, &mr)) ||
        EX_CHECK(rbr_listen(ctx, addr, 16, &l)))
        goto out;
    printf("listening on %s\n", addr);
    fflush(stdout);
    while (!last) {
        rbr_request *req = NULL;
        rbr_conn *conn = NULL;
        rbr_completion c;
        struct late_msg m;
        struct late_answer a;
        uint64_t t0;
        struct timespec nap = {0, LATE_SLEEP_NS};

        if (EX_CHECK(rbr_listener_get_request(l, timeout_ms, &req)))
            goto out;
        if (EX_CHECK(rbr_request_accept(req, cq, NULL, &conn))) {
            rbr_request_destroy(req);
            goto out;
        }
        rbr_request_destroy(req);
        /* Echo until the empty ping that announces the late message. */
        if (EX_CHECK(rbr_conn_post_recv(conn, mr, 0, MAX_SIZE, 0)))
            goto fail;
        for (;;) {
            uint8_t echo[MAX_SIZE];

            if (next_recv(cq, &c))
                goto fail;
            memcpy(echo, rbr_mr_addr(mr), c.byte_len);
            /* The next receive before the answer, as an echo server does.
             * The client announces the late message with a zero-length ping:
             * after its echo, no receive is posted. */
            if (c.byte_len > 0 &&
                EX_CHECK(rbr_conn_post_recv(conn, mr, 0, MAX_SIZE, 0)))
                goto fail;
            if (EX_CHECK(rbr_conn_post_send_inline(conn, echo, c.byte_len, 1, 0)))
                goto fail;
            if (c.byte_len == 0)
                break;
        }
        nanosleep(&nap, NULL);
        t0 = ex_now_ns();
        if (EX_CHECK(rbr_conn_post_recv(conn, mr, 0, MAX_SIZE, 0)) ||
            next_recv(cq, &c))
            goto fail;
        a.ns = ex_now_ns() - t0;
        a.posted = t0;
        a.magic = LATE_MAGIC;
        memcpy(&m, rbr_mr_addr(mr), sizeof m);
        if (c.byte_len != sizeof m || m.magic != LATE_MAGIC) {
            ex_error("expected the late message, got %u bytes",
                     (unsigned)c.byte_len);
            goto fail;
        }
        last = m.last != 0;
        if (EX_CHECK(rbr_conn_post_send_inline(conn, &a, sizeof a, 2, 0)) ||
            closed(cq))
            goto fail;
        rbr_conn_destroy(conn);
        continue;
fail:
        rbr_conn_destroy(conn);
        goto out;
    }
    rc = 0;
out:
    rbr_listener_destroy(l);
    rbr_mr_destroy(mr);
    rbr_cq_destroy(cq);
    return rc;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int run_client(rbr_ctx *ctx, const char *addr, uint64_t n,
                      uint64_t count, uint32_t size, int verbose,
                      int unsignaled)
{
    rbr_cq *cq = NULL;
    rbr_mr *mr = NULL;
    uint64_t *rtt = calloc(n * count, sizeof *rtt);
    uint64_t *worst = calloc(n, sizeof *worst);
    uint64_t *late = calloc(n, sizeof *late);
    uint64_t *late_send = calloc(n, sizeof *late_send);
    uint64_t *first = calloc(n, sizeof *first);
    uint8_t msg[MAX_SIZE];
    uint64_t bound = use_wait ? 200000 : 1000000, over = 0, max_worst = 0;
    uint64_t first_p50;
    int rc = 1;
    rbr_conn_options o;

    rbr_conn_options_init(&o);
    o.timeout_ms = timeout_ms;
    if (!rtt || !worst || !late || !late_send || !first) {
        ex_error("out of memory");
        goto out;
    }
    if (EX_CHECK(rbr_cq_create(&cq)) ||
        EX_CHECK(rbr_mr_alloc(ctx, MAX_SIZE, RBR_ACCESS_LOCAL_WRITE, &mr)))
        goto out;
    ex_fill_pattern(msg, size, 0);
    for (uint64_t r = 0; r < n; r++) {
        rbr_conn *conn = NULL;
        rbr_completion c;
        struct late_msg m = {LATE_MAGIC, r + 1 == n};
        struct late_answer a;
        uint64_t *mine = rtt + r * count, at = 0, sent_at = 0;

        if (EX_CHECK(rbr_connect(ctx, addr, cq, &o, &conn)))
            goto out;
        for (uint64_t i = 0; i < count; i++) {
            /* The last ping is empty: the server posts no receive after
             * answering it, so the late message waits for one. */
            uint32_t len = i + 1 == count ? 0 : size;
            uint64_t t0 = ex_now_ns();

            if (EX_CHECK(rbr_conn_post_recv(conn, mr, 0, MAX_SIZE, 0)) ||
                EX_CHECK(rbr_conn_post_send_inline(conn, msg, len, 1, 0)) ||
                next_recv(cq, &c))
                goto fail;
            mine[i] = ex_now_ns() - t0;
            if (c.byte_len != len) {
                ex_error("echo of %u bytes where %u were sent",
                         (unsigned)c.byte_len, (unsigned)len);
                goto fail;
            }
            if (mine[i] > worst[r]) {
                worst[r] = mine[i];
                at = i;
            }
        }
        /* The late message, signaled unless -u: the client takes its send's
         * completion (timed) and the server's answer, in either order. */
        if (EX_CHECK(rbr_conn_post_recv(conn, mr, 0, MAX_SIZE, 0)) ||
            EX_CHECK(rbr_conn_post_send_inline(
                conn, &m, sizeof m, 2, unsignaled ? 0 : RBR_SEND_SIGNALED)))
            goto fail;
        for (int sent = unsignaled, answered = 0; !sent || !answered;) {
            if (next(cq, &c))
                goto fail;
            if (c.opcode == RBR_OP_SEND) {
                sent_at = ex_now_ns();
                sent = 1;
                continue;
            }
            memcpy(&a, rbr_mr_addr(mr), sizeof a);
            if (c.opcode != RBR_OP_RECV || c.byte_len != sizeof a ||
                a.magic != LATE_MAGIC) {
                ex_report_completion("expected the server's figure", &c);
                goto fail;
            }
            answered = 1;
        }
        late[r] = a.ns;
        first[r] = mine[0];
        /* Both processes read the same clock. */
        late_send[r] = unsignaled ? 0 : sent_at - a.posted;
        if (worst[r] > bound)
            over++;
        if (worst[r] > max_worst)
            max_worst = worst[r];
        if (verbose)
            fprintf(stderr, "run %llu: slowest round trip %.1f us (#%llu), "
                            "late receive %.1f us, its send %.1f us\n",
                    (unsigned long long)r, (double)worst[r] / 1e3,
                    (unsigned long long)at + 1, (double)late[r] / 1e3,
                    (double)late_send[r] / 1e3);
        if (EX_CHECK(rbr_conn_disconnect(conn)) || closed(cq))
            goto fail;
        rbr_conn_destroy(conn);
        continue;
fail:
        rbr_conn_destroy(conn);
        goto out;
    }
    qsort(late, n, sizeof *late, cmp_u64);
    printf("RESULT first %u runs=%llu worst_us=%.1f worst_p50_us=%.1f "
           "rtt_p50_us=%.2f over_us=%llu",
           size, (unsigned long long)n, (double)max_worst / 1e3,
           (double)ex_percentile(worst, n, 50) / 1e3,
           (double)ex_percentile(rtt, n * count, 50) / 1e3,
           (unsigned long long)over);
    /* Sorted by the percentile: its last is the slowest. */
    first_p50 = ex_percentile(first, n, 50);
    printf(" first_p50_us=%.1f first_max_us=%.1f\n", (double)first_p50 / 1e3,
           (double)first[n - 1] / 1e3);
    printf("RESULT late %u runs=%llu p50_us=%.1f max_us=%.1f min_us=%.1f",
           size, (unsigned long long)n, (double)ex_percentile(late, n, 50) / 1e3,
           (double)late[n - 1] / 1e3, (double)late[0] / 1e3);
    if (!unsignaled) {
        qsort(late_send, n, sizeof *late_send, cmp_u64);
        printf(" send_p50_us=%.1f send_max_us=%.1f",
               (double)ex_percentile(late_send, n, 50) / 1e3,
               (double)late_send[n - 1] / 1e3);
    }
    printf(" signaled=%d\n", !unsignaled);
    rc = 0;
out:
    rbr_mr_destroy(mr);
    rbr_cq_destroy(cq);
    free(rtt);
    free(worst);
    free(late);
    free(late_send);
    free(first);
    return rc;
}

int main(int argc, char **argv)
{
    const char *role = NULL, *addr = "shm://rbr-first";
    uint64_t n = 50, count = 200, size = 64, secs = 30;
    rbr_ctx *ctx = NULL;
    int opt, rc, verbose = 0, unsignaled = 0;

    ex_set_progname(argv[0]);
    while ((opt = getopt(argc, argv, "r:a:n:c:s:T:Wuv")) != -1) {
        switch (opt) {
        case 'r':
            role = optarg;
            break;
        case 'a':
            addr = optarg;
            break;
        case 'n':
        case 'c':
            if (ex_parse_size(optarg, opt == 'n' ? &n : &count) == 0 &&
                (opt == 'n' ? n : count) > 0 && (opt == 'n' ? n : count) <= 1000000)
                break;
            goto usage;
        case 's':
            if (ex_parse_size(optarg, &size) == 0 &&
                size >= sizeof(struct late_msg) && size <= MAX_SIZE)
                break;
            goto usage;
        case 'T':
            if (ex_parse_size(optarg, &secs) == 0 && secs > 0 && secs < 86400)
                break;
            goto usage;
        case 'W':
            use_wait = 1;
            break;
        case 'u':
            unsignaled = 1;
            break;
        case 'v':
            verbose = 1;
            break;
        default:
            goto usage;
        }
    }
    if (optind != argc || !role ||
        (strcmp(role, "server") != 0 && strcmp(role, "client") != 0))
        goto usage;
    timeout_ms = (int)(secs * 1000);
    if (EX_CHECK(rbr_ctx_create(&ctx)))
        return 1;
    rc = strcmp(role, "server") == 0
             ? serve(ctx, addr)
             : run_client(ctx, addr, n, count, (uint32_t)size, verbose,
                          unsignaled);
    rbr_ctx_destroy(ctx);
    return rc;
usage:
    fprintf(stderr,
            "usage: %s -r server|client [-a ADDR] [-n N] [-c COUNT] "
            "[-s SIZE 16..1024] [-W] [-u] [-T SEC] [-v]\n",
            argv[0]);
    return 2;
}
