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

# Tools for the set-up and the baselines (mkfs, xfs_growfs, chgrp/chmod, losetup).
need=""
command -v mkfs.xfs >/dev/null 2>&1 || need="$need xfsprogs"
command -v mkfs.ext4 >/dev/null 2>&1 || need="$need e2fsprogs"
command -v losetup >/dev/null 2>&1 || need="$need mount"
if [ -n "$need" ]; then
    apt-get install -y $need || { apt-get update && apt-get install -y $need; }
fi

cargo build --release -p crust-agent

if [ "${CRUST_BENCH_NO_VM:-}" != 1 ] && [ -x initrd/build.sh ]; then
    command -v qemu-system-x86_64 >/dev/null 2>&1 \
        || apt-get install -y qemu-system-x86 \
        || echo "bench: could not install QEMU; the VM figures will say not measured" >&2
    command -v vhost-device-vsock >/dev/null 2>&1 || [ -x "${HOME:-/root}/.cargo/bin/vhost-device-vsock" ] \
        || cargo install vhost-device-vsock --locked \
        || echo "bench: could not install vhost-device-vsock; the VM figures will say not measured" >&2
    initrd/build.sh || echo "bench: make initrd failed; the VM figures will say not measured" >&2
fi

# Release, like the agent: the serial baseline and the echo are compiled as well as crust is.
cargo build --release -p crust-bench
exec target/x86_64-unknown-linux-gnu/release/crust-bench "$@"
