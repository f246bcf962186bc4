# The two commands of opjit (see README.md):
#   make run    install what is missing, build, start opjitd on its defaults
#   make test   install what is missing, build, run every test: the suites,
#               then the same under ASan+UBSan with the fuzzers (test-sanitize)
BUILD ?= build
JOBS ?= 2
ARGS ?=

.PHONY: all deps configure build run test test-quick test-unit test-integration test-sanitize test-gpu bench soak format clean fresh-check

all: build

deps:
	bash deploy/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo

build: configure
	cmake --build $(BUILD) -j$(JOBS)

run: build
	$(BUILD)/bin/opjitd $(ARGS)

test: test-quick test-sanitize

# Every suite on the regular build (no sanitizers, no fuzzers).
test-quick: build
	ctest --test-dir $(BUILD) --output-on-failure --timeout 600 -j$(JOBS)

# A second build with clang 16, AddressSanitizer + UndefinedBehaviorSanitizer
# and libFuzzer coverage: the unit and integration suites run under the
# sanitizers, then each fuzzer for FUZZ_SECONDS from its seed corpus. Being
# clang, it also checks the lock annotations (OPJIT_THREAD_SAFETY, on by
# default under clang: -Wthread-safety -Werror=thread-safety), so a lock
# annotation violation fails `make test` at this build.
ASAN_BUILD ?= build-asan
# -O1 (ASan's own advice) and line tables only: symbolized reports with file
# and line, about 30% less compile time than -O2 -g.
ASAN_OPT ?= -O1 -gline-tables-only -DNDEBUG
FUZZ_SECONDS ?= 60
SANITIZER_ENV = ASAN_OPTIONS=halt_on_error=1:detect_stack_use_after_return=0:strict_string_checks=1 \
                UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
                LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp
test-sanitize: deps
	CC=clang-16 CXX=clang++-16 cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=$(ASAN_OPT)" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$(ASAN_OPT)" \
	  -DOPJIT_SANITIZE=address,undefined -DOPJIT_FUZZ=ON -DOPJIT_FUZZ_SECONDS=$(FUZZ_SECONDS) \
	  -DOPJIT_BUILD_BENCH=OFF
	cmake --build $(ASAN_BUILD) -j$(JOBS)
	$(SANITIZER_ENV) ctest --test-dir $(ASAN_BUILD) --output-on-failure --timeout 900 -j$(JOBS) \
	  -L 'unit|integration' -LE variant
	$(SANITIZER_ENV) ctest --test-dir $(ASAN_BUILD) --output-on-failure -j$(JOBS) -L fuzz

# Every GPU test, on a machine with a GPU (see README "Tests"): fails at once
# where there is none; there a skipped GPU test is a failure.
test-gpu: build
	bash tests/gpu/run.sh $(BUILD)

test-unit: build
	ctest --test-dir $(BUILD) --output-on-failure -L unit -j$(JOBS)

test-integration: build
	ctest --test-dir $(BUILD) --output-on-failure -L integration -j$(JOBS)

# Benchmarks against their peers (PyTorch, g++, a bare gRPC echo, memcpy);
# writes bench/results.md and bench/plots/. 3–4 minutes here.
bench: build
	bash deploy/install-deps.sh --bench
	bash bench/run.sh

# N clients (default 8) for T minutes (default 10) against one opjitd; fails
# on unexpected errors, RSS growth past its bound, or leaked fds or /dev/shm.
SOAK_CLIENTS ?= 8
SOAK_MINUTES ?= 10
soak: build
	/usr/bin/python3 bench/soak.py --clients $(SOAK_CLIENTS) --minutes $(SOAK_MINUTES) \
	  --build $(BUILD) --json bench/out/soak.json

# The newcomer check (deploy/fresh-check.sh, needs root): a fresh Debian 12
# root from mmdebstrap, a clean clone of HEAD (uncommitted changes are not in
# it), then install-deps, configure, build and the unit and integration suites
# inside it. FRESH_ARGS=--all runs make test there instead; see --help.
FRESH_ARGS ?=
fresh-check:
	bash deploy/fresh-check.sh --jobs $(JOBS) $(FRESH_ARGS)

format:
	find server client tests kernels bench -name '*.cc' -o -name '*.h' | xargs clang-format -i

clean:
	rm -rf $(BUILD)
