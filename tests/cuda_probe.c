/* Prints how many CUDA devices the runtime sees (0 on a machine without one). */
#include <stdio.h>

int ro_cuda_device_count(void);

int main(void)
{
	(void)printf("cuda devices: %d\n", ro_cuda_device_count());
	return 0;
}
