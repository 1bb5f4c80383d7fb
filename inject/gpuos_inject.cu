// SPDX-License-Identifier: MIT
//
// gpuos-inject - trigger one chosen GPU fault in this process, and report what the
// CUDA driver said about it.  For tests, demos and benchmarks of gpuos's fault
// handling (`gpuos faults inject` runs it; docs/inject.md is the long form).
//
//   gpuos-inject --kind KIND [--delay S] [--device N] [--after-iterations N] [--json]
//   gpuos-inject --list [--json]
//
// It only ever faults itself: every address it touches is in its own CUDA context's
// virtual address space, it changes no GPU setting and looks at no other process.
// (Under MPS, clients share one GPU context on the server, so the fault can still take
// co-running clients down: that is what gpuos measures, not something this program
// does to them.)
//
// What it does, in order:
//   1. loads the driver (libcuda.so.1, through the statically linked CUDA runtime),
//      makes a context on --device, and fetches the few driver API entry points it
//      needs through cudaGetDriverEntryPointByVersion (nothing is linked against
//      libcuda: without a driver the program still starts and says why it cannot run);
//   2. works: a kernel fills a 4 MiB buffer, the host copies it back and checks every
//      word; --after-iterations times (default 1; 0: until SIGUSR1).  Before the loop
//      it prints stage "working";
//   3. arms the fault (kind-specific setup, checked: see below) and prints stage
//      "armed", waits --delay seconds (SIGUSR1 ends the wait), then
//   4. launches the faulting kernel, synchronizes (cuCtxSynchronize), and prints
//      stage "faulted" with the error it got (or "completed" if there was none).
//
// Kinds (expected driver error; what the kernel log should show - the Xid column is
// what NVIDIA documents and the GPU host showed for oob-write; the rest is to be
// confirmed by tests/gpu/test_inject_gpu.py on the GPU host):
//   oob-write            one thread stores to (a cudaMalloc pointer + 4 TiB; more 4 TiB
//                        steps until it is above the CPU's 47-bit user address space, so
//                        that HMM/ATS cannot back it with host memory), an address no
//                        allocation maps (checked with cuMemGetAddressRange):
//                        CUDA_ERROR_ILLEGAL_ADDRESS (700); Xid 31, MMU fault,
//                        FAULT_PDE, ACCESS_TYPE_VIRT_WRITE
//   oob-read             the same address loaded, the value stored to a valid buffer:
//                        CUDA_ERROR_ILLEGAL_ADDRESS (700); Xid 31, ACCESS_TYPE_VIRT_READ
//   ro-write             a VMM allocation (cuMemCreate) mapped twice: read-write (the
//                        work fills it) and read-only (cuMemSetAccess PROT_READ; a
//                        kernel reads it back and the host checks it); then a kernel
//                        writes through the read-only mapping:
//                        CUDA_ERROR_ILLEGAL_ADDRESS (700); Xid 31, FAULT_RO_VIOLATION,
//                        ACCESS_TYPE_VIRT_WRITE
//   illegal-instruction  illegal.cu's kernel, compiled for this GPU's architecture and
//                        embedded as a cubin, is loaded once as compiled (it must store
//                        its marker) and once with its marker instruction overwritten by
//                        an invalid opcode (INVALID_INSN_LO): CUDA_ERROR_ILLEGAL_INSTRUCTION
//                        (715); Xid 13, Graphics SM Warp Exception: Illegal Instruction
//                        Encoding.  (PTX `trap;` and `brkpt;` both compile to BPT.TRAP,
//                        and a corrupt function pointer becomes CALL.REL to a bad PC, so
//                        neither gives an illegal instruction.)  Cubins: sm_80 (also
//                        runs on 8.6/8.7/8.9), sm_90, sm_100; other GPUs: setup failure.
//   trap                 inline PTX `trap;` (SASS BPT.TRAP): CUDA_ERROR_LAUNCH_FAILED
//                        (719, "unspecified launch failure"); Xid 13, SM warp exception
//   assert               device-side assert(0) (__assertfail, then a trap): the assertion
//                        message goes to stderr; CUDA_ERROR_ASSERT (710)
//   none                 a one-thread kernel stores to a valid address: no error (control)
//
// Output: with --json, one JSON object a line on stdout for each stage ("working",
// "armed", then "faulted", "completed", "setup-failed" or "work-failed"), each with
// "kind", "pid" and "stage"; without it, the same as sentences.  Problems also go to
// stderr as one line "gpuos-inject: ...".  While the fault is synchronized, stdout is
// pointed at stderr, so the driver's device-side messages (the assert's) never mix
// into the JSON.
//
// Exit codes:
//   0  the kind's expected error was observed (none: no error)
//   2  bad usage
//   3  setup failed before the fault: no driver, no GPU, no such device, an allocation,
//      mapping, module load or launch failed, no cubin for this GPU, a wrong result
//      while arming
//   4  the fault happened but the driver reported another error than expected
//   5  no error at all (the fault did not happen)
//   6  the work before the fault failed: a CUDA error or a wrong result (under MPS,
//      this is how a co-runner's fault shows in a victim)
//
// Build: inject/Makefile (nvcc, -cudart static; setup.py ships the binary as
// gpuos/_native/gpuos-inject).  Needs only libcuda.so.1 (driver r580+ for CUDA 13) at
// run time.  --write-illegal-cubins DIR (for host tests, no GPU needed) writes each
// embedded cubin as compiled and as patched.

#undef NDEBUG
#include <cassert>
#include <cerrno>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include <dlfcn.h>
#include <elf.h>
#include <getopt.h>
#include <unistd.h>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

enum {
	EXIT_EXPECTED = 0,
	EXIT_USAGE = 2,
	EXIT_SETUP = 3,
	EXIT_UNEXPECTED = 4,
	EXIT_NO_FAULT = 5,
	EXIT_WORK = 6,
};

#define GPUOS_MARKER 0x1badc0deu                    // illegal.cu stores this
// The low 64 bits of the patched instruction: opcode 0xfff, no operands.  nvdisasm
// (CUDA 13.5) rejects it on sm_80, sm_90 and sm_100 ("Unrecognized operation ...
// Illegal instruction found"); tests/unit/test_inject.py checks the patched cubins
// when nvdisasm is at hand.
#define INVALID_INSN_LO 0x0000000000000fffull
#define OOB_OFFSET (1ull << 42)                     // 4 TiB: 1<<40 floats, as on the GPU host

// ---------------------------------------------------------------------------------
// Kinds

struct Kind {
	const char *name;
	CUresult expect;              // the error this kind must produce
	const char *expect_name;
	const char *xid;              // what the kernel log should say
	const char *what;
};

static const Kind KINDS[] = {
	{"oob-write", CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
	 "Xid 31 (MMU fault, FAULT_PDE, ACCESS_TYPE_VIRT_WRITE)",
	 "store to an unmapped address (a valid pointer + 4 TiB)"},
	{"oob-read", CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
	 "Xid 31 (MMU fault, FAULT_PDE, ACCESS_TYPE_VIRT_READ)",
	 "load from an unmapped address, the value kept"},
	{"ro-write", CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
	 "Xid 31 (MMU fault, FAULT_RO_VIOLATION, ACCESS_TYPE_VIRT_WRITE)",
	 "store through a read-only VMM mapping (cuMemSetAccess PROT_READ)"},
	{"illegal-instruction", CUDA_ERROR_ILLEGAL_INSTRUCTION, "CUDA_ERROR_ILLEGAL_INSTRUCTION",
	 "Xid 13 (SM warp exception: Illegal Instruction Encoding)",
	 "execute an invalid opcode (a cubin patched at run time)"},
	{"trap", CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED",
	 "Xid 13 (SM warp exception)",
	 "inline PTX trap; (BPT.TRAP)"},
	{"assert", CUDA_ERROR_ASSERT, "CUDA_ERROR_ASSERT",
	 "none or Xid 13 (to be confirmed)",
	 "device-side assert(0)"},
	{"none", CUDA_SUCCESS, "CUDA_SUCCESS",
	 "none",
	 "a valid store (control: no fault)"},
};

static const Kind *find_kind(const char *name)
{
	for (const Kind &k : KINDS)
		if (strcmp(k.name, name) == 0)
			return &k;
	return nullptr;
}

// ---------------------------------------------------------------------------------
// Driver entry points (fetched through the runtime: nothing links against libcuda)

#define DRIVER_CALLS(X) \
	X(cuGetErrorName, 6000) \
	X(cuGetErrorString, 6000) \
	X(cuCtxSynchronize, 2000) \
	X(cuMemGetAddressRange, 3020) \
	X(cuMemGetAllocationGranularity, 10020) \
	X(cuMemCreate, 10020) \
	X(cuMemAddressReserve, 10020) \
	X(cuMemMap, 10020) \
	X(cuMemSetAccess, 10020) \
	X(cuModuleLoadData, 2000) \
	X(cuModuleGetFunction, 2000) \
	X(cuLaunchKernel, 4000)

#define DECLARE(name, ver) static PFN_##name##_v##ver p_##name;
DRIVER_CALLS(DECLARE)
#undef DECLARE

// ---------------------------------------------------------------------------------
// Embedded cubins of illegal.cu (illegal_cubins.S); weak: an architecture the build
// left out is NULL.

#define CUBIN_DECL(sm) \
	extern "C" const unsigned char gpuos_illegal_sm##sm[] __attribute__((weak)); \
	extern "C" const unsigned long long gpuos_illegal_sm##sm##_size __attribute__((weak));
CUBIN_DECL(80)
CUBIN_DECL(90)
CUBIN_DECL(100)

struct Cubin {
	int sm;                       // 80, 90, 100
	const unsigned char *data;
	const unsigned long long *size;
};

static const Cubin CUBINS[] = {
	{80, gpuos_illegal_sm80, &gpuos_illegal_sm80_size},
	{90, gpuos_illegal_sm90, &gpuos_illegal_sm90_size},
	{100, gpuos_illegal_sm100, &gpuos_illegal_sm100_size},
};

static std::string built_cubins()
{
	std::string s;
	for (const Cubin &c : CUBINS)
		if (c.data)
			s += (s.empty() ? "sm_" : " sm_") + std::to_string(c.sm);
	return s.empty() ? "none" : s;
}

// The cubin that runs on a GPU of compute capability major.minor: same major, the
// highest minor not above the GPU's (SASS is compatible within a major version).
static const Cubin *pick_cubin(int major, int minor)
{
	const Cubin *best = nullptr;
	for (const Cubin &c : CUBINS)
		if (c.data && c.sm / 10 == major && c.sm % 10 <= minor && (!best || c.sm > best->sm))
			best = &c;
	return best;
}

// Overwrites the low 64 bits of the one instruction of .text.gpuos_illegal that
// carries GPUOS_MARKER as its immediate.  Returns the patched byte offset in the
// image, or -1 with *why set.
static long patch_illegal(std::vector<unsigned char> &img, std::string *why)
{
	const unsigned char *b = img.data();
	size_t n = img.size();
	Elf64_Ehdr eh;
	if (n < sizeof eh) {
		*why = "cubin shorter than an ELF header";
		return -1;
	}
	memcpy(&eh, b, sizeof eh);
	if (memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64 ||
	    eh.e_shentsize != sizeof(Elf64_Shdr) || eh.e_shstrndx >= eh.e_shnum ||
	    eh.e_shoff > n || (n - eh.e_shoff) / sizeof(Elf64_Shdr) < eh.e_shnum) {
		*why = "not a 64-bit ELF cubin with section headers";
		return -1;
	}
	auto shdr = [&](unsigned i) {
		Elf64_Shdr sh;
		memcpy(&sh, b + eh.e_shoff + (size_t)i * sizeof sh, sizeof sh);
		return sh;
	};
	Elf64_Shdr strs = shdr(eh.e_shstrndx);
	if (strs.sh_offset > n || strs.sh_size > n - strs.sh_offset) {
		*why = "section name table out of bounds";
		return -1;
	}
	static const char want[] = ".text.gpuos_illegal";
	for (unsigned i = 0; i < eh.e_shnum; i++) {
		Elf64_Shdr sh = shdr(i);
		if (sh.sh_name >= strs.sh_size || strs.sh_size - sh.sh_name < sizeof want ||
		    memcmp(b + strs.sh_offset + sh.sh_name, want, sizeof want) != 0)
			continue;
		if (sh.sh_offset > n || sh.sh_size > n - sh.sh_offset) {
			*why = "kernel text out of bounds";
			return -1;
		}
		long at = -1;
		int found = 0;
		for (size_t off = 0; off + 16 <= sh.sh_size; off += 16) {
			uint32_t imm;
			memcpy(&imm, b + sh.sh_offset + off + 4, sizeof imm);
			if (imm == GPUOS_MARKER) {
				found++;
				at = (long)(sh.sh_offset + off);
			}
		}
		if (found != 1) {
			*why = "expected one marker instruction in .text.gpuos_illegal, found " +
			       std::to_string(found);
			return -1;
		}
		uint64_t lo = INVALID_INSN_LO;
		memcpy(img.data() + at, &lo, sizeof lo);
		return at;
	}
	*why = "no section .text.gpuos_illegal";
	return -1;
}

// ---------------------------------------------------------------------------------
// Kernels

__host__ __device__ static inline unsigned work_word(unsigned i, unsigned seed)
{
	return (i * 2654435761u) ^ seed;
}

__global__ void k_fill(unsigned *a, unsigned n, unsigned seed)
{
	unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		a[i] = work_word(i, seed);
}

__global__ void k_copy(unsigned *dst, const unsigned *src, unsigned n)
{
	unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		dst[i] = src[i];
}

// oob-write, ro-write, none: one store.
__global__ void k_store(unsigned *p, unsigned v)
{
	*(volatile unsigned *)p = v;
}

// oob-read: the loaded value is stored, so the load stays.
__global__ void k_load(unsigned *out, const unsigned *p)
{
	*out = *(const volatile unsigned *)p;
}

__global__ void k_trap(unsigned *p, int go)
{
	if (go)
		asm volatile("trap;");
	p[0] = 1;
}

__global__ void k_assert(unsigned *p, int ok)
{
	assert(ok && "gpuos-inject --kind assert");
	p[0] = 1;
}

// ---------------------------------------------------------------------------------
// Output

static bool g_json;
static const Kind *g_kind;
static long g_pid;

static std::string jstr(const std::string &s)
{
	std::string o = "\"";
	for (unsigned char c : s) {
		if (c == '"' || c == '\\') {
			o += '\\';
			o += (char)c;
		} else if (c < 0x20) {
			char buf[8];
			snprintf(buf, sizeof buf, "\\u%04x", c);
			o += buf;
		} else {
			o += (char)c;
		}
	}
	return o + "\"";
}

// One JSON object on one line: Line(stage).s(k, v).i(k, v)....emit()
struct Line {
	std::string body;
	explicit Line(const char *stage)
	{
		body = "{\"kind\": " + jstr(g_kind ? g_kind->name : "") + ", \"pid\": " +
		       std::to_string(g_pid) + ", \"stage\": " + jstr(stage);
	}
	Line &s(const char *k, const std::string &v)
	{
		body += std::string(", ") + jstr(k) + ": " + jstr(v);
		return *this;
	}
	Line &i(const char *k, long long v)
	{
		body += std::string(", ") + jstr(k) + ": " + std::to_string(v);
		return *this;
	}
	Line &f(const char *k, double v)
	{
		char buf[64];
		snprintf(buf, sizeof buf, "%.3f", v);
		body += std::string(", ") + jstr(k) + ": " + buf;
		return *this;
	}
	Line &b(const char *k, bool v)
	{
		body += std::string(", ") + jstr(k) + ": " + (v ? "true" : "false");
		return *this;
	}
	void emit()
	{
		if (g_json) {
			fprintf(stdout, "%s}\n", body.c_str());
			fflush(stdout);
		}
	}
};

__attribute__((format(printf, 1, 2))) static void say(const char *fmt, ...)
{
	if (g_json)
		return;
	va_list ap;
	va_start(ap, fmt);
	printf("gpuos-inject: %s: ", g_kind ? g_kind->name : "-");
	vprintf(fmt, ap);
	printf("\n");
	fflush(stdout);
	va_end(ap);
}

static std::string hex(unsigned long long v)
{
	char buf[32];
	snprintf(buf, sizeof buf, "0x%llx", v);
	return buf;
}

static std::string drv_name(CUresult r)
{
	const char *s = nullptr;
	if (p_cuGetErrorName && p_cuGetErrorName(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "CUresult " + std::to_string((int)r);
}

static std::string drv_text(CUresult r)
{
	const char *s = nullptr;
	if (p_cuGetErrorString && p_cuGetErrorString(r, &s) == CUDA_SUCCESS && s)
		return s;
	return drv_name(r);
}

// A failure before the fault: one line on stderr, a JSON line on stdout (--json),
// and the exit code (EXIT_SETUP or EXIT_WORK).
[[noreturn]] static void fail(int code, const char *step, const std::string &error, long errcode,
			      const std::string &message)
{
	const char *stage = code == EXIT_WORK ? "work-failed" : "setup-failed";
	Line(stage).s("step", step).s("error", error).i("code", errcode).s("message", message)
		.i("exit", code).emit();
	fprintf(stderr, "gpuos-inject: %s%s%s: %s: %s\n", g_kind ? g_kind->name : "",
		g_kind ? ": " : "", stage, step, message.c_str());
	fflush(stderr);
	exit(code);
}

[[noreturn]] static void fail_rt(int code, const char *step, cudaError_t e)
{
	fail(code, step, cudaGetErrorName(e), (long)e,
	     std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")");
}

[[noreturn]] static void fail_drv(int code, const char *step, CUresult r)
{
	fail(code, step, drv_name(r), (long)r, drv_name(r) + " (" + drv_text(r) + ")");
}

#define RT(call, code, step)                                     \
	do {                                                     \
		cudaError_t e_ = (call);                         \
		if (e_ != cudaSuccess)                           \
			fail_rt(code, step, e_);                 \
	} while (0)

#define DRV(call, code, step)                                    \
	do {                                                     \
		CUresult r_ = (call);                            \
		if (r_ != CUDA_SUCCESS)                          \
			fail_drv(code, step, r_);                \
	} while (0)

// ---------------------------------------------------------------------------------
// Options

static const char USAGE[] =
	"Usage: gpuos-inject --kind KIND [--delay S] [--device N] [--after-iterations N] [--json]\n"
	"       gpuos-inject --list [--json]\n"
	"\n"
	"Triggers one GPU fault in this process (never in another) and reports the CUDA\n"
	"error it got.  First it does real work on the GPU (a kernel fills a buffer, the\n"
	"host checks it), then arms the fault, prints stage \"armed\", waits --delay\n"
	"seconds and faults.\n"
	"\n"
	"Kinds:\n"
	"  oob-write            store to an unmapped address   CUDA_ERROR_ILLEGAL_ADDRESS (700)\n"
	"  oob-read             load from an unmapped address  CUDA_ERROR_ILLEGAL_ADDRESS (700)\n"
	"  ro-write             store to a read-only mapping   CUDA_ERROR_ILLEGAL_ADDRESS (700)\n"
	"  illegal-instruction  execute an invalid opcode      CUDA_ERROR_ILLEGAL_INSTRUCTION (715)\n"
	"  trap                 PTX trap;                      CUDA_ERROR_LAUNCH_FAILED (719)\n"
	"  assert               device-side assert(0)          CUDA_ERROR_ASSERT (710)\n"
	"  none                 a valid store (control)        no error\n"
	"\n"
	"Options:\n"
	"  --kind KIND            the fault (required)\n"
	"  --delay S              seconds to wait between \"armed\" and the fault [0]\n"
	"  --device N             CUDA device ordinal [0]\n"
	"  --after-iterations N   work iterations before arming [1]; 0: until SIGUSR1\n"
	"                         (SIGUSR1 also ends the work and the delay early)\n"
	"  --json                 one JSON object a line on stdout per stage\n"
	"  --list                 the kinds, their expected errors and Xids\n"
	"  -h, --help             this text\n"
	"\n"
	"Exit codes: 0 the expected error (none: no error), 2 bad usage, 3 setup failed\n"
	"(no driver, no GPU, ...), 4 another error than expected, 5 no error at all,\n"
	"6 the work before the fault failed.\n";

[[noreturn]] static void usage_error(const char *fmt, const char *arg)
{
	fprintf(stderr, "gpuos-inject: ");
	fprintf(stderr, fmt, arg);
	fprintf(stderr, "\nTry 'gpuos-inject --help'.\n");
	exit(EXIT_USAGE);
}

static double parse_seconds(const char *s)
{
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno || end == s || *end || !(v >= 0) || v > 86400.0)
		usage_error("--delay: not a number of seconds from 0 to 86400: '%s'", s);
	return v;
}

static long parse_count(const char *opt, const char *s)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < 0 || v > 1000000000L) {
		std::string m = std::string(opt) + ": not a whole number from 0 to 1000000000: '%s'";
		usage_error(m.c_str(), s);
	}
	return v;
}

static void list_kinds()
{
	for (const Kind &k : KINDS) {
		if (g_json)
			printf("{\"kind\": %s, \"expect\": %s, \"code\": %d, \"xid\": %s, \"what\": %s}\n",
			       jstr(k.name).c_str(), jstr(k.expect_name).c_str(), (int)k.expect,
			       jstr(k.xid).c_str(), jstr(k.what).c_str());
		else
			printf("%-20s %-37s %s; %s\n", k.name,
			       (std::string(k.expect_name) + " (" + std::to_string((int)k.expect) + ")").c_str(),
			       k.what, k.xid);
	}
}

static int write_cubins(const char *dir)
{
	int n = 0;
	for (const Cubin &c : CUBINS) {
		if (!c.data)
			continue;
		std::vector<unsigned char> img(c.data, c.data + *c.size);
		std::string why;
		for (int patched = 0; patched < 2; patched++) {
			if (patched && patch_illegal(img, &why) < 0) {
				fprintf(stderr, "gpuos-inject: sm_%d: %s\n", c.sm, why.c_str());
				return EXIT_SETUP;
			}
			std::string path = std::string(dir) + "/illegal_sm" + std::to_string(c.sm) +
					   (patched ? ".patched.cubin" : ".cubin");
			FILE *f = fopen(path.c_str(), "wb");
			if (!f || fwrite(img.data(), 1, img.size(), f) != img.size() || fclose(f) != 0) {
				fprintf(stderr, "gpuos-inject: %s: %s\n", path.c_str(), strerror(errno));
				return EXIT_SETUP;
			}
			printf("%s\n", path.c_str());
		}
		n++;
	}
	return n ? 0 : EXIT_SETUP;
}

// ---------------------------------------------------------------------------------
// Running

static volatile sig_atomic_t g_usr1;

static void on_usr1(int)
{
	g_usr1 = 1;
}

static double now_ms()
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_s(double s)
{
	struct timespec ts;
	ts.tv_sec = (time_t)s;
	ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
	while (!g_usr1 && nanosleep(&ts, &ts) != 0 && errno == EINTR) {
	}
}

static const unsigned WORDS = 1u << 20;  // the work buffer: 4 MiB
static const unsigned THREADS = 256;

static unsigned blocks(unsigned n)
{
	return (n + THREADS - 1) / THREADS;
}

// Checks that host[0..n) holds work_word(i, seed); a mismatch is fatal with `code`.
static void check_words(const std::vector<unsigned> &host, unsigned n, unsigned seed, int code,
			const char *step)
{
	for (unsigned i = 0; i < n; i++)
		if (host[i] != work_word(i, seed))
			fail(code, step, "wrong-result", 0,
			     std::string(step) + ": word " + std::to_string(i) + " is " + hex(host[i]) +
				     ", expected " + hex(work_word(i, seed)));
}

int main(int argc, char **argv)
{
	const char *kind_name = nullptr;
	const char *cubin_dir = nullptr;
	double delay = 0;
	long device = 0, iterations = 1;
	bool list = false;

	enum { O_KIND = 256, O_DELAY, O_DEVICE, O_ITER, O_JSON, O_LIST, O_CUBINS };
	static const struct option opts[] = {
		{"kind", required_argument, nullptr, O_KIND},
		{"delay", required_argument, nullptr, O_DELAY},
		{"device", required_argument, nullptr, O_DEVICE},
		{"after-iterations", required_argument, nullptr, O_ITER},
		{"json", no_argument, nullptr, O_JSON},
		{"list", no_argument, nullptr, O_LIST},
		{"write-illegal-cubins", required_argument, nullptr, O_CUBINS},
		{"help", no_argument, nullptr, 'h'},
		{nullptr, 0, nullptr, 0},
	};
	opterr = 0;
	int c;
	while ((c = getopt_long(argc, argv, ":h", opts, nullptr)) != -1) {
		switch (c) {
		case O_KIND: kind_name = optarg; break;
		case O_DELAY: delay = parse_seconds(optarg); break;
		case O_DEVICE: device = parse_count("--device", optarg); break;
		case O_ITER: iterations = parse_count("--after-iterations", optarg); break;
		case O_JSON: g_json = true; break;
		case O_LIST: list = true; break;
		case O_CUBINS: cubin_dir = optarg; break;
		case 'h': fputs(USAGE, stdout); return 0;
		case ':': usage_error("option '%s' needs a value", argv[optind - 1]);
		default: usage_error("unknown option '%s'", argv[optind - 1]);
		}
	}
	if (optind < argc)
		usage_error("unexpected argument '%s'", argv[optind]);
	if (list) {
		list_kinds();
		return 0;
	}
	if (cubin_dir)
		return write_cubins(cubin_dir);
	if (!kind_name)
		usage_error("%s", "--kind KIND is required (oob-write, oob-read, ro-write, "
				  "illegal-instruction, trap, assert, none)");
	g_kind = find_kind(kind_name);
	if (!g_kind)
		usage_error("unknown kind '%s' (oob-write, oob-read, ro-write, illegal-instruction, "
			    "trap, assert, none)", kind_name);
	const Kind &kind = *g_kind;
	g_pid = (long)getpid();

	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_usr1;
	sa.sa_flags = SA_RESTART;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGUSR1, &sa, nullptr);

	// 1. The driver, the device, a context, the entry points.
	void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!libcuda) {
		const char *e = dlerror();
		fail(EXIT_SETUP, "driver", "no-driver", 0,
		     std::string("cannot load libcuda.so.1: no NVIDIA driver on this host (") +
			     (e ? e : "dlopen failed") + ")");
	}
	int ndev = 0;
	RT(cudaGetDeviceCount(&ndev), EXIT_SETUP, "cudaGetDeviceCount");
	if (device >= ndev)
		fail(EXIT_SETUP, "device", "no-such-device", 0,
		     "device " + std::to_string(device) + " does not exist (" + std::to_string(ndev) +
			     " visible)");
	RT(cudaSetDevice((int)device), EXIT_SETUP, "cudaSetDevice");
	RT(cudaFree(nullptr), EXIT_SETUP, "context");
	cudaDeviceProp prop;
	RT(cudaGetDeviceProperties(&prop, (int)device), EXIT_SETUP, "cudaGetDeviceProperties");
	std::string sm = std::to_string(prop.major) + "." + std::to_string(prop.minor);
#define FETCH(name, ver)                                                                       \
	{                                                                                      \
		cudaDriverEntryPointQueryResult q_ = cudaDriverEntryPointSymbolNotFound;       \
		cudaError_t e_ = cudaGetDriverEntryPointByVersion(#name, (void **)&p_##name, ver, \
								  cudaEnableDefault, &q_);     \
		if (e_ != cudaSuccess)                                                         \
			fail_rt(EXIT_SETUP, "entry point " #name, e_);                         \
		if (q_ != cudaDriverEntryPointSuccess || !p_##name)                            \
			fail(EXIT_SETUP, "entry point " #name, "no-entry-point", (long)q_,     \
			     "the driver has no " #name " (version " #ver ")");                 \
	}
	DRIVER_CALLS(FETCH)
#undef FETCH

	// 2. Real work.
	Line("working").i("device", device).s("gpu", prop.name).s("sm", sm).emit();
	say("pid %ld, device %ld (%s, sm_%d%d): working", g_pid, device, prop.name, prop.major,
	    prop.minor);
	unsigned *buf = nullptr;
	RT(cudaMalloc(&buf, WORDS * sizeof(unsigned)), EXIT_SETUP, "cudaMalloc");
	std::vector<unsigned> host(WORDS);
	long done = 0;
	for (; (iterations == 0 || done < iterations) && !g_usr1; done++) {
		unsigned seed = (unsigned)done * 0x9e3779b9u + 1;
		k_fill<<<blocks(WORDS), THREADS>>>(buf, WORDS, seed);
		RT(cudaGetLastError(), EXIT_WORK, "work launch");
		RT(cudaMemcpy(host.data(), buf, WORDS * sizeof(unsigned), cudaMemcpyDeviceToHost), EXIT_WORK,
		   "work copy");
		check_words(host, WORDS, seed, EXIT_WORK, "work check");
	}

	// 3. Arm.
	Line armed("armed");
	armed.i("device", device).s("gpu", prop.name).s("sm", sm).i("iterations", done);
	unsigned *addr = nullptr;     // the faulting address (oob-*, ro-write, none)
	CUfunction illegal = nullptr;
	if (strcmp(kind.name, "oob-write") == 0 || strcmp(kind.name, "oob-read") == 0) {
		// 4 TiB past the buffer, and above the CPU's 47-bit user address space, so that
		// no host mapping can back it either (HMM/ATS resolve GPU faults on host addresses).
		CUdeviceptr p = (CUdeviceptr)buf + OOB_OFFSET, base = 0;
		while (p < (1ull << 47))
			p += OOB_OFFSET;
		size_t size = 0;
		if (p_cuMemGetAddressRange(&base, &size, p) == CUDA_SUCCESS)
			fail(EXIT_SETUP, "target", "address-mapped", 0,
			     "the target address " + hex(p) + " is mapped (allocation " + hex(base) +
				     "): refusing");
		addr = (unsigned *)p;
		armed.s("address", hex(p));
	} else if (strcmp(kind.name, "ro-write") == 0) {
		CUmemAllocationProp ap;
		memset(&ap, 0, sizeof ap);
		ap.type = CU_MEM_ALLOCATION_TYPE_PINNED;
		ap.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		ap.location.id = (int)device;
		size_t gran = 0;
		DRV(p_cuMemGetAllocationGranularity(&gran, &ap, CU_MEM_ALLOC_GRANULARITY_MINIMUM), EXIT_SETUP,
		    "cuMemGetAllocationGranularity");
		CUmemGenericAllocationHandle h;
		DRV(p_cuMemCreate(&h, gran, &ap, 0), EXIT_SETUP, "cuMemCreate");
		CUdeviceptr rw = 0, ro = 0;
		CUmemAccessDesc ad;
		memset(&ad, 0, sizeof ad);
		ad.location = ap.location;
		DRV(p_cuMemAddressReserve(&rw, gran, 0, 0, 0), EXIT_SETUP, "cuMemAddressReserve");
		DRV(p_cuMemMap(rw, gran, 0, h, 0), EXIT_SETUP, "cuMemMap");
		ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
		DRV(p_cuMemSetAccess(rw, gran, &ad, 1), EXIT_SETUP, "cuMemSetAccess read-write");
		DRV(p_cuMemAddressReserve(&ro, gran, 0, 0, 0), EXIT_SETUP, "cuMemAddressReserve");
		DRV(p_cuMemMap(ro, gran, 0, h, 0), EXIT_SETUP, "cuMemMap");
		ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
		DRV(p_cuMemSetAccess(ro, gran, &ad, 1), EXIT_SETUP, "cuMemSetAccess read-only");
		// The read-only mapping must work for reads: fill through rw, read through ro.
		unsigned n = (unsigned)(gran / sizeof(unsigned) < WORDS ? gran / sizeof(unsigned) : WORDS);
		k_fill<<<blocks(n), THREADS>>>((unsigned *)rw, n, 0x5eed);
		k_copy<<<blocks(n), THREADS>>>(buf, (const unsigned *)ro, n);
		RT(cudaGetLastError(), EXIT_SETUP, "read-only mapping launch");
		RT(cudaMemcpy(host.data(), buf, n * sizeof(unsigned), cudaMemcpyDeviceToHost), EXIT_SETUP,
		   "read-only mapping read");
		check_words(host, n, 0x5eed, EXIT_SETUP, "read-only mapping check");
		addr = (unsigned *)ro;
		armed.s("address", hex(ro)).i("mapping_bytes", (long long)gran);
	} else if (strcmp(kind.name, "illegal-instruction") == 0) {
		const Cubin *cb = pick_cubin(prop.major, prop.minor);
		if (!cb)
			fail(EXIT_SETUP, "cubin", "no-cubin", 0,
			     "no illegal-instruction cubin for sm_" + std::to_string(prop.major) +
				     std::to_string(prop.minor) + " (built: " + built_cubins() + ")");
		// As compiled first: it must run and store its marker.
		std::vector<unsigned char> img(cb->data, cb->data + *cb->size);
		std::vector<unsigned long long> aligned((img.size() + 7) / 8);
		memcpy(aligned.data(), img.data(), img.size());
		CUmodule mod;
		CUfunction fn;
		DRV(p_cuModuleLoadData(&mod, aligned.data()), EXIT_SETUP, "cuModuleLoadData (as compiled)");
		DRV(p_cuModuleGetFunction(&fn, mod, "gpuos_illegal"), EXIT_SETUP, "cuModuleGetFunction");
		RT(cudaMemset(buf, 0, sizeof(unsigned)), EXIT_SETUP, "cudaMemset");
		void *args[] = {&buf};
		DRV(p_cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, nullptr, args, nullptr), EXIT_SETUP,
		    "cuLaunchKernel (as compiled)");
		unsigned got = 0;
		RT(cudaMemcpy(&got, buf, sizeof got, cudaMemcpyDeviceToHost), EXIT_SETUP,
		   "illegal kernel as compiled");
		if (got != GPUOS_MARKER)
			fail(EXIT_SETUP, "illegal kernel as compiled", "wrong-result", 0,
			     "the unpatched kernel stored " + hex(got) + ", not " + hex(GPUOS_MARKER));
		std::string why;
		long at = patch_illegal(img, &why);
		if (at < 0)
			fail(EXIT_SETUP, "patch", "bad-cubin", 0, "cannot patch the sm_" +
				     std::to_string(cb->sm) + " cubin: " + why);
		memcpy(aligned.data(), img.data(), img.size());
		DRV(p_cuModuleLoadData(&mod, aligned.data()), EXIT_SETUP, "cuModuleLoadData (patched)");
		DRV(p_cuModuleGetFunction(&illegal, mod, "gpuos_illegal"), EXIT_SETUP, "cuModuleGetFunction");
		armed.s("cubin", "sm_" + std::to_string(cb->sm)).s("patched_at", hex((unsigned long long)at));
	} else if (strcmp(kind.name, "none") == 0) {
		addr = buf;
	}
	armed.f("delay_s", delay).emit();
	say("armed after %ld work iteration(s)%s%s", done,
	    addr && strcmp(kind.name, "none") != 0 ? "; target " : "",
	    addr && strcmp(kind.name, "none") != 0 ? hex((unsigned long long)addr).c_str() : "");
	if (delay > 0)
		sleep_s(delay);

	// 4. Fault, with stdout on stderr meanwhile (device-side messages).
	fflush(stdout);
	int saved_stdout = dup(1);
	if (saved_stdout >= 0)
		dup2(2, 1);
	auto restore_stdout = [&]() {
		fflush(stdout);
		if (saved_stdout >= 0) {
			dup2(saved_stdout, 1);
			close(saved_stdout);
			saved_stdout = -1;
		}
	};
	double t0 = now_ms();
	cudaError_t launch = cudaSuccess;
	CUresult dlaunch = CUDA_SUCCESS;
	if (strcmp(kind.name, "oob-write") == 0 || strcmp(kind.name, "ro-write") == 0 ||
	    strcmp(kind.name, "none") == 0) {
		k_store<<<1, 1>>>(addr, 0xdeadbeefu);
		launch = cudaGetLastError();
	} else if (strcmp(kind.name, "oob-read") == 0) {
		k_load<<<1, 1>>>(buf, addr);
		launch = cudaGetLastError();
	} else if (strcmp(kind.name, "trap") == 0) {
		k_trap<<<1, 1>>>(buf, 1);
		launch = cudaGetLastError();
	} else if (strcmp(kind.name, "assert") == 0) {
		k_assert<<<1, 1>>>(buf, 0);
		launch = cudaGetLastError();
	} else if (strcmp(kind.name, "illegal-instruction") == 0) {
		void *args[] = {&buf};
		dlaunch = p_cuLaunchKernel(illegal, 1, 1, 1, 1, 1, 1, 0, nullptr, args, nullptr);
	}
	if (launch != cudaSuccess) {
		restore_stdout();
		fail_rt(EXIT_SETUP, "launch", launch);
	}
	if (dlaunch != CUDA_SUCCESS) {
		restore_stdout();
		fail_drv(EXIT_SETUP, "launch", dlaunch);
	}
	CUresult r = p_cuCtxSynchronize();
	double t1 = now_ms();
	cudaError_t rt = cudaDeviceSynchronize();  // the same error as the runtime names it
	restore_stdout();

	int code;
	const char *stage = r == CUDA_SUCCESS ? "completed" : "faulted";
	if (r == kind.expect)
		code = EXIT_EXPECTED;
	else if (r == CUDA_SUCCESS)
		code = EXIT_NO_FAULT;
	else
		code = EXIT_UNEXPECTED;
	Line(stage).s("error", drv_name(r)).i("code", (long)r).s("message", drv_text(r))
		.s("runtime_error", cudaGetErrorName(rt)).i("runtime_code", (long)rt)
		.s("expected", kind.expect_name).b("as_expected", code == EXIT_EXPECTED)
		.f("elapsed_ms", t1 - t0).i("exit", code).emit();
	if (r == CUDA_SUCCESS)
		say("completed without error%s", code == EXIT_EXPECTED ? "" : ": the fault did not happen");
	else
		say("faulted: %s (%d: %s) after %.3f ms%s%s", drv_name(r).c_str(), (int)r, drv_text(r).c_str(),
		    t1 - t0, code == EXIT_EXPECTED ? ", as expected" : "; expected ",
		    code == EXIT_EXPECTED ? "" : kind.expect_name);
	if (code == EXIT_UNEXPECTED || code == EXIT_NO_FAULT)
		fprintf(stderr, "gpuos-inject: %s: expected %s, got %s\n", kind.name, kind.expect_name,
			drv_name(r).c_str());
	fflush(stdout);
	fflush(stderr);
	(void)libcuda;
	return code;
}
