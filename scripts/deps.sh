#!/bin/bash
# Installs what building, testing and the demo need, idempotently: Debian
# packages (mkfs tools, QEMU, cpio, kmod, Go and its ttrpc, g++ for libFuzzer,
# cryptsetup to check the agent's LUKS2 against) and vhost-device-vsock from
# crates.io. Quick when everything is already there.
set -euo pipefail

need_apt=()
for pair in mkfs.ext4:e2fsprogs mkfs.xfs:xfsprogs xfs_repair:xfsprogs qemu-system-x86_64:qemu-system-x86 \
            cpio:cpio depmod:kmod losetup:mount dpkg-deb:dpkg go:golang-go c++:g++ \
            cryptsetup:cryptsetup-bin; do
    cmd=${pair%%:*} pkg=${pair#*:}
    command -v "$cmd" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# Python's cryptography: the LUKS2 VM tests decrypt images on the host with
# cryptsetup's volume key and an AES-XTS that shares nothing with the agent.
python3 -c 'import cryptography' 2>/dev/null || need_apt+=(python3-cryptography)
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
# Python's grpcio, pinned, in build/py: crustd/tests/grpcio.rs drives crustd
# with gRPC C-core, whose default channel sends the socket's path as
# :authority (1.57 and later; Debian's python3-grpcio is older and does not).
GRPCIO_VERSION=1.71.0
PY_DIR="$(cd "$(dirname "$0")/.." && pwd)/build/py"
if ! PYTHONPATH="$PY_DIR" python3 -c "import grpc, sys; sys.exit(grpc.__version__ != '$GRPCIO_VERSION')" 2>/dev/null; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        echo "deps: installing python3-pip"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq python3-pip >/dev/null
    fi
    echo "deps: pip install grpcio==$GRPCIO_VERSION into $PY_DIR"
    rm -rf "$PY_DIR"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
        --target "$PY_DIR" "grpcio==$GRPCIO_VERSION"
fi
