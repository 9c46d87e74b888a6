# crust-agent: build, test, initrd, demo, bench. Every target installs what it
# needs (scripts/deps.sh: Debian packages and vhost-device-vsock), so each
# works on a fresh Debian machine as root.
TRIPLE := x86_64-unknown-linux-gnu
RELEASE := target/$(TRIPLE)/release

.PHONY: all build deps initrd guest-image test test-host test-fuzz test-vm fuzz stress demo bench lint

all: build

deps:
	@scripts/deps.sh

# Static, stripped binaries: crust-agent, crustctl, crust-vm, crustd, crustd-ctl.
build:
	cargo build --release --workspace
	@ls -l $(RELEASE)/crust-agent $(RELEASE)/crustctl $(RELEASE)/crust-vm $(RELEASE)/crustd $(RELEASE)/crustd-ctl

# build/vmlinuz (Debian's cloud kernel) and build/initrd.img (the agent as /init + modules).
initrd: deps
	sh initrd/build.sh

# build/guest/: a Debian 12 sandbox guest with systemd, udev and crun on the
# same kernel, for the agent as a service (scripts/guest-image.sh; cached,
# about a minute when its inputs change).
guest-image: deps initrd
	sh scripts/guest-image.sh

# Everything: unit tests, host tests on loop devices (root), a short fuzzing
# round, then the VM tests (the agent as PID 1 under QEMU, hot-plug over QMP).
# Nothing is skipped here. A test that needs more than a plain developer
# machine is #[ignore = "needs root: make test runs it"] (or needs go, python
# grpcio, a VM), so a plain `cargo test` reports it as ignored, never as
# passed; these targets run the ignored tests too, and one that cannot run
# (not root, no losetup or mkfs, no Go) fails saying what is missing.
test: deps initrd guest-image test-host test-fuzz test-vm

# Every test but the VM tests, which all live in crust-vm's tests/: the other
# packages with their ignored tests, then crust-vm's own unit tests.
test-host: deps
	cargo test --workspace --exclude crust-vm --no-fail-fast -- --include-ignored
	cargo test -p crust-vm --lib --bins --no-fail-fast -- --include-ignored
	sh scripts/embed-example.sh

# Fuzzing (fuzz/, README "Fuzzing"): every parser a hostile host or disk
# feeds (ttrpc frames and requests, mountinfo, state records, uevents,
# superblocks, LUKS2 headers, mount options, crustd's JSON files, Kata
# direct-volume records), coverage-guided by libFuzzer on stable rustc, at nice 19.
# test-fuzz runs each target for FUZZ_TEST_SECS (12 targets: about 2 minutes
# in all, plus the first build of the instrumented binaries: about 8
# CPU-minutes, once); make fuzz for FUZZ_SECS each, keeping what it learns in
# target/fuzz/corpus/. A finding fails the run and is kept in
# target/fuzz/artifacts/<target>/. The committed corpus (fuzz/corpus/) also
# runs as plain tests in test-host (cargo test -p crust-fuzz).
FUZZ_TEST_SECS ?= 10
FUZZ_SECS ?= 300
test-fuzz: deps
	fuzz/run.sh $(FUZZ_TEST_SECS)

fuzz: deps
	fuzz/run.sh $(FUZZ_SECS)

# Every VM test: the agent's, and crustd's against a real guest (the kit
# builds crustd's binaries for them). One at a time: each boots its own guest.
test-vm: deps initrd guest-image
	cargo test -p crust-vm --test '*' --no-fail-fast -- --ignored --test-threads=1

# The concurrency and crash suite (tests/chaos.rs) as a soak: STRESS_SECS of
# random rounds (make test runs about 20 s of them). CRUST_CHAOS_SEED=N replays a seed.
STRESS_SECS ?= 600
stress: deps
	CRUST_STRESS_SECS=$(STRESS_SECS) cargo test -p crust-agent --test chaos -- --include-ignored --nocapture

# Boots a sandbox, hot-plugs an ext4 and an xfs disk, and walks through every operation;
# then "what kubelet sees": the same through crustd's CRUST socket.
demo: deps initrd
	cargo build --release -p crust-client -p crust-vm -p crustd
	scripts/demo.sh

# Speed, size and memory against baselines in the same run: target/bench/report.md and report.json.
bench:
	sh bench/run.sh

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
