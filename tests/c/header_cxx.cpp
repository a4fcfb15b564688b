/*
 * header_cxx: proves that rdmabridge.h compiles as C++11 with
 * -Wall -Wextra -Wpedantic -Werror and that its functions link with C
 * linkage from C++ (the header must wrap them in extern "C").
 */
#include "rdmabridge.h"

#include <cstdio>
#include <cstring>

int main()
{
    const char *ok = rbr_status_str(RBR_OK);
    const char *refused = rbr_status_str(RBR_ERR_REFUSED);

    if (ok == nullptr || refused == nullptr || std::strcmp(ok, refused) == 0) {
        std::fprintf(stderr, "rbr_status_str does not name the status codes\n");
        return 1;
    }
    std::printf("rdmabridge %s from C++: RBR_OK is \"%s\", RBR_ERR_REFUSED is \"%s\"\n",
                rbr_version(), ok, refused);
    return 0;
}
