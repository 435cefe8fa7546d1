/* Private helpers shared by the files of imds/. */
#pragma once

#include <stdint.h>

int64_t ro_imds_mono_ms(void);
int64_t ro_imds_wall_ms(void);
/* Sleep ms milliseconds, resuming after signals. */
void ro_imds_sleep_ms(int64_t ms);
