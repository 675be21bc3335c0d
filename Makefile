# Everyday targets; the real build is CMake's (build/ by default).
BUILD ?= build
SAN_BUILD ?= build-sanitize
TSAN_BUILD ?= build-tsan
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PREFIX ?= /usr/local

.PHONY: all tool test test-sanitize test-tsan fuzz soak run probe install format clean

all:
	@scripts/bootstrap --tests
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVMMT_BUILD_TESTS=ON >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

# The tool alone (with the library and the emulated driver), needing none of the test
# packages: a fresh build directory is configured without the tests; one that has
# them (make all) keeps them, and only the tool is built.
tool:
	@scripts/bootstrap
	@test -f $(BUILD)/CMakeCache.txt || \
	    cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVMMT_BUILD_TESTS=OFF >/dev/null
	cmake --build $(BUILD) -j $(JOBS) --target vmmt_tool

test: all
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

test-sanitize:
	@scripts/bootstrap --tests
	cmake -S . -B $(SAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DVMMT_SANITIZE=ON >/dev/null
	cmake --build $(SAN_BUILD) -j $(JOBS)
	ctest --test-dir $(SAN_BUILD) --output-on-failure -j $(JOBS)

# The suite under ThreadSanitizer; benign reports are suppressed, each with its
# reason, in tests/tsan.supp.
test-tsan:
	@scripts/bootstrap --tests
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DVMMT_TSAN=ON >/dev/null
	cmake --build $(TSAN_BUILD) -j $(JOBS)
	TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$(CURDIR)/tests/tsan.supp" \
	    ctest --test-dir $(TSAN_BUILD) --output-on-failure -j $(JOBS)

# libFuzzer on every fuzz target, FUZZ_SECONDS each (clang; scripts/fuzz).
fuzz:
	JOBS=$(JOBS) scripts/fuzz

# Producer and consumer processes with kill -9, VMMT_SOAK_SECONDS (default 60).
soak: all
	$(BUILD)/tests/soak/soak

# The main job: --driver auto runs on the GPU, or says there is none and runs on the
# emulated driver.
run: tool
	$(BUILD)/vmmt demo --driver auto

# The machine's own check: without a GPU it stops (exit 2) and says so.
probe: tool
	$(BUILD)/vmmt probe

install: all
	cmake --install $(BUILD) --prefix $(PREFIX)

format:
	clang-format -i include/*.h src/*.[ch] emu/*.[ch] tools/*.[ch] bench/*.[ch] tests/*/*.[ch] python/src/*.[ch]

clean:
	rm -rf $(BUILD) $(SAN_BUILD) $(TSAN_BUILD) build-fuzz
