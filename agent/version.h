/* What --version prints for rolloutd and rolloutctl. */
#pragma once

#include <stdio.h>

/* prog's version, the git describe of the tree it was built from (when it was a checkout),
 * whether it was configured with CUDA, libfabric's version and the providers fi_getinfo lists
 * on this node (no address is resolved or contacted). */
void ro_version_print(FILE *out, const char *prog);
