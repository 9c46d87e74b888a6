#!/bin/sh
# Makes the guest: build/vmlinuz (Debian's cloud kernel) and build/initrd.img
# (the static agent as /init + only the modules it needs + this host's mke2fs
# and mkfs.xfs with exactly their libraries in /usr/lib/crust/mkfs/, packed
# reproducibly by `crust-vm initrd`). Installs what it needs; quick when
# nothing changed.
#   CRUST_KERNEL_DEB=path.deb  pins the kernel package (else the current
#                              linux-image-cloud-amd64 dependency, cached in build/)
#   CRUST_MODULES=a,b          the boot module list (default: crust-vm's list)
#   CRUST_ON_DEMAND_MODULES=a  shipped but loaded by the agent on first use
#   CRUST_NO_MKFS=1            leaves mke2fs and mkfs.xfs out (the agent then
#                              cannot make the filesystem of a new encrypted volume)
set -eu
cd "$(dirname "$0")/.."
BUILD=build
mkdir -p "$BUILD"

need_pkgs=""
command -v dpkg-deb >/dev/null 2>&1 || need_pkgs="$need_pkgs dpkg"
command -v depmod >/dev/null 2>&1 || [ -x /sbin/depmod ] || need_pkgs="$need_pkgs kmod"
if [ -z "${CRUST_NO_MKFS:-}" ]; then
    [ -x /usr/sbin/mke2fs ] || [ -x /sbin/mke2fs ] || need_pkgs="$need_pkgs e2fsprogs"
    [ -x /usr/sbin/mkfs.xfs ] || [ -x /sbin/mkfs.xfs ] || need_pkgs="$need_pkgs xfsprogs"
fi
if [ -n "$need_pkgs" ]; then
    apt-get install -y $need_pkgs || { apt-get update && apt-get install -y $need_pkgs; }
fi
DEPMOD=$(command -v depmod || echo /sbin/depmod)

# The kernel package: pinned, cached, or downloaded.
DEB=${CRUST_KERNEL_DEB:-}
if [ -z "$DEB" ]; then
    PKG=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image/{print $2; exit}')
    if [ -z "$PKG" ]; then
        apt-get update >/dev/null
        PKG=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image/{print $2; exit}')
    fi
    DEB=$(ls "$BUILD/${PKG}"_*.deb 2>/dev/null | head -n1 || true)
    if [ -z "$DEB" ]; then
        (cd "$BUILD" && apt-get download "$PKG")
        DEB=$(ls "$BUILD/${PKG}"_*.deb | head -n1)
    fi
fi

# Extract once per package (a stamp names the .deb it came from).
STAMP="$BUILD/kernel/.from-$(basename "$DEB")"
if [ ! -e "$STAMP" ]; then
    rm -rf "$BUILD/kernel"
    dpkg-deb -x "$DEB" "$BUILD/kernel"
    touch "$STAMP"
fi
VER=$(ls "$BUILD/kernel/lib/modules" | head -n1)
[ -s "$BUILD/kernel/lib/modules/$VER/modules.dep" ] || "$DEPMOD" -b "$BUILD/kernel" "$VER"
cmp -s "$BUILD/kernel/boot/vmlinuz-$VER" "$BUILD/vmlinuz" || cp "$BUILD/kernel/boot/vmlinuz-$VER" "$BUILD/vmlinuz"

cargo build --release -p crust-agent
T=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu
AGENT=$T/release/crust-agent
cargo build -q -p crust-vm
set -- --agent "$AGENT" --kernel-root "$BUILD/kernel" --version "$VER" --out "$BUILD/initrd.img"
[ -n "${CRUST_MODULES:-}" ] && set -- "$@" --modules "$CRUST_MODULES"
[ -n "${CRUST_ON_DEMAND_MODULES:-}" ] && set -- "$@" --on-demand "$CRUST_ON_DEMAND_MODULES"
[ -n "${CRUST_NO_MKFS:-}" ] && set -- "$@" --no-mkfs
"$T/debug/crust-vm" initrd "$@"
echo "kernel $VER: $BUILD/vmlinuz, $BUILD/initrd.img ($(stat -c %s "$BUILD/initrd.img") bytes, agent $(stat -c %s "$AGENT") bytes)"
