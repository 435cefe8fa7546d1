/* Private helpers shared by the files of imds/. */
#pragma once

#include <stddef.h>
#include <stdint.h>

int64_t ro_imds_mono_ms(void);
int64_t ro_imds_wall_ms(void);
/* Sleep ms milliseconds, resuming after signals. */
void ro_imds_sleep_ms(int64_t ms);

/* The reply parsers, apart from the HTTP that fetches them, so the fuzz targets
 * (tests/fuzz/fuzz_imds.c) reach them without a server. A body is what ro_imds_get()
 * hands on: NUL-terminated at len, with no NUL inside. Each fills m's message on failure. */
struct ro_imds;
struct ro_imds_notice;
struct ro_imds_maintenance;
void ro_imds_parse_header(struct ro_imds *m, const char *line, size_t n);
int ro_imds_take_token(struct ro_imds *m, const char *what, const char *body, size_t len);
int ro_imds_parse_spot(struct ro_imds *m, const char *body, size_t len,
		       struct ro_imds_notice *ret);
int ro_imds_parse_rebalance(struct ro_imds *m, const char *body, size_t len,
			    int64_t *ret_notice_ms);
/* a plain word (lifecycle state, identity): trimmed, [A-Za-z0-9:._-], shorter than len */
int ro_imds_parse_word(struct ro_imds *m, const char *what, const char *body, char *buf,
		       size_t len);
int ro_imds_parse_maintenance(struct ro_imds *m, const char *body, size_t len,
			      struct ro_imds_maintenance **ret, size_t *ret_count);
