/* SPDX-License-Identifier: MIT */
/*
 * unhooked_x86_64.S - the trampolines of unhooked.h: each calls
 * gpuos_unhooked_used(index) with the caller's argument registers saved (it marks the
 * record incomplete and returns the driver's entry point), restores them and jumps there,
 * so the driver sees the call exactly as made (stack arguments included). A driver
 * without the entry point: CUDA_ERROR_NOT_FOUND (500), as the hook wrappers answer.
 */
#include "args_x86_64.inc"

	.text
	.set	unhooked_index, 0

	.macro	trampoline name
	.globl	\name
	.type	\name, @function
\name:
	.cfi_startproc
	save_args
	movl	$unhooked_index, %edi
	call	gpuos_unhooked_used
	restore_args
	testq	%rax, %rax
	jz	1f
	jmp	*%rax
1:	movl	$500, %eax
	ret
	.cfi_endproc
	.size	\name, .-\name
	.set	unhooked_index, unhooked_index + 1
	.endm

#define U(name) trampoline name
#include "unhooked.h"
#undef U

	.section .note.GNU-stack,"",@progbits
