/* The CUDA build switch's smallest customer: asks the runtime how many devices it sees,
 * so --with-cuda is exercised end to end (nvcc rule, cudart link) before the kernels of
 * a later issue land on the same rules. */
#include <cuda_runtime.h>

extern "C" int ro_cuda_device_count(void)
{
	int n = 0;

	if (cudaGetDeviceCount(&n) != cudaSuccess)
		return 0;
	return n;
}
