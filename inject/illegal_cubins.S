/* SPDX-License-Identifier: MIT */
/*
 * illegal_cubins.S - illegal.cu's cubins, one per architecture the Makefile built
 * (GPUOS_HAVE_SM80, ...), as gpuos_illegal_smNN[] with gpuos_illegal_smNN_size.
 * The cubins are found in the build directory through the assembler's -I.
 * gpuos_inject.cu declares the symbols weak: an architecture left out is NULL there.
 */
	.macro cubin sym, file
	.section .rodata
	.balign 16
	.globl \sym
	.type \sym, @object
\sym:
	.incbin "\file"
\sym\()_end:
	.size \sym, \sym\()_end - \sym
	.balign 8
	.globl \sym\()_size
	.type \sym\()_size, @object
\sym\()_size:
	.quad \sym\()_end - \sym
	.size \sym\()_size, 8
	.endm

#ifdef GPUOS_HAVE_SM80
	cubin gpuos_illegal_sm80, illegal_sm80.cubin
#endif
#ifdef GPUOS_HAVE_SM90
	cubin gpuos_illegal_sm90, illegal_sm90.cubin
#endif
#ifdef GPUOS_HAVE_SM100
	cubin gpuos_illegal_sm100, illegal_sm100.cubin
#endif

	.section .note.GNU-stack, "", @progbits
