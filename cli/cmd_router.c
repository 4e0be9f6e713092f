/*
 * cmd_router: `tandem router`, one router process of a cluster (the process lives in router/).
 */
#include "td_cli.h"

#include "router_main.h"

int cmd_router(int argc, char **argv)
{
    return router_main(argc, argv);
}
