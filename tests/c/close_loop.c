/*
 * close_loop: an orderly close is always reported as one.  N times over, a
 * client and a server connection are made in this process, both post
 * receives, and one side (alternately the client and the server) destroys
 * its connection.  Each side must see its receives flushed and then its
 * RBR_OP_DISCONNECTED with RBR_WC_SUCCESS - never RBR_WC_TRANSPORT - and
 * nothing after it.  Runs under ASan+UBSan in ctest.
 *
 * usage: close_loop [-a ADDR] [-n PAIRS]   (defaults: shm://rbr-close-PID, 2000)
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

#define RECVS 4
#define SLOT 1024

/*
 * Takes one connection's records up to its disconnect: RECVS flushed
 * receives, then RBR_OP_DISCONNECTED, whose status must be success.
 */
static int expect_orderly_end(rbr_cq *cq, const char *side, uint64_t pair)
{
    rbr_completion c;
    int flushed = 0;

    for (;;) {
        if (ex_check(ex_wait_one(cq, &c, 10000), "waiting for a completion"))
            return -1;
        if (c.opcode == RBR_OP_RECV && c.status == RBR_WC_FLUSHED) {
            flushed++;
            continue;
        }
        if (c.opcode == RBR_OP_DISCONNECTED && c.status == RBR_WC_SUCCESS &&
            flushed == RECVS)
            return 0;
        ex_error("pair %llu, %s: after %d flushed receives:",
                 (unsigned long long)pair, side, flushed);
        ex_report_completion(side, &c);
        return -1;
    }
}

static int post_recvs(rbr_conn *conn, rbr_mr *mr)
{
    for (uint64_t k = 0; k < RECVS; k++)
        if (EX_CHECK(rbr_conn_post_recv(conn, mr, k * SLOT, SLOT, k)))
            return -1;
    return 0;
}

int main(int argc, char **argv)
{
    char addr[128];
    uint64_t pairs = 2000, i;
    rbr_ctx *ctx = NULL;
    rbr_cq *ccq = NULL, *scq = NULL;
    rbr_listener *listener = NULL;
    rbr_mr *mr = NULL;
    rbr_completion extra;
    size_t n;
    int opt, rc = 1;

    ex_set_progname(argv[0]);
    snprintf(addr, sizeof addr, "shm://rbr-close-%ld", (long)getpid());
    while ((opt = getopt(argc, argv, "a:n:")) != -1) {
        switch (opt) {
        case 'a':
            snprintf(addr, sizeof addr, "%s", optarg);
            break;
        case 'n':
            if (ex_parse_size(optarg, &pairs) == 0 && pairs > 0)
                break;
            /* fall through */
        default:
            fprintf(stderr, "usage: %s [-a ADDR] [-n PAIRS]\n", argv[0]);
            return 2;
        }
    }

    if (EX_CHECK(rbr_ctx_create(&ctx)))
        goto out;
    if (EX_CHECK(rbr_cq_create(&ccq)))
        goto out_ctx;
    if (EX_CHECK(rbr_cq_create(&scq)))
        goto out_ccq;
    if (EX_CHECK(rbr_listen(ctx, addr, 16, &listener)))
        goto out_scq;
    if (EX_CHECK(rbr_mr_alloc(ctx, RECVS * SLOT, RBR_ACCESS_LOCAL_WRITE, &mr)))
        goto out_listener;

    for (i = 0; i < pairs; i++) {
        struct ex_acceptor a = {listener, scq, NULL, RBR_ERR_PANIC};
        rbr_conn *client = NULL, *closer, *peer;
        rbr_cq *closer_cq, *peer_cq;
        pthread_t t;

        if (pthread_create(&t, NULL, ex_accept_one, &a) != 0) {
            ex_error("pthread_create failed");
            goto out_mr;
        }
        rbr_status st = rbr_connect(ctx, addr, ccq, NULL, &client);
        pthread_join(t, NULL);
        if (ex_check(st, "rbr_connect") || ex_check(a.status, "accept")) {
            rbr_conn_destroy(client);
            rbr_conn_destroy(a.conn);
            goto out_mr;
        }
        if (post_recvs(client, mr) || post_recvs(a.conn, mr)) {
            rbr_conn_destroy(client);
            rbr_conn_destroy(a.conn);
            goto out_mr;
        }
        /* Alternate which side closes. */
        if (i % 2 == 0) {
            closer = client, closer_cq = ccq, peer = a.conn, peer_cq = scq;
        } else {
            closer = a.conn, closer_cq = scq, peer = client, peer_cq = ccq;
        }
        rbr_conn_destroy(closer);
        if (expect_orderly_end(closer_cq, "closing side", i) ||
            expect_orderly_end(peer_cq, "other side", i)) {
            rbr_conn_destroy(peer);
            goto out_mr;
        }
        rbr_conn_destroy(peer);
        if (rbr_cq_poll(ccq, &extra, 1, &n) != RBR_EMPTY ||
            rbr_cq_poll(scq, &extra, 1, &n) != RBR_EMPTY) {
            ex_error("pair %llu: a record after the disconnect",
                     (unsigned long long)i);
            goto out_mr;
        }
    }
    printf("close_loop: %llu pairs, every close orderly on both sides\n",
           (unsigned long long)pairs);
    rc = 0;

out_mr:
    rbr_mr_destroy(mr);
out_listener:
    rbr_listener_destroy(listener);
out_scq:
    rbr_cq_destroy(scq);
out_ccq:
    rbr_cq_destroy(ccq);
out_ctx:
    rbr_ctx_destroy(ctx);
out:
    return rc;
}
