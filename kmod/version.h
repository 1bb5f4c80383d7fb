/* SPDX-License-Identifier: GPL-2.0 OR MIT */
#ifndef _GPUOS_VERSION_H
#define _GPUOS_VERSION_H

/* Reported by MODULE_VERSION and GPUOS_A_MODULE_VERSION; see dkms.conf too. */
#define GPUOS_MODULE_VERSION "0.1.0"

#endif /* _GPUOS_VERSION_H */
