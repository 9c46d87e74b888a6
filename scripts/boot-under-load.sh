#!/bin/bash
# Boots the guest N times in a row (crust-vm up, then down) while the machine
# is loaded the way a busy CI runner is: a cargo build of the workspace in a
# scratch copy (CPU, memory, I/O), a dd loop writing and reading with O_DIRECT
# and fsync (I/O), and a file held in /dev/shm (memory that cannot be
# reclaimed without swap). Prints each boot's time; fails on the first boot
# that does not come up. Needs `make initrd` and a built crust-vm.
#   boot-under-load.sh [N]        (default 20)
#   LOAD=0      no load (a baseline)
#   SHM_MIB=M   the /dev/shm hog (default: half of MemAvailable less 6 GiB, at most 8 GiB)
#   KEEP=1      keep the scratch directory (console logs of every boot)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
ROOT=$PWD
if [ -z "${CRUST_VM:-}" ]; then
    cargo build -q -p crust-vm
    VM=$ROOT/target/x86_64-unknown-linux-gnu/debug/crust-vm
else
    VM=$CRUST_VM
fi
[ -f build/initrd.img ] || { echo "run make initrd first" >&2; exit 2; }

SCRATCH=$(mktemp -d /tmp/crust-boot-load.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -- -"$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ -d "$SCRATCH/vm" ] && "$VM" down --dir "$SCRATCH/vm" >/dev/null 2>&1 || true
    rm -f "/dev/shm/$(basename "$SCRATCH").hog"
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $SCRATCH"; else rm -rf "$SCRATCH"; fi
}
trap cleanup EXIT INT TERM

if [ "${LOAD:-1}" != 0 ]; then
    # CPU, memory and I/O: a full debug build of the workspace from a clean
    # copy, over and over (each its own process group, so it can be stopped).
    mkdir "$SCRATCH/src"
    git archive HEAD | tar -x -C "$SCRATCH/src"
    setsid bash -c "cd '$SCRATCH/src' && while :; do rm -rf target; \
        CARGO_TARGET_DIR='$SCRATCH/src/target' cargo build -q --workspace --all-targets >/dev/null 2>&1 || sleep 5; done" &
    PIDS+=($!)
    # I/O: direct writes and reads of 512 MiB, then buffered writes with fsync.
    setsid bash -c "while :; do \
        dd if=/dev/zero of='$SCRATCH/io' bs=1M count=512 oflag=direct status=none; \
        dd if='$SCRATCH/io' of=/dev/null bs=1M iflag=direct status=none; \
        dd if=/dev/zero of='$SCRATCH/io' bs=64k count=8192 conv=fsync status=none; done" &
    PIDS+=($!)
    # Memory: a /dev/shm file (unreclaimable without swap) leaves the page
    # cache little room, so the build and QEMU fight for it.
    avail=$(awk '/MemAvailable/{print int($2/1024)}' /proc/meminfo)
    shm=${SHM_MIB:-$(( (avail - 6144) / 2 ))}
    [ "$shm" -gt 8192 ] && [ -z "${SHM_MIB:-}" ] && shm=8192
    if [ "$shm" -gt 0 ]; then
        dd if=/dev/zero of="/dev/shm/$(basename "$SCRATCH").hog" bs=1M count="$shm" status=none
    fi
    echo "load: cargo build loop, dd I/O loop, ${shm} MiB in /dev/shm; letting it ramp up for 20 s"
    sleep 20
fi

ok=0
times=()
for i in $(seq 1 "$N"); do
    start=$(date +%s.%N)
    if ! "$VM" up --dir "$SCRATCH/vm" --kernel build/vmlinuz --initrd build/initrd.img \
            ${CRUST_VM_APPEND:+--append "$CRUST_VM_APPEND"} >"$SCRATCH/up.out" 2>&1; then
        echo "boot $i FAILED after $(echo "$(date +%s.%N) - $start" | bc) s:"
        cat "$SCRATCH/up.out"
        echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
        KEEP=1
        exit 1
    fi
    t=$(echo "$(date +%s.%N) - $start" | bc)
    times+=("$t")
    ok=$((ok + 1))
    printf 'boot %2d: up in %5.2f s, %s (load %s)\n' "$i" "$t" \
        "$(sed -n 's/^agent ready after //p' "$SCRATCH/up.out")" "$(cut -d' ' -f1 /proc/loadavg)"
    cp "$SCRATCH/vm/console.log" "$SCRATCH/console.$i.log" 2>/dev/null || true
    "$VM" down --dir "$SCRATCH/vm" >/dev/null 2>&1
done
printf '%s\n' "${times[@]}" | sort -n | awk -v n="$ok" '
    { t[NR] = $1; s += $1 }
    END { printf "%d boots, none failed: min %.2f s, median %.2f s, max %.2f s, mean %.2f s\n",
          n, t[1], t[int((NR + 1) / 2)], t[NR], s / NR }'
