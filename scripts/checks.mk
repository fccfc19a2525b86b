# The checks scripts/test.sh runs after the Python tests, one target each, run by
#   make -f scripts/checks.mk -j"$(nproc)" --output-sync=recurse -k
# Make starts the next check whenever one ends, so a check that leaves a core idle for
# part of its time (the loom models' longest model is one thread; the soak and the fuzzing
# run for a fixed time) has another beside it. --output-sync=recurse prints each check's
# output in one piece when it ends (its first line says when it started, its last how long
# it took; plain -O would not hold back recipes marked `+`, below); -k runs the other
# checks after a failure, and make then fails (a check that must come after a failed one
# does not run: make says "not remade because of errors").
# The orders that matter are declared. Cargo lets one build at a time use a target folder
# (the others wait for its lock, holding a job slot and doing nothing), so the checks that
# use one take turns: the release builds of the loom models, the soak and the benchmarks
# are one target that runs first; the MuJoCo check's builds come after the short ones in
# target/debug (the check without features, the header tool); the fuzz targets (in
# fuzz/target) are built before they run. Every region is in the run's namespace
# (SHMBRIDGE_NAMESPACE) or one of the check's own, so no check sees another's.
# scripts/test.sh exports PY (the test venv's python, which has the wheel).
# `all` lists the long ones first, so the short ones fill the gaps at the end.

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.ONESHELL:
# The recipes print their own step lines: make does not echo them.
.SILENT:
.PHONY: all release-builds soak loom fuzz-build mujoco bench no-features generated stubtest docker api-docs fuzz

all: release-builds no-features generated fuzz-build mujoco soak loom bench stubtest docker api-docs fuzz
soak loom bench: release-builds
mujoco: | no-features generated
fuzz: fuzz-build

# Each recipe's first lines: the helpers, its title with the time since the run began, and
# on exit its own time. `+`: the recipe gets make's jobserver, which cargo then shares, so
# the builds of checks side by side take no more jobs in all than make's -j. (So `make -n`
# and `make -q` run the recipes too: list the checks with
# `make -f scripts/checks.mk -p --eval 'list: ;' list`.)
define begin
+. scripts/lib.sh
step "$(TITLE)"
trap 'echo "   ($@: $$SECONDS s)"' EXIT
endef

# The `loom` feature sets cfg(loom) for this crate alone (build.rs), so the models'
# dependencies are the release ones of the benchmarks and the soak, compiled once. The C
# library with the features it is installed with (scripts/install-c.sh), as the C
# benchmarks build it.
release-builds: TITLE = the release builds of the loom models, the soak and the benchmarks
release-builds:
	$(begin)
	cargo test --locked --release --features loom --lib --no-run
	cargo build --locked --release --bin shmbridge --example soak
	cargo build --locked --release -p shmbridge-capi --features cuda
	cargo bench --locked --no-run --bench roundtrip --bench commands --bench shards

soak: TITLE = soak for $(or $(SHMBRIDGE_SOAK_MINUTES),1) min: steps, resets, calls, re-attaches, engine restarts and kills, every step checked, resources flat
soak:
	$(begin)
	bash scripts/soak.sh "$${SHMBRIDGE_SOAK_MINUTES:-1}"

loom: TITLE = loom models of the real post/wait handshake, doorbell, ring and stream lanes (each prints its interleavings)
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
fuzz: TITLE = fuzz the command-channel reader, the header validation and the stream record decoder: $(or $(SHMBRIDGE_FUZZ_SECONDS),90) s in all
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
