/*
 * ucx_scaling: UCX's side of rbr_scaling's round-robin run over shared memory
 * (benchmarks/shm.sh runs both; ucx_perftest has no mode with many endpoints).
 * One client process sends SIZE-byte tagged messages round-robin over N UCP
 * endpoints, all to one server worker, progressing its worker once after each
 * send, as rbr_scaling's client polls once after each send; the server
 * receives them (any tag) one after another.  At each N (increasing,
 * endpoints added), after a warm-up that carries at least 64 messages per
 * endpoint, PASSES passes of MSGS messages, each right after a pass of as many
 * over the first endpoint alone; it prints the median rate over N endpoints,
 * the ratio of the medians (N endpoints to one, side by side), and each
 * process's memory with its growth per endpoint since the first N.  The
 * server makes no endpoints: it only receives (a UCP worker takes any peer's
 * tagged messages without one).
 *
 *   UCX_TLS=posix,self ucx_scaling [-N LIST] [-m SIZE] [-n MSGS] [-p PASSES]
 *   defaults: -N 1,16,256,1024 -m 512 -n 1000000 -p 5
 *
 * Output, per N:
 *   RESULT ucx-rate N msgs_per_s=X side_ratio=Y
 *   RESULT ucx-mem N client_kib=X server_kib=X client_pss_kib=X server_pss_kib=X
 *          [client_kib_per_conn=X server_kib_per_conn=X client_pss_kib_per_conn=X
 *           server_pss_kib_per_conn=X]  (from the second N)
 * (resident memory, VmRSS, and the proportional set size, Pss: see mem()).
 * The server runs on cpu0 and the client on cpu1.  The server's worker
 * address goes to the client over a socketpair made before the fork; so do
 * each pass's count and the server's answer once it has taken them all
 * (which ends the pass's clock), and the requests for its memory figure.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#define TAG 7
#define MAX_N 4096

static void die(const char *what)
{
    fprintf(stderr, "ucx_scaling: %s\n", what);
    exit(1);
}

static void xwrite(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k <= 0) die("write");
        c += k;
        n -= (size_t)k;
    }
}

static void xread(int fd, void *p, size_t n)
{
    char *c = p;
    while (n) {
        ssize_t k = read(fd, c, n);
        if (k <= 0) die("read");
        c += k;
        n -= (size_t)k;
    }
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One figure of this process's memory, in KiB: `key` "VmRSS" from
 * /proc/self/status, or "Pss" from /proc/self/smaps_rollup. */
static long mem_kib(const char *file, const char *key)
{
    FILE *f = fopen(file, "r");
    char line[256];
    size_t n = strlen(key);
    long v = -1;
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, n) && line[n] == ':' && sscanf(line + n + 1, "%ld", &v) == 1) break;
    fclose(f);
    return v;
}

/* Resident memory (VmRSS) and proportional set size (Pss): RSS counts a shared
 * page once per mapping of it, and UCX maps the peer's segments once per
 * endpoint, so its RSS grows with endpoints while the memory does not; Pss
 * counts each page once, shared ones split among the processes mapping them. */
static void mem(long out[2])
{
    out[0] = mem_kib("/proc/self/status", "VmRSS");
    out[1] = mem_kib("/proc/self/smaps_rollup", "Pss");
}

static void pin(int cpu)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

static void setup(ucp_context_h *ctx, ucp_worker_h *w)
{
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_TAG};
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_init(&p, NULL, ctx) != UCS_OK) die("ucp_init");
    if (ucp_worker_create(*ctx, &wp, w) != UCS_OK) die("ucp_worker_create");
}

static void wait_req(ucp_worker_h w, void *req)
{
    if (req == NULL) return;
    if (UCS_PTR_IS_ERR(req)) die("request failed");
    while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(w);
    ucp_request_free(req);
}

static void server(int sock, size_t size)
{
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_address_t *addr;
    size_t len;
    char *buf = malloc(size);
    pin(0);
    setup(&ctx, &w);
    if (ucp_worker_get_address(w, &addr, &len) != UCS_OK) die("get_address");
    xwrite(sock, &len, sizeof len);
    xwrite(sock, addr, len);
    for (;;) {
        uint64_t n;
        xread(sock, &n, sizeof n);
        if (n == 0) break;
        if (n == UINT64_MAX) { /* the client asks for the memory figure */
            long kib[2];
            mem(kib);
            xwrite(sock, kib, sizeof kib);
            continue;
        }
        ucp_request_param_t rp = {0};
        for (uint64_t i = 0; i < n; i++) {
            void *r = ucp_tag_recv_nbx(w, buf, size, 0, 0, &rp);
            wait_req(w, r);
        }
        xwrite(sock, &n, sizeof n);
    }
    ucp_worker_release_address(w, addr);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
    exit(0);
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pass(int sock, ucp_worker_h w, ucp_ep_h *eps, size_t n_eps, uint64_t msgs,
                   char *buf, size_t size)
{
    ucp_request_param_t rp = {0};
    uint64_t ack;
    double t0 = now();
    xwrite(sock, &msgs, sizeof msgs);
    for (uint64_t i = 0; i < msgs; i++) {
        void *r = ucp_tag_send_nbx(eps[i % n_eps], buf, size, TAG, &rp);
        wait_req(w, r);
        ucp_worker_progress(w);
    }
    xread(sock, &ack, sizeof ack);
    return msgs / (now() - t0);
}

int main(int argc, char **argv)
{
    const char *list = "1,16,256,1024";
    size_t size = 512;
    uint64_t msgs = 1000000;
    int passes = 5, opt, sv[2];
    while ((opt = getopt(argc, argv, "N:m:n:p:")) != -1) {
        switch (opt) {
        case 'N': list = optarg; break;
        case 'm': size = strtoul(optarg, NULL, 0); break;
        case 'n': msgs = strtoull(optarg, NULL, 0); break;
        case 'p': passes = atoi(optarg); break;
        default: die("usage: ucx_scaling [-N LIST] [-m SIZE] [-n MSGS] [-p PASSES]");
        }
    }
    if (passes < 1 || passes > 64 || size == 0 || msgs == 0) die("-p 1 to 64, -m and -n above 0");
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) die("socketpair");
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        close(sv[0]);
        server(sv[1], size);
    }
    close(sv[1]);
    int sock = sv[0];
    pin(1);
    ucp_context_h ctx;
    ucp_worker_h w;
    setup(&ctx, &w);
    size_t len;
    xread(sock, &len, sizeof len);
    ucp_address_t *peer = malloc(len);
    xread(sock, peer, len);
    ucp_ep_h *eps = calloc(MAX_N, sizeof *eps);
    char *buf = malloc(size);
    memset(buf, 0x5a, size);
    size_t have = 0, first_n = 0;
    long first_c[2] = {0, 0}, first_s[2] = {0, 0};
    char *l = strdup(list);
    for (char *tok = strtok(l, ","); tok; tok = strtok(NULL, ",")) {
        size_t n = strtoul(tok, NULL, 0);
        if (n > MAX_N || n < have) die("bad -N");
        for (; have < n; have++) {
            ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
                                  .address = peer};
            if (ucp_ep_create(w, &ep, &eps[have]) != UCS_OK) die("ucp_ep_create");
        }
        /* Warm-up: every endpoint carries messages first. */
        pass(sock, w, eps, n, n * 64 > msgs / 10 ? n * 64 : msgs / 10, buf, size);
        double many[64], one[64];
        for (int p = 0; p < passes; p++) {
            one[p] = pass(sock, w, eps, 1, msgs, buf, size);
            many[p] = pass(sock, w, eps, n, msgs, buf, size);
        }
        qsort(many, passes, sizeof *many, cmp);
        qsort(one, passes, sizeof *one, cmp);
        double m = many[passes / 2], o = one[passes / 2];
        printf("RESULT ucx-rate %zu msgs_per_s=%.0f side_ratio=%.3f\n", n, m, m / o);
        uint64_t q = UINT64_MAX;
        long cmem[2], smem[2];
        mem(cmem);
        xwrite(sock, &q, sizeof q);
        xread(sock, smem, sizeof smem);
        printf("RESULT ucx-mem %zu client_kib=%ld server_kib=%ld client_pss_kib=%ld "
               "server_pss_kib=%ld", n, cmem[0], smem[0], cmem[1], smem[1]);
        if (first_n == 0) {
            first_n = n;
            memcpy(first_c, cmem, sizeof cmem);
            memcpy(first_s, smem, sizeof smem);
        } else {
            double k = (double)(n - first_n);
            printf(" client_kib_per_conn=%.1f server_kib_per_conn=%.1f"
                   " client_pss_kib_per_conn=%.1f server_pss_kib_per_conn=%.1f",
                   (cmem[0] - first_c[0]) / k, (smem[0] - first_s[0]) / k,
                   (cmem[1] - first_c[1]) / k, (smem[1] - first_s[1]) / k);
        }
        printf("\n");
        fflush(stdout);
    }
    uint64_t zero = 0;
    xwrite(sock, &zero, sizeof zero);
    waitpid(pid, NULL, 0);
    return 0;
}
