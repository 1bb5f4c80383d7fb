# fake.mk - the fake libcuda.so.1 for host tests (included by libgpuos/Makefile).
# Alone, from libgpuos/:
#   make -f fakecuda/fake.mk O=build CUDA_INC=/usr/local/cuda-13.0/include fake
# Uses $(O) (build dir), $(CUDA_INC), $(CC); not the includer's CFLAGS (a
# -fvisibility=hidden there would hide the driver ABI): FAKE_EXTRA_CFLAGS adds flags.
# Include it after setting O (its targets use it).  Safe to include twice.

ifndef FAKE_MK_INCLUDED
FAKE_MK_INCLUDED := 1
O ?= build
CUDA_INC ?= /usr/local/cuda-13.0/include
CC ?= cc
FAKE_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))
FAKE_SRCS := $(FAKE_DIR)/fakecuda.c $(FAKE_DIR)/kernels.c
FAKE_HDRS := $(FAKE_DIR)/fakecuda.h $(FAKE_DIR)/kernels.h
FAKE_LIB := $(O)/fakecuda/libcuda.so.1
FAKE_CFLAGS = -O2 -g -fPIC -std=gnu11 -Wall -Wextra -Werror -I$(CUDA_INC) -I$(FAKE_DIR) $(FAKE_EXTRA_CFLAGS)

.PHONY: fake
fake: $(FAKE_LIB) $(O)/fakecuda/libcuda.so

# -Bsymbolic: the fake's own references (the cuGetProcAddress table, internal calls)
# bind to its own definitions, never to an LD_PRELOADed interposer, as in the real driver.
$(FAKE_LIB): $(FAKE_SRCS) $(FAKE_HDRS)
	@mkdir -p $(@D)
	$(CC) $(FAKE_CFLAGS) -shared -Wl,-soname,libcuda.so.1 -Wl,-Bsymbolic -Wl,--no-undefined \
		-o $@ $(FAKE_SRCS) -lpthread

$(O)/fakecuda/libcuda.so: $(FAKE_LIB)
	ln -sf libcuda.so.1 $@
endif
