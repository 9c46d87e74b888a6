#!/bin/sh
# make bench: builds the release agent and the bench, makes the guest image
# where it can (the VM figures need build/vmlinuz + build/initrd.img, QEMU and
# vhost-device-vsock; without them those figures say "not measured"), then
# runs every figure as root. Arguments go to crust-bench (--help).
#   CRUST_BENCH_NO_VM=1  skip making the guest image (VM figures: not measured)
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
if [ "${CRUST_BENCH_NO_VM:-}" != 1 ]; then
    sh initrd/build.sh || echo "bench: make initrd failed; the VM figures will say not measured" >&2
fi

# Release, like the agent: the serial baseline and the echo are compiled as well as crust is.
cargo build --release -p crust-bench
exec target/x86_64-unknown-linux-gnu/release/crust-bench "$@"
