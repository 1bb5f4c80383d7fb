/* SPDX-License-Identifier: MIT */
/*
 * fingerprint_ptx.S - the validator's kernels (fingerprint.cu compiled to PTX by the
 * Makefile), embedded as one NUL-terminated string: gpuos_fingerprint_ptx.
 * GPUOS_PTX_PATH is the .ptx file's path, given by the Makefile.
 */
	.section .rodata
	.balign 8
	.globl gpuos_fingerprint_ptx
	.hidden gpuos_fingerprint_ptx
	.type gpuos_fingerprint_ptx, @object
gpuos_fingerprint_ptx:
	.incbin GPUOS_PTX_PATH
	.byte 0
	.size gpuos_fingerprint_ptx, . - gpuos_fingerprint_ptx

	.section .note.GNU-stack, "", @progbits
