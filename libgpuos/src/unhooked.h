/* SPDX-License-Identifier: MIT */
/*
 * unhooked.h - driver entry points that write device memory and that libgpuos does not
 * track (X-macro: U(exported name)). Each is exported by a jump trampoline
 * (unhooked_x86_64.S) that marks the process's record incomplete on a call
 * (GPUOS_INCOMPLETE_UNHOOKED_WRITER) and goes on to the driver's, its arguments untouched;
 * dlsym and cuGetProcAddress hand out the trampoline as they hand out hook wrappers.
 * The list is cuda.h's writers of linear device memory less the hook table (hooktable.h):
 * copies from CUDA arrays and 3D peer/batch copies, batched stream memory operations,
 * batched decompression, multi-device cooperative launches. Writes to CUDA arrays only
 * (HtoA, DtoA, AtoA) are not listed: arrays are not in the map.
 */
U(cuMemcpyAtoD_v2)
U(cuMemcpyAtoD_v2_ptds)
U(cuMemcpy3DPeer)
U(cuMemcpy3DPeer_ptds)
U(cuMemcpy3DPeerAsync)
U(cuMemcpy3DPeerAsync_ptsz)
U(cuMemcpy3DBatchAsync_v2)
U(cuMemcpy3DBatchAsync_v2_ptsz)
U(cuStreamBatchMemOp_v2)
U(cuStreamBatchMemOp_v2_ptsz)
U(cuMemBatchDecompressAsync)
U(cuMemBatchDecompressAsync_ptsz)
U(cuLaunchCooperativeKernelMultiDevice)
