/*******************************************************************************
    The kernel's integer types for gpuos's own nvidia-uvm files, which gpuos's
    tests also compile in user space (patches/nvidia-uvm/).

    SPDX-License-Identifier: MIT
*******************************************************************************/

#ifndef __UVM_GPUOS_TYPES_H__
#define __UVM_GPUOS_TYPES_H__

#ifdef __KERNEL__
#include <linux/types.h>
#else
#include <stdbool.h>
#include <stdint.h>
typedef uint32_t u32;
typedef uint64_t u64;
typedef int32_t s32;
#endif

#endif // __UVM_GPUOS_TYPES_H__
