#!/bin/sh
# make bench: builds the release agent and the bench, makes the guest image
# where it can (the VM figures need build/vmlinuz + build/initrd.img, QEMU and
# vhost-device-vsock; without them those figures say "not measured"), then
# runs every figure as root. Arguments go to crust-bench (--help).
#   CRUST_BENCH_NO_VM=1  skip making the guest image (VM figures: not measured)
#   CRUST_BENCH_BASELINE=REV  the commit whose agent is measured beside ours
#       (round trip, RSS, idle connections); default d45c9af, the last one
#       served by the ttrpc crate's sync server; "none" to skip it
set -eu
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
    echo "make bench needs root (loop devices, mounts, chown, drop_caches)" >&2
    exit 2
fi

# Tools for the set-up and the baselines (mkfs, xfs_growfs, chgrp/chmod,
# losetup), QEMU and vhost-device-vsock for the VM figures.
scripts/deps.sh
export PATH="${HOME:-/root}/.cargo/bin:$PATH"

cargo build --release -p crust-agent -p crustd

# Today's figures beside ours: the baseline commit's agent, built once into
# target/bench/baseline/REV (its own target dir, so ours is untouched).
BASE=${CRUST_BENCH_BASELINE:-d45c9af}
if [ "$BASE" != none ]; then
    rev=$(git rev-parse --short "$BASE" 2>/dev/null || true)
    out=target/bench/baseline/$rev
    bin=$out/target/x86_64-unknown-linux-gnu/release/crust-agent
    if [ -n "$rev" ] && [ ! -x "$bin" ]; then
        rm -rf "$out/src" && mkdir -p "$out/src"
        git archive "$rev" | tar -x -C "$out/src"
        (cd "$out/src" && cargo build --release -p crust-agent --target-dir ../target) ||
            echo "bench: the baseline agent ($rev) did not build; its figures will be missing" >&2
    fi
    if [ -x "$bin" ]; then
        export CRUST_BENCH_BASELINE_AGENT="$PWD/$bin" CRUST_BENCH_BASELINE_REV="$rev"
    fi
fi
if [ "${CRUST_BENCH_NO_VM:-}" != 1 ]; then
    sh initrd/build.sh || echo "bench: make initrd failed; the VM figures will say not measured" >&2
fi

# Release, like the agent: the serial baseline and the echo are compiled as well as crust is.
cargo build --release -p crust-bench
exec target/x86_64-unknown-linux-gnu/release/crust-bench "$@"
