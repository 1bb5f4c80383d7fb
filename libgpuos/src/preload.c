/* SPDX-License-Identifier: MIT */
/*
 * preload.c - a warm standby loads, while it waits, the kernels its client launched.
 *
 * Why: a warm standby (standby.c, GPUOS_MPS_STANDBY_AT=launch) waits at its first kernel
 * launch, its context made and its weights copied in; after its release its first
 * iteration still took 0.15-0.3 s on an H200, against about 1 ms for the next, because
 * the driver loads each kernel into the context at its first launch (lazy loading).
 * Launching the same kernels once beforehand brought that first iteration to 1 ms;
 * making cuBLAS's handles beforehand did not (tools/probes/first_iteration_probe.py).
 * Loading every kernel of every library (CUDA_MODULE_LOADING=EAGER) cost 2 s more.
 *
 * Client side (GPUOS_MPS_KERNELS=FILE, set by `gpuos mps` for clients that have a warm
 * standby): each launch's function handle goes into a set (one hash probe per launch).
 * At its first launch it is written down as "NAME\tOBJECT\tOFFSET": its name, and where
 * the image of its library lies (the shared object, and the image's offset from that
 * object's load address), when the library was loaded from an image inside one.  A
 * thread writes the records to FILE (a temporary file renamed over it), merged with the
 * ones already there, at most twice a second and only when new ones came, and once more
 * at exit.  A standby that took over goes on adding to the same FILE.
 *
 * Standby side (FILE and GPUOS_MPS_STANDBY_AT=launch): when the standby stops at its
 * first launch, a thread in its context reads FILE (again whenever it changes).  The CUDA
 * runtime loads each image as a library only when one of its kernels is first needed,
 * so at the stop most of them are not loaded: the thread loads each recorded image
 * (found at the same offset in the same object here) as a library, then loads each name
 * found in the process's libraries and modules into the context (cuLibraryGetKernel,
 * cuKernelGetFunction, cuFuncLoad; cuModuleGetFunction, cuFuncLoad), until the release.
 * When the runtime then asks for an image loaded ahead (cuLibraryLoadData, no JIT
 * options), it is given that library, its kernels already in the context, instead of a
 * second copy.  What the thread did goes to FILE.standby.PID (one JSON object).  A name
 * it cannot find (a kernel compiled at run time) is loaded at its first launch, as
 * without it.
 */
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

int gpuos_preload_noting;   /* launches are noted (GPUOS_MPS_KERNELS set) */
static int standby_loading; /* ... and this process is a warm standby that preloads */
static int printf_ahead = 1; /* ready_printf_buffer while waiting (GPUOS_MPS_PRINTF_AHEAD=0: not) */
static const char *list_path;

__attribute__((constructor)) static void preload_init(void)
{
	const char *p = getenv("GPUOS_MPS_KERNELS");
	if (!p || !*p)
		return;
	list_path = p;
	const char *at = getenv("GPUOS_MPS_STANDBY_AT");
	const char *fifo = getenv("GPUOS_MPS_STANDBY");
	standby_loading = at && !strcmp(at, "launch") && fifo && *fifo;
	const char *pa = getenv("GPUOS_MPS_PRINTF_AHEAD");
	printf_ahead = !(pa && !strcmp(pa, "0"));
	__atomic_store_n(&gpuos_preload_noting, 1, __ATOMIC_RELEASE);
}

/* ---- names, sorted and unique ---------------------------------------------------------------- */

struct names {
	char **v;
	size_t n, cap;
};

static int names_add(struct names *s, const char *name, size_t len)
{
	if (!len)
		return 0;
	if (s->n == s->cap) {
		size_t cap = s->cap ? 2 * s->cap : 256;
		char **v = realloc(s->v, cap * sizeof *v);
		if (!v)
			return -1;
		s->v = v;
		s->cap = cap;
	}
	if (!(s->v[s->n] = strndup(name, len)))
		return -1;
	s->n++;
	return 0;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

static void names_sort_unique(struct names *s)
{
	if (!s->n)
		return;
	qsort(s->v, s->n, sizeof *s->v, cmp_str);
	size_t o = 1;
	for (size_t i = 1; i < s->n; i++) {
		if (strcmp(s->v[i], s->v[o - 1]))
			s->v[o++] = s->v[i];
		else
			free(s->v[i]);
	}
	s->n = o;
}

static void names_free(struct names *s)
{
	for (size_t i = 0; i < s->n; i++)
		free(s->v[i]);
	free(s->v);
	memset(s, 0, sizeof *s);
}

/* The lines of path added to s (none when it cannot be read). */
static void names_read(struct names *s, const char *path)
{
	FILE *f = fopen(path, "re");
	if (!f)
		return;
	char *line = NULL;
	size_t cap = 0;
	ssize_t len;
	while ((len = getline(&line, &cap, f)) > 0) {
		if (line[len - 1] == '\n')
			len--;
		if (names_add(s, line, (size_t)len))
			break;
	}
	free(line);
	fclose(f);
}

/* ---- the libraries and modules the process loaded -------------------------------------------- */

/* Kept where GPUOS_MPS_KERNELS is set: a client names the code image of each kernel it
 * launches (its shared object and offset there), and a standby looks its names up in
 * them.  ours: a library the standby loaded ahead from a client's record, handed to the
 * first cuLibraryLoadData of the same image (gpuos_preload_take) instead of a second copy. */
struct code {
	uint64_t handle;
	const void *image;
	int module;
	int ours;
	char opts[160]; /* the load's options, as written down (format_options) */
};

static pthread_mutex_t code_mu = PTHREAD_MUTEX_INITIALIZER;
static struct code *codes;
static size_t ncodes, codes_cap;

/* kernel -> function pairs (cuKernelGetFunction): a launch may name either */
static struct {
	uint64_t f, k;
} *fk;
static size_t nfk, fk_cap;

void gpuos_preload_function(uint64_t f, uint64_t k)
{
	if (!__atomic_load_n(&gpuos_preload_noting, __ATOMIC_RELAXED) || !f || !k)
		return;
	pthread_mutex_lock(&code_mu);
	for (size_t i = 0; i < nfk; i++)
		if (fk[i].f == f) {
			fk[i].k = k;
			goto out;
		}
	if (nfk == fk_cap) {
		size_t cap = fk_cap ? 2 * fk_cap : 256;
		void *v = realloc(fk, cap * sizeof *fk);
		if (!v)
			goto out;
		fk = v;
		fk_cap = cap;
	}
	fk[nfk].f = f;
	fk[nfk++].k = k;
out:
	pthread_mutex_unlock(&code_mu);
}

struct object_of {
	uintptr_t addr;
	const char *name;
	uintptr_t base;
	int found;
};

static int find_object_of(struct dl_phdr_info *info, size_t size, void *arg)
{
	(void)size;
	struct object_of *o = arg;
	for (int i = 0; i < info->dlpi_phnum; i++) {
		const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
		uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
		if (ph->p_type == PT_LOAD && o->addr >= lo && o->addr < lo + ph->p_memsz) {
			o->name = info->dlpi_name ? info->dlpi_name : "";
			o->base = info->dlpi_addr;
			return o->found = 1;
		}
	}
	return 0;
}

static int find_object_named(struct dl_phdr_info *info, size_t size, void *arg)
{
	(void)size;
	struct object_of *o = arg;
	if (strcmp(info->dlpi_name ? info->dlpi_name : "", o->name))
		return 0;
	o->base = info->dlpi_addr;
	return o->found = 1;
}

/* A pointer as "OBJECT+OFFSET" when it lies in a loaded object, else its value. */
static void where_is(const void *p, char *out, size_t cap)
{
	struct object_of o = { (uintptr_t)p, NULL, 0, 0 };
	if (p && dl_iterate_phdr(find_object_of, &o) && o.found)
		snprintf(out, cap, "%s+%#lx", strrchr(o.name, '/') ? strrchr(o.name, '/') + 1 : o.name,
			 (unsigned long)((uintptr_t)p - o.base));
	else
		snprintf(out, cap, "%#lx", (unsigned long)(uintptr_t)p);
}

/* "\tOBJECT\tOFFSET" of the image the launched handle h came from, into out; "" if none
 * (a module, or an image not inside a loaded object: compiled at run time). */
static void image_of(uint64_t h, char *out, size_t cap)
{
	out[0] = 0;
	if (!gpuos_drv.kernel_get_library)
		return;
	uint64_t k = h;
	pthread_mutex_lock(&code_mu);
	for (size_t i = 0; i < nfk; i++)
		if (fk[i].f == h) {
			k = fk[i].k;
			break;
		}
	pthread_mutex_unlock(&code_mu);
	CUlibrary lib;
	if (gpuos_drv.kernel_get_library(&lib, (CUkernel)(uintptr_t)k) != CUDA_SUCCESS)
		return;
	const void *image = NULL;
	char opts[160] = "";
	pthread_mutex_lock(&code_mu);
	for (size_t i = 0; i < ncodes; i++)
		if (!codes[i].module && codes[i].handle == (uint64_t)(uintptr_t)lib) {
			image = codes[i].image;
			memcpy(opts, codes[i].opts, sizeof opts);
		}
	pthread_mutex_unlock(&code_mu);
	struct object_of o = { (uintptr_t)image, NULL, 0, 0 };
	if (!image || !dl_iterate_phdr(find_object_of, &o) || !o.found || strchr(o.name, '\t') || strchr(o.name, '\n'))
		return;
	snprintf(out, cap, "\t%s\t%#lx\t%s", o.name, (unsigned long)((uintptr_t)image - o.base), opts);
}

/* ---- client side: the launched functions ----------------------------------------------------- */

#define SEEN_SLOTS 16384u /* a power of two; noting stops at three quarters full */

static uint64_t seen[SEEN_SLOTS];
static unsigned seen_count;
static int seen_dirty;
static pthread_mutex_t launched_mu = PTHREAD_MUTEX_INITIALIZER;
static struct names launched; /* their names, taken at the first launch of each */
static pthread_once_t writer_once = PTHREAD_ONCE_INIT;

static pthread_mutex_t write_mu = PTHREAD_MUTEX_INITIALIZER; /* the writer thread, or exit */

static void write_list(void)
{
	pthread_mutex_lock(&write_mu); /* one temporary file per process */
	struct names s = { 0 };
	names_read(&s, list_path);
	pthread_mutex_lock(&launched_mu);
	for (size_t i = 0; i < launched.n; i++)
		if (names_add(&s, launched.v[i], strlen(launched.v[i])))
			break;
	pthread_mutex_unlock(&launched_mu);
	names_sort_unique(&s);
	char tmp[4096];
	if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", list_path, (int)getpid()) >= (int)sizeof tmp)
		goto out;
	FILE *f = fopen(tmp, "we");
	if (!f) {
		gpuos_dbg("preload: cannot write %s: %s", tmp, strerror(errno));
		goto out;
	}
	for (size_t i = 0; i < s.n; i++)
		fprintf(f, "%s\n", s.v[i]);
	if (fclose(f) || rename(tmp, list_path)) {
		gpuos_dbg("preload: cannot write %s: %s", list_path, strerror(errno));
		unlink(tmp);
	}
out:
	names_free(&s);
	pthread_mutex_unlock(&write_mu);
}

static void *writer_main(void *arg)
{
	(void)arg;
	const struct timespec half = { 0, 500 * 1000 * 1000 };
	for (;;) {
		nanosleep(&half, NULL);
		if (__atomic_exchange_n(&seen_dirty, 0, __ATOMIC_ACQ_REL))
			write_list();
		gpuos_aheadmem_write(list_path);
	}
	return NULL;
}

/* A program that ends within half a second of a new kernel still leaves its list. */
__attribute__((destructor)) static void preload_fini(void)
{
	if (list_path && __atomic_exchange_n(&seen_dirty, 0, __ATOMIC_ACQ_REL))
		write_list();
	if (list_path)
		gpuos_aheadmem_write(list_path);
}

static void start_writer(void)
{
	if (gpuos_thread_detached(writer_main, NULL))
		gpuos_dbg("preload: no writer thread: the list is written at exit");
}

int gpuos_preload_launched(void)
{
	return __atomic_load_n(&seen_count, __ATOMIC_ACQUIRE) > 0;
}

void gpuos_preload_note_slow(uint64_t h)
{
	if (!h || gpuos_blaswarm_thread) /* the warm-up's kernels are cuBLAS's, not the client's */
		return;
	uint64_t x = h * 0x9e3779b97f4a7c15ull;
	unsigned i = (unsigned)(x >> 50) & (SEEN_SLOTS - 1);
	for (unsigned probes = 0; probes < SEEN_SLOTS; probes++, i = (i + 1) & (SEEN_SLOTS - 1)) {
		uint64_t v = __atomic_load_n(&seen[i], __ATOMIC_ACQUIRE);
		if (v == h)
			return;
		if (v)
			continue;
		if (!__atomic_compare_exchange_n(&seen[i], &v, h, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
			if (v == h)
				return;
			continue; /* another thread took the slot for another handle */
		}
		if (__atomic_add_fetch(&seen_count, 1, __ATOMIC_ACQ_REL) >= SEEN_SLOTS / 4 * 3)
			__atomic_store_n(&gpuos_preload_noting, 0, __ATOMIC_RELEASE); /* enough */
		gpuos_sharemem_launched(); /* a client's start-up memory, for its standby (once) */
		/* A CUfunction or a CUkernel: the driver refuses the other kind.  Named now, while
		 * the handle is surely valid (once per function, not per launch). */
		const char *name = NULL;
		gpuos_resolve();
		if ((!gpuos_drv.func_get_name || gpuos_drv.func_get_name(&name, (CUfunction)(uintptr_t)h) != CUDA_SUCCESS) &&
		    (!gpuos_drv.kernel_get_name || gpuos_drv.kernel_get_name(&name, (CUkernel)(uintptr_t)h) != CUDA_SUCCESS))
			name = NULL;
		if (!name || strchr(name, '\n') || strchr(name, '\t'))
			return;
		char line[8192], where[4200];
		image_of(h, where, sizeof where);
		int len = snprintf(line, sizeof line, "%s%s", name, where);
		if (len < 0 || (size_t)len >= sizeof line)
			return;
		pthread_mutex_lock(&launched_mu);
		int e = names_add(&launched, line, (size_t)len);
		pthread_mutex_unlock(&launched_mu);
		if (!e) {
			__atomic_store_n(&seen_dirty, 1, __ATOMIC_RELEASE);
			pthread_once(&writer_once, start_writer);
		}
		return;
	}
}

/* ---- standby side: loading the names while it waits ------------------------------------------ */

/* A load's options as "jNJIT,ID=VALUE...": written down for the record (the values where
 * they lie, since a pointer means nothing in another process). */
static void format_options(char *out, size_t cap, unsigned int njit, const CUlibraryOption *lo, void *const *lv,
			   unsigned int nl)
{
	size_t o = (size_t)snprintf(out, cap, "j%u", njit);
	for (unsigned int i = 0; i < nl && lo && lv && o < cap; i++) {
		char w[96];
		where_is(lv[i], w, sizeof w);
		o += (size_t)snprintf(out + o, cap - o, ",%d=%s", (int)lo[i], w);
	}
}

static void add_code(uint64_t handle, const void *image, int module, const char *opts)
{
	pthread_mutex_lock(&code_mu);
	if (ncodes == codes_cap) {
		size_t cap = codes_cap ? 2 * codes_cap : 256;
		struct code *c = realloc(codes, cap * sizeof *c);
		if (c) {
			codes = c;
			codes_cap = cap;
		}
	}
	if (ncodes < codes_cap) {
		codes[ncodes] = (struct code){ handle, image, module, 0, { 0 } };
		snprintf(codes[ncodes++].opts, sizeof codes->opts, "%s", opts);
	}
	pthread_mutex_unlock(&code_mu);
}

void gpuos_preload_library(uint64_t handle, const void *image, unsigned int njit, const CUlibraryOption *lo,
			   void *const *lv, unsigned int nl)
{
	if (!list_path || !handle)
		return;
	char opts[160] = "";
	if (__atomic_load_n(&gpuos_preload_noting, __ATOMIC_RELAXED)) /* a client writes them down */
		format_options(opts, sizeof opts, njit, lo, lv, nl);
	add_code(handle, image, 0, opts);
}

void gpuos_preload_code(uint64_t handle, int module, int loaded)
{
	if (!list_path || !handle)
		return;
	if (loaded) {
		add_code(handle, NULL, module, "");
	} else {
		pthread_mutex_lock(&code_mu);
		for (size_t i = 0; i < ncodes; i++)
			if (codes[i].handle == handle && codes[i].module == module) {
				codes[i] = codes[--ncodes];
				break;
			}
		pthread_mutex_unlock(&code_mu);
	}
}

struct load_stats {
	size_t names, loaded, missing, failed, libraries, modules, images;
	double seconds;
	int printf_ready; /* ready_printf_buffer: 1 done, -1 failed, 0 not yet */
};

static unsigned taken; /* libraries loaded ahead that the application then asked for */
static char refused_opts[200]; /* the first ask for one it could not be given, and why */

static int released(void)
{
	return __atomic_load_n(&gpuos_standby_passed, __ATOMIC_ACQUIRE);
}

/* Load name wherever it is found: 1 when loaded somewhere, 0 not found, -1 refused. */
static int load_name(const char *name)
{
	int found = 0, failed = 0;
	for (size_t i = 0; i < ncodes; i++) {
		CUfunction f = NULL;
		if (codes[i].module) {
			if (!gpuos_drv.module_get_function ||
			    gpuos_drv.module_get_function(&f, (CUmodule)(uintptr_t)codes[i].handle, name) != CUDA_SUCCESS)
				continue;
		} else {
			CUkernel k;
			if (!gpuos_drv.library_get_kernel || !gpuos_drv.kernel_get_function ||
			    gpuos_drv.library_get_kernel(&k, (CUlibrary)(uintptr_t)codes[i].handle, name) != CUDA_SUCCESS ||
			    gpuos_drv.kernel_get_function(&f, k) != CUDA_SUCCESS)
				continue;
		}
		found = 1;
		if (gpuos_drv.func_load && gpuos_drv.func_load(f) != CUDA_SUCCESS)
			failed = 1;
	}
	return found ? (failed ? -1 : 1) : 0;
}

/* The image a client's record names ("NAME\tOBJECT\tOFFSET"), in this process; NULL when
 * the record names none or the object is not loaded here.  The name is cut at its tab. */
static const void *record_image(char *line)
{
	char *t1 = strchr(line, '\t');
	if (!t1)
		return NULL;
	*t1 = 0;
	char *t2 = strchr(t1 + 1, '\t');
	if (!t2)
		return NULL;
	*t2 = 0;
	char *t3 = strchr(t2 + 1, '\t');
	if (t3)
		*t3 = 0; /* the options the client's load had */
	char *end;
	errno = 0;
	unsigned long off = strtoul(t2 + 1, &end, 0);
	if (errno || *end)
		return NULL;
	struct object_of o = { 0, t1 + 1, 0, 0 };
	dl_iterate_phdr(find_object_named, &o);
	return o.found ? (const void *)(o.base + off) : NULL;
}

/* Load image as a library ahead, unless the process has it already (code_mu held). */
static int load_image(const void *image)
{
	for (size_t i = 0; i < ncodes; i++)
		if (!codes[i].module && codes[i].image == image)
			return 0;
	PFN_cuLibraryLoadData_v12000 load = (PFN_cuLibraryLoadData_v12000)gpuos_real_at(HK_cuLibraryLoadData);
	CUlibrary lib;
	if (!load || ncodes == codes_cap || load(&lib, image, NULL, NULL, 0, NULL, NULL, 0) != CUDA_SUCCESS)
		return -1;
	codes[ncodes++] = (struct code){ (uint64_t)(uintptr_t)lib, image, 0, 1, { 0 } };
	return 1;
}

int gpuos_preload_take(const void *image, unsigned int njit, CUlibraryOption *lo, void **lv, unsigned int nl,
		       CUlibrary *lib)
{
	if (!standby_loading)
		return 0;
	int refuse = njit != 0;
	/* Loaded ahead with no options: only a load asking for none, or only for the binary
	 * to be kept (the driver copies it anyway without), gets it. */
	for (unsigned int i = 0; i < nl; i++)
		if (!lo || lo[i] != CU_LIBRARY_BINARY_IS_PRESERVED)
			refuse = 1;
	int took = 0;
	pthread_mutex_lock(&code_mu);
	if (refuse) {
		for (size_t i = 0; i < ncodes && !refused_opts[0]; i++)
			if (codes[i].ours && codes[i].image == image)
				format_options(refused_opts, sizeof refused_opts, njit, lo, lv, nl);
		pthread_mutex_unlock(&code_mu);
		return 0;
	}
	for (size_t i = 0; i < ncodes; i++)
		if (codes[i].ours && !codes[i].module && codes[i].image == image) {
			*lib = (CUlibrary)(uintptr_t)codes[i].handle;
			codes[i].ours = 0; /* the application's from now on */
			format_options(codes[i].opts, sizeof codes[i].opts, njit, lo, lv, nl);
			took = 1;
			break;
		}
	pthread_mutex_unlock(&code_mu);
	if (took)
		__atomic_add_fetch(&taken, 1, __ATOMIC_RELAXED);
	return took;
}

/* The first launch of a kernel that can print (printf, or assert: CUDA's device-side
 * assertions print through the same buffer, and PyTorch's reductions have them) has the
 * driver make the context's printf buffer: two host-memory allocations (RM_ALLOC_MEMORY
 * of an OS descriptor, 1 and 4 ms), made behind the driver's lock.  A released standby's
 * first iteration made them (the first reduction or cuBLAS call, on an H200:
 * tools/probes/rm_alloc_probe.py), and waited there for the faulting client's teardown,
 * which holds that lock for 0.1-0.45 s after a trap.  A kernel of libgpuos's own that
 * can print (it never does), launched once while the standby waits, has them made
 * before the fault.  Its own module: fingerprint.cu's, loaded in every context that
 * validates or evicts, must not make every such context a printf buffer.  1, or -1 if it
 * could not be run.
 *
 * The one program it changes: the driver refuses a new printf buffer size
 * (cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE)) once a kernel that can print has run, so a
 * program that sets it after its first launch, before any kernel of its own that can
 * print, would be refused in the standby and not in its client.  GPUOS_MPS_PRINTF_AHEAD=0
 * in the client's environment (its standby's is a copy) leaves the buffer to the program. */
static const char printf_ready_ptx[] =
	".version 6.0\n.target sm_50\n.address_size 64\n"
	".extern .func (.param .b32 r) vprintf (.param .b64 f, .param .b64 a);\n"
	".global .align 1 .b8 gpuos_newline[2] = {10, 0};\n"
	".visible .entry gpuos_printf_ready(.param .u32 never)\n{\n"
	" .reg .pred p;\n .reg .b32 g;\n .reg .b64 m;\n"
	" ld.param.u32 g, [never];\n setp.eq.u32 p, g, 0;\n @p bra done;\n"
	" cvta.global.u64 m, gpuos_newline;\n"
	" { .param .b64 f0; .param .b64 a0; .param .b32 r0;\n"
	"   st.param.b64 [f0], m;\n st.param.b64 [a0], 0;\n"
	"   call.uni (r0), vprintf, (f0, a0); }\n"
	"done:\n ret;\n}\n";

static int ready_printf_buffer(void)
{
	CUmodule mod; /* stays loaded: the buffer is the context's, the module a few bytes */
	CUfunction fn;
	unsigned int never = 0;
	void *args[] = { &never };
	int ok = gpuos_drv.module_load_data && gpuos_drv.module_get_function &&
		 gpuos_drv.module_load_data(&mod, printf_ready_ptx) == CUDA_SUCCESS &&
		 gpuos_drv.module_get_function(&fn, mod, "gpuos_printf_ready") == CUDA_SUCCESS &&
		 gpuos_drv.launch_kernel(fn, 1, 1, 1, 32, 1, 1, 0, CU_STREAM_LEGACY, args, NULL) == CUDA_SUCCESS &&
		 gpuos_drv.stream_sync(CU_STREAM_LEGACY) == CUDA_SUCCESS;
	gpuos_dbg("preload: the printf buffer %s", ok ? "made" : "could not be made");
	return ok ? 1 : -1;
}

static void write_stats(const struct load_stats *st)
{
	char path[4096], tmp[4200];
	if (snprintf(path, sizeof path, "%s.standby.%d", list_path, (int)getpid()) >= (int)sizeof path)
		return;
	snprintf(tmp, sizeof tmp, "%s.tmp", path);
	FILE *f = fopen(tmp, "we");
	if (!f)
		return;
	char warm[160] = "null"; /* blaswarm.c's, once done */
	char shared[512];
	gpuos_sharemem_report(shared, sizeof shared);
	size_t ahead_n, ahead_out;
	gpuos_aheadmem_counts(&ahead_n, &ahead_out);
	if (__atomic_load_n(&gpuos_blaswarm.done, __ATOMIC_ACQUIRE))
		snprintf(warm, sizeof warm, "{\"calls\": %d, \"failed\": %d, \"seconds\": %.6f}",
			 gpuos_blaswarm.calls, gpuos_blaswarm.failed, (double)gpuos_blaswarm.ns / 1e9);
	fprintf(f, "{\"pid\": %d, \"names\": %zu, \"loaded\": %zu, \"not_found\": %zu, \"refused\": %zu, "
		"\"libraries\": %zu, \"modules\": %zu, \"images_loaded_ahead\": %zu, \"taken\": %u, "
		"\"not_taken_for\": \"%s\", \"seconds\": %.6f, \"released\": %s, \"cublas_warm_up\": %s, "
		"\"allocations_made_ahead\": %zu, \"allocations_handed_out\": %zu, \"memory_shared\": %s, "
		"\"printf_buffer_made\": %s}\n",
		(int)getpid(), st->names, st->loaded, st->missing, st->failed, st->libraries, st->modules,
		st->images, __atomic_load_n(&taken, __ATOMIC_RELAXED), refused_opts, st->seconds,
		released() ? "true" : "false", warm, ahead_n, ahead_out, shared,
		st->printf_ready > 0 ? "true" : st->printf_ready < 0 ? "false" : "null");
	if (fclose(f) || rename(tmp, path))
		unlink(tmp);
}

static void *loader_main(void *arg)
{
	CUcontext ctx = arg;
	if (!gpuos_drv.ctx_push || gpuos_drv.ctx_push(ctx) != CUDA_SUCCESS)
		return NULL;
	struct names done = { 0 }; /* loaded, or refused: not tried again */
	struct timespec seen_mtime = { 0, 0 };
	off_t seen_size = -1;
	size_t seen_codes = 0;
	struct load_stats st = { 0 };
	int warm_said = 0; /* the cuBLAS warm-up's end is in the report */
	int ahead_made = 0; /* the client's allocations made ahead (aheadmem.c) */
	int shared_asked = 0; /* its start-up memory mapped in place of ours (sharemem.c) */
	const struct timespec tick = { 0, 50 * 1000 * 1000 };
	while (!released()) {
		/* (reported with the pass's figures: the report's first writing says what the
		 * first pass loaded) */
		if (!st.printf_ready && printf_ahead)
			st.printf_ready = ready_printf_buffer();
		if (!ahead_made && (ahead_made = gpuos_aheadmem_make(list_path)) != 0)
			write_stats(&st);
		if (!shared_asked && (shared_asked = gpuos_sharemem_standby_pass()) != 0)
			write_stats(&st);
		if (shared_asked && gpuos_sharemem_standby_recheck())
			write_stats(&st);
		struct stat sb;
		int changed = !stat(list_path, &sb) &&
			      (sb.st_mtim.tv_sec != seen_mtime.tv_sec || sb.st_mtim.tv_nsec != seen_mtime.tv_nsec ||
			       sb.st_size != seen_size);
		/* Held for the pass: an unload waits for it (the handles stay valid), and the pass
		 * stops at the release, so the application waits for one name at most. */
		/* the cuBLAS warm-up's end is news too (blaswarm.c): in the next report */
		int warm_news = !warm_said && __atomic_load_n(&gpuos_blaswarm.done, __ATOMIC_ACQUIRE);
		warm_said |= warm_news;
		pthread_mutex_lock(&code_mu);
		if (!changed && ncodes == seen_codes) {
			pthread_mutex_unlock(&code_mu);
			if (warm_news)
				write_stats(&st);
			else
				nanosleep(&tick, NULL);
			continue;
		}
		if (changed) {
			seen_mtime = sb.st_mtim;
			seen_size = sb.st_size;
		}
		uint64_t t0 = gpuos_now_ns();
		struct names want = { 0 };
		names_read(&want, list_path);
		/* The images the records name, loaded ahead first (room made for them here). */
		if (codes_cap - ncodes < want.n) {
			struct code *c = realloc(codes, (ncodes + want.n) * sizeof *c);
			if (c) {
				codes = c;
				codes_cap = ncodes + want.n;
			}
		}
		for (size_t i = 0; i < want.n && !released(); i++) {
			const void *image = record_image(want.v[i]); /* cuts the record to its name */
			if (image && load_image(image) > 0)
				st.images++;
		}
		names_sort_unique(&want); /* names now: one name may have had several records */
		size_t before = done.n;
		st.names = want.n;
		st.missing = st.libraries = st.modules = 0;
		for (size_t i = 0; i < ncodes; i++) {
			if (codes[i].module)
				st.modules++;
			else
				st.libraries++;
		}
		for (size_t i = 0; i < want.n && !released(); i++) {
			if (before && bsearch(&want.v[i], done.v, before, sizeof *done.v, cmp_str))
				continue;
			int r = load_name(want.v[i]);
			if (r == 0)
				st.missing++;
			else if (names_add(&done, want.v[i], strlen(want.v[i])) == 0 && r > 0)
				st.loaded++;
			else if (r < 0)
				st.failed++;
		}
		seen_codes = ncodes;
		pthread_mutex_unlock(&code_mu);
		names_sort_unique(&done);
		names_free(&want);
		st.seconds += (double)(gpuos_now_ns() - t0) / 1e9;
		write_stats(&st);
	}
	/* Once more a moment after the release: what the application then took. */
	const struct timespec settle = { 2, 0 };
	nanosleep(&settle, NULL);
	write_stats(&st);
	names_free(&done);
	CUcontext old;
	gpuos_drv.ctx_pop(&old);
	return NULL;
}

static void start_loader(void)
{
	gpuos_resolve();
	CUcontext ctx = NULL;
	if (!gpuos_drv.ctx_get_current || gpuos_drv.ctx_get_current(&ctx) != CUDA_SUCCESS || !ctx) {
		gpuos_dbg("preload: no current context at the first launch: nothing loaded ahead");
		return;
	}
	int e = gpuos_thread_detached(loader_main, ctx);
	if (e)
		gpuos_dbg("preload: no loader thread: %s", strerror(e));
}

static pthread_once_t loader_once = PTHREAD_ONCE_INIT;

void gpuos_preload_standby_waits(void)
{
	if (standby_loading)
		pthread_once(&loader_once, start_loader);
}

void gpuos_preload_forget(void)
{
	/* A fork child notes its own launches, with a writer thread of its own. */
	memset(seen, 0, sizeof seen);
	seen_count = 0;
	seen_dirty = 0;
	pthread_mutex_init(&launched_mu, NULL);
	pthread_mutex_init(&write_mu, NULL);
	pthread_mutex_init(&code_mu, NULL);
	writer_once = (pthread_once_t)PTHREAD_ONCE_INIT;
	if (list_path)
		__atomic_store_n(&gpuos_preload_noting, 1, __ATOMIC_RELEASE);
}

/* With GPUOS_LIB_DEBUG=1, each code load: where its image lies, its magic, how long. */
void gpuos_preload_debug_load(const char *call, const void *image, uint64_t t0_ns)
{
	if (!gpuos_debugging())
		return;
	char w[200];
	uint32_t magic = 0;
	where_is(image, w, sizeof w);
	if (image)
		memcpy(&magic, image, sizeof magic);
	uint64_t now = gpuos_now_ns();
	gpuos_dbg("%.6f %s: image at %s, magic %#x, %.3f ms", (double)now / 1e9, call, w, magic,
		  (double)(now - t0_ns) / 1e6);
}
