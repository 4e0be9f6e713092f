/*
 * test_grpc_stock: a stock gRPC client (python3-grpcio, tests/unit/grpc_stock_client.py) calls
 * the td_grpc test server (grpc_test_service.h): unary, server streaming, health check,
 * UNIMPLEMENTED and DEADLINE_EXCEEDED as grpc-core sees them. Skips visibly when
 * /usr/bin/python3 lacks grpc or protoc is missing.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include "grpc_test_service.h"

Test(grpc_stock, python_grpcio_client, .timeout = 60)
{
    signal(SIGPIPE, SIG_IGN);
    if (system("/usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null") != 0)
        cr_skip_test("/usr/bin/python3 has no grpc module (install python3-grpcio python3-protobuf)");
    if (system("command -v protoc >/dev/null 2>&1") != 0)
        cr_skip_test("protoc not found (install protobuf-compiler)");
    test_server_t ts;
    td_grpc_server_config_t cfg = td_grpc_server_config_default();
    uint16_t port = ts_start(&ts, &cfg);
    cr_assert_neq(port, 0);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "GRPC_ENABLE_FORK_SUPPORT=0 /usr/bin/python3 %s/tests/unit/grpc_stock_client.py %s/proto 127.0.0.1:%u 2>&1",
             TD_SOURCE_DIR, TD_SOURCE_DIR, port);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    char out[8192] = "";
    size_t len = fread(out, 1, sizeof out - 1, p);
    out[len] = '\0';
    int rc = pclose(p);
    cr_assert_eq(ts_stop(&ts), 0, "server loop has handles left");
    if (WIFEXITED(rc) && WEXITSTATUS(rc) == 77)
        cr_skip_test("%s", out);
    cr_assert(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "python client failed:\n%s", out);
    cr_assert(strstr(out, "ok: "), "%s", out);
}
