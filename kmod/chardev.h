/* SPDX-License-Identifier: GPL-2.0 OR MIT */
#ifndef _GPUOS_CHARDEV_H
#define _GPUOS_CHARDEV_H

int gpuos_chardev_init(void);
void gpuos_chardev_exit(void);

#endif /* _GPUOS_CHARDEV_H */
