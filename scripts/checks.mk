# The checks scripts/test.sh runs after the Python tests, one target each, run by
#   make -f scripts/checks.mk -j"$(nproc)" -O -k
# Make starts the next check whenever one ends, so a check that leaves a core idle for
# part of its time (the loom models' longest model is one thread; the soak and the fuzzing
# run for a fixed time) has another beside it. The one order that matters is declared: the
# fuzz targets are built before they run. -O prints each check's output in one piece when
# it ends (its first line says when it started, its last how long it took); -k runs the
# other checks after a failure, and make then fails.
# No check touches another's files or regions: each cargo build waits for the target
# folder's lock, and every region is in the run's namespace (SHMBRIDGE_NAMESPACE) or one of
# the check's own. scripts/test.sh exports PY (the test venv's python, which has the wheel).
# `all` lists them longest-first, so the short ones fill the gaps at the end.

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.ONESHELL:
# The recipes print their own step lines: make does not echo them.
.SILENT:
.PHONY: all soak loom fuzz-build mujoco bench no-features generated stubtest docker api-docs fuzz

all: soak loom fuzz-build mujoco bench no-features generated stubtest docker api-docs fuzz

# Each recipe's first lines: the helpers, its title with the time since the run began, and
# on exit its own time. `+`: the recipe gets make's jobserver, which cargo then shares, so
# the builds of checks side by side take no more jobs in all than make's -j.
define begin
+. scripts/lib.sh
step "$(TITLE)"
trap 'echo "   ($@: $$SECONDS s)"' EXIT
endef

soak: TITLE = soak for $(or $(SHMBRIDGE_SOAK_MINUTES),1) min: steps, resets, calls, re-attaches, engine restarts and kills, every step checked, resources flat
soak:
	$(begin)
	bash scripts/soak.sh "$${SHMBRIDGE_SOAK_MINUTES:-1}"

# The `loom` feature sets cfg(loom) for this crate alone (build.rs), so its dependencies
# are the release ones the benchmarks and the soak use, compiled once.
loom: TITLE = loom models of the real post/wait handshake, doorbell and ring (each prints its interleavings)
loom:
	$(begin)
	LOOM_MAX_PREEMPTIONS=3 cargo test --locked --release --features loom --lib loom_tests -- --nocapture

# In their own target folder (fuzz/target).
fuzz-build: TITLE = the fuzz targets built (scripts/fuzz.sh --build)
fuzz-build:
	$(begin)
	bash scripts/fuzz.sh --build

# Under AddressSanitizer with a nightly toolchain; on stable (a fresh Debian machine)
# without a sanitizer: scripts/fuzz.sh says which.
fuzz: TITLE = fuzz the command-channel reader and the header validation: $(or $(SHMBRIDGE_FUZZ_SECONDS),90) s in all
fuzz: fuzz-build
	$(begin)
	bash scripts/fuzz.sh "$${SHMBRIDGE_FUZZ_SECONDS:-90}"

mujoco: TITLE = the native MuJoCo engine (cargo feature mujoco; MuJoCo from PyPI's wheel): its unit tests and the alignment with Gymnasium's envs (scripts/test-mujoco.sh)
mujoco:
	$(begin)
	bash scripts/test-mujoco.sh

bench: TITLE = benchmark smoke runs (no timing is checked): roundtrip with the C engine, the C engine's own Vulkan memory, commands, shards
bench:
	$(begin)
	export SHMBRIDGE_BENCH_QUICK=1
	bash scripts/bench-c.sh
	PYTHON="$$PY" bash scripts/bench-c-vulkan.sh   # the package from the wheel
	cargo bench --locked --bench commands
	cargo bench --locked --bench shards

no-features: TITLE = the build without the cuda and vulkan features
no-features:
	$(begin)
	cargo check --locked --all-targets

generated: TITLE = generated code: FlatBuffers (schema/shmbridge.fbs) and include/shmbridge.h (cbindgen)
generated:
	$(begin)
	bash scripts/gen-flatbuffers.sh --check
	cargo run --locked -q -p shmbridge-header -- --check

stubtest: TITLE = the native module's type stubs (python/shmbridge/_native.pyi) against the module: mypy's stubtest
stubtest:
	$(begin)
	without_rust "$$PY" -m mypy.stubtest shmbridge._native --allowlist scripts/stubtest-allowlist.txt

docker: TITLE = examples/deploy's Dockerfile, Compose file and Kubernetes Job, run as written with their containers emulated by namespaces (scripts/docker-check.sh --emulate)
docker:
	$(begin)
	bash scripts/docker-check.sh --emulate target/dist/shmbridge-*.whl

api-docs: TITLE = the Python API reference (scripts/api-docs.sh: a broken docstring reference fails)
api-docs:
	$(begin)
	bash scripts/api-docs.sh "$$PY"
