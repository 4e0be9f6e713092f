/*
 * cmd_unified: `tandem unified`, one unified node of a cluster: prefill and decode in one
 * engine, the colocated baseline (the process lives in decode/: decode_main.c).
 */
#include "td_cli.h"

#include "decode_node.h"

int cmd_unified(int argc, char **argv)
{
    return unified_main(argc, argv);
}
