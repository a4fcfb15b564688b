/*
 * header_c99: proves that rdmabridge.h compiles as strict C99 with
 * -Wall -Wextra -Wpedantic -Werror, and that the library links and names
 * its status codes.  Exits 0 if rbr_status_str names RBR_OK and an error.
 */
#include "rdmabridge.h"

#include <stdio.h>
#include <string.h>

int main(void)
{
    rbr_conn_options opts;
    const char *ok = rbr_status_str(RBR_OK);
    const char *refused = rbr_status_str(RBR_ERR_REFUSED);

    rbr_conn_options_init(&opts);
    if (ok == NULL || refused == NULL || ok[0] == '\0' || refused[0] == '\0' ||
        strcmp(ok, refused) == 0) {
        fprintf(stderr, "rbr_status_str does not name the status codes\n");
        return 1;
    }
    if (opts.struct_size != sizeof opts) {
        fprintf(stderr, "rbr_conn_options_init: struct_size %u, expected %zu\n",
                (unsigned)opts.struct_size, sizeof opts);
        return 1;
    }
    printf("rdmabridge %s from C99: RBR_OK is \"%s\", RBR_ERR_REFUSED is \"%s\"\n",
           rbr_version(), ok, refused);
    return 0;
}
