/*
 * rbr_setup: connection setup rate, as a program that opens a connection per
 * request pays it.  The client, N times one after another: connects, posts
 * a receive, sends a first message, waits for the server's answer (the
 * connection now carries data both ways), closes the connection and waits
 * for its last record.  The server accepts, posts a receive, answers the
 * first message, and destroys the connection once the client has closed it.
 *
 * usage: rbr_setup -r server [-a ADDR] [-T SEC]
 *        rbr_setup -r client [-a ADDR] [-n N] [-s SIZE] [-T SEC]
 *   -a ADDR  shm://NAME or rdma://IP:PORT (default shm://rbr-setup)
 *   -n N     connections (default 1000)
 *   -s SIZE  bytes of the first message and of the answer (16..1024,
 *            default 64; sent inline)
 *   -T SEC   give up after SEC seconds of waiting for any one step (default 30)
 *
 * The client prints one line:
 *   RESULT setup SIZE conns=N rate_per_s=X first_p50_us=X first_p99_us=X
 *          cycle_p50_us=X cycle_p99_us=X
 * rate: N over the whole loop; first: from the start of rbr_connect to the
 * answer's arrival; cycle: the same to the close's last record.  The server
 * prints "listening on ADDR" once it listens, and exits after the client's
 * last connection (its first message says it is the last).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

#define MAX_SIZE 1024

/* The first message: which connection, whether it is the last, a pattern. */
struct hello {
    uint64_t index;
    uint64_t last;
};

static int timeout_ms = 30000;

/* Waits for the next record of `cq`, which must be a success of `opcode`. */
static int expect(rbr_cq *cq, uint32_t opcode, rbr_completion *c)
{
    return ex_expect(cq, timeout_ms, opcode, c);
}

static void fill(uint8_t *buf, uint32_t size, uint64_t index, int last)
{
    struct hello h = {index, (uint64_t)last};

    ex_fill_pattern(buf, size, index);
    memcpy(buf, &h, size < sizeof h ? size : sizeof h);
}

static int check(const uint8_t *buf, uint32_t got, uint32_t size,
                 uint64_t index, int *last)
{
    uint8_t want[MAX_SIZE];
    struct hello h = {0, 0};

    if (got != size) {
        ex_error("connection %llu: %u bytes where %u were sent",
                 (unsigned long long)index, got, size);
        return -1;
    }
    memcpy(&h, buf, size < sizeof h ? size : sizeof h);
    fill(want, size, index, h.last != 0);
    if (memcmp(buf, want, size) != 0) {
        ex_error("connection %llu: the message is not what was sent",
                 (unsigned long long)index);
        return -1;
    }
    if (last)
        *last = h.last != 0;
    return 0;
}

static int serve(rbr_ctx *ctx, const char *addr)
{
    rbr_listener *l = NULL;
    rbr_cq *cq = NULL;
    rbr_mr *mr = NULL;
    uint8_t out[MAX_SIZE];
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
        uint64_t index;

        if (EX_CHECK(rbr_listener_get_request(l, timeout_ms, &req)))
            goto out;
        if (EX_CHECK(rbr_request_accept(req, cq, NULL, &conn))) {
            rbr_request_destroy(req);
            goto out;
        }
        rbr_request_destroy(req);
        if (EX_CHECK(rbr_conn_post_recv(conn, mr, 0, MAX_SIZE, 0)) ||
            expect(cq, RBR_OP_RECV, &c)) {
            rbr_conn_destroy(conn);
            goto out;
        }
        memcpy(&index, rbr_mr_addr(mr), sizeof index);
        if (c.byte_len < sizeof(struct hello) ||
            check(rbr_mr_addr(mr), c.byte_len, c.byte_len, index, &last)) {
            rbr_conn_destroy(conn);
            goto out;
        }
        /* The answer is the same message: the client checks it. */
        fill(out, c.byte_len, index, last);
        if (EX_CHECK(rbr_conn_post_send_inline(conn, out, c.byte_len, 0, 0)) ||
            expect(cq, RBR_OP_DISCONNECTED, &c)) {
            rbr_conn_destroy(conn);
            goto out;
        }
        rbr_conn_destroy(conn);
    }
    rc = 0;
out:
    rbr_listener_destroy(l);
    rbr_mr_destroy(mr);
    rbr_cq_destroy(cq);
    return rc;
}

static int run_client(rbr_ctx *ctx, const char *addr, uint64_t n,
                      uint32_t size)
{
    rbr_cq *cq = NULL;
    rbr_mr *mr = NULL;
    uint64_t *first = calloc(n, sizeof *first);
    uint64_t *cycle = calloc(n, sizeof *cycle);
    uint8_t msg[MAX_SIZE];
    int rc = 1;

    rbr_conn_options o;
    rbr_conn_options_init(&o);
    o.timeout_ms = timeout_ms;
    if (!first || !cycle) {
        ex_error("out of memory");
        goto out;
    }
    if (EX_CHECK(rbr_cq_create(&cq)) ||
        EX_CHECK(rbr_mr_alloc(ctx, MAX_SIZE, RBR_ACCESS_LOCAL_WRITE, &mr)))
        goto out;
    uint64_t start = ex_now_ns();
    for (uint64_t i = 0; i < n; i++) {
        rbr_conn *conn = NULL;
        rbr_completion c;
        uint64_t t0 = ex_now_ns();

        fill(msg, size, i, i + 1 == n);
        if (EX_CHECK(rbr_connect(ctx, addr, cq, &o, &conn)))
            goto out;
        if (EX_CHECK(rbr_conn_post_recv(conn, mr, 0, MAX_SIZE, 0)) ||
            EX_CHECK(rbr_conn_post_send_inline(conn, msg, size, 0, 0)) ||
            expect(cq, RBR_OP_RECV, &c) ||
            check(rbr_mr_addr(mr), c.byte_len, size, i, NULL)) {
            rbr_conn_destroy(conn);
            goto out;
        }
        first[i] = ex_now_ns() - t0;
        rbr_conn_destroy(conn);
        if (expect(cq, RBR_OP_DISCONNECTED, &c))
            goto out;
        cycle[i] = ex_now_ns() - t0;
    }
    double secs = (double)(ex_now_ns() - start) / 1e9;
    printf("RESULT setup %u conns=%llu rate_per_s=%.1f first_p50_us=%.1f "
           "first_p99_us=%.1f cycle_p50_us=%.1f cycle_p99_us=%.1f\n",
           size, (unsigned long long)n, (double)n / secs,
           (double)ex_percentile(first, n, 50) / 1e3,
           (double)ex_percentile(first, n, 99) / 1e3,
           (double)ex_percentile(cycle, n, 50) / 1e3,
           (double)ex_percentile(cycle, n, 99) / 1e3);
    rc = 0;
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
    uint64_t n = 1000, size = 64, secs = 30;
    rbr_ctx *ctx = NULL;
    int opt, rc;

    ex_set_progname(argv[0]);
    while ((opt = getopt(argc, argv, "r:a:n:s:T:")) != -1) {
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
    rc = strcmp(role, "server") == 0 ? serve(ctx, addr)
                                     : run_client(ctx, addr, n, (uint32_t)size);
    rbr_ctx_destroy(ctx);
    return rc;
usage:
    fprintf(stderr,
            "usage: %s -r server|client [-a ADDR] [-n N] [-s SIZE 16..1024] "
            "[-T SEC]\n",
            argv[0]);
    return 2;
}
