# libmagice — build, test, demo, install.
#   make            build/libmagice.so and build/magice-trace
#   make test       every CPU test (the NCCL stand-in plays the GPUs)
#   make demo       a 4-rank FSDP-style inference run under the shim, then its skeleton and diff
#   make bench      per-call overhead benchmark (tools/bench)
#   make gpu-test   tests/gpu on a machine with a GPU
#   make install PREFIX=/usr/local   lib/libmagice.so, bin/magice-trace and, in lib/magice/, the
#                   libraries they carry: a self-contained prefix, to copy as it is onto a GPU node

CUDA_HOME ?= /usr/local/cuda
PREFIX    ?= /usr/local
BUILD     ?= build

CXX       ?= g++
CXXSTD    := -std=c++20
WARNINGS  := -Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wformat=2 -Werror
OPT       ?= -O2 -g
# SANITIZE=address,undefined or SANITIZE=thread instruments the whole build (test-asan and
# test-tsan below set it, each with a BUILD of its own). The link rules take no LDFLAGS, so the
# flags ride on the compiler command: every compile and every link gets them alike. -g1 keeps
# what a report shows (functions, lines, inlined frames) at two thirds of the compile time of -g.
ifneq ($(SANITIZE),)
  OPT     := -O1 -g1
  CXX     := $(CXX) -fsanitize=$(SANITIZE) -fno-omit-frame-pointer -fno-sanitize-recover=all
endif
INCLUDES  := -I. -isystem $(CUDA_HOME)/include -isystem /usr/include/x86_64-linux-gnu
CXXFLAGS  += $(CXXSTD) $(OPT) $(WARNINGS) $(INCLUDES) -fPIC -pthread -MMD -MP

# The library: hidden by default, only the NCCL entry points are exported (see shim/exports.cc).
# cudart is linked statically and the driver is reached at run time, so a machine without a
# driver still loads the shim; libunwind is linked dynamically (Debian's .a is not PIC) and
# carried (below): beside the library in build/, in PREFIX/lib/magice/ once installed.
LIB_SRCS  := $(filter-out capture/trace_reader.cc,$(wildcard base/*.cc shim/*.cc capture/*.cc rewrite/*.cc ce_transport/*.cc))
LIB_OBJS  := $(LIB_SRCS:%.cc=$(BUILD)/obj/%.o)
LIB_LDLIBS:= -L$(CUDA_HOME)/lib64 -lcudart_static -lunwind -ldl -lrt -pthread
LIB       := $(BUILD)/libmagice.so

# What the trace tool shares with the library: the trace format and the step detector.
CORE_OBJS := $(BUILD)/obj/capture/trace_reader.o $(BUILD)/obj/capture/skeleton.o \
             $(BUILD)/obj/capture/trace_format.o $(BUILD)/obj/base/options.o $(BUILD)/obj/base/log.o \
             $(BUILD)/obj/base/host.o $(BUILD)/obj/base/agreement_records.o $(BUILD)/obj/capture/flight_recorder.o
TOOL_SRCS := $(wildcard tools/magice-trace/*.cc)
TOOL_OBJS := $(TOOL_SRCS:%.cc=$(BUILD)/obj/%.o)
TOOL      := $(BUILD)/magice-trace

# The libraries an installed prefix carries (tools/install/libraries: those a GPU node may lack)
# are copied beside the binaries, so build/ runs wherever it is copied, as the prefix does. The
# prefix keeps them in lib/magice/, off the system's search path: with PREFIX=/usr/local, lib/
# is searched by every program, and our copies must not stand in for the machine's own.
CARRIED       := $(shell awk '$$1 == "carried" {print $$2}' tools/install/libraries)
CARRIED_FILES := $(addprefix $(BUILD)/,$(CARRIED))

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
               $(wildcard tests/base/*.cc tests/shim/*.cc tests/capture/*.cc tests/tools/*.cc tests/integration/*.cc tests/ce_transport/*.cc tests/rewrite/*.cc tests/*.cc))
TEST_OBJS := $(TEST_SRCS:%.cc=$(BUILD)/obj/%.o)
TESTS     := $(BUILD)/tests/magice-tests
BENCH     := $(BUILD)/magice-bench

DEPS_STAMP := $(BUILD)/.deps-ok

.PHONY: all test demo bench gpu-test install clean deps format format-check layers-check
all: $(LIB) $(TOOL) $(CARRIED_FILES)

# Debian packages the build needs; installed when missing (CI runs as root on a clean machine).
deps: $(DEPS_STAMP)
$(DEPS_STAMP):
	@mkdir -p $(BUILD)
	@missing=""; \
	 [ -f /usr/include/x86_64-linux-gnu/libunwind.h ] || missing="$$missing libunwind-dev"; \
	 [ -f /usr/include/xxhash.h ] || missing="$$missing libxxhash-dev"; \
	 [ -f /usr/include/elfutils/libdwfl.h ] || missing="$$missing libdw-dev"; \
	 [ -f /usr/include/gtest/gtest.h ] || missing="$$missing libgtest-dev"; \
	 [ -f /usr/include/benchmark/benchmark.h ] || missing="$$missing libbenchmark-dev"; \
	 command -v clang-format >/dev/null || missing="$$missing clang-format"; \
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

# The run path is a DT_RUNPATH (new dtags): it serves only the library's own dependencies, not
# what the program dlopens (NCCL), which a DT_RPATH of a preloaded library would also serve.
# libunwind's dependencies are all base (tools/install/libraries; tests/tools/install_test.cc).
# $ORIGIN/magice comes first: installed, $ORIGIN is PREFIX/lib (/usr/local/lib), where the
# machine may have a libunwind of its own; $ORIGIN finds the carried copy in build/.
$(LIB): $(LIB_OBJS) shim/exports.map
	$(CXX) -shared -o $@ $(LIB_OBJS) $(LIB_LDLIBS) -Wl,-rpath,'$$ORIGIN/magice:$$ORIGIN' \
	  -Wl,--no-undefined -Wl,-z,defs \
	  -Wl,--version-script=shim/exports.map

# libdw names frames offline (tools/magice-trace/symbols.cc): the tool links it, the library never.
# libdw's own dependencies (libelf, libbz2) must be found too, and a DT_RUNPATH would serve only
# the tool's: the tool takes a DT_RPATH (old dtags), which the loader also searches for the
# dependencies of every library the tool loads that has no run path of its own. $ORIGIN finds the
# libraries in build/, $ORIGIN/../lib/magice in an installed prefix. $ORIGIN comes first here:
# from build/, $ORIGIN/../lib/magice lies outside build/; installed, $ORIGIN is bin/, no library's.
$(TOOL): $(TOOL_OBJS) $(CORE_OBJS)
	$(CXX) -o $@ $^ -ldw -lelf -pthread -Wl,--disable-new-dtags \
	  -Wl,-rpath,'$$ORIGIN:$$ORIGIN/../lib/magice'

# The carried libraries, copied from the build machine's.
$(CARRIED_FILES): $(BUILD)/%: | $(DEPS_STAMP)
	@p=$$($(CXX) -print-file-name=$*); \
	 [ "$$p" != "$*" ] || { echo "$*: $(CXX) finds no such library to carry"; exit 1; }; \
	 echo "cp -L $$p $@"; cp -L "$$p" $@

# ---- test support -------------------------------------------------------------------------
# The stand-in exports only the NCCL names (tests/support/standin/export.h); all else is hidden,
# so a shim in front of it sees the program's calls and never the stand-in's own.
$(BUILD)/obj/tests/support/standin/%.o: CXXFLAGS += -fvisibility=hidden

$(STANDIN): $(STANDIN_SRCS:%.cc=$(BUILD)/obj/%.o) tests/support/standin/exports.map
	@mkdir -p $(dir $@)
	$(CXX) -shared -o $@ $(filter %.o,$^) -Wl,-soname,libnccl.so.2 -Wl,--no-undefined \
	  -Wl,--version-script=tests/support/standin/exports.map -L$(CUDA_HOME)/lib64 -lcudart_static \
	  -ldl -lrt -pthread
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
	  -Wl,--no-undefined -L$(CUDA_HOME)/lib64 -lcudart_static -Wl,--exclude-libs,ALL -ldl -lrt -pthread

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
# A disk that fills up: writes to *.trace files fail with ENOSPC past FULL_DISK_BYTES.
FULL_DISK := $(SUPPORT)/libfull_disk.so
$(FULL_DISK): $(BUILD)/obj/tests/support/full_disk.o
	@mkdir -p $(dir $@)
	$(CXX) -shared -o $@ $^ -ldl
TEST_BINS := $(SUPPORT_BINS) $(PROBE) $(PARTIAL) $(CALLSITE_PROBE) $(FULL_DISK)

# The CUDA transport under faults (tests/gpu/cuda_transport_faults.cc): run by make gpu-test on a
# GPU machine; built by make test too, so a machine without a GPU keeps it compiling.
GPU_FAULTS := $(BUILD)/tests/gpu/magi-transport-faults
$(GPU_FAULTS): $(BUILD)/obj/tests/gpu/cuda_transport_faults.o $(filter-out $(BUILD)/obj/shim/exports.o,$(LIB_OBJS))
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(filter %.o,$^) $(LIB_LDLIBS) -Wl,-rpath,'$$ORIGIN/../..'

# Unit tests link the library's objects directly (all but the exported entry points);
# integration tests run real processes under LD_PRELOAD.
$(TESTS): $(TEST_OBJS) $(filter-out $(BUILD)/obj/shim/exports.o,$(LIB_OBJS)) \
          $(BUILD)/obj/capture/trace_reader.o $(BUILD)/obj/tests/support/launch.o \
          $(BUILD)/obj/tests/support/forked_ranks.o
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(filter %.o,$^) -lgtest $(LIB_LDLIBS) -Wl,-rpath,'$$ORIGIN/..'

# ---- user-facing targets ------------------------------------------------------------------
# make test: the layout checks, then the four suites of "the suites" below at once, in one make
# run over every core (unless -j says otherwise), then the tests that time themselves, alone.
test:
	@$(MAKE) --no-print-directory format-check layers-check gpu-verdicts
	@$(MAKE) --no-print-directory $(JOBS) TIMED_LATER=1 SANITIZED_SUITE_LOCK=$(SANITIZED_SUITE_LOCK) \
	  test-plain test-asan test-tsan test-fuzz
	@$(MAKE) --no-print-directory test-timed

# The build takes one job per core unless -j says otherwise, as make test does.
demo:
	@$(MAKE) --no-print-directory $(JOBS) all $(SUPPORT_BINS)
	@tools/demo/run-demo.sh $(BUILD)

$(BENCH): $(BUILD)/obj/tools/bench/shim_overhead.o
	$(CXX) -o $@ $^ -lbenchmark -ldl -pthread

# The copy-engine transport against cudaMemcpyAsync, N processes on one GPU (needs a GPU to run).
$(BUILD)/magice-ce-bench: $(BUILD)/obj/tools/bench/ce_gather_bench.o $(filter-out $(BUILD)/obj/shim/exports.o,$(LIB_OBJS))
	$(CXX) -o $@ $(filter %.o,$^) $(LIB_LDLIBS) -Wl,-rpath,'$$ORIGIN'

# The shim over the real NCCL, 1 rank (needs a GPU to run: tools/bench/run-nccl-bench.sh).
$(BUILD)/magice-nccl-bench: $(BUILD)/obj/tools/bench/nccl_overhead.o
	$(CXX) -o $@ $^ -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -pthread

# What the reader's half of a static-weights set-up (CUDA IPC mappings) costs the program's CUDA
# calls beside it, under each pacing (needs a GPU to run: BENCHMARKS.md, "Pacing the mappings").
$(BUILD)/magice-mapping-pace: $(BUILD)/obj/tools/bench/mapping_pace_bench.o
	$(CXX) -o $@ $^ -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -pthread

# The nccl-tests-like all-gather loop and the FSDP-like pool program: one source for the real NCCL
# and the stand-in. Linked against libnccl.so.2 with no path of its own, so the loader takes the
# NCCL that LD_LIBRARY_PATH names (the stand-in: tools/bench/allgather_bench.py sets it) or the
# system's (the GPU machine, with build/ carried: tools/bench/run-allgather-bench-gpu.sh).
ALLGATHER_BENCH := $(BUILD)/magice-allgather-bench
$(ALLGATHER_BENCH): $(BUILD)/obj/tools/bench/allgather_bench.o $(BUILD)/obj/tests/support/bootstrap.o \
                    $(STANDIN)
	$(CXX) -o $@ $(filter %.o,$^) -L$(SUPPORT) -l:libnccl.so.2 -L$(CUDA_HOME)/lib64 -lcudart_static \
	  -ldl -lrt -pthread

# What tools/bench/run-allgather-bench-gpu.sh needs and nothing more (about 30 MB): carry
# $(BUILD)/allgather-kit to the GPU machine and pass it as the build directory.
ALLGATHER_KIT := $(BUILD)/allgather-kit
.PHONY: allgather-kit
allgather-kit: all $(ALLGATHER_BENCH) $(LAUNCH)
	rm -rf $(ALLGATHER_KIT) && mkdir -p $(ALLGATHER_KIT)/tests/support
	cp $(LIB) $(BUILD)/libunwind.so.8 $(TOOL) $(ALLGATHER_BENCH) $(ALLGATHER_KIT)/
	for l in $(TOOL_LIBS); do [ ! -f $(BUILD)/$$l ] || cp $(BUILD)/$$l $(ALLGATHER_KIT)/; done
	cp $(LAUNCH) $(ALLGATHER_KIT)/tests/support/

bench: all $(STANDIN) $(BENCH) $(BUILD)/magice-ce-bench $(ALLGATHER_BENCH) $(LAUNCH)
	@tools/bench/run-bench.sh $(BUILD)
	@tools/bench/run-allgather-bench.sh $(BUILD)

# Runs what is already built (build here, carry build/ to the GPU machine): no compiler needed there.
gpu-test:
	@tests/gpu/run.sh $(BUILD)

# The verdicts of gpu-test (its checks, skips and closing line) on made-up runs: no GPU needed.
.PHONY: gpu-verdicts
gpu-verdicts:
	@python3 tests/gpu/verdict_test.py

# PREFIX/lib/libmagice.so, PREFIX/bin/magice-trace and the carried libraries in PREFIX/lib/magice/:
# the prefix needs nothing of the machine but its base (tools/install/libraries) and the CUDA
# driver, so it can be built here and copied to a GPU node. The copying is
# tools/install/install.sh, which builds nothing: tests/gpu/run.sh installs a carried build/ with
# it where no compiler is.
install: all
	DESTDIR=$(DESTDIR) tools/install/install.sh $(BUILD) $(PREFIX)

# ---- the suites: plain, sanitizers, fuzzing ------------------------------------------------
# test-plain runs the suite in this build; test-asan and test-tsan build everything again,
# instrumented, in a BUILD of their own and run the suite there (TSan: all but TSAN_SKIPS).
# A suite runs as TEST_PROCESSES processes at once, each on its share of the tests
# (tests/run-sharded.sh): most tests start ranks and then wait on them; a sanitizer suite runs as
# fewer, its ranks being busier. They cannot collide:
# ranks meet in a temporary directory and /dev/shm names of their own launch, traces and tools
# write to temporary directories, and what is looked for in /dev/shm is looked for by pid.
# make test runs the suites at once under one jobserver, in the order it names them: the plain
# suite first (the quickest answer; its ranks mostly wait, while the sanitizer builds compile),
# then ASan's build, the heaviest, and TSan's, so that the CPU-bound sanitizer suites come last.
# Without -j on the command line, each of these targets takes one job per core. The sanitizer
# suites take turns (SANITIZED_SUITE_LOCK), whatever compiles meanwhile: both at once on two cores
# slowed the ranks of an 8-rank TSan test past its 60 s timeout.
# Tests that assert how long something took (TIMED_TESTS) would fail on a machine this busy:
# a suite runs them alone after the rest; under make test (TIMED_LATER), test-timed runs them
# once every suite has ended, one build after the other.
# Every process of the run, the ranks and tools the tests start included, writes its ASan and
# TSan reports under sanitizer-reports/ rather than to stderr, so a report from a process whose
# exit status no test looks at still fails the run.
# The shim under test is the instrumented one; the sanitizer runtime is preloaded before it
# (TEST_PRELOAD_FIRST, read by tests/integration/shim_test.cc), as the runtime must come first.
.PHONY: test-plain test-asan test-tsan test-fuzz test-timed run-suite run-timed fuzz fuzz-corpus
CORES          := $(shell nproc 2>/dev/null || echo 2)
JOBS            = $(if $(filter -j%,$(MAKEFLAGS)),,-j$(CORES))
TEST_PROCESSES ?= $(shell echo $$(( $(CORES) * $(if $(SANITIZE),2,4) )))
SANITIZED_SUITE_LOCK ?= $(abspath $(BUILD))/.sanitized-suite.lock
TIMED_TESTS    := Agreement.TheCostTrial*:PythonCallsite.NoInterpreterRecordsNothingAndCostsNothingVisible
ASAN_BUILD     := BUILD=$(BUILD)/asan PLAIN_BUILD=$(BUILD) SANITIZE=address,undefined
TSAN_BUILD     := BUILD=$(BUILD)/tsan PLAIN_BUILD=$(BUILD) SANITIZE=thread
PLAIN_BUILD    ?= $(BUILD)

# The demo and the GPU fault program only have to keep compiling: the plain build makes them.
test-plain:
	@$(MAKE) --no-print-directory $(JOBS) run-suite $(DEMO) $(GPU_FAULTS)
test-asan:
	@$(MAKE) --no-print-directory $(JOBS) $(ASAN_BUILD) run-suite
test-tsan:
	@$(MAKE) --no-print-directory $(JOBS) $(TSAN_BUILD) run-suite
test-timed:
	@$(MAKE) --no-print-directory run-timed
	@$(MAKE) --no-print-directory $(ASAN_BUILD) run-timed
	@$(MAKE) --no-print-directory $(TSAN_BUILD) run-timed

# libunwind's per-thread cache, freed as a thread that unwound exits, crashes TSan's runtime:
# the TSan run leaves call sites off (MAGI_CALLSITES=0) by default. The tests that need them turn
# them on for their ranks, whose calls are unwound on the main thread, which never frees that
# cache; the one that unwinds from threads of its own unwinds on the main thread alone under
# TSan. So no test is skipped (TSAN_SKIPS: a gtest filter, for a test that must be).
TSAN_SKIPS :=

REPORTS := $(abspath $(BUILD))/sanitizer-reports
# The plain suite tests the installed layout too: installed under build/, its path in
# TEST_INSTALL_PREFIX (the sanitized suites skip those tests).
TEST_PREFIX := $(abspath $(BUILD))/installed
# TEST_TIMES: how long each test took in the plain suite's last run and in this suite's, so that
# tests/run-sharded.sh deals the long ones out first (under make test the plain suite has ended
# before a sanitized suite starts).
SUITE_ENV = TEST_BUILD_DIR=$(abspath $(BUILD)) $(if $(SANITIZE),,TEST_INSTALL_PREFIX=$(TEST_PREFIX)) \
            TEST_TIMES="$$(ls $(abspath $(PLAIN_BUILD))/test-logs/plain.*.log \
                              $(abspath $(BUILD))/test-logs/$(SUITE).*.log 2>/dev/null)"
SUITE     = plain
ifeq ($(SANITIZE),thread)
  SUITE       = tsan
  SUITE_SKIPS = $(TSAN_SKIPS)
  # The random agreement programs: 100 under TSan (5-10x slower), 200 in the other runs.
  # TEST_TIMEOUT_SCALE stretches the limit a launch of ranks gets (tests/support/launch.h):
  # under TSan on two cores, 8 ranks of a thousand gathers a step ran past 120 s.
  SUITE_ENV  += TEST_PRELOAD_FIRST=$(shell $(CXX) -print-file-name=libtsan.so) \
                TSAN_OPTIONS="log_path=$(REPORTS)/tsan second_deadlock_stack=1" MAGI_CALLSITES=0 \
                TEST_AGREE_SCENARIOS=100 TEST_TIMEOUT_SCALE=3
else ifneq ($(SANITIZE),)
  SUITE       = asan
  # UBSan, running inside ASan's runtime, writes to stderr whatever log_path says; it aborts
  # instead, and no test takes a SIGABRT for an expected result.
  SUITE_ENV  += TEST_PRELOAD_FIRST=$(shell $(CXX) -print-file-name=libasan.so) \
                ASAN_OPTIONS="log_path=$(REPORTS)/asan detect_leaks=1 check_initialization_order=1 detect_stack_use_after_return=1" \
                UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1 abort_on_error=1" \
                TEST_TIMEOUT_SCALE=2
endif
# Under a sanitizer the tests' own code builds at -O0, where the sanitizer sees every access; it
# compiles in half the time, and none of it is hot (the library, the stand-in, the workloads and
# the tool keep -O1).
# In the plain build they take -O1 -g1: a test file of GoogleTest's templates compiles in under
# half the time of -O2 -g (9 s against 21 s for agreement_test.cc), and the code that tests time
# (the library, the stand-in) keeps -O2.
ifneq ($(SANITIZE),)
$(TEST_OBJS): CXXFLAGS += -O0
else
$(TEST_OBJS): OPT = -O1 -g1
endif
# Fails the recipe when a process of the run wrote a sanitizer report.
CHECK_REPORTS = if [ -n "$$(ls -A $(REPORTS))" ]; then \
	          cat $(REPORTS)/*; echo "sanitizer reports: $(REPORTS)"; exit 1; fi

run-suite: all $(filter-out $(DEMO),$(TEST_BINS)) $(TESTS)
	@rm -rf $(REPORTS) && mkdir -p $(REPORTS)
	@$(if $(SANITIZE),true,rm -rf $(TEST_PREFIX) && DESTDIR= tools/install/install.sh $(BUILD) $(TEST_PREFIX) >/dev/null)
	@echo "$(SUITE): $(TESTS)$(if $(SANITIZE), under -fsanitize=$(SANITIZE)), $(TEST_PROCESSES) processes"
	@$(SUITE_ENV) $(if $(SANITIZE),flock $(SANITIZED_SUITE_LOCK)) \
	   tests/run-sharded.sh $(SUITE) $(TEST_PROCESSES) $(BUILD)/test-logs $(TESTS) \
	   '*-$(TIMED_TESTS)$(if $(SUITE_SKIPS),:$(SUITE_SKIPS))'; status=$$?; \
	 $(CHECK_REPORTS); [ $$status = 0 ] || exit $$status
	@$(if $(TIMED_LATER),,$(MAKE) --no-print-directory run-timed)

run-timed: all $(filter-out $(DEMO),$(TEST_BINS)) $(TESTS)
	@rm -rf $(REPORTS) && mkdir -p $(REPORTS)
	@$(SUITE_ENV) tests/run-sharded.sh $(SUITE)-timed 1 $(BUILD)/test-logs $(TESTS) \
	   '$(TIMED_TESTS)$(if $(SUITE_SKIPS),-$(SUITE_SKIPS))'; status=$$?; \
	 $(CHECK_REPORTS); exit $$status

# libFuzzer targets (tests/fuzz/), built with clang: `make fuzz` runs each for FUZZ_SECONDS;
# `make test` runs each for FUZZ_TEST_SECONDS. Seeds are read from tests/fuzz/corpus/<target>;
# what the fuzzer finds goes to $(BUILD)/fuzz/corpus/<target>, a crashing input to
# $(BUILD)/fuzz/crashes/ (replay: $(BUILD)/fuzz/fuzz_<target> <file>).
FUZZ_CXX          ?= clang++
FUZZ_SECONDS      ?= 300
FUZZ_TEST_SECONDS ?= 20
FUZZ_BUILD        := $(BUILD)/fuzz
FUZZ_SANITIZERS   := address,undefined
FUZZ_CXXFLAGS     := $(CXXSTD) -O1 -g $(WARNINGS) $(INCLUDES) -fno-omit-frame-pointer \
                     -fno-sanitize-recover=all -fsanitize=fuzzer-no-link,$(FUZZ_SANITIZERS)
FUZZ_TARGETS      := trace_reader options
FUZZERS           := $(FUZZ_TARGETS:%=$(FUZZ_BUILD)/fuzz_%)

# clang is installed when missing, as `deps` does for the rest.
$(FUZZ_BUILD)/.deps-ok:
	@mkdir -p $(dir $@)
	@command -v $(FUZZ_CXX) >/dev/null || { \
	   echo "installing: clang"; SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	   $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq clang >/dev/null || \
	     { echo "could not install clang (run: apt-get install clang)"; exit 1; }; }
	@touch $@

$(FUZZ_BUILD)/obj/%.o: %.cc | $(DEPS_STAMP) $(FUZZ_BUILD)/.deps-ok
	@mkdir -p $(dir $@)
	$(FUZZ_CXX) $(FUZZ_CXXFLAGS) -MMD -MP -c $< -o $@

$(FUZZ_BUILD)/fuzz_trace_reader: $(addprefix $(FUZZ_BUILD)/obj/,tests/fuzz/trace_reader_fuzz.o \
                                   capture/trace_reader.o)
$(FUZZ_BUILD)/fuzz_options: $(addprefix $(FUZZ_BUILD)/obj/,tests/fuzz/options_fuzz.o \
                              base/options.o base/log.o base/host.o)
$(FUZZERS):
	$(FUZZ_CXX) -fsanitize=fuzzer,$(FUZZ_SANITIZERS) -o $@ $^ -pthread

fuzz: $(FUZZERS)
	@for target in $(FUZZ_TARGETS); do \
	   mkdir -p $(FUZZ_BUILD)/corpus/$$target $(FUZZ_BUILD)/crashes && \
	   echo "fuzzing $$target for $(FUZZ_SECONDS) s" && \
	   $(FUZZ_BUILD)/fuzz_$$target -max_total_time=$(FUZZ_SECONDS) -timeout=10 -print_final_stats=1 \
	     -artifact_prefix=$(FUZZ_BUILD)/crashes/$$target- \
	     $(FUZZ_BUILD)/corpus/$$target tests/fuzz/corpus/$$target 2>$(FUZZ_BUILD)/$$target.log; \
	   status=$$?; grep -aE "^(#[0-9]+[[:space:]]+DONE|stat::|==[0-9]+==ERROR|SUMMARY)" $(FUZZ_BUILD)/$$target.log; \
	   [ $$status = 0 ] || { tail -n 60 $(FUZZ_BUILD)/$$target.log; exit 1; }; \
	 done

test-fuzz:
	@$(MAKE) --no-print-directory $(JOBS) fuzz FUZZ_SECONDS=$(FUZZ_TEST_SECONDS)

# Rewrites the trace seeds from tests/fuzz/make_corpus.cc (tests/support/trace_builder.h).
fuzz-corpus: $(FUZZ_BUILD)/make_corpus
	$(FUZZ_BUILD)/make_corpus tests/fuzz/corpus/trace_reader
$(FUZZ_BUILD)/make_corpus: tests/fuzz/make_corpus.cc tests/support/trace_builder.h capture/trace_format.h \
                          | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXSTD) $(OPT) $(WARNINGS) $(INCLUDES) -o $@ $<

# Every C++ file follows .clang-format; no line of the library (base, shim, capture, rewrite,
# ce_transport) is longer than 100 columns, comments and strings included.
FORMATTED := $(shell git ls-files '*.cc' '*.h' 2>/dev/null)
LIBRARY_SOURCES := $(filter base/% shim/% capture/% rewrite/% ce_transport/%,$(FORMATTED))
format: | $(DEPS_STAMP)
	clang-format -i $(FORMATTED)
format-check: | $(DEPS_STAMP)
	@clang-format --dry-run --Werror $(FORMATTED)
	@! LC_ALL=C.UTF-8 grep -nP '^.{101,}' $(LIBRARY_SOURCES) | sed 's/$$/  <- over 100 columns/' | grep .
	@echo "format-check: $(words $(FORMATTED)) files follow .clang-format"

# Data flows shim -> capture -> rewrite -> ce_transport, with base/ below them all: a folder may
# include only folders below it. Each line: a folder, then the folders it must never include.
LAYERS := base:shim,capture,rewrite,ce_transport capture:shim,rewrite,ce_transport \
          rewrite:shim ce_transport:shim,capture,rewrite
layers-check:
	@status=0; for rule in $(LAYERS); do \
	   folder=$${rule%%:*}; \
	   for above in $$(echo $${rule#*:} | tr , ' '); do \
	     if grep -Hn "#include \"$$above/" $$folder/*.h $$folder/*.cc; then \
	       echo "  ^ $$folder/ includes $$above/, which is above it"; status=1; fi; \
	   done; \
	 done; [ $$status = 0 ] && echo "layers-check: no folder includes one above it"; exit $$status

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD)/obj $(FUZZ_BUILD)/obj -name '*.d' 2>/dev/null)
