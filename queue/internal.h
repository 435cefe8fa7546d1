/* Private to queue/: the JSON number-array encoders shared by samples and checkpoints. */
#pragma once

#include <stdint.h>

#include "queue/queue.h"

/* "[1,2,3]"; caller frees */
char *ro_json_ints(const int32_t *v, uint32_t n);
/* "[-0.5,-1.25]" with %.9g, which round-trips every float32 bit for bit; caller frees */
char *ro_json_floats(const float *v, uint32_t n);
/* [[start, end, version], ...] of a sample of len tokens ([[0, len, dflt]] without pv) */
char *ro_json_pv(const struct ro_pv *pv, uint32_t n_pv, uint32_t len, int64_t dflt);
