/* SPDX-License-Identifier: MIT */
/*
 * t_procaddr - the shared workload (work.h) with every entry point fetched through
 * cuGetProcAddress_v2 by its base name, like the CUDA 12/13 runtime: with cudaVersion
 * 13000 and 12000, each with CU_GET_PROC_ADDRESS_DEFAULT and with
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (then the _ptsz/_ptds variants are
 * called).  cuGetProcAddress_v2 itself comes from dlsym, then is asked for
 * "cuGetProcAddress" and the answer is used from there on.  "cuFakeInternalOnly"
 * resolves to a function libcuda does not export; it must still work (an interposer
 * passes unmatched results through).  Not linked with -lcuda.  Usage: t_procaddr [SEED]
 *
 * Each result is identified by comparing it with dlsym(libcuda, variant) for the
 * variants sym, sym_ptsz and sym_ptds, and the test checks it is the variant the
 * version and flags call for.
 */
#include "common.h"
#include <cudaTypedefs.h>

static void *g_h;
static PFN_cuGetProcAddress_v12000 g_gpa;
static int g_ver;
static cuuint64_t g_flags;
static unsigned g_gen = 1;

static void *dl(const char *name) { return dlsym(g_h, name); }

/* A name kept for the program's lifetime, one copy per name. */
static const char *intern(const char *name)
{
	static char *names[512];
	static int n;
	for (int i = 0; i < n; i++)
		if (!strcmp(names[i], name))
			return names[i];
	if (n == 512 || !(names[n] = strdup(name)))
		abort();
	return names[n++];
}

static CUresult gpa(const char *sym, void **pfn, int ver, cuuint64_t flags, CUdriverProcAddressQueryResult *st)
{
	tally("cuGetProcAddress_v2");
	return g_gpa(sym, pfn, ver, flags, st);
}

/* Resolve the exported name `sym` (cuMemAlloc_v2, cuLaunchKernel) by its base name
 * with the current version and flags; returns the exported name of the variant got. */
static const char *pa_resolve(const char *sym, void **out)
{
	char base[128], cand[3][160];
	const char *sfx[3] = { "", "_ptsz", "_ptds" };
	CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	size_t n = strlen(sym);
	int ver = g_ver, want = 0;
	CUresult r;

	snprintf(base, sizeof(base), "%s", sym);
	/* strip an ABI suffix _vN: cuMemAlloc_v2 -> cuMemAlloc */
	while (n > 0 && base[n - 1] >= '0' && base[n - 1] <= '9')
		n--;
	if (n > 2 && n < strlen(base) && base[n - 1] == 'v' && base[n - 2] == '_')
		base[n - 2] = 0;
	/* this program calls these with their CUDA 12 signatures (13.0 has _v2 ones) */
	if ((!strcmp(base, "cuCtxSynchronize") || !strcmp(base, "cuCtxGetDevice")) && ver > 12090)
		ver = 12090;
	/* and this one with its CUDA 12.5 signature, whatever the mode's version */
	if (!strcmp(sym, "cuCtxCreate_v4") && ver < 12050)
		ver = 12050;
	r = gpa(base, out, ver, g_flags, &st);
	if (r != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS || !*out) {
		fprintf(stderr, "cuGetProcAddress(%s, %d, %llu) failed: %d/%d\n", base, ver,
			(unsigned long long)g_flags, (int)r, (int)st);
		exit(1);
	}
	for (int i = 0; i < 3; i++)
		snprintf(cand[i], sizeof(cand[i]), "%s%s", sym, sfx[i]);
	if (g_flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
		want = dl(cand[1]) ? 1 : dl(cand[2]) ? 2 : 0;
	for (int i = 0; i < 3; i++)
		if (dl(cand[i]) && dl(cand[i]) == *out) {
			CHECK(i == want, "cuGetProcAddress(%s, %d, %llu) gave %s, expected %s", base, ver,
			      (unsigned long long)g_flags, cand[i], cand[want]);
			return intern(cand[i]);
		}
	fprintf(stderr, "cuGetProcAddress(%s, %d, %llu) gave %p: none of %s, %s, %s\n", base, ver,
		(unsigned long long)g_flags, *out, cand[0], cand[1], cand[2]);
	exit(1);
}

#define FN(sym) (*({ \
	static void *p_; \
	static const char *n_; \
	static unsigned gen_; \
	if (gen_ != g_gen) { \
		n_ = pa_resolve(#sym, &p_); \
		gen_ = g_gen; \
	} \
	tally(n_); \
	(__typeof__(&sym))p_; }))
#include "work.h"

/* What cuGetProcAddress answers for (name, version, flags) must be dlsym(expected). */
static void expect(const char *name, int ver, cuuint64_t flags, const char *expected)
{
	void *p = NULL;
	CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	CU_CALL(CUDA_SUCCESS, gpa(name, &p, ver, flags, &st));
	CHECK(st == CU_GET_PROC_ADDRESS_SUCCESS && p && p == dl(expected),
	      "cuGetProcAddress(%s, %d, %llu) = %p, dlsym(%s) = %p", name, ver, (unsigned long long)flags, p,
	      expected, dl(expected));
}

int main(int argc, char **argv)
{
	static const struct { int ver; cuuint64_t flags; } modes[] = {
		{ 13000, CU_GET_PROC_ADDRESS_DEFAULT },
		{ 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM },
		{ 12000, CU_GET_PROC_ADDRESS_DEFAULT },
		{ 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM },
	};
	const cuuint64_t PT = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
	uint64_t seed = seed_from_args(argc, argv);
	CUdriverProcAddressQueryResult st;
	PFN_cuGetProcAddress_v11030 gpa1 = NULL;
	void *p = NULL;
	int v = 0;
	char extra[64];

	if (!(g_h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL))) {
		fprintf(stderr, "dlopen(libcuda.so.1): %s\n", dlerror());
		return 1;
	}
	if (!(g_gpa = (PFN_cuGetProcAddress_v12000)dl("cuGetProcAddress_v2"))) {
		fprintf(stderr, "no cuGetProcAddress_v2\n");
		return 1;
	}
	/* cuGetProcAddress through itself: v2 for 12.0 and later, v1 before */
	expect("cuGetProcAddress", 13000, 0, "cuGetProcAddress_v2");
	CU_CALL(CUDA_SUCCESS, gpa("cuGetProcAddress", &p, 13000, 0, &st));
	if (p)
		g_gpa = (PFN_cuGetProcAddress_v12000)p;
	expect("cuGetProcAddress", 11030, 0, "cuGetProcAddress");
	CU_CALL(CUDA_SUCCESS, gpa("cuGetProcAddress", (void **)&gpa1, 11080, 0, &st));
	if (gpa1) {
		tally("cuGetProcAddress");
		CHECK(gpa1("cuInit", &p, 13000, 0) == CUDA_SUCCESS && p == dl("cuInit"), "v1 cuGetProcAddress(cuInit)");
	}

	/* the variants the real driver hands out */
	expect("cuLaunchKernel", 13000, 0, "cuLaunchKernel");
	expect("cuLaunchKernel", 13000, PT, "cuLaunchKernel_ptsz");
	expect("cuLaunchKernel", 13000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, "cuLaunchKernel");
	expect("cuMemAlloc", 12000, PT, "cuMemAlloc_v2");
	expect("cuMemcpyHtoD", 13000, 0, "cuMemcpyHtoD_v2");
	expect("cuMemcpyHtoD", 13000, PT, "cuMemcpyHtoD_v2_ptds");
	expect("cuMemcpyHtoDAsync", 12000, PT, "cuMemcpyHtoDAsync_v2_ptsz");
	expect("cuStreamBeginCapture", 12000, 0, "cuStreamBeginCapture_v2");
	expect("cuStreamBeginCapture", 12000, PT, "cuStreamBeginCapture_v2_ptsz");
	expect("cuStreamGetCaptureInfo", 12030, PT, "cuStreamGetCaptureInfo_v3_ptsz");
	expect("cuCtxCreate", 13000, 0, "cuCtxCreate_v4");
	expect("cuCtxCreate", 12000, 0, "cuCtxCreate_v2");
	expect("cuCtxSynchronize", 12000, 0, "cuCtxSynchronize");
	expect("cuCtxSynchronize", 13000, 0, "cuCtxSynchronize_v2");
	expect("cuGraphInstantiate", 12000, 0, "cuGraphInstantiateWithFlags");
	expect("cuGraphLaunch", 12000, PT, "cuGraphLaunch_ptsz");
	expect("cuStreamWriteValue32", 12000, PT, "cuStreamWriteValue32_v2_ptsz");

	/* unknown names, too old a version, bad flags */
	p = (void *)1;
	st = CU_GET_PROC_ADDRESS_SUCCESS;
	CU_CALL(CUDA_ERROR_NOT_FOUND, gpa("cuNoSuchEntryPoint", &p, 13000, 0, &st));
	CHECK(p == NULL && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, "unknown name: %p %d", p, (int)st);
	CU_CALL(CUDA_ERROR_NOT_FOUND, gpa("cuLibraryLoadData", &p, 11080, 0, &st));
	CHECK(p == NULL && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, "old version: %p %d", p, (int)st);
	CU_CALL(CUDA_ERROR_INVALID_VALUE, gpa("cuInit", &p, 13000, 8, &st));

	/* an internal function the library does not export: passed through, callable */
	p = NULL;
	CU_CALL(CUDA_SUCCESS, gpa("cuFakeInternalOnly", &p, 13000, 0, &st));
	CHECK(p && !dl("cuFakeInternalOnly"), "cuFakeInternalOnly: %p", p);
	if (p) {
		tally("cuFakeInternalOnly");
		CHECK(((CUresult(*)(int *))p)(&v) == CUDA_SUCCESS && v == 42, "cuFakeInternalOnly gave %d", v);
	}

	rng_seed(seed);
	for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
		g_ver = modes[m].ver;
		g_flags = modes[m].flags;
		g_gen++;
		work_init();
		if (g_ver == 13000 && !g_flags) { /* the CUDA 13 signature, called as such */
			PFN_cuCtxSynchronize_v13000 sync2 = NULL;
			CU_CALL(CUDA_SUCCESS, gpa("cuCtxSynchronize", (void **)&sync2, 13000, 0, &st));
			if (sync2) {
				tally(sync2 == (PFN_cuCtxSynchronize_v13000)dl("cuCtxSynchronize_v2") ?
				      "cuCtxSynchronize_v2" : "cuCtxSynchronize?");
				CHECK(sync2(w_ctx) == CUDA_SUCCESS, "cuCtxSynchronize_v2(ctx)");
			}
		}
		work_main();
		if (g_ver >= 12040)
			work_semantics();
		work_fini();
	}
	snprintf(extra, sizeof(extra), ", \"seed\": %" PRIu64 ", \"modes\": %zu", seed,
		 sizeof(modes) / sizeof(modes[0]));
	return finish("t_procaddr", extra);
}
