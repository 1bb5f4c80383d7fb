/* SPDX-License-Identifier: MIT */
/*
 * graph.c - CUDA graphs: what an exec runs, extracted once, replayed at each launch.
 *
 * At instantiate (and exec update) the source graph is walked with the real driver,
 * child graphs included: kernel nodes are scanned then, because their kernelParams
 * are only readable then; memcpy and memset nodes give exact ranges; memory
 * allocation nodes put their allocation in the map (GPUOS_ALLOC_GRAPH, held by every
 * exec that has it), and what a free node frees becomes scratch the validator leaves
 * alone.  A graph launch writes one GRAPH record and then the LAUNCH and COPY records
 * of the nodes, all with the launch's seq.  Nodes that may write memory but are not
 * extracted (conditional, batch memory operations, anything unknown) flag the GRAPH
 * record GPUOS_GRAPH_INCOMPLETE, as does an exec we never saw instantiated.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

#define MAX_DEPTH 16 /* child graph nesting */

struct gkernel {
	uint64_t node;
	uint16_t flags;               /* GPUOS_LAUNCH_*, GRAPH included */
	struct gpuos_rec_launch rec;  /* seq, stream, ctx and graph_exec are the launch's */
	struct gpuos_rec_buf *bufs;   /* rec.nbuf */
};

struct gcopy {
	struct gpuos_rec_copy rec;    /* seq, stream and graph_exec are the launch's */
	struct gpuos_rec_buf bufs[2];
	uint32_t nbuf;
};

struct gpuos_gexec {
	struct gkernel *k;
	struct gcopy *c;
	struct {
		uint64_t base, size;
	} *a;                         /* graph allocations this exec holds */
	uint32_t nk, nc, na;
	uint16_t gflags;              /* GPUOS_GRAPH_INCOMPLETE */
	int touch_all;                /* for validation: predict everything */
	struct gpuos_rec_buf *ubufs;  /* for validation: every node's buffers */
	uint32_t nubuf;
};

#define H(x) ((uint64_t)(uintptr_t)(x))

/* ---- extraction ---------------------------------------------------------------------------- */

struct nodes {
	struct {
		CUgraphNode node;
		CUgraphNodeType type;
	} *v;
	size_t n, cap;
	int incomplete, oom;
};

static int append(struct nodes *ns, CUgraphNode node, CUgraphNodeType type)
{
	if (ns->n == ns->cap) {
		size_t cap = ns->cap ? ns->cap * 2 : 64;
		void *p = realloc(ns->v, cap * sizeof ns->v[0]);
		if (!p) {
			ns->oom = 1;
			return -1;
		}
		ns->v = p;
		ns->cap = cap;
	}
	ns->v[ns->n].node = node;
	ns->v[ns->n++].type = type;
	return 0;
}

/* Every node of graph and of its child graphs, with its type. */
static void collect(struct nodes *ns, CUgraph graph, int depth)
{
	size_t n = 0;
	if (!gpuos_drv.graph_get_nodes || !gpuos_drv.graph_node_get_type || depth > MAX_DEPTH ||
	    gpuos_drv.graph_get_nodes(graph, NULL, &n) != CUDA_SUCCESS) {
		ns->incomplete = 1;
		return;
	}
	if (!n)
		return;
	CUgraphNode *v = malloc(n * sizeof *v);
	if (!v) {
		ns->oom = 1;
		return;
	}
	int ok = gpuos_drv.graph_get_nodes(graph, v, &n) == CUDA_SUCCESS;
	if (!ok)
		ns->incomplete = 1;
	for (size_t i = 0; ok && i < n && !ns->oom; i++) {
		CUgraphNodeType t;
		CUgraph child;
		if (gpuos_drv.graph_node_get_type(v[i], &t) != CUDA_SUCCESS)
			ns->incomplete = 1;
		else if (append(ns, v[i], t))
			break;
		else if (t == CU_GRAPH_NODE_TYPE_GRAPH) {
			if (gpuos_drv.graph_child_graph && gpuos_drv.graph_child_graph(v[i], &child) == CUDA_SUCCESS)
				collect(ns, child, depth + 1);
			else
				ns->incomplete = 1;
		}
	}
	free(v);
}

/* Scan one kernel node's parameters into *out.  0, or -1 (not extracted). */
static int scan_kernel(uint64_t node, const CUDA_KERNEL_NODE_PARAMS *p, struct gkernel *out)
{
	uint64_t h = p->func ? H(p->func) : H(p->kern);
	if (!h)
		return -1;
	gpuos_fn_ensure(h, p->func ? GPUOS_HINT_UNKNOWN : GPUOS_HINT_KERNEL, 0);
	struct gpuos_scan *s = gpuos_scan_tls();
	if (!s)
		return -1;
	memset(out, 0, sizeof *out);
	pthread_rwlock_rdlock(&gpuos_lock.v);
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_FN, h);
	const struct gpuos_fn *fn = o ? o->ptr : NULL;
	gpuos_scan_launch(s, fn, p->kernelParams, p->extra);
	out->rec.func_id = fn ? fn->func_id : GPUOS_NO_FUNC;
	pthread_rwlock_unlock(&gpuos_lock.v);
	out->node = node;
	out->flags = s->lflags | GPUOS_LAUNCH_GRAPH;
	out->rec.grid[0] = p->gridDimX;
	out->rec.grid[1] = p->gridDimY;
	out->rec.grid[2] = p->gridDimZ;
	out->rec.block[0] = p->blockDimX;
	out->rec.block[1] = p->blockDimY;
	out->rec.block[2] = p->blockDimZ;
	out->rec.shmem = p->sharedMemBytes;
	out->rec.arg_hash = s->hash;
	out->rec.nbuf = s->nbuf;
	if (s->nbuf) {
		out->bufs = malloc(s->nbuf * sizeof *out->bufs);
		if (!out->bufs) {
			gpuos_track_off(ENOMEM, "out of memory for a graph's kernel node");
			return -1;
		}
		memcpy(out->bufs, s->bufs, s->nbuf * sizeof *out->bufs);
	}
	return 0;
}

/* Hold a graph allocation (in the map, counted in aux) for this exec. */
static void hold_alloc(struct gpuos_gexec *g, uint64_t base, uint64_t size, int device)
{
	struct gpuos_alloc a = {
		.base = base, .end = base + size, .ctx = gpuos_current_ctx(), .aux = 1,
		.kind = GPUOS_ALLOC_GRAPH, .flags = GPUOS_A_DEVMEM, .device = device,
	};
	int fresh = 0, held = 1;
	gpuos_write_lock_drained();
	ssize_t i = gpuos_map_index(&gpuos_allocs, base);
	if (i >= 0 && gpuos_allocs.v[i].kind == GPUOS_ALLOC_GRAPH && gpuos_allocs.v[i].end == a.end)
		gpuos_allocs.v[i].aux++;
	else
		held = fresh = !gpuos_map_insert(&gpuos_allocs, &a);
	pthread_rwlock_unlock(&gpuos_lock.v);
	if (fresh)
		gpuos_alloc_record(GPUOS_REC_ALLOC, &a, 0);
	if (held) {
		g->a[g->na].base = base;
		g->a[g->na++].size = size;
	}
}

/* Let go of the exec's graph allocations (write lock held). */
static void release_locked(struct gpuos_gexec *g)
{
	for (uint32_t j = 0; j < g->na; j++) {
		ssize_t i = gpuos_map_index(&gpuos_allocs, g->a[j].base);
		struct gpuos_alloc *e = i >= 0 ? &gpuos_allocs.v[i] : NULL;
		if (!e || e->kind != GPUOS_ALLOC_GRAPH || e->end != g->a[j].base + g->a[j].size || --e->aux)
			continue;
		struct gpuos_alloc gone = *e;
		gpuos_map_remove_at(&gpuos_allocs, (size_t)i);
		gpuos_alloc_record(GPUOS_REC_FREE, &gone, 0);
	}
	g->na = 0;
}

static void gexec_free(struct gpuos_gexec *g)
{
	if (!g)
		return;
	for (uint32_t i = 0; i < g->nk; i++)
		free(g->k[i].bufs);
	free(g->k);
	free(g->c);
	free(g->a);
	free(g->ubufs);
	free(g);
}

static int cmp_base(const void *a, const void *b)
{
	uint64_t x = ((const struct gpuos_rec_buf *)a)->base, y = ((const struct gpuos_rec_buf *)b)->base;
	return x < y ? -1 : x > y;
}

/* The validator's prediction for a launch of the exec: kernels' allocations (once
 * each), then the copies' exact ranges. */
static void make_union(struct gpuos_gexec *g)
{
	free(g->ubufs);
	g->ubufs = NULL;
	g->nubuf = 0;
	g->touch_all = !!(g->gflags & GPUOS_GRAPH_INCOMPLETE);
	size_t nk = 0, total = 0;
	for (uint32_t i = 0; i < g->nk; i++) {
		if (g->k[i].flags & (GPUOS_LAUNCH_LAYOUT_UNKNOWN | GPUOS_LAUNCH_TOUCH_ALL | GPUOS_LAUNCH_TRUNCATED))
			g->touch_all = 1;
		nk += g->k[i].rec.nbuf;
	}
	total = nk;
	for (uint32_t i = 0; i < g->nc; i++)
		total += g->c[i].nbuf;
	if (g->touch_all || !total)
		return;
	struct gpuos_rec_buf *u = malloc(total * sizeof *u);
	if (!u) {
		g->touch_all = 1;
		return;
	}
	size_t n = 0;
	for (uint32_t i = 0; i < g->nk; i++) {
		memcpy(u + n, g->k[i].bufs, g->k[i].rec.nbuf * sizeof *u);
		n += g->k[i].rec.nbuf;
	}
	qsort(u, nk, sizeof *u, cmp_base);
	size_t m = 0;
	for (size_t i = 0; i < nk; i++)
		if (!m || u[m - 1].base != u[i].base)
			u[m++] = u[i];
	for (uint32_t i = 0; i < g->nc; i++)
		for (uint32_t j = 0; j < g->c[i].nbuf; j++)
			u[m++] = g->c[i].bufs[j];
	g->ubufs = u;
	g->nubuf = (uint32_t)m;
}

/* Memory that a free node of the graph frees is scratch from then on: not for the
 * validator, which must not read memory the pool may have handed to someone else. */
static void mark_freed(const struct nodes *ns)
{
	for (size_t i = 0; i < ns->n; i++) {
		CUdeviceptr p = 0;
		if (ns->v[i].type != CU_GRAPH_NODE_TYPE_MEM_FREE || !gpuos_drv.graph_mem_free_node_get_params ||
		    gpuos_drv.graph_mem_free_node_get_params(ns->v[i].node, &p) != CUDA_SUCCESS)
			continue;
		gpuos_write_lock_drained();
		ssize_t j = gpuos_map_index(&gpuos_allocs, p);
		if (j >= 0 && (gpuos_allocs.v[j].kind == GPUOS_ALLOC_GRAPH || gpuos_allocs.v[j].kind == GPUOS_ALLOC_ASYNC))
			gpuos_allocs.v[j].flags &= ~GPUOS_A_DEVMEM;
		pthread_rwlock_unlock(&gpuos_lock.v);
	}
}

/* What an exec of graph runs.  NULL when out of memory (tracking is then off). */
static struct gpuos_gexec *build(CUgraph graph)
{
	struct gpuos_gexec *g = calloc(1, sizeof *g);
	struct nodes ns = { 0 };
	if (!g)
		goto oom;
	collect(&ns, graph, 0);
	if (ns.oom)
		goto oom;
	size_t nk = 0, nc = 0, na = 0;
	for (size_t i = 0; i < ns.n; i++) {
		CUgraphNodeType t = ns.v[i].type;
		nk += t == CU_GRAPH_NODE_TYPE_KERNEL;
		nc += t == CU_GRAPH_NODE_TYPE_MEMCPY || t == CU_GRAPH_NODE_TYPE_MEMSET;
		na += t == CU_GRAPH_NODE_TYPE_MEM_ALLOC;
	}
	g->k = calloc(nk + 1, sizeof *g->k);
	g->c = calloc(nc + 1, sizeof *g->c);
	g->a = calloc(na + 1, sizeof *g->a);
	if (!g->k || !g->c || !g->a)
		goto oom;
	if (ns.incomplete)
		g->gflags |= GPUOS_GRAPH_INCOMPLETE;

	/* Allocations first: the kernels of the graph take pointers into them. */
	for (size_t i = 0; i < ns.n; i++) {
		CUDA_MEM_ALLOC_NODE_PARAMS p;
		memset(&p, 0, sizeof p);
		if (ns.v[i].type != CU_GRAPH_NODE_TYPE_MEM_ALLOC)
			continue;
		if (!gpuos_drv.graph_mem_alloc_node_get_params ||
		    gpuos_drv.graph_mem_alloc_node_get_params(ns.v[i].node, &p) != CUDA_SUCCESS) {
			g->gflags |= GPUOS_GRAPH_INCOMPLETE;
			continue;
		}
		int device = p.poolProps.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? p.poolProps.location.id : -1;
		hold_alloc(g, p.dptr, p.bytesize, device);
	}
	mark_freed(&ns);
	for (size_t i = 0; i < ns.n; i++) {
		CUgraphNode node = ns.v[i].node;
		int ok = 1;
		switch (ns.v[i].type) {
		case CU_GRAPH_NODE_TYPE_KERNEL: {
			CUDA_KERNEL_NODE_PARAMS p;
			memset(&p, 0, sizeof p);
			ok = gpuos_drv.graph_kernel_node_get_params &&
			     gpuos_drv.graph_kernel_node_get_params(node, &p) == CUDA_SUCCESS &&
			     !scan_kernel(H(node), &p, &g->k[g->nk]);
			g->nk += ok;
			break;
		}
		case CU_GRAPH_NODE_TYPE_MEMCPY: {
			CUDA_MEMCPY3D p;
			memset(&p, 0, sizeof p);
			ok = gpuos_drv.graph_memcpy_node_get_params &&
			     gpuos_drv.graph_memcpy_node_get_params(node, &p) == CUDA_SUCCESS;
			if (ok) {
				struct gcopy *c = &g->c[g->nc++];
				pthread_rwlock_rdlock(&gpuos_lock.v);
				c->nbuf = gpuos_node_memcpy(&p, &c->rec, c->bufs);
				pthread_rwlock_unlock(&gpuos_lock.v);
			}
			break;
		}
		case CU_GRAPH_NODE_TYPE_MEMSET: {
			CUDA_MEMSET_NODE_PARAMS p;
			memset(&p, 0, sizeof p);
			ok = gpuos_drv.graph_memset_node_get_params &&
			     gpuos_drv.graph_memset_node_get_params(node, &p) == CUDA_SUCCESS;
			if (ok) {
				struct gcopy *c = &g->c[g->nc++];
				pthread_rwlock_rdlock(&gpuos_lock.v);
				c->nbuf = gpuos_node_memset(&p, &c->rec, c->bufs);
				pthread_rwlock_unlock(&gpuos_lock.v);
			}
			break;
		}
		case CU_GRAPH_NODE_TYPE_HOST:
		case CU_GRAPH_NODE_TYPE_GRAPH: /* its nodes are in the list */
		case CU_GRAPH_NODE_TYPE_EMPTY:
		case CU_GRAPH_NODE_TYPE_WAIT_EVENT:
		case CU_GRAPH_NODE_TYPE_EVENT_RECORD:
		case CU_GRAPH_NODE_TYPE_EXT_SEMAS_SIGNAL:
		case CU_GRAPH_NODE_TYPE_EXT_SEMAS_WAIT:
		case CU_GRAPH_NODE_TYPE_MEM_ALLOC:
		case CU_GRAPH_NODE_TYPE_MEM_FREE:
			break;
		default: /* conditional, batch memory operations, newer types */
			ok = 0;
			break;
		}
		if (!ok)
			g->gflags |= GPUOS_GRAPH_INCOMPLETE;
	}
	free(ns.v);
	make_union(g);
	return g;
oom:
	free(ns.v);
	if (g) {
		gpuos_write_lock_drained();
		release_locked(g);
		pthread_rwlock_unlock(&gpuos_lock.v);
		gexec_free(g);
	}
	gpuos_track_off(ENOMEM, "out of memory for a graph's nodes");
	return NULL;
}

/* The exec now runs graph (instantiated, or updated from it). */
static void install(CUgraphExec exec, CUgraph graph, int created)
{
	struct gpuos_gexec *g = build(graph), *old;
	gpuos_write_lock_drained();
	struct gpuos_obj *o = gpuos_obj_put(GPUOS_O_GEXEC, H(exec));
	if (o) {
		old = o->ptr;
		o->ptr = g;
		o->parent = H(graph);
	} else {
		old = g;
	}
	if (old)
		release_locked(old);
	pthread_rwlock_unlock(&gpuos_lock.v);
	gexec_free(old);
	if (o && created)
		gpuos_obj_record(GPUOS_OBJ_GRAPH_EXEC, GPUOS_OBJ_CREATED, H(exec), H(graph), GPUOS_NO_FUNC);
}

/* ---- handlers -------------------------------------------------------------------------------------- */

CUresult gpuos_h_graph_instantiate_with_flags(PFN_cuGraphInstantiateWithFlags_v11040 real, int pt,
					      CUgraphExec *exec, CUgraph graph, unsigned long long flags)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(exec, graph, flags);
	if (on && r == CUDA_SUCCESS)
		install(*exec, graph, 1);
	return r;
}

CUresult gpuos_h_graph_instantiate_with_params(PFN_cuGraphInstantiateWithParams_v12000 real, int pt,
					       CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(exec, graph, params);
	if (on && r == CUDA_SUCCESS)
		install(*exec, graph, 1);
	return r;
}

CUresult gpuos_h_graph_instantiate_v1(gpuos_pfn_cuGraphInstantiate_v10000 real, int pt, CUgraphExec *exec,
				      CUgraph graph, CUgraphNode *err_node, char *log, size_t log_size)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(exec, graph, err_node, log, log_size);
	if (on && r == CUDA_SUCCESS)
		install(*exec, graph, 1);
	return r;
}

CUresult gpuos_h_graph_exec_update(PFN_cuGraphExecUpdate_v12000 real, int pt, CUgraphExec exec, CUgraph graph,
				   CUgraphExecUpdateResultInfo *info)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(exec, graph, info);
	if (on && r == CUDA_SUCCESS)
		install(exec, graph, 0);
	return r;
}

CUresult gpuos_h_graph_exec_update_v1(PFN_cuGraphExecUpdate_v10020 real, int pt, CUgraphExec exec, CUgraph graph,
				      CUgraphNode *err_node, CUgraphExecUpdateResult *result)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(exec, graph, err_node, result);
	if (on && r == CUDA_SUCCESS)
		install(exec, graph, 0);
	return r;
}

/* New parameters for one kernel node of the exec: scan them now (only now readable). */
static void node_params_set(CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p)
{
	struct gkernel k;
	if (scan_kernel(H(node), p, &k))
		return;
	struct gpuos_rec_buf *old = k.bufs;
	gpuos_write_lock_drained();
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_GEXEC, H(exec));
	struct gpuos_gexec *g = o ? o->ptr : NULL;
	for (uint32_t i = 0; g && i < g->nk; i++) {
		if (g->k[i].node == H(node)) {
			old = g->k[i].bufs;
			g->k[i] = k;
			make_union(g);
			break;
		}
	}
	pthread_rwlock_unlock(&gpuos_lock.v);
	free(old);
}

CUresult gpuos_h_graph_exec_kernel_node_set_params(PFN_cuGraphExecKernelNodeSetParams_v12000 real, int pt,
						   CUgraphExec exec, CUgraphNode node,
						   const CUDA_KERNEL_NODE_PARAMS *p)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(exec, node, p);
	if (on && r == CUDA_SUCCESS && p)
		node_params_set(exec, node, p);
	return r;
}

CUresult gpuos_h_graph_exec_kernel_node_set_params_v1(PFN_cuGraphExecKernelNodeSetParams_v10010 real, int pt,
						      CUgraphExec exec, CUgraphNode node,
						      const CUDA_KERNEL_NODE_PARAMS_v1 *p)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(exec, node, p);
	if (on && r == CUDA_SUCCESS && p) {
		CUDA_KERNEL_NODE_PARAMS v2 = {
			.func = p->func, .gridDimX = p->gridDimX, .gridDimY = p->gridDimY, .gridDimZ = p->gridDimZ,
			.blockDimX = p->blockDimX, .blockDimY = p->blockDimY, .blockDimZ = p->blockDimZ,
			.sharedMemBytes = p->sharedMemBytes, .kernelParams = p->kernelParams, .extra = p->extra,
		};
		node_params_set(exec, node, &v2);
	}
	return r;
}

CUresult gpuos_h_graph_exec_destroy(PFN_cuGraphExecDestroy_v10000 real, int pt, CUgraphExec exec)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(exec);
	if (!on || r != CUDA_SUCCESS)
		return r;
	struct gpuos_obj o;
	gpuos_write_lock_drained();
	int had = gpuos_obj_del(GPUOS_O_GEXEC, H(exec), &o);
	if (had && o.ptr)
		release_locked(o.ptr);
	pthread_rwlock_unlock(&gpuos_lock.v);
	if (had)
		gexec_free(o.ptr);
	gpuos_obj_record(GPUOS_OBJ_GRAPH_EXEC, GPUOS_OBJ_DESTROYED, H(exec), had ? o.parent : 0, GPUOS_NO_FUNC);
	return r;
}

/* The GRAPH record and its nodes' records (read lock held). */
static void replay(CUgraphExec exec, uint64_t seq, uint64_t stream, uint64_t ctx, int captured)
{
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_GEXEC, H(exec));
	const struct gpuos_gexec *g = o ? o->ptr : NULL;
	struct gpuos_rec_graph gr = {
		.seq = seq, .graph_exec = H(exec), .stream = stream,
		.nkernels = g ? g->nk : 0, .ncopies = g ? g->nc : 0,
	};
	uint16_t gflags = (g ? g->gflags : GPUOS_GRAPH_INCOMPLETE) | (captured ? GPUOS_GRAPH_CAPTURED : 0);
	gpuos_ring_emit(GPUOS_REC_GRAPH, gflags, &gr, sizeof gr, NULL, 0);
	uint64_t unknown = 0;
	for (uint32_t i = 0; g && i < g->nk; i++) {
		const struct gkernel *k = &g->k[i];
		struct gpuos_rec_launch rec = k->rec;
		rec.seq = seq;
		rec.stream = stream;
		rec.ctx = ctx;
		rec.graph_exec = H(exec);
		gpuos_ring_emit(GPUOS_REC_LAUNCH, k->flags | (captured ? GPUOS_LAUNCH_CAPTURED : 0), &rec, sizeof rec,
				k->bufs, rec.nbuf * sizeof *k->bufs);
		unknown += !!(k->flags & GPUOS_LAUNCH_LAYOUT_UNKNOWN);
	}
	for (uint32_t i = 0; g && i < g->nc; i++) {
		struct gpuos_rec_copy rec = g->c[i].rec;
		rec.seq = seq;
		rec.stream = stream;
		rec.graph_exec = H(exec);
		gpuos_ring_emit(GPUOS_REC_COPY, GPUOS_COPY_GRAPH | (captured ? GPUOS_COPY_CAPTURED : 0), &rec,
				sizeof rec, NULL, 0);
	}
	GPUOS_COUNT(n_graph_launches, 1);
	GPUOS_COUNT(n_launches, gr.nkernels);
	GPUOS_COUNT(n_copies, gr.ncopies);
	if (unknown)
		GPUOS_COUNT(n_unknown_layout, unknown);
}

/* A graph launch in a queue. */
struct qe_graph {
	struct gpuos_qe h;
	uint64_t exec, stream, ctx;
	uint32_t captured, pad;
};

void gpuos_play_graph(const struct gpuos_qe *e)
{
	const struct qe_graph *q = (const struct qe_graph *)e;
	/* The exec as it was at the launch: updating or destroying it drains the queues. */
	replay((CUgraphExec)(uintptr_t)q->exec, gpuos_next_seq(), q->stream, q->ctx, (int)q->captured);
}

CUresult gpuos_h_graph_launch(PFN_cuGraphLaunch_v10000 real, int pt, CUgraphExec exec, CUstream st)
{
	gpuos_standby_at_launch();
	if (!gpuos_recording())
		return real(exec, st);
	uint64_t stream = gpuos_eff_stream(st, pt), ctx = gpuos_current_ctx();
	int captured = gpuos_stream_captured(stream);
	struct gpuos_qe *e = gpuos_defer_reserve(sizeof(struct qe_graph), GPUOS_QE_GRAPH, 0);
	if (e) {
		struct qe_graph *q = (struct qe_graph *)e;
		q->exec = H(exec);
		q->stream = stream;
		q->ctx = ctx;
		q->captured = (uint32_t)captured;
		CUresult r = real(exec, st);
		gpuos_defer_commit(r == CUDA_SUCCESS);
		return r;
	}
	gpuos_defer_drain_self(); /* recorded inline, after what this thread queued */
	uint64_t seq = gpuos_next_seq();
	int validating = gpuos_validating;
	struct gpuos_val_op op;
	struct gpuos_rec_buf *bufs = NULL; /* a copy: the exec may change while validating */
	if (validating) {
		memset(&op, 0, sizeof op);
		op.op_type = GPUOS_REC_GRAPH;
		op.seq = seq;
		op.func_id = GPUOS_NO_FUNC;
		op.ctx = (CUcontext)(uintptr_t)ctx;
		op.stream = (CUstream)(uintptr_t)stream;
		pthread_rwlock_rdlock(&gpuos_lock.v);
		struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_GEXEC, H(exec));
		const struct gpuos_gexec *g = o ? o->ptr : NULL;
		if (!g || g->touch_all)
			op.touch_all = 1;
		else if (g->nubuf && !(bufs = malloc(g->nubuf * sizeof *bufs)))
			op.touch_all = 1;
		else if (g->nubuf) {
			memcpy(bufs, g->ubufs, g->nubuf * sizeof *bufs);
			op.bufs = bufs;
			op.nbuf = g->nubuf;
		}
		pthread_rwlock_unlock(&gpuos_lock.v);
		gpuos_val_begin(&op);
	}
	CUresult r = real(exec, st);
	if (r == CUDA_SUCCESS) {
		pthread_rwlock_rdlock(&gpuos_lock.v);
		replay(exec, seq, stream, ctx, captured);
		pthread_rwlock_unlock(&gpuos_lock.v);
	}
	if (validating) {
		gpuos_val_end(&op, r);
		free(bufs);
	}
	return r;
}
