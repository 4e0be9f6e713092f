/*
 * cmd_prefill: `tandem prefill`, one prefill process of a cluster (the process lives in prefill/).
 */
#include "td_cli.h"

#include "prefill_node.h"

int cmd_prefill(int argc, char **argv)
{
    return prefill_main(argc, argv);
}
