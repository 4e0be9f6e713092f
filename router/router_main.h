/*
 * router_main: the `tandem router` process: the gateway API (tandem.v1.Generation,
 * grpc.health.v1.Health), the control API (tandem.control.v1.Registry), request routing
 * and token relay. docs/cluster.md.
 */
#ifndef ROUTER_MAIN_H
#define ROUTER_MAIN_H

/* The process's main: argv[0] is "router". Returns the exit status (0, 1, 2 usage). */
int router_main(int argc, char **argv);

#endif /* ROUTER_MAIN_H */
