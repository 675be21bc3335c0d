# Everyday targets; the real build is CMake's (build/ by default).
BUILD ?= build
SAN_BUILD ?= build-sanitize
TSAN_BUILD ?= build-tsan
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PREFIX ?= /usr/local

.PHONY: all test test-sanitize test-tsan fuzz soak run probe install format clean

all:
	@scripts/bootstrap --tests
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

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

# The main job: on a machine without a GPU the tool falls back to the emulated driver.
run: all
	$(BUILD)/vmmt demo

probe: all
	$(BUILD)/vmmt probe

install: all
	cmake --install $(BUILD) --prefix $(PREFIX)

format:
	clang-format -i include/*.h src/*.[ch] emu/*.[ch] tools/*.[ch] bench/*.[ch] tests/*/*.[ch] python/src/*.[ch]

clean:
	rm -rf $(BUILD) $(SAN_BUILD) $(TSAN_BUILD) build-fuzz
