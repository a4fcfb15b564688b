/*
 * rdma_write: the one-sided pattern, over either transport.
 *
 *   server: allocates a board of SLOTS slots that the peer may write
 *           (RBR_ACCESS_REMOTE_WRITE), packs its descriptor and sends it to
 *           the client in an ordinary message, then waits for signals.
 *   client: unpacks the descriptor, and for each round RDMA-writes SLOTS
 *           messages straight into the server's board (no receive, no CPU on
 *           the server), then signals the round with a zero-length write with
 *           immediate (its value: the round number), which completes a
 *           receive posted by the server.  The writes' bytes are in place
 *           before the signal arrives.
 *   server: on the signal, checks every slot byte for byte, and answers
 *           with a one-byte message; the client starts the next round only
 *           then, so it never overwrites a slot the server is still reading.
 *
 * usage: rbr_rdma_write -s|-c [-a ADDR] [-n ROUNDS] [-z SIZE]
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define SLOTS 8
#define WAIT_MS 10000

struct opts {
    int server;
    const char *addr;
    uint64_t rounds;
    uint64_t size;
};

/* The message in slot `i` of round `r`. */
static uint64_t msg_no(uint64_t r, int i) { return r * SLOTS + (uint64_t)i; }

static int run_server(const struct opts *o, rbr_ctx *ctx, rbr_cq *cq)
{
    rbr_listener *l = NULL;
    rbr_request *req = NULL;
    rbr_conn *conn = NULL;
    rbr_mr *board = NULL, *sig = NULL;
    rbr_completion c;
    uint8_t desc[RBR_REMOTE_DESC_LEN];
    int rc = -1;

    if (EX_CHECK(rbr_listen(ctx, o->addr, 1, &l)))
        goto out;
    printf("listening on %s\n", o->addr);
    fflush(stdout);
    if (EX_CHECK(rbr_listener_get_request(l, WAIT_MS, &req)) ||
        EX_CHECK(rbr_request_accept(req, cq, NULL, &conn)))
        goto out;
    /* Library-allocated memory: over shm the client maps it and writes with a
     * plain copy; over verbs it is registered with the device. */
    if (EX_CHECK(rbr_mr_alloc(ctx, SLOTS * o->size + 1,
                              RBR_ACCESS_LOCAL_WRITE | RBR_ACCESS_REMOTE_WRITE,
                              &board)) ||
        EX_CHECK(rbr_mr_alloc(ctx, 64, RBR_ACCESS_LOCAL_WRITE, &sig)))
        goto out;
    /* The receive the first signal will complete, posted before the client
     * can know where to write. */
    if (EX_CHECK(rbr_conn_post_recv(conn, sig, 0, 64, 0)) ||
        EX_CHECK(rbr_conn_pack_region(conn, board, desc)) ||
        EX_CHECK(rbr_conn_post_send_inline(conn, desc, sizeof desc, 1,
                                           RBR_SEND_SIGNALED)) ||
        ex_expect(cq, WAIT_MS, RBR_OP_SEND, &c))
        goto out;
    for (uint64_t r = 0; r < o->rounds; r++) {
        uint8_t *slots = rbr_mr_addr(board);
        if (ex_expect(cq, WAIT_MS, RBR_OP_RECV_WRITE_IMM, &c))
            goto out;
        if (!(c.flags & RBR_WC_WITH_IMM) || c.imm_data != (uint32_t)r) {
            ex_error("round %llu: signal carries %u", (unsigned long long)r,
                     c.imm_data);
            goto out;
        }
        for (int i = 0; i < SLOTS; i++)
            if (ex_verify_pattern(slots + i * o->size, o->size, msg_no(r, i)))
                goto out;
        /* Repost the signal's receive, then let the client go on. */
        if (EX_CHECK(rbr_conn_post_recv(conn, sig, 0, 64, r + 1)) ||
            EX_CHECK(rbr_conn_post_send_inline(conn, "k", 1, 2,
                                               RBR_SEND_SIGNALED)) ||
            ex_expect(cq, WAIT_MS, RBR_OP_SEND, &c))
            goto out;
    }
    printf("server: %llu rounds of %d writes of %llu B verified\n",
           (unsigned long long)o->rounds, SLOTS,
           (unsigned long long)o->size);
    rc = 0;
out:
    rbr_conn_destroy(conn);
    rbr_mr_destroy(board);
    rbr_mr_destroy(sig);
    rbr_request_destroy(req);
    rbr_listener_destroy(l);
    return rc;
}

static int run_client(const struct opts *o, rbr_ctx *ctx, rbr_cq *cq)
{
    rbr_conn *conn = NULL;
    rbr_mr *src = NULL, *in = NULL;
    rbr_completion c;
    rbr_remote board;
    int rc = -1;

    if (EX_CHECK(rbr_connect(ctx, o->addr, cq, NULL, &conn)) ||
        EX_CHECK(rbr_mr_alloc(ctx, SLOTS * o->size + 1, 0, &src)) ||
        EX_CHECK(rbr_mr_alloc(ctx, 64, RBR_ACCESS_LOCAL_WRITE, &in)))
        goto out;
    /* 1. The server's descriptor arrives as an ordinary message. */
    if (EX_CHECK(rbr_conn_post_recv(conn, in, 0, 64, 0)) ||
        ex_expect(cq, WAIT_MS, RBR_OP_RECV, &c) ||
        EX_CHECK(rbr_conn_unpack_remote(conn, rbr_mr_addr(in), c.byte_len,
                                        &board)))
        goto out;
    for (uint64_t r = 0; r < o->rounds; r++) {
        uint8_t *bytes = rbr_mr_addr(src);
        /* The server's answer to this round's signal. */
        if (EX_CHECK(rbr_conn_post_recv(conn, in, 0, 64, r + 1)))
            goto out;
        /* 2. Write every slot straight into the server's board. Unsignaled:
         * only a failure would be reported. */
        for (int i = 0; i < SLOTS; i++) {
            rbr_sge seg = {src, i * o->size, o->size};
            ex_fill_pattern(bytes + i * o->size, o->size, msg_no(r, i));
            if (EX_CHECK(rbr_conn_post_write(conn, &seg, 1, &board,
                                             i * o->size, 100 + i, 0)))
                goto out;
        }
        /* 3. Signal the round: the server's receive completes after the
         * writes' bytes are in place. */
        if (EX_CHECK(rbr_conn_post_write_imm(conn, NULL, 0, &board, 0,
                                             (uint32_t)r, 200,
                                             RBR_SEND_SIGNALED)))
            goto out;
        /* The signal's completion and the server's answer, in either order;
         * the source slots may be rewritten once the answer is here. */
        for (int seen = 0; seen < 2; seen++) {
            if (ex_check(ex_wait_one(cq, &c, WAIT_MS), "waiting"))
                goto out;
            if (c.status != RBR_WC_SUCCESS ||
                (c.opcode != RBR_OP_WRITE && c.opcode != RBR_OP_RECV)) {
                ex_report_completion("unexpected", &c);
                goto out;
            }
        }
    }
    printf("client: %llu rounds of %d writes of %llu B, each round signaled\n",
           (unsigned long long)o->rounds, SLOTS,
           (unsigned long long)o->size);
    rc = 0;
out:
    rbr_conn_destroy(conn);
    rbr_mr_destroy(src);
    rbr_mr_destroy(in);
    return rc;
}

int main(int argc, char **argv)
{
    struct opts o = {-1, EX_DEFAULT_ADDR, 100, 4096};
    rbr_ctx *ctx = NULL;
    rbr_cq *cq = NULL;
    int ch, rc = 1;

    ex_set_progname(argv[0]);
    while ((ch = getopt(argc, argv, "sca:n:z:")) != -1) {
        switch (ch) {
        case 's': o.server = 1; break;
        case 'c': o.server = 0; break;
        case 'a': o.addr = optarg; break;
        case 'n':
            if (ex_parse_size(optarg, &o.rounds)) goto usage;
            break;
        case 'z':
            if (ex_parse_size(optarg, &o.size) || o.size == 0) goto usage;
            break;
        default: goto usage;
        }
    }
    if (o.server < 0)
        goto usage;
    if (EX_CHECK(rbr_ctx_create(&ctx)) || EX_CHECK(rbr_cq_create(&cq)))
        goto out;
    rc = (o.server ? run_server(&o, ctx, cq) : run_client(&o, ctx, cq)) ? 1 : 0;
out:
    rbr_cq_destroy(cq);
    rbr_ctx_destroy(ctx);
    return rc;
usage:
    fprintf(stderr, "usage: %s -s|-c [-a ADDR] [-n ROUNDS] [-z SIZE]\n", argv[0]);
    return 2;
}
