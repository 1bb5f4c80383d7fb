// SPDX-License-Identifier: MIT
//
// fingerprint.cu - the GPU side of libgpuos's validation mode (validate.c).
//
// Built with `nvcc -ptx -arch=compute_75` and embedded in libgpuos.so as the PTX string
// gpuos_fingerprint_ptx; validate.c loads it with the real cuModuleLoadData into every
// context it validates (the driver JIT-compiles it for the device at hand).
//
// Device memory is fingerprinted in 4 KiB chunks (GPUOS_VALIDATE_CHUNK): one 64-bit hash
// per chunk.  The live allocations of a context are described by a table of segments,
// sorted by first_chunk (and by base); segment s owns the chunks
// [first_chunk, first_chunk + ceil(size / 4096)) of the output array.
//
// The fake libcuda.so.1 of the host tests (libgpuos/fakecuda/) implements the same two
// kernels, with the same signatures, as C functions; hash values need not agree between
// the two, only within one implementation.
//
// Both kernels take only plain integers and pointers so that validate.c can launch them
// with cuLaunchKernel and a parameter array of (pointer, u32, pointer, u64) / (pointer,
// pointer, u64, pointer, pointer).  Launch them with blockDim.x a multiple of 32 (the
// hash kernel gives each warp a whole chunk and reduces with full-warp shuffles).

#define GPUOS_FP_CHUNK 4096ULL
#define GPUOS_FP_WORDS (GPUOS_FP_CHUNK / 8ULL)

struct gpuos_fp_seg {
	unsigned long long base;        // device address, any alignment
	unsigned long long size;        // bytes
	unsigned long long first_chunk; // index of its first chunk in the output array
};

// splitmix64's finalizer: a bijection with full avalanche.
__device__ __forceinline__ unsigned long long fp_mix(unsigned long long z)
{
	z += 0x9E3779B97F4A7C15ULL;
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
	return z ^ (z >> 31);
}

// The contribution of the word at word index `pos` of a chunk: position-dependent, so
// that moving a word changes the hash; contributions are summed, so the order in which
// lanes and the shuffle reduction add them does not matter.
__device__ __forceinline__ unsigned long long fp_word(unsigned long long w, unsigned long long pos)
{
	return fp_mix(w ^ (pos * 0x9E3779B97F4A7C15ULL));
}

// Little-endian assembly of n (1..8) bytes at p; the missing high bytes are zero.
__device__ __forceinline__ unsigned long long fp_load_bytes(const unsigned char *p, unsigned int n)
{
	unsigned long long w = 0;
	for (unsigned int i = 0; i < n; i++)
		w |= (unsigned long long)p[i] << (8 * i);
	return w;
}

// The segment owning chunk c: the last s with segs[s].first_chunk <= c, or -1.  A chunk
// index past the end of that segment's chunks (a gap in the table: validate.c leaves out
// allocations that went away between the two fingerprints) is not owned by anyone.
__device__ __forceinline__ int fp_find_seg(const gpuos_fp_seg *segs, unsigned int nsegs,
					    unsigned long long c)
{
	unsigned int lo = 0, hi = nsegs; // answer in [lo - 1, hi - 1]
	while (lo < hi) {
		unsigned int mid = lo + (hi - lo) / 2;
		if (segs[mid].first_chunk <= c)
			lo = mid + 1;
		else
			hi = mid;
	}
	return (int)lo - 1;
}

extern "C" __global__ void gpuos_fp_hash(const gpuos_fp_seg *segs, unsigned int nsegs,
					 unsigned long long *out, unsigned long long nchunks)
{
	const unsigned int lane = threadIdx.x & 31u;
	const unsigned long long warp =
		((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
	const unsigned long long nwarps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;

	// Every lane of a warp runs the same iterations (c depends on the warp only), so
	// the full-mask shuffles below are uniform.
	for (unsigned long long c = warp; c < nchunks; c += nwarps) {
		int s = fp_find_seg(segs, nsegs, c);
		if (s < 0)
			continue;
		const unsigned long long base = segs[s].base;
		const unsigned long long size = segs[s].size;
		const unsigned long long k = c - segs[s].first_chunk;
		if (k >= (size + GPUOS_FP_CHUNK - 1) / GPUOS_FP_CHUNK)
			continue; // a gap: no live segment owns this chunk
		const unsigned long long off = k * GPUOS_FP_CHUNK;
		const unsigned long long len =
			size - off < GPUOS_FP_CHUNK ? size - off : GPUOS_FP_CHUNK;
		const unsigned long long addr = base + off;
		const unsigned int nwords = (unsigned int)(len / 8);
		const unsigned int tail = (unsigned int)(len % 8);

		unsigned long long h = 0;
		if ((addr & 7ULL) == 0) {
			// Coalesced: lane i reads words i, i + 32, ... (256 bytes per warp step).
			const unsigned long long *w = (const unsigned long long *)addr;
			for (unsigned int i = lane; i < nwords; i += 32)
				h += fp_word(w[i], i);
		} else {
			// An unaligned base (VMM / graph allocations may start anywhere):
			// assemble each word from bytes; never read outside [addr, addr + len).
			const unsigned char *b = (const unsigned char *)addr;
			for (unsigned int i = lane; i < nwords; i += 32)
				h += fp_word(fp_load_bytes(b + 8ULL * i, 8), i);
		}
		if (tail != 0 && lane == 0) {
			// The short end of the segment, bytewise, as a zero-padded last word.
			const unsigned char *b = (const unsigned char *)addr + 8ULL * nwords;
			h += fp_word(fp_load_bytes(b, tail), nwords);
		}
		for (int d = 16; d > 0; d >>= 1)
			h += __shfl_xor_sync(0xffffffffu, h, d);
		if (lane == 0)
			out[c] = h;
	}
}

extern "C" __global__ void gpuos_fp_diff(const unsigned long long *before,
					 const unsigned long long *after,
					 unsigned long long nchunks,
					 unsigned long long *changed, unsigned int *count)
{
	const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
	for (unsigned long long c = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
	     c < nchunks; c += stride) {
		if (before[c] != after[c])
			changed[atomicAdd(count, 1u)] = c;
	}
}
