/* The policy-weights fetcher: manifests of a policy's files (name, size, sha256), and the
 * fetch that makes one version of a policy available on local disk, every byte checked,
 * from a directory (file://), an S3 prefix (s3://, SigV4 with the AWS SDKs' credential
 * chain) or a plain web server (https://, http:// for mirrors on a private network).
 * A library: it never logs; every function returns 0 or -errno with a message in err.
 *
 *   -EBADMSG    a size or sha256 mismatch (err names the file and both values), a bad manifest
 *   -ENOENT     a missing file or object (err names the path or the key)
 *   -EACCES     credentials missing or refused
 *   -ECANCELED  *opts->cancel became non-zero
 *   -EIO        network failure after the retries, or an unexpected reply
 *   -EINVAL     a URI that is none of the above
 * Credentials are never written into err, logs or files. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct ro_policy_file {
	char *name; /* relative to the policy's root, '/'-separated, no "." or ".." parts */
	uint64_t size;
	char sha256[65]; /* lowercase hex */
};

struct ro_policy_manifest {
	struct ro_policy_file *files; /* sorted by name (bytewise) */
	size_t n;
};

void ro_policy_manifest_clear(struct ro_policy_manifest *m);
/* {"files":[{"name":..,"size":..,"sha256":..},...]}: the form stored in Redis and in
 * manifest.json. NULL on allocation failure; the caller frees. */
char *ro_policy_manifest_json(const struct ro_policy_manifest *m);
/* Parses and checks (names safe and unique, sizes, 64 hex digits); sorts by name. On failure
 * m is left empty. */
int ro_policy_manifest_parse(const char *json, struct ro_policy_manifest *m, char *err,
			     size_t errlen);
/* true when a and b list the same files with the same sizes and hashes. */
bool ro_policy_manifest_equal(const struct ro_policy_manifest *a,
			      const struct ro_policy_manifest *b);

struct ro_fetch_opts {
	const char *cache_dir;	    /* s3:// and https:// policies land in <cache>/v<version>/ */
	const char *region;	    /* NULL: AWS_REGION, AWS_DEFAULT_REGION, IMDS placement/region,
				       else us-east-1 */
	const char *s3_endpoint;    /* NULL: https://<bucket>.s3.<region>.amazonaws.com; else
				       path-style <endpoint>/<bucket>/<key> (tests, MinIO) */
	const char *imds_endpoint;  /* NULL: http://169.254.169.254 */
	unsigned parallel;	    /* concurrent GETs, default 8 */
	uint64_t chunk_bytes;	    /* range size, default 8 MiB */
	unsigned keep;		    /* versions kept in the cache, default 2 */
	const volatile int *cancel; /* non-zero (another thread): stop within ~100 ms */
	/* progress, may be NULL; stored atomically while it runs */
	volatile uint64_t *bytes_done, *bytes_total;
	/* statistics of the last call, may be NULL: requests sent, of which retries */
	volatile uint64_t *requests, *retries;
};

/* The manifest of the policy at uri:
 *   file:///dir (or /dir): <dir>/manifest.json if there is one, else every regular file
 *     below dir (names starting with '.' skipped) hashed;
 *   s3://bucket/prefix: <prefix>/manifest.json if there is one, else ListObjectsV2 of the
 *     prefix and every object hashed by streaming it (parallel GETs, no disk);
 *   https://host/path: <path>/manifest.json, required. */
int ro_policy_manifest_compute(const struct ro_fetch_opts *o, const char *uri,
			       struct ro_policy_manifest *ret, char *err, size_t errlen);

/* Makes version `version` of the policy at uri available locally, every file checked
 * against m's size and sha256; the local directory's path in ret_dir.
 *   file://: verified in place; ret_dir is the directory itself (no copy).
 *   s3://, https://: <cache>/v<version>/ already holding m (its manifest.json equal to m,
 *     sizes right) is reused; else the files are downloaded with parallel ranged GETs into
 *     <cache>/v<version>.partial.<pid>/ (a dropped transfer resumed from the byte it
 *     reached, bounded retries with backoff), hashed as they complete, m written as its
 *     manifest.json, and the directory renamed to <cache>/v<version>. Cached versions
 *     beyond o->keep (least recently made or reused first) are then removed, never the one
 *     just made. On failure nothing but the partial directory (removed) was touched. */
int ro_policy_fetch(const struct ro_fetch_opts *o, const char *uri, int64_t version,
		    const struct ro_policy_manifest *m, char *ret_dir, size_t dirlen, char *err,
		    size_t errlen);

/* ---- AWS credentials (agent/awscreds.c) ------------------------------------------------ */

struct ro_aws_creds {
	char access_key_id[128];
	char secret_access_key[128];
	char session_token[4096]; /* "" when none */
	int64_t expire_ms;	  /* wall clock ms, 0: never */
	char source[24];	  /* "env", "container", "web-identity", "imds" */
};

/* The AWS SDKs' order: environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
 * AWS_SESSION_TOKEN); container credentials (AWS_CONTAINER_CREDENTIALS_FULL_URI or _RELATIVE_URI,
 * authorization from AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE or _TOKEN: EKS Pod Identity,
 * ECS); web identity (AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, STS
 * AssumeRoleWithWebIdentity at AWS_ENDPOINT_URL_STS or sts.<region>.amazonaws.com: IRSA);
 * the instance profile through IMDSv2 at imds_endpoint (NULL: the default). Credentials
 * that expire are cached in the process and fetched again 5 minutes before they expire.
 * -EACCES when no source has any (err lists what was tried), or the one configured
 * refused. */
int ro_aws_creds_get(const char *imds_endpoint, const char *region, struct ro_aws_creds *ret,
		     char *err, size_t errlen);
/* Forget the cached credentials (a 403 ExpiredToken: fetch them again). */
void ro_aws_creds_invalidate(void);
/* The region: AWS_REGION, AWS_DEFAULT_REGION, IMDS placement/region, else "us-east-1". */
void ro_aws_region(const char *imds_endpoint, char *buf, size_t len);
