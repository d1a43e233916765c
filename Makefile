# libmagice — build, test, demo, install.
#   make            build/libmagice.so and build/magice-trace
#   make test       every CPU test (the NCCL stand-in plays the GPUs)
#   make demo       a 4-rank FSDP-style inference run under the shim, then its skeleton and diff
#   make bench      per-call overhead benchmark (tools/bench)
#   make gpu-test   tests/gpu on a machine with a GPU
#   make install PREFIX=/usr/local

CUDA_HOME ?= /usr/local/cuda
PREFIX    ?= /usr/local
BUILD     ?= build

CXX       ?= g++
CXXSTD    := -std=c++20
WARNINGS  := -Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wformat=2 -Werror
OPT       ?= -O2 -g
INCLUDES  := -I. -isystem $(CUDA_HOME)/include -isystem /usr/include/x86_64-linux-gnu
CXXFLAGS  += $(CXXSTD) $(OPT) $(WARNINGS) $(INCLUDES) -fPIC -pthread -MMD -MP

# The library: hidden by default, only the NCCL entry points are exported (see shim/exports.cc).
# cudart is linked statically and the driver is reached at run time, so a machine without a
# driver still loads the shim; libunwind is linked dynamically (Debian's .a is not PIC) and
# looked for next to the library first ($ORIGIN), so build/ can travel with it.
LIB_SRCS  := $(filter-out capture/trace_reader.cc,$(wildcard shim/*.cc capture/*.cc rewrite/*.cc ce_transport/*.cc))
LIB_OBJS  := $(LIB_SRCS:%.cc=$(BUILD)/obj/%.o)
LIB_LDLIBS:= -L$(CUDA_HOME)/lib64 -lcudart_static -lunwind -ldl -lrt -pthread
LIB       := $(BUILD)/libmagice.so

# What the trace tool shares with the library: the trace format and the step detector.
CORE_OBJS := $(BUILD)/obj/capture/trace_reader.o $(BUILD)/obj/capture/skeleton.o \
             $(BUILD)/obj/capture/trace_format.o $(BUILD)/obj/shim/options.o $(BUILD)/obj/shim/log.o
TOOL_SRCS := $(wildcard tools/magice-trace/*.cc)
TOOL_OBJS := $(TOOL_SRCS:%.cc=$(BUILD)/obj/%.o)
TOOL      := $(BUILD)/magice-trace

# Test support: the NCCL stand-in (a real libnccl.so.2 over shared memory), the launcher, the
# workload programs, and the extension library a workload opens with RTLD_LOCAL.
SUPPORT   := $(BUILD)/tests/support
STANDIN   := $(SUPPORT)/libnccl.so.2
STANDIN_SRCS := $(wildcard tests/support/standin/*.cc)
LAUNCH    := $(SUPPORT)/magi-launch
WORKLOAD  := $(SUPPORT)/magi-workload
EXTLIB    := $(SUPPORT)/libworkload_ext.so
DEMO      := $(BUILD)/magice-demo

TEST_SRCS := $(filter-out tests/capture/callsite_probe_lib.cc,\
               $(wildcard tests/shim/*.cc tests/capture/*.cc tests/tools/*.cc tests/integration/*.cc tests/*.cc))
TEST_OBJS := $(TEST_SRCS:%.cc=$(BUILD)/obj/%.o)
TESTS     := $(BUILD)/tests/magice-tests
BENCH     := $(BUILD)/magice-bench

DEPS_STAMP := $(BUILD)/.deps-ok

.PHONY: all test demo bench gpu-test install clean deps
all: $(LIB) $(TOOL)

# Debian packages the build needs; installed when missing (CI runs as root on a clean machine).
deps: $(DEPS_STAMP)
$(DEPS_STAMP):
	@mkdir -p $(BUILD)
	@missing=""; \
	 [ -f /usr/include/x86_64-linux-gnu/libunwind.h ] || missing="$$missing libunwind-dev"; \
	 [ -f /usr/include/xxhash.h ] || missing="$$missing libxxhash-dev"; \
	 [ -f /usr/include/gtest/gtest.h ] || missing="$$missing libgtest-dev"; \
	 [ -f /usr/include/benchmark/benchmark.h ] || missing="$$missing libbenchmark-dev"; \
	 if [ -n "$$missing" ]; then \
	   echo "installing:$$missing"; \
	   SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	   $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null || \
	     { echo "could not install:$$missing (run: apt-get install$$missing)"; exit 1; }; \
	 fi
	@touch $@

$(BUILD)/obj/%.o: %.cc | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -c $< -o $@

# libunwind.so.8 is copied beside the library: machines without it (the GPU image) then find it
# through $ORIGIN when build/ travels.
$(LIB): $(LIB_OBJS) shim/exports.map
	$(CXX) -shared -o $@ $(LIB_OBJS) $(LIB_LDLIBS) -Wl,-rpath,'$$ORIGIN' -Wl,--no-undefined -Wl,-z,defs \
	  -Wl,--version-script=shim/exports.map
	cp -L $$($(CXX) -print-file-name=libunwind.so.8) $(BUILD)/libunwind.so.8

$(TOOL): $(TOOL_OBJS) $(CORE_OBJS)
	$(CXX) -o $@ $^ -pthread

# ---- test support -------------------------------------------------------------------------
# The stand-in exports only the NCCL names (tests/support/standin/export.h); all else is hidden,
# so a shim in front of it sees the program's calls and never the stand-in's own.
$(BUILD)/obj/tests/support/standin/%.o: CXXFLAGS += -fvisibility=hidden

$(STANDIN): $(STANDIN_SRCS:%.cc=$(BUILD)/obj/%.o) tests/support/standin/exports.map
	@mkdir -p $(dir $@)
	$(CXX) -shared -o $@ $(filter %.o,$^) -Wl,-soname,libnccl.so.2 -Wl,--no-undefined \
	  -Wl,--version-script=tests/support/standin/exports.map -lrt -pthread
	ln -sf libnccl.so.2 $(SUPPORT)/libnccl.so

$(LAUNCH): $(BUILD)/obj/tests/support/launch_main.o $(BUILD)/obj/tests/support/launch.o
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $^ -pthread

# The workloads: the scenarios live in libworkload.so (linked against the stand-in); magi-workload
# links it normally, magi-workload-local dlopens it RTLD_LOCAL the way PyTorch loads NCCL.
WORKLOAD_LIB   := $(SUPPORT)/libworkload.so
WORKLOAD_LOCAL := $(SUPPORT)/magi-workload-local
WORKLOAD_SRCS  := tests/support/workload_scenarios.cc $(wildcard tests/support/workload/*.cc) \
                  tests/support/bootstrap.cc

$(WORKLOAD_LIB): $(WORKLOAD_SRCS:%.cc=$(BUILD)/obj/%.o) $(STANDIN)
	$(CXX) -shared -o $@ $(filter %.o,$^) -L$(SUPPORT) -l:libnccl.so.2 -Wl,-rpath,'$$ORIGIN' \
	  -Wl,--no-undefined -pthread

$(WORKLOAD): $(BUILD)/obj/tests/support/workload_main.o $(WORKLOAD_LIB)
	$(CXX) -o $@ $< -L$(SUPPORT) -l:libworkload.so -Wl,-rpath,'$$ORIGIN' -Wl,-rpath-link,$(SUPPORT) \
	  -pthread

$(WORKLOAD_LOCAL): $(BUILD)/obj/tests/support/workload_local_main.o
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $< -ldl -pthread

$(DEMO): $(BUILD)/obj/tools/demo/fsdp_inference.o $(BUILD)/obj/tests/support/bootstrap.o $(STANDIN)
	$(CXX) -o $@ $(BUILD)/obj/tools/demo/fsdp_inference.o $(BUILD)/obj/tests/support/bootstrap.o \
	  -L$(SUPPORT) -l:libnccl.so.2 -Wl,-rpath,'$$ORIGIN/tests/support' -pthread

SUPPORT_BINS := $(STANDIN) $(LAUNCH) $(WORKLOAD_LIB) $(WORKLOAD) $(WORKLOAD_LOCAL) $(DEMO)

# For the shim's own tests: a program that loads no NCCL, and an incomplete NCCL.
PROBE     := $(SUPPORT)/magi-probe
PARTIAL   := $(SUPPORT)/libpartial_nccl.so
$(PROBE): $(BUILD)/obj/tests/support/probe_main.o
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $^ -ldl
$(PARTIAL): $(BUILD)/obj/tests/support/partial_nccl.o
	@mkdir -p $(dir $@)
	$(CXX) -shared -o $@ $^
# A library the call-site tests dlopen, unload and load again (tests/capture/callsite_test.cc).
CALLSITE_PROBE := $(SUPPORT)/libcallsite_probe.so
$(CALLSITE_PROBE): $(BUILD)/obj/tests/capture/callsite_probe_lib.o
	@mkdir -p $(dir $@)
	$(CXX) -shared -o $@ $^
TEST_BINS := $(SUPPORT_BINS) $(PROBE) $(PARTIAL) $(CALLSITE_PROBE)

# Unit tests link the library's objects directly (all but the exported entry points);
# integration tests run real processes under LD_PRELOAD.
$(TESTS): $(TEST_OBJS) $(filter-out $(BUILD)/obj/shim/exports.o,$(LIB_OBJS)) \
          $(BUILD)/obj/capture/trace_reader.o $(BUILD)/obj/tests/support/launch.o
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(filter %.o,$^) -lgtest $(LIB_LDLIBS) -Wl,-rpath,'$$ORIGIN/..'

# ---- user-facing targets ------------------------------------------------------------------
test: all $(TEST_BINS) $(TESTS)
	MAGI_BUILD_DIR=$(abspath $(BUILD)) $(TESTS)

demo: all $(SUPPORT_BINS)
	@tools/demo/run-demo.sh $(BUILD)

$(BENCH): $(BUILD)/obj/tools/bench/shim_overhead.o
	$(CXX) -o $@ $^ -lbenchmark -ldl -pthread

bench: all $(STANDIN) $(BENCH)
	@tools/bench/run-bench.sh $(BUILD)

# Runs what is already built (build here, carry build/ to the GPU machine): no compiler needed there.
gpu-test:
	@tests/gpu/run.sh $(BUILD)

install: all
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin
	install -m 0755 $(LIB) $(DESTDIR)$(PREFIX)/lib/libmagice.so
	install -m 0755 $(TOOL) $(DESTDIR)$(PREFIX)/bin/magice-trace

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
