# The two commands of opjit (see README.md):
#   make run    install what is missing, build, start opjitd on its defaults
#   make test   install what is missing, build, run every test
BUILD ?= build
JOBS ?= 2
ARGS ?=

.PHONY: all deps configure build run test test-unit test-integration bench soak format clean

all: build

deps:
	bash deploy/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo

build: configure
	cmake --build $(BUILD) -j$(JOBS)

run: build
	$(BUILD)/bin/opjitd $(ARGS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure --timeout 600 -j$(JOBS)

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

format:
	find server client tests kernels bench -name '*.cc' -o -name '*.h' | xargs clang-format -i

clean:
	rm -rf $(BUILD)
