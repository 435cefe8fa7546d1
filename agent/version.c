/* --version: enough for a bug report: the release, the commit, the backends. */
#include "config.h"

#include <rdma/fabric.h>
#include <string.h>

#include "agent/version.h"
#include "kernels/model.h"

void ro_version_print(FILE *out, const char *prog)
{
	struct fi_info *hints = fi_allocinfo(), *info = NULL;
	const char *seen[32];
	size_t n = 0;
	uint32_t v = fi_version();

	(void)fprintf(out, "%s %s%s%s\n", prog, PACKAGE_VERSION, *RO_GIT_DESCRIBE ? " (git " : "",
		      *RO_GIT_DESCRIBE ? RO_GIT_DESCRIBE ")" : "");
	(void)fprintf(out, "cuda: %s\n", ro_kernels_cuda_built() ? "yes" : "no");
	(void)fprintf(out, "libfabric: %u.%u, providers:", FI_MAJOR(v), FI_MINOR(v));
	if (hints) {
		hints->ep_attr->type = FI_EP_RDM;
		hints->caps = FI_MSG | FI_RMA;
		hints->mode = ~0ULL;
		hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
					      FI_MR_PROV_KEY | FI_MR_ENDPOINT;
	}
	if (hints && fi_getinfo(FI_VERSION(1, 11), NULL, NULL, 0, hints, &info) == 0) {
		for (struct fi_info *i = info; i && n < 32; i = i->next) {
			const char *p = i->fabric_attr->prov_name;
			size_t k = 0;

			while (k < n && strcmp(seen[k], p))
				k++;
			if (k == n) {
				seen[n++] = p;
				(void)fprintf(out, " %s", p);
			}
		}
	}
	if (!n)
		(void)fputs(" (none found)", out);
	(void)fputc('\n', out);
	fi_freeinfo(info);
	fi_freeinfo(hints);
}
