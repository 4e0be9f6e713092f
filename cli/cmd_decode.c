/*
 * cmd_decode: `tandem decode`, one decode process of a cluster (the process lives in decode/).
 */
#include "td_cli.h"

#include "decode_node.h"

int cmd_decode(int argc, char **argv)
{
    return decode_main(argc, argv);
}
