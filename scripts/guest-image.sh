#!/bin/sh
# Makes build/guest/: a Debian 12 sandbox guest of the shape runtimes run
# (systemd as init, udev, crun; cryptsetup, to open what the agent
# encrypted with tools that share none of its code), on the same kernel as build/vmlinuz (the
# kernel package `make initrd` cached), for the tests that run the agent as
# a service beside other userspace:
#   build/guest/root.img     ext4 root filesystem (sparse, 2 GiB), no agent in it
#   build/guest/initrd.img   the image's own initramfs (initramfs-tools), to boot it
#   build/guest/vmlinuz      the kernel (the same file as build/vmlinuz)
# The agent and its unit are copied into a copy of root.img by each test
# (crust_testkit::guest), so a rebuilt agent needs no new image.
#
# Cached like the kernel package: rebuilt only when this script, the
# package list or the kernel package changes (build/guest/.stamp holds their
# digest). mmdebstrap with apt's own sources; about a minute.
set -eu
cd "$(dirname "$0")/.."
BUILD=build
OUT="$BUILD/guest"
# e2fsprogs and xfsprogs: the agent as a service makes the filesystem of a new
# encrypted volume with the guest's own mkfs.ext4 and mkfs.xfs (src/mkfs.rs);
# cryptsetup-bin: the guest's own cryptsetup opens what the agent made (the VM tests).
PACKAGES="systemd-sysv,udev,crun,initramfs-tools,util-linux,ca-certificates,e2fsprogs,xfsprogs,cryptsetup-bin"

command -v mmdebstrap >/dev/null 2>&1 || apt-get install -y mmdebstrap || { apt-get update && apt-get install -y mmdebstrap; }
command -v mkfs.ext4 >/dev/null 2>&1 || apt-get install -y e2fsprogs

DEB=$(ls "$BUILD"/linux-image-*-cloud-amd64_*.deb 2>/dev/null | head -n1 || true)
[ -n "$DEB" ] || { echo "guest-image: no kernel package in $BUILD: run make initrd first" >&2; exit 1; }
SOURCES=$(ls /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 || true)
[ -n "$SOURCES" ] || SOURCES=/etc/apt/sources.list

DIGEST=$(cat "$0" "$SOURCES" | sha256sum | cut -c1-16)-$(basename "$DEB")-$PACKAGES
if [ -f "$OUT/.stamp" ] && [ "$(cat "$OUT/.stamp")" = "$DIGEST" ] && [ -s "$OUT/root.img" ]; then
    echo "guest image: $OUT (cached)"
    exit 0
fi

rm -rf "$OUT"
mkdir -p "$OUT"
TMP=$(mktemp -d "$OUT/tmp.XXXXXX")
trap 'umount "$TMP/mnt" 2>/dev/null || true; rm -rf "$TMP"' EXIT

# The kernel is the cached .deb itself, so the guest's modules are the
# ones of build/vmlinuz. Made the same way each time: mmdebstrap clamps
# every timestamp to SOURCE_DATE_EPOCH (the kernel package's date) and
# leaves no machine-id; the filesystem's UUID and hash seed are fixed. Only
# the package versions apt serves can change it.
SOURCE_DATE_EPOCH=$(date -r "$DEB" +%s)
export SOURCE_DATE_EPOCH
mmdebstrap --variant=minbase --include="$PACKAGES,$PWD/$DEB" \
    --customize-hook='echo crust-guest > "$1/etc/hostname"' \
    --customize-hook='echo "root:crust" | chroot "$1" chpasswd' \
    --customize-hook='printf "/dev/vda / ext4 rw,errors=remount-ro 0 1\n" > "$1/etc/fstab"' \
    --customize-hook='chroot "$1" systemctl mask systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer 2>/dev/null || true' \
    --customize-hook='chroot "$1" systemctl enable serial-getty@ttyS0.service 2>/dev/null || true' \
    bookworm "$TMP/rootfs.tar" "$SOURCES"

mkdir -p "$TMP/root" "$TMP/mnt"
tar -C "$TMP/root" -xf "$TMP/rootfs.tar"
VER=$(ls "$TMP/root/lib/modules" | head -n1)
cmp -s "$TMP/root/boot/vmlinuz-$VER" "$BUILD/vmlinuz" || {
    echo "guest-image: the image's kernel $VER is not build/vmlinuz" >&2
    exit 1
}
cp "$TMP/root/boot/initrd.img-$VER" "$OUT/initrd.img"
cp "$TMP/root/boot/vmlinuz-$VER" "$OUT/vmlinuz"
truncate -s 2G "$OUT/root.img"
mkfs.ext4 -q -F -L crust-guest -U 2857c0de-0000-4000-8000-000000002857 \
    -E hash_seed=2857c0de-0000-4000-8000-000000000001 -d "$TMP/root" "$OUT/root.img"
echo "$DIGEST" > "$OUT/.stamp"
echo "guest image: $OUT/root.img ($(du -k "$OUT/root.img" | cut -f1) KiB used), kernel $VER"
