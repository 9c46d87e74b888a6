#!/bin/sh
# Runs examples/dm_guest.rs as PID 1 of a guest of its own, with a disk that
# cryptsetup made: the device-mapper and keyring leaves alone against the
# guest kernel (docs/encryption.md; the VM tests drive them through the agent).
# Needs what `make initrd` made (build/kernel, build/vmlinuz), qemu,
# cryptsetup and python3-cryptography; as root, like `make test`.
#   CRUST_BUILD=dir   where the kernel is (default: build)
# Prints the probe's DM_GUEST lines; exits 0 on "DM_GUEST OK".
set -eu
cd "$(dirname "$0")/.."
. scripts/probe-env.sh

cargo build -q -p crust-agent --example dm_guest
cargo build -q -p crust-vm

# A LUKS2 image (4096-byte sectors) whose first two data sectors hold known
# plaintext, encrypted with the volume key cryptsetup dumps, as
# aes-xts-plain64 counts IVs for LUKS2: in 512-byte sectors (data sector 1
# has IV 8). The probe reads them back through its own mapping.
truncate -s 32M "$WORK/disk.img"
printf 'crust-test-pass' > "$WORK/pass"
cryptsetup luksFormat -q --type luks2 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 \
    --sector-size 4096 --key-file "$WORK/pass" "$WORK/disk.img"
cryptsetup luksDump --dump-volume-key --batch-mode --key-file "$WORK/pass" "$WORK/disk.img" > "$WORK/dump"
python3 - "$WORK" <<'PY'
import re, sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
work = sys.argv[1]
dump = open(f"{work}/dump").read().split("MK dump:")[1]
key = bytes.fromhex("".join(re.findall(r"\b[0-9a-f]{2}\b", dump))[:128])
assert len(key) == 64, len(key)
offset = 16 << 20  # luksFormat's default data offset for a 32 MiB disk
plain = [(p * 200)[:4096] for p in (b"CRUST-PLAINTEXT-SECTOR-0 ", b"crust-plaintext-sector-1 ")]
with open(f"{work}/disk.img", "r+b") as f:
    f.seek(offset)
    for i, p in enumerate(plain):
        e = Cipher(algorithms.AES(key), modes.XTS((i * 8).to_bytes(16, "little"))).encryptor()
        f.write(e.update(p) + e.finalize())
PY
cryptsetup luksDump "$WORK/disk.img" | grep -q 'offset: 16777216 \[bytes\]'

"$T/crust-vm" initrd --agent "$T/examples/dm_guest" --kernel-root "$BUILD/kernel" --version "$VER" \
    --modules virtio_pci,virtio_blk,dm_mod,dm_crypt,dm_zero,xts,aesni_intel --out "$WORK/initrd.img" >/dev/null
# TCG: on some hosts KVM stops at the guest's first cmpxchg16b.
timeout 300 qemu-system-x86_64 -accel tcg -cpu max -m 512 -smp 1 -nographic -no-reboot \
    -kernel "$BUILD/vmlinuz" -initrd "$WORK/initrd.img" \
    -drive "file=$WORK/disk.img,if=virtio,format=raw" \
    -append "console=ttyS0 panic=-1 quiet" > "$WORK/console.log" 2>&1 || true
grep -a 'DM_GUEST\|device-mapper:' "$WORK/console.log" | sed 's/^.*DM_GUEST/DM_GUEST/'
grep -aq 'DM_GUEST OK' "$WORK/console.log"
