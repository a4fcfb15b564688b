/*
 * soak: connect / transfer / close, over and over, watching the process's
 * descriptors and resident memory.  Each cycle makes a client and a server
 * connection in this process (one completion queue per side for the whole
 * run), exchanges messages both ways with each verified, and closes (the
 * client and the server take turns); with -m (mixed traffic) it also packs a
 * region, writes to it, reads it back, runs a fetch-and-add and a
 * compare-and-swap, and sizes vary from 1 byte to 64 KiB.  Every SAMPLE
 * cycles (and at the end) it prints the descriptor count and VmRSS; it fails
 * if, after the warm-up (the first tenth of the run), either grows past its
 * allowance: descriptors not at all, RSS by more than -r MIB.
 *
 * usage: soak [-a ADDR] [-n CYCLES | -t SECONDS] [-m] [-k MSGS] [-s SAMPLE] [-r MIB]
 *   defaults: shm://rbr-soak-PID, -n 10000, -k 4, -s 1000, -r 8
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

#define SLOT (64 * 1024)
#define RECVS 4

static long rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;

    if (f == NULL)
        return -1;
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    fclose(f);
    return kib;
}

/* Waits for the next completion, which must be a success of `opcode`. */
static int expect_op(rbr_cq *cq, uint32_t opcode, rbr_completion *c)
{
    return ex_expect(cq, 10000, opcode, c);
}

/* Drains cq up to the connection's RBR_OP_DISCONNECTED (flushed receives allowed). */
static int expect_end(rbr_cq *cq, const char *side)
{
    rbr_completion c;

    for (;;) {
        if (ex_check(ex_wait_one(cq, &c, 10000), "waiting for the disconnect"))
            return -1;
        if (c.opcode == RBR_OP_RECV && c.status == RBR_WC_FLUSHED)
            continue;
        if (c.opcode == RBR_OP_DISCONNECTED && c.status == RBR_WC_SUCCESS)
            return 0;
        ex_report_completion(side, &c);
        return -1;
    }
}

/* k messages each way, ping-pong, each verified; sizes vary with -m. */
static int messages(rbr_conn *c, rbr_cq *ccq, rbr_mr *cmr, rbr_conn *s, rbr_cq *scq,
                    rbr_mr *smr, uint64_t cycle, uint64_t k, int mixed)
{
    unsigned char *cb = rbr_mr_addr(cmr), *sb = rbr_mr_addr(smr);
    rbr_completion x;

    for (uint64_t j = 0; j < k; j++) {
        size_t len = mixed ? (size_t)((cycle * 7919 + j * 104729) % SLOT) + 1 : 64;
        uint64_t tag = cycle * k + j;
        /* Receive slots 0 (client) / 0 (server); the send comes from slot 1. */
        if (EX_CHECK(rbr_conn_post_recv(s, smr, 0, SLOT, tag)) ||
            EX_CHECK(rbr_conn_post_recv(c, cmr, 0, SLOT, tag)))
            return -1;
        ex_fill_pattern(cb + SLOT, len, tag);
        if (EX_CHECK(rbr_conn_post_send(c, cmr, SLOT, len, tag, RBR_SEND_SIGNALED)) ||
            expect_op(scq, RBR_OP_RECV, &x) || x.byte_len != len ||
            ex_verify_pattern(sb, len, tag) || expect_op(ccq, RBR_OP_SEND, &x))
            return -1;
        ex_fill_pattern(sb + SLOT, len, tag + 1);
        if (EX_CHECK(rbr_conn_post_send(s, smr, SLOT, len, tag, RBR_SEND_SIGNALED)) ||
            expect_op(ccq, RBR_OP_RECV, &x) || x.byte_len != len ||
            ex_verify_pattern(cb, len, tag + 1) || expect_op(scq, RBR_OP_SEND, &x))
            return -1;
    }
    return 0;
}

/* One-sided traffic: the server's target region, written, read back, and two atomics. */
static int one_sided(rbr_conn *c, rbr_cq *ccq, rbr_mr *cmr, rbr_conn *s, rbr_mr *tmr,
                     uint64_t cycle)
{
    unsigned char desc[RBR_REMOTE_DESC_LEN];
    unsigned char *cb = rbr_mr_addr(cmr);
    rbr_remote rem;
    rbr_sge sge;
    rbr_completion x;
    size_t len = (size_t)(cycle * 131 % 4096) + 1;
    uint64_t old;

    if (EX_CHECK(rbr_conn_pack_region(s, tmr, desc)) ||
        EX_CHECK(rbr_conn_unpack_remote(c, desc, sizeof desc, &rem)))
        return -1;
    ex_fill_pattern(cb + SLOT, len, cycle);
    sge.mr = cmr;
    sge.offset = SLOT;
    sge.len = len;
    if (EX_CHECK(rbr_conn_post_write(c, &sge, 1, &rem, 64, 1, RBR_SEND_SIGNALED)) ||
        expect_op(ccq, RBR_OP_WRITE, &x))
        return -1;
    sge.offset = 2 * SLOT;
    if (EX_CHECK(rbr_conn_post_read(c, &sge, 1, &rem, 64, 2, RBR_SEND_SIGNALED)) ||
        expect_op(ccq, RBR_OP_READ, &x) || ex_verify_pattern(cb + 2 * SLOT, len, cycle))
        return -1;
    memcpy(&old, rbr_mr_addr(tmr), 8);
    if (EX_CHECK(rbr_conn_post_fetch_add(c, cmr, 3 * SLOT, &rem, 0, 1, 3, RBR_SEND_SIGNALED)) ||
        expect_op(ccq, RBR_OP_FETCH_ADD, &x) || memcmp(cb + 3 * SLOT, &old, 8) != 0)
        return -1;
    old++;
    if (EX_CHECK(rbr_conn_post_cmp_swap(c, cmr, 3 * SLOT, &rem, 0, old, 0, 4,
                                        RBR_SEND_SIGNALED)) ||
        expect_op(ccq, RBR_OP_CMP_SWAP, &x) || memcmp(cb + 3 * SLOT, &old, 8) != 0)
        return -1;
    return 0;
}

int main(int argc, char **argv)
{
    char addr[128];
    uint64_t cycles = 10000, seconds = 0, k = 4, sample = 1000, rss_mib = 8, i;
    int mixed = 0, opt, rc = 1;
    rbr_ctx *ctx = NULL;
    rbr_cq *ccq = NULL, *scq = NULL;
    rbr_listener *listener = NULL;
    rbr_mr *cmr = NULL, *smr = NULL, *tmr = NULL;
    long fd0 = -1, rss0 = -1, fd_max = 0, rss_max = 0, fd, rss;
    uint64_t start, warm = 0;

    ex_set_progname(argv[0]);
    snprintf(addr, sizeof addr, "shm://rbr-soak-%ld", (long)getpid());
    while ((opt = getopt(argc, argv, "a:n:t:mk:s:r:")) != -1) {
        switch (opt) {
        case 'a':
            snprintf(addr, sizeof addr, "%s", optarg);
            break;
        case 'n':
            if (ex_parse_size(optarg, &cycles) || cycles == 0)
                goto usage;
            break;
        case 't':
            if (ex_parse_size(optarg, &seconds) || seconds == 0)
                goto usage;
            break;
        case 'm':
            mixed = 1;
            break;
        case 'k':
            if (ex_parse_size(optarg, &k) || k == 0)
                goto usage;
            break;
        case 's':
            if (ex_parse_size(optarg, &sample) || sample == 0)
                goto usage;
            break;
        case 'r':
            if (ex_parse_size(optarg, &rss_mib))
                goto usage;
            break;
        default:
        usage:
            fprintf(stderr,
                    "usage: %s [-a ADDR] [-n CYCLES | -t SECONDS] [-m] [-k MSGS] "
                    "[-s SAMPLE] [-r MIB]\n",
                    argv[0]);
            return 2;
        }
    }
    if (seconds)
        cycles = UINT64_MAX;

    if (EX_CHECK(rbr_ctx_create(&ctx)))
        goto out;
    if (EX_CHECK(rbr_cq_create(&ccq)))
        goto out_ctx;
    if (EX_CHECK(rbr_cq_create(&scq)))
        goto out_ccq;
    if (EX_CHECK(rbr_listen(ctx, addr, 16, &listener)))
        goto out_scq;
    if (EX_CHECK(rbr_mr_alloc(ctx, 4 * SLOT, RBR_ACCESS_LOCAL_WRITE, &cmr)) ||
        EX_CHECK(rbr_mr_alloc(ctx, 2 * SLOT, RBR_ACCESS_LOCAL_WRITE, &smr)) ||
        EX_CHECK(rbr_mr_alloc(ctx, 8192,
                              RBR_ACCESS_LOCAL_WRITE | RBR_ACCESS_REMOTE_WRITE |
                                  RBR_ACCESS_REMOTE_READ | RBR_ACCESS_REMOTE_ATOMIC,
                              &tmr)))
        goto out_mr;

    start = ex_now_ns();
    printf("soak: %s, %s%s, %llu messages each way per cycle\n", addr,
           mixed ? "mixed traffic" : "messages", mixed ? " + one-sided" : "",
           (unsigned long long)k);
    printf("%10s %10s %6s %10s\n", "cycle", "seconds", "fds", "rss_kib");
    for (i = 0; i < cycles; i++) {
        struct ex_acceptor a = {listener, scq, NULL, RBR_ERR_PANIC};
        rbr_conn *client = NULL;
        pthread_t t;
        uint64_t elapsed = (ex_now_ns() - start) / 1000000000u;

        if (seconds && elapsed >= seconds)
            break;
        if (i % sample == 0) {
            fd = ex_count_fds();
            rss = rss_kib();
            printf("%10llu %10llu %6ld %10ld\n", (unsigned long long)i,
                   (unsigned long long)elapsed, fd, rss);
            fflush(stdout);
            /* Baseline once a tenth of the run (or of the time) is done. */
            if (fd0 < 0 && (seconds ? elapsed * 10 >= seconds : i * 10 >= cycles) && i > 0) {
                fd0 = fd, rss0 = rss, warm = i;
            } else if (fd0 >= 0) {
                fd_max = fd > fd_max ? fd : fd_max;
                rss_max = rss > rss_max ? rss : rss_max;
            }
        }
        if (pthread_create(&t, NULL, ex_accept_one, &a) != 0) {
            ex_error("pthread_create failed");
            goto out_mr;
        }
        rbr_status st = rbr_connect(ctx, addr, ccq, NULL, &client);
        pthread_join(t, NULL);
        if (ex_check(st, "rbr_connect") || ex_check(a.status, "accept") ||
            messages(client, ccq, cmr, a.conn, scq, smr, i, k, mixed) ||
            (mixed && one_sided(client, ccq, cmr, a.conn, tmr, i))) {
            ex_error("cycle %llu failed", (unsigned long long)i);
            rbr_conn_destroy(client);
            rbr_conn_destroy(a.conn);
            goto out_mr;
        }
        /* Take turns closing; both sides see their orderly end. */
        rbr_conn *closer = i % 2 ? a.conn : client, *peer = i % 2 ? client : a.conn;
        rbr_cq *closer_cq = i % 2 ? scq : ccq, *peer_cq = i % 2 ? ccq : scq;
        rbr_conn_destroy(closer);
        if (expect_end(closer_cq, "closing side") || expect_end(peer_cq, "other side")) {
            ex_error("cycle %llu: no orderly end", (unsigned long long)i);
            rbr_conn_destroy(peer);
            goto out_mr;
        }
        rbr_conn_destroy(peer);
    }
    fd = ex_count_fds();
    rss = rss_kib();
    printf("%10llu %10llu %6ld %10ld  (end)\n", (unsigned long long)i,
           (unsigned long long)((ex_now_ns() - start) / 1000000000u), fd, rss);
    fd_max = fd > fd_max ? fd : fd_max;
    rss_max = rss > rss_max ? rss : rss_max;
    if (fd0 < 0) {
        ex_error("the run was too short for a baseline after warm-up (use a smaller -s)");
        goto out_mr;
    }
    printf("soak: %llu cycles; after warm-up (cycle %llu): fds %ld -> max %ld, "
           "rss %ld -> max %ld KiB\n",
           (unsigned long long)i, (unsigned long long)warm, fd0, fd_max, rss0, rss_max);
    if (fd_max > fd0) {
        ex_error("descriptors grew: %ld -> %ld", fd0, fd_max);
        goto out_mr;
    }
    if (rss_max > rss0 + (long)rss_mib * 1024) {
        ex_error("resident memory grew by more than %llu MiB: %ld -> %ld KiB",
                 (unsigned long long)rss_mib, rss0, rss_max);
        goto out_mr;
    }
    printf("soak: stable\n");
    rc = 0;
out_mr:
    rbr_mr_destroy(tmr);
    rbr_mr_destroy(smr);
    rbr_mr_destroy(cmr);
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
