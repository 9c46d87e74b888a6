#!/bin/bash
# Installs what building, testing and the demo need, idempotently: Debian
# packages (mkfs tools, QEMU, cpio, kmod, Go and its ttrpc) and vhost-device-vsock from
# crates.io. Quick when everything is already there.
set -euo pipefail

need_apt=()
for pair in mkfs.ext4:e2fsprogs mkfs.xfs:xfsprogs xfs_repair:xfsprogs qemu-system-x86_64:qemu-system-x86 \
            cpio:cpio depmod:kmod losetup:mount dpkg-deb:dpkg go:golang-go; do
    cmd=${pair%%:*} pkg=${pair#*:}
    command -v "$cmd" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# Go's containerd/ttrpc, for the interoperability test (tests/interop.rs).
[ -d /usr/share/gocode/src/github.com/containerd/ttrpc ] || need_apt+=(golang-github-containerd-ttrpc-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "deps: installing ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v vhost-device-vsock >/dev/null 2>&1; then
    echo "deps: cargo install vhost-device-vsock (a few minutes, once)"
    cargo install --locked --quiet vhost-device-vsock
fi
