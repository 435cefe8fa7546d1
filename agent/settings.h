/* rolloutd's settings: one table (agent/config.c), a row per setting, through which flags,
 * ROLLOUTD_* environment variables and the config file all parse; --help and
 * --print-config are generated from it. Flags beat environment beat file beat default. */
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

enum ro_rebalance { RO_REBALANCE_DRAIN, RO_REBALANCE_STOP_CLAIMING, RO_REBALANCE_IGNORE };

struct ro_config {
	char *config_file;
	char *redis, *queue, *prefix, *worker_id, *model;
	char *redis_password, *redis_password_file, *redis_sentinel_password;
	char *redis_tls_ca, *redis_tls_cert, *redis_tls_key, *redis_tls_server_name;
	uint32_t redis_cluster; /* enum ro_redis_cluster */
	uint32_t redis_wait_replicas, redis_wait_timeout_ms, redis_unready_ms;
	uint32_t max_inflight, claim_batch, lease_ms, checkpoint_tokens, checkpoint_ms;
	uint32_t prefill_chunk, max_attempts, redis_timeout_ms;
	char *imds_endpoint;
	bool imds, imds_v1_fallback;
	uint32_t imds_poll_ms, imds_slow_poll_ms, drain_margin_ms, notice_s, sigterm_grace_s;
	uint32_t rebalance; /* enum ro_rebalance */
	uint32_t max_prompt, max_n, max_new_tokens, max_body;
	uint32_t high_water;
	char *trainer_group;
	char *metrics_file;
	uint32_t metrics_interval_ms, status_interval_ms;
	char *control_socket;
	uint32_t threads;
	bool weights_hugepages;
	int64_t policy_version;
	uint32_t policy_swap; /* 0 recompute, 1 finish */
	uint32_t max_policy_lag, policy_rebuild_chunk;
	char *weights_cache, *s3_region, *s3_endpoint;
	uint32_t log_level; /* syslog LOG_* */
	/* expert parallelism */
	char *ep_group, *fabric_provider;
	uint32_t ep_size, ep_rank, ep_local_ranks, ep_timeout_ms, ep_max_tokens;
	uint32_t ep_mode;		       /* enum ro_ep_mode */
	uint32_t ep_dtype, ep_combine_dtype; /* enum ro_ep_dtype */
	bool ep_direct;
	uint32_t ep_combine;		  /* 0 exact, 1 sum */
	char *ep_secret, *ep_secret_file; /* signs the EP cards (HMAC-SHA256) */
};

/* Parse argv/environment/file into c. Returns 0, 1 after --help or --print-config was
 * handled, or -EINVAL with the error already printed to err (naming the setting). */
int ro_config_load(struct ro_config *c, int argc, char **argv, FILE *out, FILE *err);
void ro_config_clear(struct ro_config *c);
void ro_config_print(const struct ro_config *c, FILE *f);
/* The settings as roff .TP entries for the man pages: flags (rolloutd(8)) or config file
 * lines (rolloutd.conf(5)), from the same table as --help, so the pages cannot drift. */
void ro_config_man(FILE *f, bool conf);
const char *ro_rebalance_name(uint32_t r);
