/* SPDX-License-Identifier: MIT */
/*
 * t_graph - stream capture and graphs (linked with -lcuda).  Usage: t_graph [SEED]
 *
 *   capture (fill x, saxpy y += a*x, DtoD copy z = y, memset z2 = 7) into graph g;
 *   nothing runs while capturing, parameter values are copied at capture time;
 *   inspect the nodes; instantiate; launch 3 times; change the fill node's value with
 *   cuGraphExecKernelNodeSetParams_v2 and launch; capture the same shape with another
 *   `a`, cuGraphExecUpdate_v2 and launch; build a graph by hand with
 *   cuGraphAddKernelNode_v2 on a CUkernel, cuGraphInstantiateWithParams, launch; a
 *   topology-changing update fails; cuStreamBeginCaptureToGraph adds to it; captures invalidated by synchronizing, by
 *   cuCtxSynchronize and by the legacy stream.  Every result is checked.
 */
#define FN(sym) (tally(#sym), sym)
#include "work.h"

enum { N = 2000 };
static CUdeviceptr x, y, z, z2;
static float *hy, *out;

/* The 4-operation sequence, captured on s into a new graph. */
static CUgraph capture(CUstream s, float *v, float *a, int *n)
{
	CUgraph g = NULL;
	CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
	cuuint64_t id = 0;
	CUgraph cg = NULL;
	const CUgraphNode *deps = NULL;
	const CUgraphEdgeData *edges = NULL;
	size_t nd = 0;
	void *pf[] = { &x, v, n };
	void *ps[] = { a, &x, &y, n };

	CU(cuStreamBeginCapture_v2, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
	CU(cuStreamIsCapturing, s, &st);
	CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE, "not capturing: %d", (int)st);
	CU(cuLaunchKernel, w_fill, blocks(N), 1, 1, 256, 1, 1, 0, s, pf, NULL);
	CU(cuLaunchKernel, w_saxpy, blocks(N), 1, 1, 256, 1, 1, 0, s, ps, NULL);
	CU(cuMemcpyDtoDAsync_v2, z, y, N * 4, s);
	CU(cuMemsetD32Async, z2, fbits(7.0f), N, s);
	C.captured += 4;
	CU(cuStreamGetCaptureInfo_v3, s, &st, &id, &cg, &deps, &edges, &nd);
	CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE && id && cg && nd == 1 && deps, "capture info");
	CU(cuStreamEndCapture, s, &g);
	CU(cuStreamIsCapturing, s, &st);
	CHECK(st == CU_STREAM_CAPTURE_STATUS_NONE, "still capturing");
	CHECK(g == cg, "cuStreamEndCapture gave another graph");
	return g;
}

/* The real driver's capture rules: synchronizing invalidates a capture; the legacy
 * stream cannot be used while a blocking stream captures (nothing runs, nothing is
 * recorded, no graph comes out). */
static void capture_errors(CUstream s, CUstream nb)
{
	CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
	CUgraph g = (CUgraph)&st;
	float v = 5.0f;
	int n = N;
	void *pf[] = { &z2, &v, &n };

	/* cuStreamSynchronize on the capturing stream */
	CU(cuStreamBeginCapture_v2, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
	CU(cuLaunchKernel, w_fill, blocks(N), 1, 1, 256, 1, 1, 0, s, pf, NULL);
	C.captured++;
	CU_ERR(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, cuStreamSynchronize, s);
	CU(cuStreamIsCapturing, s, &st);
	CHECK(st == CU_STREAM_CAPTURE_STATUS_INVALIDATED, "capture status %d", (int)st);
	CU_ERR(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, cuLaunchKernel, w_fill, 1, 1, 1, 1, 1, 1, 0, s, pf, NULL);
	CU_ERR(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, cuStreamEndCapture, s, &g);
	CHECK(g == NULL, "an invalidated capture gave a graph");

	/* cuCtxSynchronize while a (non-blocking) stream captures */
	CU(cuStreamBeginCapture_v2, nb, CU_STREAM_CAPTURE_MODE_RELAXED);
	CU_ERR(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, cuCtxSynchronize);
	CU_ERR(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, cuStreamEndCapture, nb, &g);

	/* the legacy stream while a blocking stream captures: the query is harmless, work
	 * on it fails and invalidates the capture; a non-blocking stream is not involved */
	CU(cuStreamBeginCapture_v2, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
	CU_ERR(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, cuStreamIsCapturing, CU_STREAM_LEGACY, &st);
	CU(cuStreamIsCapturing, nb, &st);
	CHECK(st == CU_STREAM_CAPTURE_STATUS_NONE, "non-blocking stream status %d", (int)st);
	CU(cuLaunchKernel, w_fill, blocks(N), 1, 1, 256, 1, 1, 0, nb, pf, NULL);
	C.launches++;
	CU_ERR(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, cuMemsetD32_v2, z2, 0, N);
	CU(cuStreamIsCapturing, s, &st);
	CHECK(st == CU_STREAM_CAPTURE_STATUS_INVALIDATED, "capture status %d", (int)st);
	CU_ERR(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, cuStreamEndCapture, s, &g);
	CU_ERR(CUDA_ERROR_ILLEGAL_STATE, cuStreamEndCapture, s, &g);
	CU(cuStreamSynchronize, nb);
	dtoh(out, z2, N * 4);
	check_all("after the capture errors: z2", out, N, 5.0f);
}

static void launch_graph(CUgraphExec ge, CUstream s, int times)
{
	for (int i = 0; i < times; i++) {
		CU(cuGraphLaunch, ge, s);
		C.graph_launches++;
		C.graph_kernels += 2;
		C.graph_copies++;
		C.graph_memsets++;
	}
	CU(cuStreamSynchronize, s);
}

/* y must be hy + k (and z == y, z2 == 7). */
static void check_y(const char *what, float k)
{
	dtoh(out, y, N * 4);
	for (int i = 0; i < N; i++)
		if (!feq(out[i], hy[i] + k)) {
			CHECK(0, "%s: y[%d] = %g, expected %g", what, i, out[i], hy[i] + k);
			break;
		}
	sum_bytes(out, N * 4);
	dtoh(out, z, N * 4);
	for (int i = 0; i < N; i++)
		if (!feq(out[i], hy[i] + k)) {
			CHECK(0, "%s: z[%d] = %g", what, i, out[i]);
			break;
		}
	dtoh(out, z2, N * 4);
	char z2_what[160];
	snprintf(z2_what, sizeof z2_what, "%s: z2", what);
	check_all(z2_what, out, N, 7.0f);
}

int main(int argc, char **argv)
{
	uint64_t seed = seed_from_args(argc, argv);
	CUstream s, nb;
	CUgraph g, g2, g3;
	CUgraphExec ge, ge3;
	CUgraphNode nodes[8], kn;
	CUgraphNodeType type;
	CUDA_KERNEL_NODE_PARAMS kp;
	CUDA_MEMCPY3D cp;
	CUDA_MEMSET_NODE_PARAMS mp;
	CUgraphExecUpdateResultInfo info;
	CUDA_GRAPH_INSTANTIATE_PARAMS ip;
	CUlibrary lib;
	CUkernel kfill;
	size_t nn = 0;
	float v = 1.25f, a = 0.5f, v2 = -4.0f, v3 = 2.5f;
	int n = N;
	char extra[64];

	rng_seed(seed);
	hy = malloc(N * 4);
	out = malloc(N * 4);
	work_init();
	x = dalloc(N * 4), y = dalloc(N * 4), z = dalloc(N * 4), z2 = dalloc(N * 4);
	rng_fill(hy, N);
	htod(y, hy, N * 4);
	CU(cuStreamCreate, &s, 0);
	CU(cuStreamCreate, &nb, CU_STREAM_NON_BLOCKING);
	capture_errors(s, nb);

	g = capture(s, &v, &a, &n);
	v = 99.0f; /* captured values must not follow the program's variables */
	a = 99.0f;
	dtoh(out, y, N * 4);
	check_floats("y after capture (nothing may run)", out, hy, N);

	/* the nodes as captured */
	CU(cuGraphGetNodes, g, NULL, &nn);
	CHECK(nn == 4, "%zu nodes", nn);
	nn = 8;
	CU(cuGraphGetNodes, g, nodes, &nn);
	for (size_t i = 0; i < nn && i < 4; i++) {
		static const CUgraphNodeType want[] = { CU_GRAPH_NODE_TYPE_KERNEL, CU_GRAPH_NODE_TYPE_KERNEL,
							CU_GRAPH_NODE_TYPE_MEMCPY, CU_GRAPH_NODE_TYPE_MEMSET };
		CU(cuGraphNodeGetType, nodes[i], &type);
		CHECK(type == want[i], "node %zu type %d", i, (int)type);
	}
	CU(cuGraphKernelNodeGetParams_v2, nodes[1], &kp);
	CHECK(kp.func == w_saxpy && kp.gridDimX == blocks(N) && kp.blockDimX == 256 && kp.kernelParams,
	      "saxpy node params");
	if (kp.kernelParams)
		CHECK(*(float *)kp.kernelParams[0] == 0.5f && *(CUdeviceptr *)kp.kernelParams[1] == x &&
		      *(CUdeviceptr *)kp.kernelParams[2] == y && *(int *)kp.kernelParams[3] == N,
		      "saxpy node parameter values");
	CU(cuGraphMemcpyNodeGetParams, nodes[2], &cp);
	CHECK(cp.dstDevice == z && cp.srcDevice == y && cp.WidthInBytes == N * 4 && cp.Height == 1 && cp.Depth == 1,
	      "memcpy node params");
	CU(cuGraphMemsetNodeGetParams, nodes[3], &mp);
	CHECK(mp.dst == z2 && mp.value == fbits(7.0f) && mp.elementSize == 4 && mp.width == N && mp.height == 1,
	      "memset node params");

	/* instantiate, launch 3 times: y += 3 * 0.5 * 1.25 */
	CU(cuGraphInstantiateWithFlags, &ge, g, 0);
	launch_graph(ge, s, 3);
	check_y("3 launches", 3 * 0.5f * 1.25f);

	/* the fill node now writes -4: y += 0.5 * -4 */
	void *pf2[] = { &x, &v2, &n };
	memset(&kp, 0, sizeof(kp));
	kp.func = w_fill;
	kp.gridDimX = blocks(N), kp.gridDimY = 1, kp.gridDimZ = 1;
	kp.blockDimX = 256, kp.blockDimY = 1, kp.blockDimZ = 1;
	kp.kernelParams = pf2;
	CU(cuGraphExecKernelNodeSetParams_v2, ge, nodes[0], &kp);
	v2 = 1000.0f; /* copied at the call */
	launch_graph(ge, s, 1);
	check_y("after cuGraphExecKernelNodeSetParams_v2", 3 * 0.5f * 1.25f - 2.0f);

	/* the same shape captured with a = 2, v = 1.25: cuGraphExecUpdate_v2, y += 2.5 */
	v = 1.25f, a = 2.0f;
	g2 = capture(s, &v, &a, &n);
	memset(&info, 0, sizeof(info));
	CU(cuGraphExecUpdate_v2, ge, g2, &info);
	CHECK(info.result == CU_GRAPH_EXEC_UPDATE_SUCCESS, "update result %d", (int)info.result);
	launch_graph(ge, s, 1);
	check_y("after cuGraphExecUpdate_v2", 3 * 0.5f * 1.25f - 2.0f + 2.5f);

	/* by hand: one kernel node of a CUkernel, instantiated with parameters */
	CU(cuLibraryLoadData, &lib, "fake library for graphs", NULL, NULL, 0, NULL, NULL, 0);
	CU(cuLibraryGetKernel, &kfill, lib, "fake_fill");
	CU(cuGraphCreate, &g3, 0);
	void *pf3[] = { &z2, &v3, &n };
	memset(&kp, 0, sizeof(kp));
	kp.kern = kfill;
	kp.gridDimX = blocks(N), kp.gridDimY = 1, kp.gridDimZ = 1;
	kp.blockDimX = 256, kp.blockDimY = 1, kp.blockDimZ = 1;
	kp.kernelParams = pf3;
	CU(cuGraphAddKernelNode_v2, &kn, g3, NULL, 0, &kp);
	memset(&ip, 0, sizeof(ip));
	ip.hUploadStream = s;
	CU(cuGraphInstantiateWithParams, &ge3, g3, &ip);
	CHECK(ip.result_out == CUDA_GRAPH_INSTANTIATE_SUCCESS, "instantiate result %d", (int)ip.result_out);
	CU(cuGraphLaunch, ge3, s);
	C.graph_launches++;
	C.graph_kernels++;
	CU(cuStreamSynchronize, s);
	dtoh(out, z2, N * 4);
	check_all("hand-built graph: z2", out, N, 2.5f);
	sum_bytes(out, N * 4);
	memset(&info, 0, sizeof(info));
	CU_ERR(CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, cuGraphExecUpdate_v2, ge3, g, &info);
	CHECK(info.result == CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED, "bad update result %d", (int)info.result);

	/* capture into the hand-built graph: it gets a second node after the first */
	{
		CUgraph got = NULL;
		float v4 = -1.0f;
		void *pf4[] = { &z2, &v4, &n };
		CU(cuStreamBeginCaptureToGraph, s, g3, &kn, NULL, 1, CU_STREAM_CAPTURE_MODE_GLOBAL);
		CU(cuLaunchKernel, w_fill, blocks(N), 1, 1, 256, 1, 1, 0, s, pf4, NULL);
		C.captured++;
		CU(cuStreamEndCapture, s, &got);
		CHECK(got == g3, "cuStreamBeginCaptureToGraph: another graph");
		nn = 0;
		CU(cuGraphGetNodes, g3, NULL, &nn);
		CHECK(nn == 2, "%zu nodes after capturing into the graph", nn);
		CUgraphExec ge4;
		CU(cuGraphInstantiateWithFlags, &ge4, g3, 0);
		CU(cuGraphLaunch, ge4, s);
		C.graph_launches++;
		C.graph_kernels += 2;
		CU(cuStreamSynchronize, s);
		dtoh(out, z2, N * 4);
		check_all("captured into a graph: z2", out, N, -1.0f);
		CU(cuGraphExecDestroy, ge4);
	}
	CU(cuGraphExecDestroy, ge3);
	CU(cuGraphExecDestroy, ge);
	CU(cuGraphDestroy, g3);
	CU(cuGraphDestroy, g2);
	CU(cuGraphDestroy, g);
	CU(cuLibraryUnload, lib);
	CU(cuStreamDestroy_v2, s);
	CU(cuStreamDestroy_v2, nb);
	dfree(x), dfree(y), dfree(z), dfree(z2);
	work_fini();
	snprintf(extra, sizeof(extra), ", \"seed\": %" PRIu64, seed);
	return finish("t_graph", extra);
}
