/* A program outside the repository that uses the library: a context, a queue, a region, and a
 * connect to a name nobody listens on, which must be refused. Exit 0 when all went as expected. */
#include <rdmabridge.h>
#include <stdio.h>

int main(int argc, char **argv)
{
    const char *addr = argc > 1 ? argv[1] : "shm://rbr-consumer-nobody";
    rbr_ctx *ctx = NULL;
    rbr_cq *cq = NULL;
    rbr_mr *mr = NULL;
    rbr_conn *conn = NULL;
    int rc = 1;
    if (rbr_ctx_create(&ctx) != RBR_OK || rbr_cq_create(&cq) != RBR_OK ||
        rbr_mr_alloc(ctx, 4096, RBR_ACCESS_LOCAL_WRITE, &mr) != RBR_OK) {
        fprintf(stderr, "consumer: %s\n", rbr_last_error());
        goto out;
    }
    rbr_status s = rbr_connect(ctx, addr, cq, NULL, &conn);
    if (s != RBR_ERR_REFUSED) {
        fprintf(stderr, "consumer: connect gave %s, not RBR_ERR_REFUSED\n", rbr_status_str(s));
        goto out;
    }
    printf("rdmabridge %s: region of %zu bytes; %s\n", rbr_version(), rbr_mr_len(mr),
           rbr_status_str(s));
    rc = 0;
out:
    rbr_conn_destroy(conn);
    rbr_mr_destroy(mr);
    rbr_cq_destroy(cq);
    rbr_ctx_destroy(ctx);
    return rc;
}
