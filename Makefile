# Everyday targets; the real build is CMake's (build/ by default).
BUILD ?= build
SAN_BUILD ?= build-sanitize
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PREFIX ?= /usr/local

.PHONY: all test test-sanitize run probe install format clean

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
	rm -rf $(BUILD) $(SAN_BUILD)
