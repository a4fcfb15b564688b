/*
 * rping_peer: either role of rdma-core's `rping` (rdmacm-utils), spoken over
 * rdmabridge against the stock program in the other role.  It shows a
 * library program exchanging buffers with a plain librdmacm peer that knows
 * nothing of the library: raw address/key/length in the peer's own message
 * format (rbr_conn_remote_from_raw to target the peer's buffers, the fields
 * of rbr_conn_pack_region's descriptor to advertise ours), RDMA reads and
 * writes, and verified data.
 *
 * rping's protocol, per ping (all messages are one 16-byte record
 * {be64 buf; be32 rkey; be32 size}):
 *   client: fills its start buffer with "rdma-ping-N: " and letters, then
 *           advertises it (buf, rkey, size);
 *   server: RDMA-reads the client's start buffer into its own buffer and
 *           answers with a 16-byte "go ahead" (contents ignored);
 *   client: advertises its second (echo) buffer;
 *   server: RDMA-writes its buffer (the string with its NUL) back into the
 *           echo buffer, then answers "go ahead" again;
 *   client: checks echo == start (rping -V), and starts the next ping.
 * After the last ping the client disconnects.
 *
 * Both roles here check every ping's data against rping's pattern: the
 * server what it read, the client what came back.
 *
 * usage: rbr_rping_peer -s|-c -a ADDR [-p PORT] [-C COUNT] [-S SIZE] [-v] [-V]
 *   -C 0 (the default) runs until the client stops (server) or forever (client).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define INFO_LEN 16     /* rping's advertisement record, on the wire */
#define MIN_SIZE 26     /* rping's smallest ping: its longest "rdma-ping-N: " */
#define MAX_SIZE 65535  /* and its largest */
#define WAIT_MS 15000

struct opts {
    int server;
    const char *host;
    unsigned port;
    uint64_t count;
    uint64_t size;
    int verbose;
};

/* One advertisement: where a buffer is, its rkey and its length. */
struct info {
    uint64_t addr;
    uint32_t rkey;
    uint32_t size;
};

static void put_be(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = bytes - 1; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

static uint64_t get_be(const uint8_t *p, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v = v << 8 | p[i];
    return v;
}

static uint64_t get_le(const uint8_t *p, int bytes)
{
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static void encode_info(uint8_t out[INFO_LEN], const struct info *in)
{
    put_be(out, in->addr, 8);
    put_be(out + 8, in->rkey, 4);
    put_be(out + 12, in->size, 4);
}

static void decode_info(const uint8_t in[INFO_LEN], struct info *out)
{
    out->addr = get_be(in, 8);
    out->rkey = (uint32_t)get_be(in + 8, 4);
    out->size = (uint32_t)get_be(in + 12, 4);
}

/*
 * Our region as rping advertises a buffer: the address and rkey come from the
 * descriptor the library packs for this connection (bytes 8..16: address,
 * 24..32: key, little endian; over verbs the key is the rkey).
 */
static int advert_of(rbr_conn *conn, rbr_mr *mr, struct info *out)
{
    uint8_t desc[RBR_REMOTE_DESC_LEN];

    if (EX_CHECK(rbr_conn_pack_region(conn, mr, desc)))
        return -1;
    out->addr = get_le(desc + 8, 8);
    out->rkey = (uint32_t)get_le(desc + 24, 8);
    out->size = (uint32_t)rbr_mr_len(mr);
    return 0;
}

/* rping's ping `n` of `size` bytes: "rdma-ping-N: ", then letters 'A'..'z'
 * starting one further on every ping, then a NUL in the last byte. */
static void fill_ping(char *buf, size_t size, uint64_t n)
{
    int cc = snprintf(buf, size, "rdma-ping-%d: ", (int)n);
    unsigned char c = (unsigned char)(65 + n % 58);

    for (size_t i = (size_t)cc; i < size; i++) {
        buf[i] = (char)c;
        c = c == 122 ? 65 : (unsigned char)(c + 1);
    }
    buf[size - 1] = '\0';
}

static int check_ping(const char *got, size_t size, uint64_t n, const char *what)
{
    char *want = malloc(size);
    int rc = -1;

    if (!want) {
        ex_error("out of memory");
        return -1;
    }
    fill_ping(want, size, n);
    for (size_t i = 0; i < size; i++) {
        if (got[i] != want[i]) {
            ex_error("ping %llu: %s differs at byte %zu (0x%02x, expected 0x%02x)",
                     (unsigned long long)n, what, i, (unsigned char)got[i],
                     (unsigned char)want[i]);
            goto out;
        }
    }
    rc = 0;
out:
    free(want);
    return rc;
}

/* Waits for the peer's next 16-byte record in `msg` (then reposts the
 * receive, so the peer's next record finds it), or for the end of the
 * connection when `end_ok`: returns 1 then. */
static int next_record(rbr_conn *conn, rbr_cq *cq, rbr_mr *msg, struct info *out,
                       int end_ok)
{
    rbr_completion c;

    if (ex_check(ex_wait_one(cq, &c, WAIT_MS), "waiting for the peer's record"))
        return -1;
    if (end_ok && c.opcode == RBR_OP_DISCONNECTED && c.status == RBR_WC_SUCCESS)
        return 1;
    if (c.opcode != RBR_OP_RECV || c.status != RBR_WC_SUCCESS) {
        ex_report_completion("unexpected", &c);
        return -1;
    }
    if (c.byte_len != INFO_LEN) {
        ex_error("the peer sent %u bytes, not an rping record of %d", c.byte_len,
                 INFO_LEN);
        return -1;
    }
    decode_info(rbr_mr_addr(msg), out);
    if (EX_CHECK(rbr_conn_post_recv(conn, msg, 0, INFO_LEN, c.wr_id + 1)))
        return -1;
    return 0;
}

/* Sends one record; unsignaled: only a failure would be reported. */
static int send_record(rbr_conn *conn, const struct info *in)
{
    uint8_t wire[INFO_LEN];

    encode_info(wire, in);
    return EX_CHECK(rbr_conn_post_send_inline(conn, wire, sizeof wire, 0, 0));
}

/* Waits for the connection's end (after our disconnect or the peer's). */
static int wait_end(rbr_cq *cq)
{
    rbr_completion c;

    for (;;) {
        if (ex_check(ex_wait_one(cq, &c, WAIT_MS), "waiting for the disconnect"))
            return -1;
        if (c.opcode == RBR_OP_DISCONNECTED)
            return c.status == RBR_WC_SUCCESS ? 0 : (ex_report_completion("end", &c), -1);
        if (c.status != RBR_WC_SUCCESS && c.status != RBR_WC_FLUSHED) {
            ex_report_completion("unexpected", &c);
            return -1;
        }
    }
}

static int run_server(const struct opts *o, rbr_ctx *ctx, rbr_cq *cq,
                      const char *addr)
{
    rbr_listener *l = NULL;
    rbr_request *req = NULL;
    rbr_conn *conn = NULL;
    rbr_mr *buf = NULL, *msg = NULL;
    rbr_completion c;
    uint64_t n = 0;
    int rc = -1;

    if (EX_CHECK(rbr_listen(ctx, addr, 1, &l)))
        goto out;
    printf("listening on %s\n", addr);
    fflush(stdout);
    if (EX_CHECK(rbr_listener_get_request(l, -1, &req)) ||
        EX_CHECK(rbr_request_accept(req, cq, NULL, &conn)))
        goto out;
    /* rping's server reads into and writes from one buffer of its -S size;
     * nothing of ours is reached by the peer. */
    if (EX_CHECK(rbr_mr_alloc(ctx, o->size, RBR_ACCESS_LOCAL_WRITE, &buf)) ||
        EX_CHECK(rbr_mr_alloc(ctx, INFO_LEN, RBR_ACCESS_LOCAL_WRITE, &msg)) ||
        EX_CHECK(rbr_conn_post_recv(conn, msg, 0, INFO_LEN, 0)))
        goto out;
    for (n = 0; o->count == 0 || n < o->count; n++) {
        struct info peer, go_ahead = {0, 0, 0};
        rbr_remote remote;
        char *data = rbr_mr_addr(buf);
        int r = next_record(conn, cq, msg, &peer, o->count == 0 && n > 0);

        if (r == 1)
            break; /* -C 0: the client stopped */
        if (r)
            goto out;
        if (peer.size > o->size || peer.size < MIN_SIZE) {
            ex_error("ping %llu: the client's buffer is %u bytes; this server's is %llu",
                     (unsigned long long)n, peer.size, (unsigned long long)o->size);
            goto out;
        }
        /* 1. Read the client's ping. */
        rbr_sge seg = {buf, 0, peer.size};
        memset(data, 0, o->size);
        if (EX_CHECK(rbr_conn_remote_from_raw(conn, peer.addr, peer.size, peer.rkey,
                                              &remote)) ||
            EX_CHECK(rbr_conn_post_read(conn, &seg, 1, &remote, 0, 1000 + n,
                                        RBR_SEND_SIGNALED)) ||
            ex_expect(cq, WAIT_MS, RBR_OP_READ, &c) ||
            check_ping(data, peer.size, n, "the ping read from the client"))
            goto out;
        if (o->verbose)
            printf("server ping data: %s\n", data);
        /* 2. Go ahead; the client advertises its echo buffer. */
        if (send_record(conn, &go_ahead) || next_record(conn, cq, msg, &peer, 0))
            goto out;
        /* 3. Write the string (with its NUL) back, then go ahead again. */
        const char *nul = memchr(data, 0, peer.size);
        if (!nul) {
            ex_error("ping %llu: no room for the echo in the client's %u bytes",
                     (unsigned long long)n, peer.size);
            goto out;
        }
        seg.len = (size_t)(nul - data) + 1;
        if (EX_CHECK(rbr_conn_remote_from_raw(conn, peer.addr, peer.size, peer.rkey,
                                              &remote)) ||
            EX_CHECK(rbr_conn_post_write(conn, &seg, 1, &remote, 0, 2000 + n,
                                         RBR_SEND_SIGNALED)) ||
            ex_expect(cq, WAIT_MS, RBR_OP_WRITE, &c) || send_record(conn, &go_ahead))
            goto out;
    }
    /* With -C the client disconnects after the last ping. */
    if (o->count != 0 && wait_end(cq))
        goto out;
    printf("server: %llu pings read, verified and echoed\n", (unsigned long long)n);
    rc = n > 0 ? 0 : -1;
out:
    rbr_conn_destroy(conn);
    rbr_mr_destroy(buf);
    rbr_mr_destroy(msg);
    rbr_request_destroy(req);
    rbr_listener_destroy(l);
    return rc;
}

static int run_client(const struct opts *o, rbr_ctx *ctx, rbr_cq *cq,
                      const char *addr)
{
    rbr_conn *conn = NULL;
    rbr_mr *start = NULL, *echo = NULL, *msg = NULL;
    struct info start_ad, echo_ad, reply;
    uint64_t n;
    int rc = -1;
    const uint32_t remote = RBR_ACCESS_LOCAL_WRITE | RBR_ACCESS_REMOTE_READ |
                            RBR_ACCESS_REMOTE_WRITE;

    if (EX_CHECK(rbr_connect(ctx, addr, cq, NULL, &conn)) ||
        EX_CHECK(rbr_mr_alloc(ctx, o->size, remote, &start)) ||
        EX_CHECK(rbr_mr_alloc(ctx, o->size, remote, &echo)) ||
        EX_CHECK(rbr_mr_alloc(ctx, INFO_LEN, RBR_ACCESS_LOCAL_WRITE, &msg)) ||
        EX_CHECK(rbr_conn_post_recv(conn, msg, 0, INFO_LEN, 0)) ||
        advert_of(conn, start, &start_ad) || advert_of(conn, echo, &echo_ad))
        goto out;
    for (n = 0; o->count == 0 || n < o->count; n++) {
        char *s = rbr_mr_addr(start), *e = rbr_mr_addr(echo);

        fill_ping(s, o->size, n);
        memset(e, 0, o->size);
        /* The server reads the ping, then writes it back into the echo
         * buffer; each step ends with its "go ahead". */
        if (send_record(conn, &start_ad) || next_record(conn, cq, msg, &reply, 0) ||
            send_record(conn, &echo_ad) || next_record(conn, cq, msg, &reply, 0))
            goto out;
        if (memcmp(s, e, o->size) != 0) {
            ex_error("ping %llu: data mismatch between the ping and its echo",
                     (unsigned long long)n);
            goto out;
        }
        if (check_ping(e, o->size, n, "the echo"))
            goto out;
        if (o->verbose)
            printf("ping data: %s\n", e);
    }
    if (EX_CHECK(rbr_conn_disconnect(conn)) || wait_end(cq))
        goto out;
    printf("client: %llu pings echoed and verified\n", (unsigned long long)n);
    rc = 0;
out:
    rbr_conn_destroy(conn);
    rbr_mr_destroy(start);
    rbr_mr_destroy(echo);
    rbr_mr_destroy(msg);
    return rc;
}

int main(int argc, char **argv)
{
    struct opts o = {-1, NULL, 7174, 0, 64, 0};
    rbr_ctx *ctx = NULL;
    rbr_cq *cq = NULL;
    char addr[300];
    uint64_t v;
    int ch, rc = 1;

    ex_set_progname(argv[0]);
    while ((ch = getopt(argc, argv, "sca:p:C:S:vV")) != -1) {
        switch (ch) {
        case 's': o.server = 1; break;
        case 'c': o.server = 0; break;
        case 'a': o.host = optarg; break;
        case 'p':
            if (ex_parse_size(optarg, &v) || v == 0 || v > 65535)
                goto usage;
            o.port = (unsigned)v;
            break;
        case 'C':
            if (ex_parse_size(optarg, &o.count) || o.count > 0x7fffffff)
                goto usage;
            break;
        case 'S':
            if (ex_parse_size(optarg, &o.size) || o.size < MIN_SIZE ||
                o.size > MAX_SIZE)
                goto usage;
            break;
        case 'v': o.verbose = 1; break;
        case 'V': break; /* data is always verified */
        default: goto usage;
        }
    }
    if (o.server < 0 || !o.host || optind != argc)
        goto usage;
    if (snprintf(addr, sizeof addr, "rdma://%s:%u", o.host, o.port) >= (int)sizeof addr)
        goto usage;
    if (EX_CHECK(rbr_ctx_create(&ctx)) || EX_CHECK(rbr_cq_create(&cq)))
        goto out;
    rc = (o.server ? run_server(&o, ctx, cq, addr) : run_client(&o, ctx, cq, addr)) ? 1 : 0;
out:
    rbr_cq_destroy(cq);
    rbr_ctx_destroy(ctx);
    return rc;
usage:
    fprintf(stderr,
            "usage: %s -s|-c -a ADDR [-p PORT] [-C COUNT] [-S SIZE] [-v] [-V]\n"
            "  plays rping's server (-s) or client (-c) role over rdmabridge;\n"
            "  SIZE %d..%d (default 64), PORT default 7174, COUNT 0 = until stopped\n",
            argv[0], MIN_SIZE, MAX_SIZE);
    return 2;
}
