/*
 * link_check: the smallest program that uses the library - it creates and
 * destroys a context and a completion queue and prints the library's
 * version.  ctest builds it with the exact link lines the README gives
 * (tests/c/readme_link.sh) and runs the results from the build output.
 */
#include <stdio.h>

#include <rdmabridge.h>

int main(void)
{
    rbr_ctx *ctx = NULL;
    rbr_cq *cq = NULL;
    int rc = 1;

    if (rbr_ctx_create(&ctx) != RBR_OK) {
        fprintf(stderr, "rbr_ctx_create: %s\n", rbr_last_error());
        goto out;
    }
    if (rbr_cq_create(&cq) != RBR_OK) {
        fprintf(stderr, "rbr_cq_create: %s\n", rbr_last_error());
        goto out_ctx;
    }
    printf("rdmabridge %s\n", rbr_version());
    rc = 0;
    rbr_cq_destroy(cq);
out_ctx:
    rbr_ctx_destroy(ctx);
out:
    return rc;
}
