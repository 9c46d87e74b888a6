#!/bin/sh
# Runs examples/integrity_guest.rs as PID 1 of a guest of its own, with the
# host's cryptsetup (and the libraries it links) added to its initrd as a
# second cpio archive: cryptsetup formats a blank disk with --integrity
# hmac-sha256 in the guest (the host has no device-mapper), the agent's
# luks2::mapping opens it, reads it, and sees a flipped byte refused.
# Needs what `make initrd` made (build/kernel, build/vmlinuz), qemu and
# cryptsetup; as root, like `make test`.
#   CRUST_BUILD=dir   where the kernel is (default: build)
#   INTEGRITY_GUEST_MAKE=path  makes the VM test's image there instead
#                              (cryptsetup, then ext4 inside with mke2fs)
# Prints the probe's INTEGRITY_GUEST lines; exits 0 on "INTEGRITY_GUEST OK"
# (or "INTEGRITY_GUEST MADE").
set -eu
cd "$(dirname "$0")/.."
. scripts/probe-env.sh

cargo build -q -p crust-agent --example integrity_guest
cargo build -q -p crust-vm

truncate -s 64M "$WORK/disk.img"
"$T/crust-vm" initrd --agent "$T/examples/integrity_guest" --kernel-root "$BUILD/kernel" --version "$VER" \
    --modules virtio_pci,virtio_blk,dm_mod,dm_crypt,dm_integrity,authenc,xts,aesni_intel,af_alg,algif_skcipher,algif_aead,algif_hash \
    --out "$WORK/initrd.img" >/dev/null
# cryptsetup and what it links, at their own paths.
mkdir -p "$WORK/extra/usr/sbin"
cp /usr/sbin/cryptsetup /usr/sbin/mke2fs "$WORK/extra/usr/sbin/"
for lib in $(ldd /usr/sbin/cryptsetup /usr/sbin/mke2fs | grep -o '/[^ ]*' | grep -v ':$' | sort -u); do
    mkdir -p "$WORK/extra$(dirname "$lib")"
    cp -L "$lib" "$WORK/extra$lib"
done
(cd "$WORK/extra" && find . | cpio -o -H newc --quiet) > "$WORK/extra.cpio"
# The kernel reads concatenated archives, each starting 4-byte aligned.
cp "$WORK/initrd.img" "$WORK/both.img"
truncate -s %4 "$WORK/both.img"
cat "$WORK/extra.cpio" >> "$WORK/both.img"
APPEND="console=ttyS0 panic=-1 quiet"
[ -n "${INTEGRITY_GUEST_MAKE:-}" ] && APPEND="$APPEND crust.make"
timeout 600 qemu-system-x86_64 -accel tcg -cpu max -m 768 -smp 1 -nographic -no-reboot \
    -kernel "$BUILD/vmlinuz" -initrd "$WORK/both.img" \
    -drive "file=$WORK/disk.img,if=virtio,format=raw" \
    -append "$APPEND" > "$WORK/console.log" 2>&1 || true
grep -a 'INTEGRITY_GUEST\|device-mapper:\|Buffer I/O' "$WORK/console.log" | sed 's/^.*INTEGRITY_GUEST/INTEGRITY_GUEST/'
if [ -n "${INTEGRITY_GUEST_MAKE:-}" ]; then
    grep -aq 'INTEGRITY_GUEST MADE' "$WORK/console.log"
    cp "$WORK/disk.img" "$INTEGRITY_GUEST_MAKE"
else
    grep -aq 'INTEGRITY_GUEST OK' "$WORK/console.log"
fi
