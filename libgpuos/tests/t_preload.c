/* SPDX-License-Identifier: MIT */
/*
 * t_preload - a module's kernel launched first, then a library loaded from an image in
 * this program (as the CUDA runtime loads a fatbin only when one of its kernels is first
 * needed) and its kernel launched: what a warm standby loads ahead while it waits at its
 * first launch (libgpuos/src/preload.c).  Results checked on the host.
 *
 * Usage: t_preload [heap|heap-other]: with heap, the library's image is an ELF made in
 * memory of the program's own, freed after the load (as cuBLAS loads the images it
 * unpacks); heap-other, the same with other bytes.
 */
#define FN(sym) (tally(#sym), sym)
#include <elf.h>
#include <stdlib.h>
#include <string.h>

#include "work.h"

static const char image[] = "fake library of t_preload, loaded after the first launch";

static void fill(CUfunction f, CUdeviceptr d, float v, int n)
{
	void *params[] = { &d, &v, &n };
	launch_n(f, n, NULL, params);
}

/* A small ELF image in heap memory: its header, one section of payload, the section
 * headers last (what preload.c reads to learn an image's size). */
static void *heap_image(unsigned char fill_byte)
{
	enum { PAYLOAD = 3000 };
	size_t size = sizeof(Elf64_Ehdr) + PAYLOAD + 2 * sizeof(Elf64_Shdr);
	unsigned char *p = calloc(1, size);
	Elf64_Ehdr eh = { 0 };
	Elf64_Shdr sh[2] = { { 0 } };
	memcpy(eh.e_ident, ELFMAG, SELFMAG);
	eh.e_ident[EI_CLASS] = ELFCLASS64;
	eh.e_ident[EI_DATA] = ELFDATA2LSB;
	eh.e_shoff = sizeof eh + PAYLOAD;
	eh.e_shentsize = sizeof(Elf64_Shdr);
	eh.e_shnum = 2;
	eh.e_ehsize = sizeof eh;
	sh[1].sh_type = SHT_PROGBITS;
	sh[1].sh_offset = sizeof eh;
	sh[1].sh_size = PAYLOAD;
	memcpy(p, &eh, sizeof eh);
	memset(p + sizeof eh, fill_byte, PAYLOAD);
	memcpy(p + eh.e_shoff, sh, sizeof sh);
	return p;
}

int main(int argc, char **argv)
{
	enum { N = 1000 };
	float out[N];
	CUlibrary lib;
	CUkernel k;
	CUlibraryOption opt = CU_LIBRARY_BINARY_IS_PRESERVED;
	void *preserved = (void *)(uintptr_t)1;

	const char *mode = argc > 1 ? argv[1] : "";
	void *heap = !strcmp(mode, "heap") ? heap_image(0x5a) : !strcmp(mode, "heap-other") ? heap_image(0xa5) : NULL;

	work_init();
	CUdeviceptr d = dalloc(N * 4);
	fill(w_fill, d, 1.0f, N); /* the first launch: a warm standby stops here */
	if (heap) { /* not preserved: the driver copies what it needs, and the program frees it */
		CU(cuLibraryLoadData, &lib, heap, NULL, NULL, 0, NULL, NULL, 0);
		free(heap);
	} else {
		CU(cuLibraryLoadData, &lib, image, NULL, NULL, 0, &opt, &preserved, 1);
	}
	CU(cuLibraryGetKernel, &k, lib, "fake_fill");
	fill((CUfunction)k, d, 2.0f, N);
	CU(cuCtxSynchronize);
	dtoh(out, d, N * 4);
	check_all("after the library's fill: out", out, N, 2.0f);
	sum_bytes(out, N * 4);
	CU(cuLibraryUnload, lib);
	dfree(d);
	work_fini();
	return finish("t_preload", "");
}
