# tests.mk - C test programs that drive the fake driver (included by libgpuos/Makefile).
# Alone, from libgpuos/:
#   make -f tests/tests.mk O=build CUDA_INC=/usr/local/cuda-13.0/include testprogs testrun
# Uses $(O), $(CUDA_INC), $(CC); includes fakecuda/fake.mk (guarded) for the fake.
# Run a program: LD_LIBRARY_PATH=$(O)/fakecuda $(O)/tests/t_direct [SEED]
# (add LD_PRELOAD=$(O)/libgpuos.so to run it under the interposer).

O ?= build
CUDA_INC ?= /usr/local/cuda-13.0/include
TESTS_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))
include $(TESTS_DIR)/../fakecuda/fake.mk

TEST_CFLAGS = -O2 -g -std=gnu11 -pthread -Wall -Wextra -Werror -I$(CUDA_INC) -I$(TESTS_DIR)/../fakecuda -I$(TESTS_DIR) $(TEST_EXTRA_CFLAGS)
TEST_LINKED := t_direct t_graph t_validate t_fork t_bench t_scan t_pause t_threads t_ctx_reuse t_unhooked t_movable t_agent t_resident t_preload t_share
TEST_DLOPEN := t_dlsym t_procaddr t_dlsym_answers
# Sanitizer-instrumented builds, to run with libgpuos preloaded (it must not break them).
TEST_SANITIZED := t_threads_tsan t_dlsym_tsan t_direct_asan t_resident_tsan
TESTPROGS := $(addprefix $(O)/tests/,$(TEST_LINKED) $(TEST_DLOPEN) $(TEST_SANITIZED)) $(O)/tests/fakecublas/libcublas.so.13
TEST_HDRS := $(TESTS_DIR)/common.h $(TESTS_DIR)/work.h $(TESTS_DIR)/../fakecuda/fakecuda.h

.PHONY: testprogs testrun
testprogs: $(TESTPROGS)

# linked with the fake's libcuda.so (soname libcuda.so.1), no rpath: LD_LIBRARY_PATH at run time
$(addprefix $(O)/tests/,$(TEST_LINKED)): $(O)/tests/%: $(TESTS_DIR)/%.c $(TEST_HDRS) $(O)/fakecuda/libcuda.so
	@mkdir -p $(@D)
	$(CC) $(TEST_CFLAGS) -o $@ $< -L$(O)/fakecuda -lcuda -ldl -lm

# not linked with libcuda: dlopen("libcuda.so.1")
$(addprefix $(O)/tests/,$(TEST_DLOPEN)): $(O)/tests/%: $(TESTS_DIR)/%.c $(TEST_HDRS)
	@mkdir -p $(@D)
	$(CC) $(TEST_CFLAGS) -o $@ $< -ldl -lm

$(O)/tests/t_threads_tsan: $(TESTS_DIR)/t_threads.c $(TEST_HDRS) $(O)/fakecuda/libcuda.so
	@mkdir -p $(@D)
	$(CC) $(TEST_CFLAGS) -fsanitize=thread -o $@ $< -L$(O)/fakecuda -lcuda -ldl -lm

$(O)/tests/t_resident_tsan: $(TESTS_DIR)/t_resident.c $(TEST_HDRS) $(O)/fakecuda/libcuda.so
	@mkdir -p $(@D)
	$(CC) $(TEST_CFLAGS) -fsanitize=thread -o $@ $< -L$(O)/fakecuda -lcuda -ldl -lm

$(O)/tests/t_dlsym_tsan: $(TESTS_DIR)/t_dlsym.c $(TEST_HDRS)
	@mkdir -p $(@D)
	$(CC) $(TEST_CFLAGS) -fsanitize=thread -o $@ $< -ldl -lm

$(O)/tests/t_direct_asan: $(TESTS_DIR)/t_direct.c $(TEST_HDRS) $(O)/fakecuda/libcuda.so
	@mkdir -p $(@D)
	$(CC) $(TEST_CFLAGS) -fsanitize=address -fno-omit-frame-pointer -o $@ $< -L$(O)/fakecuda -lcuda -ldl -lm

# a stand-in for cuBLAS (a warm standby's warm-up, blaswarm.c): preloaded by the test
$(O)/tests/fakecublas/libcublas.so.13: $(TESTS_DIR)/fake_cublas.c
	@mkdir -p $(@D)
	$(CC) $(TEST_CFLAGS) -shared -fPIC -o $@ $< -ldl

# Every program on the fake (TEST_PRELOAD=path/libgpuos.so to run them under it).
testrun: testprogs $(FAKE_LIB)
	$(TESTS_DIR)/run_fake.sh $(O) $(TEST_PRELOAD)
