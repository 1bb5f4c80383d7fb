// CUDA runtime API: a kernel that evolves a device buffer; each step logs a checksum of it.
// Built by tests/gpu/test_cr_matrix.py with nvcc. Usage: cuda_runtime LOG STEPS SLEEP_MS SEED
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <ctime>
#include <cstring>
#include <unistd.h>
#include <sys/time.h>

__global__ void evolve(float *x, int n, int step) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 0.999f + 0.001f * (float)((i + step) % 13);
}

#define CHECK(c) do { cudaError_t e = (c); if (e != cudaSuccess) { fprintf(stderr, "%s\n", cudaGetErrorString(e)); return 1; } } while (0)

int main(int argc, char **argv) {
    if (argc != 5) return 2;
    FILE *log = fopen(argv[1], "a");
    int steps = atoi(argv[2]), sleep_ms = atoi(argv[3]);
    srand(atoi(argv[4]));
    const int n = 1 << 22;
    float *host = (float *)malloc(n * sizeof(float)), *dev;
    for (int i = 0; i < n; i++) host[i] = (float)rand() / RAND_MAX;
    CHECK(cudaMalloc(&dev, n * sizeof(float)));
    CHECK(cudaMemcpy(dev, host, n * sizeof(float), cudaMemcpyHostToDevice));
    for (int s = 0; s < steps; s++) {
        evolve<<<n / 256, 256>>>(dev, n, s);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(host, dev, n * sizeof(float), cudaMemcpyDeviceToHost));
        uint64_t h = 1469598103934665603ull;
        for (int i = 0; i < n; i++) { uint32_t b; memcpy(&b, &host[i], 4); h = (h ^ b) * 1099511628211ull; }
        struct timeval tv; gettimeofday(&tv, 0);
        fprintf(log, "%d sum %016llx t %ld.%06ld\n", s, (unsigned long long)h, (long)tv.tv_sec, (long)tv.tv_usec);
        fflush(log);
        if (sleep_ms) usleep(sleep_ms * 1000);
    }
    fprintf(log, "done\n");
    fclose(log);
    return 0;
}
