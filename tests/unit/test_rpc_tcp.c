/*
 * test_rpc_tcp: the address and listen steps the RPC servers and channels share: IPv4 and
 * IPv6 literals parse and names do not; a listener on port 0 reports the port the kernel
 * chose; a second listener on that port fails TD_ERR_IO naming who and where, as does a
 * host that is no IP literal (TD_ERR_INVALID); and both servers that use it (td_http,
 * td_grpc_server) refuse a taken port the same way. Every loop closes with no handle open.
 */
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>

#include "td_grpc.h"
#include "td_http.h"
#include "td_rpc_tcp.h"
#include "td_status.h"

static void on_conn(uv_stream_t *s, int status) {}

static void close_loop(uv_loop_t *loop)
{
    uv_run(loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(loop), 0, "a handle was left open");
}

static void on_request(void *data, td_http_req_t *req) {}

Test(rpc_tcp, addresses_are_ip_literals)
{
    struct sockaddr_storage a;
    cr_assert(td_rpc_tcp_addr("127.0.0.1", 8080, &a));
    cr_assert_eq(a.ss_family, AF_INET);
    cr_assert_eq(ntohs(((struct sockaddr_in *)&a)->sin_port), 8080);
    cr_assert(td_rpc_tcp_addr("::1", 9, &a));
    cr_assert_eq(a.ss_family, AF_INET6);
    cr_assert_eq(ntohs(((struct sockaddr_in6 *)&a)->sin6_port), 9);
    cr_assert_not(td_rpc_tcp_addr("localhost", 80, &a), "names are not resolved");
    cr_assert_not(td_rpc_tcp_addr("", 80, &a));
    cr_assert_not(td_rpc_tcp_addr("1.2.3", 80, &a));
}

Test(rpc_tcp, listen_reports_its_port_and_a_taken_port_fails, .timeout = 20)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    uv_tcp_t a, b, c;
    uv_tcp_init(&loop, &a);
    uv_tcp_init(&loop, &b);
    uv_tcp_init(&loop, &c);
    uint16_t port = 0, other = 4242;
    cr_assert_eq(td_rpc_tcp_listen(&a, "test", "127.0.0.1", 0, on_conn, &port), TD_OK, "%s", td_last_error());
    cr_assert_neq(port, 0, "port 0 listens on the kernel's choice, which is reported");
    cr_assert_eq(td_rpc_tcp_listen(&b, "test", "127.0.0.1", port, on_conn, &other), TD_ERR_IO);
    cr_assert_eq(other, 4242, "the port is set only on success");
    char want[64];
    snprintf(want, sizeof want, "test: listen on 127.0.0.1:%u: ", port);
    cr_assert(strstr(td_last_error(), want), "message '%s' names who and where", td_last_error());
    cr_assert_eq(td_rpc_tcp_listen(&c, "test", "example.org", 0, on_conn, &other), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), "test: listen on example.org:0"), "%s", td_last_error());
    uv_close((uv_handle_t *)&a, NULL);
    uv_close((uv_handle_t *)&b, NULL);
    uv_close((uv_handle_t *)&c, NULL);
    close_loop(&loop);
}

Test(rpc_tcp, both_servers_refuse_a_taken_port, .timeout = 20)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    td_http_config_t hc = td_http_config_default();
    hc.handler = on_request;
    td_http_server_t *http = NULL, *http2 = NULL;
    cr_assert_eq(td_http_server_create(&loop, &hc, &http), TD_OK, "%s", td_last_error());
    uint16_t port = td_http_server_port(http);
    cr_assert_neq(port, 0);

    hc.port = port;
    cr_assert_eq(td_http_server_create(&loop, &hc, &http2), TD_ERR_IO);
    cr_assert_null(http2);
    cr_assert(strstr(td_last_error(), "http: listen on 127.0.0.1:"), "%s", td_last_error());

    td_grpc_server_config_t gc = td_grpc_server_config_default();
    gc.host = "127.0.0.1";
    gc.port = port;
    td_grpc_server_t *grpc = NULL;
    cr_assert_eq(td_grpc_server_create(&loop, &gc, &grpc), TD_ERR_IO);
    cr_assert_null(grpc);
    cr_assert(strstr(td_last_error(), "grpc server: listen on 127.0.0.1:"), "%s", td_last_error());
    gc.port = 0;
    cr_assert_eq(td_grpc_server_create(&loop, &gc, &grpc), TD_OK, "%s", td_last_error());
    cr_assert_neq(td_grpc_server_port(grpc), 0);
    cr_assert_neq(td_grpc_server_port(grpc), port);

    td_grpc_server_close(grpc, NULL, NULL);
    td_http_server_close(http, NULL, NULL);
    close_loop(&loop);
}
