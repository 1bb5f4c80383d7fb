/* SPDX-License-Identifier: MIT */
/*
 * dlsym_x86_64.S - libgpuos's dlsym, which every dynamically linked program calls
 * (sanitizer runtimes before anything is initialised, from .preinit_array).
 *
 * A name that does not start with "cu" costs three compares and a jump to the real
 * dlsym: a jump, not a call, so the real one sees our caller's return address and
 * RTLD_NEXT keeps its meaning whatever the compiler would have done with C. No other
 * work happens before that check. "cu" names go to gpuos_dlsym_table (hooks.c), which
 * answers for names of the hook table and leaves the rest to the same jump.
 */
#include "args_x86_64.inc"

	.text
	.globl	dlsym
	.type	dlsym, @function
dlsym:
	.cfi_startproc
	testq	%rsi, %rsi
	jz	.Lreal
	cmpb	$'c', (%rsi)
	jne	.Lreal
	cmpb	$'u', 1(%rsi)
	jne	.Lreal
	save_args
	movq	%rsp, %rdx		/* (%rsp): the answer */
	call	gpuos_dlsym_table	/* (handle, name, &answer): 1 if a table name */
	movq	(%rsp), %r11
	restore_args
	testl	%eax, %eax
	jz	.Lreal
	movq	%r11, %rax
	ret
.Lreal:
	movq	gpuos_real_dlsym(%rip), %rax
	testq	%rax, %rax
	jz	.Linit
	jmp	*%rax
.Linit:					/* the process's first dlsym: find the real one */
	save_args
	call	gpuos_dlsym_init	/* the real dlsym, or NULL */
	restore_args
	testq	%rax, %rax
	jz	.Lnone
	jmp	*%rax
.Lnone:
	xorl	%eax, %eax
	ret
	.cfi_endproc
	.size	dlsym, .-dlsym

	.section .note.GNU-stack,"",@progbits
