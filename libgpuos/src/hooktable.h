/* SPDX-License-Identifier: MIT */
/*
 * hooktable.h - THE table of the driver entry points libgpuos wraps (X-macro).
 *
 *   X(exported_name, PFN type, handler, pt, (parameters), (arguments))
 *
 * One line per symbol that libcuda.so.1 exports: the exported name is exactly the
 * symbol (cuMemAlloc_v2, cuLaunchKernel_ptsz), the PFN type is its ABI from
 * cudaTypedefs.h (hooks.c checks every prototype against it), pt is 1 for the
 * per-thread-stream variants (_ptsz, _ptds).  Variants of one ABI share a handler.
 * Older ABIs that a runtime may still get from cuGetProcAddress are listed too
 * (cuStreamBeginCapture, cuGraphInstantiate, cuMemcpyBatchAsync, ...): a pointer that
 * matches no line is passed through untracked.  Everything not listed passes through;
 * cuGetExportTable is never wrapped.  No include guard: included once per expansion.
 */

/* entry-point lookup */
X(cuGetProcAddress, PFN_cuGetProcAddress_v11030, gpuos_h_get_proc, 0,
  (const char *symbol, void **pfn, int driverVersion, cuuint64_t flags),
  (symbol, pfn, driverVersion, flags))
X(cuGetProcAddress_v2, PFN_cuGetProcAddress_v12000, gpuos_h_get_proc_v2, 0,
  (const char *symbol, void **pfn, int driverVersion, cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus),
  (symbol, pfn, driverVersion, flags, symbolStatus))

/* initialisation (a standby copy of an MPS client waits here: standby.c) */
X(cuInit, PFN_cuInit_v2000, gpuos_h_init, 0, (unsigned int Flags), (Flags))

/* allocations */
X(cuMemAlloc_v2, PFN_cuMemAlloc_v3020, gpuos_h_mem_alloc, 0,
  (CUdeviceptr *dptr, size_t bytesize), (dptr, bytesize))
X(cuMemAllocPitch_v2, PFN_cuMemAllocPitch_v3020, gpuos_h_mem_alloc_pitch, 0,
  (CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height, unsigned int ElementSizeBytes),
  (dptr, pPitch, WidthInBytes, Height, ElementSizeBytes))
X(cuMemFree_v2, PFN_cuMemFree_v3020, gpuos_h_mem_free, 0, (CUdeviceptr dptr), (dptr))
X(cuMemAllocManaged, PFN_cuMemAllocManaged_v6000, gpuos_h_mem_alloc_managed, 0,
  (CUdeviceptr *dptr, size_t bytesize, unsigned int flags), (dptr, bytesize, flags))
X(cuMemAllocHost_v2, PFN_cuMemAllocHost_v3020, gpuos_h_mem_alloc_host, 0,
  (void **pp, size_t bytesize), (pp, bytesize))
X(cuMemHostAlloc, PFN_cuMemHostAlloc_v2020, gpuos_h_mem_host_alloc, 0,
  (void **pp, size_t bytesize, unsigned int Flags), (pp, bytesize, Flags))
X(cuMemFreeHost, PFN_cuMemFreeHost_v2000, gpuos_h_mem_free_host, 0, (void *p), (p))
X(cuMemHostRegister_v2, PFN_cuMemHostRegister_v6050, gpuos_h_mem_host_register, 0,
  (void *p, size_t bytesize, unsigned int Flags), (p, bytesize, Flags))
X(cuMemHostRegister, PFN_cuMemHostRegister_v6050, gpuos_h_mem_host_register, 0,
  (void *p, size_t bytesize, unsigned int Flags), (p, bytesize, Flags))
X(cuMemHostUnregister, PFN_cuMemHostUnregister_v4000, gpuos_h_mem_host_unregister, 0, (void *p), (p))
X(cuMemAllocAsync, PFN_cuMemAllocAsync_v11020, gpuos_h_mem_alloc_async, 0,
  (CUdeviceptr *dptr, size_t bytesize, CUstream hStream), (dptr, bytesize, hStream))
X(cuMemAllocAsync_ptsz, PFN_cuMemAllocAsync_v11020_ptsz, gpuos_h_mem_alloc_async, 1,
  (CUdeviceptr *dptr, size_t bytesize, CUstream hStream), (dptr, bytesize, hStream))
X(cuMemAllocFromPoolAsync, PFN_cuMemAllocFromPoolAsync_v11020, gpuos_h_mem_alloc_from_pool_async, 0,
  (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream), (dptr, bytesize, pool, hStream))
X(cuMemAllocFromPoolAsync_ptsz, PFN_cuMemAllocFromPoolAsync_v11020_ptsz, gpuos_h_mem_alloc_from_pool_async, 1,
  (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream), (dptr, bytesize, pool, hStream))
X(cuMemFreeAsync, PFN_cuMemFreeAsync_v11020, gpuos_h_mem_free_async, 0,
  (CUdeviceptr dptr, CUstream hStream), (dptr, hStream))
X(cuMemFreeAsync_ptsz, PFN_cuMemFreeAsync_v11020_ptsz, gpuos_h_mem_free_async, 1,
  (CUdeviceptr dptr, CUstream hStream), (dptr, hStream))

/* virtual memory management */
X(cuMemCreate, PFN_cuMemCreate_v10020, gpuos_h_mem_create, 0,
  (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags),
  (handle, size, prop, flags))
X(cuMemRelease, PFN_cuMemRelease_v10020, gpuos_h_mem_release, 0,
  (CUmemGenericAllocationHandle handle), (handle))
X(cuMemAddressReserve, PFN_cuMemAddressReserve_v10020, gpuos_h_mem_address_reserve, 0,
  (CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags),
  (ptr, size, alignment, addr, flags))
X(cuMemAddressFree, PFN_cuMemAddressFree_v10020, gpuos_h_mem_address_free, 0,
  (CUdeviceptr ptr, size_t size), (ptr, size))
X(cuMemMap, PFN_cuMemMap_v10020, gpuos_h_mem_map, 0,
  (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags),
  (ptr, size, offset, handle, flags))
X(cuMemUnmap, PFN_cuMemUnmap_v10020, gpuos_h_mem_unmap, 0, (CUdeviceptr ptr, size_t size), (ptr, size))
X(cuMemSetAccess, PFN_cuMemSetAccess_v10020, gpuos_h_mem_set_access, 0,
  (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count), (ptr, size, desc, count))

/* modules, libraries, functions, kernels */
X(cuModuleLoad, PFN_cuModuleLoad_v2000, gpuos_h_module_load, 0,
  (CUmodule *module, const char *fname), (module, fname))
X(cuModuleLoadData, PFN_cuModuleLoadData_v2000, gpuos_h_module_load_data, 0,
  (CUmodule *module, const void *image), (module, image))
X(cuModuleLoadDataEx, PFN_cuModuleLoadDataEx_v2010, gpuos_h_module_load_data_ex, 0,
  (CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options, void **optionValues),
  (module, image, numOptions, options, optionValues))
X(cuModuleLoadFatBinary, PFN_cuModuleLoadFatBinary_v2000, gpuos_h_module_load_fat_binary, 0,
  (CUmodule *module, const void *fatCubin), (module, fatCubin))
X(cuModuleUnload, PFN_cuModuleUnload_v2000, gpuos_h_module_unload, 0, (CUmodule hmod), (hmod))
X(cuModuleGetFunction, PFN_cuModuleGetFunction_v2000, gpuos_h_module_get_function, 0,
  (CUfunction *hfunc, CUmodule hmod, const char *name), (hfunc, hmod, name))
X(cuLibraryLoadData, PFN_cuLibraryLoadData_v12000, gpuos_h_library_load_data, 0,
  (CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
   unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
   unsigned int numLibraryOptions),
  (library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions, libraryOptionValues,
   numLibraryOptions))
X(cuLibraryLoadFromFile, PFN_cuLibraryLoadFromFile_v12000, gpuos_h_library_load_from_file, 0,
  (CUlibrary *library, const char *fileName, CUjit_option *jitOptions, void **jitOptionsValues,
   unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
   unsigned int numLibraryOptions),
  (library, fileName, jitOptions, jitOptionsValues, numJitOptions, libraryOptions, libraryOptionValues,
   numLibraryOptions))
X(cuLibraryUnload, PFN_cuLibraryUnload_v12000, gpuos_h_library_unload, 0, (CUlibrary library), (library))
X(cuLibraryGetKernel, PFN_cuLibraryGetKernel_v12000, gpuos_h_library_get_kernel, 0,
  (CUkernel *pKernel, CUlibrary library, const char *name), (pKernel, library, name))
X(cuLibraryGetModule, PFN_cuLibraryGetModule_v12000, gpuos_h_library_get_module, 0,
  (CUmodule *pMod, CUlibrary library), (pMod, library))
X(cuKernelGetFunction, PFN_cuKernelGetFunction_v12000, gpuos_h_kernel_get_function, 0,
  (CUfunction *pFunc, CUkernel kernel), (pFunc, kernel))

/* streams, events, stream capture */
/* CUDA IPC (only to say why it fails on movable memory) */
X(cuIpcGetMemHandle, PFN_cuIpcGetMemHandle_v4010, gpuos_h_ipc_get_mem_handle, 0,
  (CUipcMemHandle *pHandle, CUdeviceptr dptr), (pHandle, dptr))

/* contexts */
X(cuCtxDestroy_v2, PFN_cuCtxDestroy_v4000, gpuos_h_ctx_destroy, 0, (CUcontext ctx), (ctx))

X(cuStreamCreate, PFN_cuStreamCreate_v2000, gpuos_h_stream_create, 0,
  (CUstream *phStream, unsigned int Flags), (phStream, Flags))
X(cuStreamCreateWithPriority, PFN_cuStreamCreateWithPriority_v5050, gpuos_h_stream_create_with_priority, 0,
  (CUstream *phStream, unsigned int flags, int priority), (phStream, flags, priority))
X(cuStreamDestroy_v2, PFN_cuStreamDestroy_v4000, gpuos_h_stream_destroy, 0, (CUstream hStream), (hStream))
X(cuStreamDestroy, PFN_cuStreamDestroy_v4000, gpuos_h_stream_destroy, 0, (CUstream hStream), (hStream))
X(cuEventCreate, PFN_cuEventCreate_v2000, gpuos_h_event_create, 0,
  (CUevent *phEvent, unsigned int Flags), (phEvent, Flags))
X(cuEventDestroy_v2, PFN_cuEventDestroy_v4000, gpuos_h_event_destroy, 0, (CUevent hEvent), (hEvent))
X(cuEventDestroy, PFN_cuEventDestroy_v4000, gpuos_h_event_destroy, 0, (CUevent hEvent), (hEvent))
X(cuStreamBeginCapture_v2, PFN_cuStreamBeginCapture_v10010, gpuos_h_begin_capture, 0,
  (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode))
X(cuStreamBeginCapture_v2_ptsz, PFN_cuStreamBeginCapture_v10010_ptsz, gpuos_h_begin_capture, 1,
  (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode))
X(cuStreamBeginCapture, gpuos_pfn_cuStreamBeginCapture_v10000, gpuos_h_begin_capture_v1, 0,
  (CUstream hStream), (hStream))
X(cuStreamBeginCapture_ptsz, gpuos_pfn_cuStreamBeginCapture_v10000, gpuos_h_begin_capture_v1, 1,
  (CUstream hStream), (hStream))
X(cuStreamBeginCaptureToGraph, PFN_cuStreamBeginCaptureToGraph_v12030, gpuos_h_begin_capture_to_graph, 0,
  (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies, const CUgraphEdgeData *dependencyData,
   size_t numDependencies, CUstreamCaptureMode mode),
  (hStream, hGraph, dependencies, dependencyData, numDependencies, mode))
X(cuStreamBeginCaptureToGraph_ptsz, PFN_cuStreamBeginCaptureToGraph_v12030_ptsz, gpuos_h_begin_capture_to_graph, 1,
  (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies, const CUgraphEdgeData *dependencyData,
   size_t numDependencies, CUstreamCaptureMode mode),
  (hStream, hGraph, dependencies, dependencyData, numDependencies, mode))
X(cuStreamEndCapture, PFN_cuStreamEndCapture_v10000, gpuos_h_end_capture, 0,
  (CUstream hStream, CUgraph *phGraph), (hStream, phGraph))
X(cuStreamEndCapture_ptsz, PFN_cuStreamEndCapture_v10000_ptsz, gpuos_h_end_capture, 1,
  (CUstream hStream, CUgraph *phGraph), (hStream, phGraph))

/* copies */
X(cuMemcpy, PFN_cuMemcpy_v4000, gpuos_h_memcpy, 0,
  (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount), (dst, src, ByteCount))
X(cuMemcpy_ptds, PFN_cuMemcpy_v7000_ptds, gpuos_h_memcpy, 1,
  (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount), (dst, src, ByteCount))
X(cuMemcpyAsync, PFN_cuMemcpyAsync_v4000, gpuos_h_memcpy_async, 0,
  (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream), (dst, src, ByteCount, hStream))
X(cuMemcpyAsync_ptsz, PFN_cuMemcpyAsync_v7000_ptsz, gpuos_h_memcpy_async, 1,
  (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream), (dst, src, ByteCount, hStream))
X(cuMemcpyHtoD_v2, PFN_cuMemcpyHtoD_v3020, gpuos_h_memcpy_htod, 0,
  (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount), (dstDevice, srcHost, ByteCount))
X(cuMemcpyHtoD_v2_ptds, PFN_cuMemcpyHtoD_v7000_ptds, gpuos_h_memcpy_htod, 1,
  (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount), (dstDevice, srcHost, ByteCount))
X(cuMemcpyDtoH_v2, PFN_cuMemcpyDtoH_v3020, gpuos_h_memcpy_dtoh, 0,
  (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount), (dstHost, srcDevice, ByteCount))
X(cuMemcpyDtoH_v2_ptds, PFN_cuMemcpyDtoH_v7000_ptds, gpuos_h_memcpy_dtoh, 1,
  (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount), (dstHost, srcDevice, ByteCount))
X(cuMemcpyDtoD_v2, PFN_cuMemcpyDtoD_v3020, gpuos_h_memcpy_dtod, 0,
  (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount), (dstDevice, srcDevice, ByteCount))
X(cuMemcpyDtoD_v2_ptds, PFN_cuMemcpyDtoD_v7000_ptds, gpuos_h_memcpy_dtod, 1,
  (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount), (dstDevice, srcDevice, ByteCount))
X(cuMemcpyHtoDAsync_v2, PFN_cuMemcpyHtoDAsync_v3020, gpuos_h_memcpy_htod_async, 0,
  (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream),
  (dstDevice, srcHost, ByteCount, hStream))
X(cuMemcpyHtoDAsync_v2_ptsz, PFN_cuMemcpyHtoDAsync_v7000_ptsz, gpuos_h_memcpy_htod_async, 1,
  (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream),
  (dstDevice, srcHost, ByteCount, hStream))
X(cuMemcpyDtoHAsync_v2, PFN_cuMemcpyDtoHAsync_v3020, gpuos_h_memcpy_dtoh_async, 0,
  (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),
  (dstHost, srcDevice, ByteCount, hStream))
X(cuMemcpyDtoHAsync_v2_ptsz, PFN_cuMemcpyDtoHAsync_v7000_ptsz, gpuos_h_memcpy_dtoh_async, 1,
  (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),
  (dstHost, srcDevice, ByteCount, hStream))
X(cuMemcpyDtoDAsync_v2, PFN_cuMemcpyDtoDAsync_v3020, gpuos_h_memcpy_dtod_async, 0,
  (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),
  (dstDevice, srcDevice, ByteCount, hStream))
X(cuMemcpyDtoDAsync_v2_ptsz, PFN_cuMemcpyDtoDAsync_v7000_ptsz, gpuos_h_memcpy_dtod_async, 1,
  (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),
  (dstDevice, srcDevice, ByteCount, hStream))
X(cuMemcpy2D_v2, PFN_cuMemcpy2D_v3020, gpuos_h_memcpy_2d, 0, (const CUDA_MEMCPY2D *pCopy), (pCopy))
X(cuMemcpy2D_v2_ptds, PFN_cuMemcpy2D_v7000_ptds, gpuos_h_memcpy_2d, 1, (const CUDA_MEMCPY2D *pCopy), (pCopy))
X(cuMemcpy2DUnaligned_v2, PFN_cuMemcpy2DUnaligned_v3020, gpuos_h_memcpy_2d, 0,
  (const CUDA_MEMCPY2D *pCopy), (pCopy))
X(cuMemcpy2DUnaligned_v2_ptds, PFN_cuMemcpy2DUnaligned_v7000_ptds, gpuos_h_memcpy_2d, 1,
  (const CUDA_MEMCPY2D *pCopy), (pCopy))
X(cuMemcpy2DAsync_v2, PFN_cuMemcpy2DAsync_v3020, gpuos_h_memcpy_2d_async, 0,
  (const CUDA_MEMCPY2D *pCopy, CUstream hStream), (pCopy, hStream))
X(cuMemcpy2DAsync_v2_ptsz, PFN_cuMemcpy2DAsync_v7000_ptsz, gpuos_h_memcpy_2d_async, 1,
  (const CUDA_MEMCPY2D *pCopy, CUstream hStream), (pCopy, hStream))
X(cuMemcpy3D_v2, PFN_cuMemcpy3D_v3020, gpuos_h_memcpy_3d, 0, (const CUDA_MEMCPY3D *pCopy), (pCopy))
X(cuMemcpy3D_v2_ptds, PFN_cuMemcpy3D_v7000_ptds, gpuos_h_memcpy_3d, 1, (const CUDA_MEMCPY3D *pCopy), (pCopy))
X(cuMemcpy3DAsync_v2, PFN_cuMemcpy3DAsync_v3020, gpuos_h_memcpy_3d_async, 0,
  (const CUDA_MEMCPY3D *pCopy, CUstream hStream), (pCopy, hStream))
X(cuMemcpy3DAsync_v2_ptsz, PFN_cuMemcpy3DAsync_v7000_ptsz, gpuos_h_memcpy_3d_async, 1,
  (const CUDA_MEMCPY3D *pCopy, CUstream hStream), (pCopy, hStream))
X(cuMemcpyPeer, PFN_cuMemcpyPeer_v4000, gpuos_h_memcpy_peer, 0,
  (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount),
  (dstDevice, dstContext, srcDevice, srcContext, ByteCount))
X(cuMemcpyPeer_ptds, PFN_cuMemcpyPeer_v7000_ptds, gpuos_h_memcpy_peer, 1,
  (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount),
  (dstDevice, dstContext, srcDevice, srcContext, ByteCount))
X(cuMemcpyPeerAsync, PFN_cuMemcpyPeerAsync_v4000, gpuos_h_memcpy_peer_async, 0,
  (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,
   CUstream hStream),
  (dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream))
X(cuMemcpyPeerAsync_ptsz, PFN_cuMemcpyPeerAsync_v7000_ptsz, gpuos_h_memcpy_peer_async, 1,
  (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,
   CUstream hStream),
  (dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream))
X(cuMemcpyBatchAsync_v2, PFN_cuMemcpyBatchAsync_v13000, gpuos_h_memcpy_batch_async, 0,
  (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
   size_t *attrIdxs, size_t numAttrs, CUstream hStream),
  (dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, hStream))
X(cuMemcpyBatchAsync_v2_ptsz, PFN_cuMemcpyBatchAsync_v13000_ptsz, gpuos_h_memcpy_batch_async, 1,
  (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
   size_t *attrIdxs, size_t numAttrs, CUstream hStream),
  (dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, hStream))
X(cuMemcpyBatchAsync, PFN_cuMemcpyBatchAsync_v12080, gpuos_h_memcpy_batch_async_v1, 0,
  (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
   size_t *attrIdxs, size_t numAttrs, size_t *failIdx, CUstream hStream),
  (dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, failIdx, hStream))
X(cuMemcpyBatchAsync_ptsz, PFN_cuMemcpyBatchAsync_v12080_ptsz, gpuos_h_memcpy_batch_async_v1, 1,
  (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
   size_t *attrIdxs, size_t numAttrs, size_t *failIdx, CUstream hStream),
  (dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, failIdx, hStream))

/* memsets and stream memory writes */
X(cuMemsetD8_v2, PFN_cuMemsetD8_v3020, gpuos_h_memset_d8, 0,
  (CUdeviceptr dstDevice, unsigned char uc, size_t N), (dstDevice, uc, N))
X(cuMemsetD8_v2_ptds, PFN_cuMemsetD8_v7000_ptds, gpuos_h_memset_d8, 1,
  (CUdeviceptr dstDevice, unsigned char uc, size_t N), (dstDevice, uc, N))
X(cuMemsetD16_v2, PFN_cuMemsetD16_v3020, gpuos_h_memset_d16, 0,
  (CUdeviceptr dstDevice, unsigned short us, size_t N), (dstDevice, us, N))
X(cuMemsetD16_v2_ptds, PFN_cuMemsetD16_v7000_ptds, gpuos_h_memset_d16, 1,
  (CUdeviceptr dstDevice, unsigned short us, size_t N), (dstDevice, us, N))
X(cuMemsetD32_v2, PFN_cuMemsetD32_v3020, gpuos_h_memset_d32, 0,
  (CUdeviceptr dstDevice, unsigned int ui, size_t N), (dstDevice, ui, N))
X(cuMemsetD32_v2_ptds, PFN_cuMemsetD32_v7000_ptds, gpuos_h_memset_d32, 1,
  (CUdeviceptr dstDevice, unsigned int ui, size_t N), (dstDevice, ui, N))
X(cuMemsetD2D8_v2, PFN_cuMemsetD2D8_v3020, gpuos_h_memset_d2d8, 0,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height),
  (dstDevice, dstPitch, uc, Width, Height))
X(cuMemsetD2D8_v2_ptds, PFN_cuMemsetD2D8_v7000_ptds, gpuos_h_memset_d2d8, 1,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height),
  (dstDevice, dstPitch, uc, Width, Height))
X(cuMemsetD2D16_v2, PFN_cuMemsetD2D16_v3020, gpuos_h_memset_d2d16, 0,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height),
  (dstDevice, dstPitch, us, Width, Height))
X(cuMemsetD2D16_v2_ptds, PFN_cuMemsetD2D16_v7000_ptds, gpuos_h_memset_d2d16, 1,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height),
  (dstDevice, dstPitch, us, Width, Height))
X(cuMemsetD2D32_v2, PFN_cuMemsetD2D32_v3020, gpuos_h_memset_d2d32, 0,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height),
  (dstDevice, dstPitch, ui, Width, Height))
X(cuMemsetD2D32_v2_ptds, PFN_cuMemsetD2D32_v7000_ptds, gpuos_h_memset_d2d32, 1,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height),
  (dstDevice, dstPitch, ui, Width, Height))
X(cuMemsetD8Async, PFN_cuMemsetD8Async_v3020, gpuos_h_memset_d8_async, 0,
  (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream), (dstDevice, uc, N, hStream))
X(cuMemsetD8Async_ptsz, PFN_cuMemsetD8Async_v7000_ptsz, gpuos_h_memset_d8_async, 1,
  (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream), (dstDevice, uc, N, hStream))
X(cuMemsetD16Async, PFN_cuMemsetD16Async_v3020, gpuos_h_memset_d16_async, 0,
  (CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream), (dstDevice, us, N, hStream))
X(cuMemsetD16Async_ptsz, PFN_cuMemsetD16Async_v7000_ptsz, gpuos_h_memset_d16_async, 1,
  (CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream), (dstDevice, us, N, hStream))
X(cuMemsetD32Async, PFN_cuMemsetD32Async_v3020, gpuos_h_memset_d32_async, 0,
  (CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream), (dstDevice, ui, N, hStream))
X(cuMemsetD32Async_ptsz, PFN_cuMemsetD32Async_v7000_ptsz, gpuos_h_memset_d32_async, 1,
  (CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream), (dstDevice, ui, N, hStream))
X(cuMemsetD2D8Async, PFN_cuMemsetD2D8Async_v3020, gpuos_h_memset_d2d8_async, 0,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height, CUstream hStream),
  (dstDevice, dstPitch, uc, Width, Height, hStream))
X(cuMemsetD2D8Async_ptsz, PFN_cuMemsetD2D8Async_v7000_ptsz, gpuos_h_memset_d2d8_async, 1,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height, CUstream hStream),
  (dstDevice, dstPitch, uc, Width, Height, hStream))
X(cuMemsetD2D16Async, PFN_cuMemsetD2D16Async_v3020, gpuos_h_memset_d2d16_async, 0,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height, CUstream hStream),
  (dstDevice, dstPitch, us, Width, Height, hStream))
X(cuMemsetD2D16Async_ptsz, PFN_cuMemsetD2D16Async_v7000_ptsz, gpuos_h_memset_d2d16_async, 1,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height, CUstream hStream),
  (dstDevice, dstPitch, us, Width, Height, hStream))
X(cuMemsetD2D32Async, PFN_cuMemsetD2D32Async_v3020, gpuos_h_memset_d2d32_async, 0,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height, CUstream hStream),
  (dstDevice, dstPitch, ui, Width, Height, hStream))
X(cuMemsetD2D32Async_ptsz, PFN_cuMemsetD2D32Async_v7000_ptsz, gpuos_h_memset_d2d32_async, 1,
  (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height, CUstream hStream),
  (dstDevice, dstPitch, ui, Width, Height, hStream))
X(cuStreamWriteValue32_v2, PFN_cuStreamWriteValue32_v11070, gpuos_h_write_value32, 0,
  (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags), (stream, addr, value, flags))
X(cuStreamWriteValue32_v2_ptsz, PFN_cuStreamWriteValue32_v11070_ptsz, gpuos_h_write_value32, 1,
  (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags), (stream, addr, value, flags))
X(cuStreamWriteValue32, PFN_cuStreamWriteValue32_v8000, gpuos_h_write_value32, 0,
  (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags), (stream, addr, value, flags))
X(cuStreamWriteValue32_ptsz, PFN_cuStreamWriteValue32_v8000_ptsz, gpuos_h_write_value32, 1,
  (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags), (stream, addr, value, flags))
X(cuStreamWriteValue64_v2, PFN_cuStreamWriteValue64_v11070, gpuos_h_write_value64, 0,
  (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags), (stream, addr, value, flags))
X(cuStreamWriteValue64_v2_ptsz, PFN_cuStreamWriteValue64_v11070_ptsz, gpuos_h_write_value64, 1,
  (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags), (stream, addr, value, flags))
X(cuStreamWriteValue64, PFN_cuStreamWriteValue64_v9000, gpuos_h_write_value64, 0,
  (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags), (stream, addr, value, flags))
X(cuStreamWriteValue64_ptsz, PFN_cuStreamWriteValue64_v9000_ptsz, gpuos_h_write_value64, 1,
  (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags), (stream, addr, value, flags))

/* kernel launches */
X(cuLaunchKernel, PFN_cuLaunchKernel_v4000, gpuos_h_launch_kernel, 0,
  (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,
   unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
   void **kernelParams, void **extra),
  (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra))
X(cuLaunchKernel_ptsz, PFN_cuLaunchKernel_v7000_ptsz, gpuos_h_launch_kernel, 1,
  (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,
   unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
   void **kernelParams, void **extra),
  (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra))
X(cuLaunchKernelEx, PFN_cuLaunchKernelEx_v11060, gpuos_h_launch_kernel_ex, 0,
  (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
  (config, f, kernelParams, extra))
X(cuLaunchKernelEx_ptsz, PFN_cuLaunchKernelEx_v11060_ptsz, gpuos_h_launch_kernel_ex, 1,
  (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
  (config, f, kernelParams, extra))
X(cuLaunchCooperativeKernel, PFN_cuLaunchCooperativeKernel_v9000, gpuos_h_launch_cooperative, 0,
  (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,
   unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
   void **kernelParams),
  (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams))
X(cuLaunchCooperativeKernel_ptsz, PFN_cuLaunchCooperativeKernel_v9000_ptsz, gpuos_h_launch_cooperative, 1,
  (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,
   unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
   void **kernelParams),
  (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams))

/* graphs */
X(cuGraphInstantiateWithFlags, PFN_cuGraphInstantiateWithFlags_v11040, gpuos_h_graph_instantiate_with_flags, 0,
  (CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags), (phGraphExec, hGraph, flags))
X(cuGraphInstantiateWithParams, PFN_cuGraphInstantiateWithParams_v12000, gpuos_h_graph_instantiate_with_params, 0,
  (CUgraphExec *phGraphExec, CUgraph hGraph, CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams),
  (phGraphExec, hGraph, instantiateParams))
X(cuGraphInstantiateWithParams_ptsz, PFN_cuGraphInstantiateWithParams_v12000_ptsz,
  gpuos_h_graph_instantiate_with_params, 1,
  (CUgraphExec *phGraphExec, CUgraph hGraph, CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams),
  (phGraphExec, hGraph, instantiateParams))
X(cuGraphInstantiate, gpuos_pfn_cuGraphInstantiate_v10000, gpuos_h_graph_instantiate_v1, 0,
  (CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize),
  (phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize))
X(cuGraphInstantiate_v2, gpuos_pfn_cuGraphInstantiate_v10000, gpuos_h_graph_instantiate_v1, 0,
  (CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize),
  (phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize))
X(cuGraphLaunch, PFN_cuGraphLaunch_v10000, gpuos_h_graph_launch, 0,
  (CUgraphExec hGraphExec, CUstream hStream), (hGraphExec, hStream))
X(cuGraphLaunch_ptsz, PFN_cuGraphLaunch_v10000_ptsz, gpuos_h_graph_launch, 1,
  (CUgraphExec hGraphExec, CUstream hStream), (hGraphExec, hStream))
X(cuGraphExecUpdate_v2, PFN_cuGraphExecUpdate_v12000, gpuos_h_graph_exec_update, 0,
  (CUgraphExec hGraphExec, CUgraph hGraph, CUgraphExecUpdateResultInfo *resultInfo),
  (hGraphExec, hGraph, resultInfo))
X(cuGraphExecUpdate, PFN_cuGraphExecUpdate_v10020, gpuos_h_graph_exec_update_v1, 0,
  (CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out, CUgraphExecUpdateResult *updateResult_out),
  (hGraphExec, hGraph, hErrorNode_out, updateResult_out))
X(cuGraphExecKernelNodeSetParams_v2, PFN_cuGraphExecKernelNodeSetParams_v12000,
  gpuos_h_graph_exec_kernel_node_set_params, 0,
  (CUgraphExec hGraphExec, CUgraphNode hNode, const CUDA_KERNEL_NODE_PARAMS *nodeParams),
  (hGraphExec, hNode, nodeParams))
X(cuGraphExecKernelNodeSetParams, PFN_cuGraphExecKernelNodeSetParams_v10010,
  gpuos_h_graph_exec_kernel_node_set_params_v1, 0,
  (CUgraphExec hGraphExec, CUgraphNode hNode, const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams),
  (hGraphExec, hNode, nodeParams))
X(cuGraphExecDestroy, PFN_cuGraphExecDestroy_v10000, gpuos_h_graph_exec_destroy, 0,
  (CUgraphExec hGraphExec), (hGraphExec))
