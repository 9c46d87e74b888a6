#!/bin/sh
# Runs examples/mkfs_guest.rs as PID 1 of a guest of its own, from an initrd
# packed with the mkfs programs (/usr/lib/crust/mkfs/), with two blank
# disks: mkfs::make with the shipped mke2fs and mkfs.xfs, run through their
# own interpreter, as PID 1's children with its reaper running; then the
# host's e2fsck and xfs_repair check what they made (docs/encryption.md,
# "Making the filesystem inside").
# Needs what `make initrd` made (build/kernel, build/vmlinuz), qemu,
# e2fsprogs and xfsprogs; as root, like `make test`.
#   CRUST_BUILD=dir   where the kernel is (default: build)
# Prints the probe's MKFS_GUEST lines; exits 0 on "MKFS_GUEST OK" and clean checks.
set -eu
cd "$(dirname "$0")/.."
. scripts/probe-env.sh

cargo build -q -p crust-agent --example mkfs_guest
cargo build -q -p crust-vm
# 320 MiB: mkfs.xfs 6.x refuses less than 300 MB.
truncate -s 320M "$WORK/a.img" "$WORK/b.img"
"$T/crust-vm" initrd --agent "$T/examples/mkfs_guest" --kernel-root "$BUILD/kernel" --version "$VER" \
    --modules virtio_pci,virtio_blk,xfs --out "$WORK/initrd.img"
# TCG: on some hosts KVM stops at the guest's first cmpxchg16b.
timeout 600 qemu-system-x86_64 -accel tcg -cpu max -m 512 -smp 1 -nographic -no-reboot \
    -kernel "$BUILD/vmlinuz" -initrd "$WORK/initrd.img" \
    -drive "file=$WORK/a.img,if=virtio,format=raw" \
    -drive "file=$WORK/b.img,if=virtio,format=raw" \
    -append "console=ttyS0 panic=-1 quiet" > "$WORK/console.log" 2>&1 || true
grep -a 'MKFS_GUEST' "$WORK/console.log" | sed 's/^.*MKFS_GUEST/MKFS_GUEST/'
grep -aq 'MKFS_GUEST OK' "$WORK/console.log"
e2fsck -f -n "$WORK/a.img"
xfs_repair -n -f "$WORK/b.img"
echo "mkfs-guest: e2fsck and xfs_repair on the host accept both filesystems"
