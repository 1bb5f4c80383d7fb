/* USDT probes (provider "gpuos") for tracers that read SystemTap's notes: bpftrace,
 * bcc's trace/argdist, perf probe, SystemTap. A probe is one nop in the code and a
 * .note.stapsdt entry saying where it is and where its arguments are; nothing runs
 * unless a tracer sets a breakpoint there. Written here, after <sys/sdt.h>'s format
 * (note type 3: the nop's address, _.stapsdt.base's, no semaphore, provider, name,
 * arguments as "SIZE@OPERAND", SIZE negative for signed), because the build hosts have no
 * sys/sdt.h. Every argument is an unsigned 64-bit value in a register ("8@%reg": the
 * form every tracer parses; sys/sdt.h also allows memory operands).
 *
 *   bpftrace -e 'usdt:/path/libgpuos.so:gpuos:evict { @out = sum(arg1); }'
 *
 * The probes (tests/unit/test_libgpuos.py checks each is in the built library):
 *   gpuos:evict        base, size, copied       an allocation made non-resident, its
 *                                               contents copied out (copied: bytes that
 *                                               changed since its host copy)
 *   gpuos:swap_in      base, size               contents copied back (issued on gpuos's stream)
 *   gpuos:swap_ahead   base, size               that, ahead of the use (learned sequence, a turn)
 *   gpuos:call_in      want, copied, ns         a call's memory made resident: bytes it
 *                                               needed mapped, bytes copied, nanoseconds waited
 */
#ifndef GPUOS_USDT_H
#define GPUOS_USDT_H

#include <stdint.h>

#define GPUOS_USDT_NOTE(name, argfmt)                                                          \
	"990: nop\n"                                                                           \
	".pushsection .note.stapsdt,\"?\",\"note\"\n"                                          \
	".balign 4\n"                                                                          \
	".4byte 992f-991f, 994f-993f, 3\n"                                                     \
	"991: .asciz \"stapsdt\"\n"                                                            \
	"992: .balign 4\n"                                                                     \
	"993: .8byte 990b\n"                                                                   \
	".8byte _.stapsdt.base\n"                                                              \
	".8byte 0\n"                                                                           \
	".asciz \"gpuos\"\n"                                                                   \
	".asciz \"" #name "\"\n"                                                               \
	".asciz \"" argfmt "\"\n"                                                              \
	"994: .balign 4\n"                                                                     \
	".popsection\n"                                                                        \
	".ifndef _.stapsdt.base\n"                                                             \
	".pushsection .stapsdt.base,\"aG\",\"progbits\",.stapsdt.base,comdat\n"                \
	".weak _.stapsdt.base\n"                                                               \
	".hidden _.stapsdt.base\n"                                                             \
	"_.stapsdt.base: .space 1\n"                                                           \
	".size _.stapsdt.base, 1\n"                                                            \
	".popsection\n"                                                                        \
	".endif\n"

/* (the operands' names are not the macro's parameters: those would be substituted) */
#define GPUOS_USDT2(name, x1, x2)                                                              \
	__asm__ __volatile__(GPUOS_USDT_NOTE(name, "8@%[a1] 8@%[a2]")                           \
			     : : [a1] "r"((uint64_t)(x1)), [a2] "r"((uint64_t)(x2)))
#define GPUOS_USDT3(name, x1, x2, x3)                                                          \
	__asm__ __volatile__(GPUOS_USDT_NOTE(name, "8@%[a1] 8@%[a2] 8@%[a3]")                   \
			     : : [a1] "r"((uint64_t)(x1)), [a2] "r"((uint64_t)(x2)),          \
			       [a3] "r"((uint64_t)(x3)))

#endif
