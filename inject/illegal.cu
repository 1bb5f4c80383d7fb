// SPDX-License-Identifier: MIT
//
// illegal.cu - the kernel behind `gpuos-inject --kind illegal-instruction`.
//
// The Makefile compiles it to one cubin per architecture (illegal_sm80.cubin, ...),
// which illegal_cubins.S embeds.  Run as compiled, the kernel stores GPUOS_MARKER to
// p[0]: the immediate of the instruction that loads it sits in bits 32..63 of one
// 128-bit instruction on every architecture since Volta (checked with nvdisasm for
// sm_80, sm_90, sm_100).  gpuos-inject finds that instruction in .text.gpuos_illegal
// and overwrites its low 64 bits (opcode and operands) with an encoding no SM
// decodes (INVALID_INSN_LO in gpuos_inject.cu), keeping the high 64 bits (scheduling
// control), so the patched kernel executes an invalid opcode.
//
// Keep the kernel this small: the marker must be loaded by exactly one instruction
// that executes before anything else observable.

#define GPUOS_MARKER 0x1badc0deu

extern "C" __global__ void gpuos_illegal(unsigned *p)
{
	p[0] = GPUOS_MARKER;
}
