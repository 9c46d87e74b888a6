#!/bin/bash
# make demo: boots a sandbox VM with crust-agent as PID 1, hot-plugs an ext4
# and an xfs disk, a raw block volume's disk, a disk trimmed on a schedule and a blank disk made an
# encrypted (LUKS2) volume in the guest, and walks through every
# operation with crustctl (an idmapped bind for a user-namespace pod among them), showing
# what each answers and how long it took. Then shuts the guest down and checks
# the disks on the host. Needs root (loop mounts prepare the disk images).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=target/x86_64-unknown-linux-gnu/release
DEMO=build/demo
CRUSTCTL="$BIN/crustctl"
CRUSTVM="$BIN/crust-vm"
CRUSTD="$BIN/crustd"
CRUSTDCTL="$BIN/crustd-ctl"

bold=$'\e[1m' dim=$'\e[2m' green=$'\e[32m' red=$'\e[31m' off=$'\e[0m'
[ -t 1 ] || { bold='' dim='' green='' red='' off=''; }

section() { printf '\n%s== %s%s\n' "$bold" "$*" "$off"; }
# run CMD...: prints the command, its output, and how long it took.
run() {
    printf '%s$ %s%s\n' "$dim" "${*/#$BIN\//}" "$off"
    local t0 t1 rc=0
    t0=$(date +%s%N)
    "$@" 2>&1 | sed 's/^/  /' || rc=${PIPESTATUS[0]}
    t1=$(date +%s%N)
    printf '  %s(%d ms, exit %d)%s\n' "$dim" $(((t1 - t0) / 1000000)) "$rc" "$off"
    return 0
}
ctl() { run "$CRUSTCTL" --addr "$ADDR" "$@"; }

cleanup() {
    "$CRUSTVM" down --dir "$DEMO/vm" >/dev/null 2>&1 || true
    "$CRUSTVM" down --dir "$DEMO/sandboxes/pod-demo" >/dev/null 2>&1 || true
    [ -n "${CRUSTD_PID:-}" ] && kill "$CRUSTD_PID" 2>/dev/null && wait "$CRUSTD_PID" 2>/dev/null
    for l in ${LOOPS:-}; do losetup -d "$l" 2>/dev/null; done
    for m in "$DEMO"/mnt-*; do mountpoint -q "$m" 2>/dev/null && umount "$m"; done
    return 0
}
trap cleanup EXIT

# Two disk images, made on the host with content owned by someone else (uid/gid 1234, mode 0700/0600).
make_image() { # file fs mib
    local img=$1 fs=$2 mib=$3 m="$DEMO/mnt-$2"
    rm -f "$img"; truncate -s "${mib}M" "$img"
    if [ "$fs" = ext4 ]; then mkfs.ext4 -q -F "$img"; else mkfs.xfs -q -f "$img"; fi
    mkdir -p "$m"; mount -o loop "$img" "$m"
    mkdir -p "$m/app/logs" "$m/app/data"
    for i in $(seq 1 200); do echo "record $i" > "$m/app/data/r$i"; done
    echo "hello from the host" > "$m/app/README"
    chown -R 1234:1234 "$m/app"; chmod -R go-rwx "$m/app"
    umount "$m"
}

section "Preparing: two disk images on the host (ext4 256 MiB, xfs 512 MiB), owned by uid/gid 1234"
cleanup
rm -rf "$DEMO"; mkdir -p "$DEMO"
make_image "$DEMO/ext4.img" ext4 256
make_image "$DEMO/xfs.img" xfs 512
# A raw disk for a block volume (volumeMode: Block): no filesystem, 8 MiB of random bytes.
truncate -s 64M "$DEMO/raw.img"
dd if=/dev/urandom of="$DEMO/raw.img" bs=1M count=8 conv=notrunc status=none
raw_sha=$(sha256sum "$DEMO/raw.img" | cut -d' ' -f1)
ls -l "$DEMO"/*.img | sed 's/^/  /'

section "Booting the sandbox: QEMU + vhost-user-vsock, the agent is /init ($(stat -c %s build/initrd.img) byte initrd)"
t0=$(date +%s%N)
ADDR=$("$CRUSTVM" up --dir "$DEMO/vm")
printf '  agent answering at %s after %d ms (wall clock, QEMU start to first answer)\n' "$ADDR" $((($(date +%s%N) - t0) / 1000000))
ctl info
ctl capabilities
ctl filesystems

section "Publish by serial before the disk exists: the agent waits for the hot-plug"
(
    sleep 1
    t=$(date +%s%N)
    "$CRUSTVM" hotplug --dir "$DEMO/vm" --image "$DEMO/ext4.img" --serial vol-ext4-0001
    echo "$t" > "$DEMO/plugged_at"
) &
ctl publish pvc-ext4 --serial vol-ext4-0001 --fs-type ext4 -o noatime --fs-group 2000 --wait 30
wait
done_at=$(date +%s%N)
printf '  hot-plug (QMP device_add) to publish complete: %d ms\n' $(((done_at - $(cat "$DEMO/plugged_at")) / 1000000))

section "Hot-plug the xfs disk, then publish it with fsGroup OnRootMismatch"
run "$CRUSTVM" hotplug --dir "$DEMO/vm" --image "$DEMO/xfs.img" --serial vol-xfs-0002
echo "  asking for the wrong filesystem is refused, and the disk is never written to:"
ctl publish pvc-xfs --serial vol-xfs-0002 --fs-type ext4
ctl publish pvc-xfs --serial vol-xfs-0002 --fs-type xfs --fs-group 2000 --fs-group-policy on-root-mismatch
echo "  the same request again is idempotent:"
ctl publish pvc-xfs --serial vol-xfs-0002 --fs-type xfs --fs-group 2000 --fs-group-policy on-root-mismatch
echo "  the same id with other parameters is refused:"
ctl publish pvc-xfs --serial vol-xfs-0002 --fs-type xfs --read-only
echo "  the same disk under a second volume id is refused:"
ctl publish pvc-twin --serial vol-xfs-0002 --fs-type xfs
echo "  a serial that never appears:"
ctl publish pvc-ghost --serial vol-missing --fs-type ext4 --wait 1
ctl list

section "Usage and health"
ctl stats pvc-ext4
ctl stats pvc-xfs

section "Online growth: the host grows the disks (block_resize), ExpandVolume right after"
run "$CRUSTVM" resize --dir "$DEMO/vm" --serial vol-ext4-0001 --bytes $((1024 << 20))
ctl expand pvc-ext4 --bytes 1G --wait 30
run "$CRUSTVM" resize --dir "$DEMO/vm" --serial vol-xfs-0002 --bytes $((2048 << 20))
ctl expand pvc-xfs --bytes 2G --wait 30
echo "  more than the disk has:"
ctl expand pvc-xfs --bytes 8G --wait 1
ctl stats pvc-ext4
ctl stats pvc-xfs

# freeze_id VOL... [FLAGS]: a freeze's id, as a backup tool keeps it (crustctl
# prints the id alone on stdout, what it means on stderr).
freeze_id() {
    printf '%s$ ID=$(crustctl freeze %s)%s\n' "$dim" "$*" "$off" >&2
    local id
    id=$("$CRUSTCTL" --addr "$ADDR" freeze "$@" 2>/dev/null) || true
    printf '  %s\n' "${id:-(refused)}" >&2
    echo "$id"
}

section "A consistent snapshot, the way a backup tool takes one: freeze (a lease: it has an id), copy the disk on the host, thaw by that id"
ID=$(freeze_id pvc-ext4 pvc-xfs --thaw-after 60)
ctl list
echo "  while frozen, what writes is refused, naming the freeze:"
ctl expand pvc-ext4 --bytes 1G --wait 1
run cp --sparse=always "$DEMO/ext4.img" "$DEMO/ext4.snap"
ctl thaw "$ID"
echo "  the copy needs no journal replay and is clean:"
dumpe2fs -h "$DEMO/ext4.snap" 2>/dev/null | grep '^Filesystem features' | sed 's/^/  /'
run e2fsck -f -n "$DEMO/ext4.snap"
echo "  a freeze nobody thaws ends by itself; its late thaw says so (ABORTED), and ends"
echo "  nothing of the next backup's freeze of the same volume:"
OLD=$(freeze_id pvc-xfs --thaw-after 1)
sleep 2
NEW=$(freeze_id pvc-xfs --thaw-after 60)
ctl thaw "$OLD"
ctl list
ctl thaw "$NEW"
echo "  your own id makes a retried freeze idempotent; an operator's forced thaw ends"
echo "  whatever holds a volume, and the freeze it ended hears so:"
ctl freeze pvc-ext4 --freeze-id demo:nightly.1
ctl freeze pvc-ext4 --freeze-id demo:nightly.1
ctl thaw --force pvc-ext4
ctl thaw demo:nightly.1

section "Free space back to the host (FITRIM; the hot-plug asked QEMU for discard=unmap), and CSI 1.13 health"
printf '  ext4.img holds %s KiB on the host\n' "$(du -k "$DEMO/ext4.img" | cut -f1)"
ctl trim pvc-ext4
printf '  ext4.img holds %s KiB on the host\n' "$(du -k "$DEMO/ext4.img" | cut -f1)"
ctl health pvc-ext4
ctl health pvc-ghost

section "Trim on a schedule: freed blocks go back to the host without anyone asking"
# An image whose filesystem had a 64 MiB file, deleted on the host: the blocks are free in
# ext4 but still held in the host's sparse image.
truncate -s 128M "$DEMO/sched.img"; mkfs.ext4 -q -F "$DEMO/sched.img"
mount -o loop "$DEMO/sched.img" "$DEMO/mnt-ext4"
dd if=/dev/urandom of="$DEMO/mnt-ext4/big" bs=1M count=64 status=none; sync; rm "$DEMO/mnt-ext4/big"
umount "$DEMO/mnt-ext4"
run "$CRUSTVM" hotplug --dir "$DEMO/vm" --image "$DEMO/sched.img" --serial vol-sched-0005
ctl publish pvc-sched --serial vol-sched-0005 --fs-type ext4 --trim-every 10s
printf '  sched.img holds %s KiB on the host; no trim is asked for from here on\n' "$(du -k "$DEMO/sched.img" | cut -f1)"
for _ in $(seq 1 30); do
    "$CRUSTCTL" --addr "$ADDR" --json list 2>/dev/null | grep -q '"lastUnixMs":"[1-9]' && break
    sleep 1
done
ctl list
printf '  sched.img holds %s KiB on the host\n' "$(du -k "$DEMO/sched.img" | cut -f1)"
ctl unpublish pvc-sched

section "Surfacing volumes to containers: a subpath, read-only, recursively read-only"
ctl bind pvc-ext4 /run/crust/pods/web/data --subpath app/data --read-only --recursive-read-only enabled
ctl bind pvc-xfs /run/crust/pods/web/logs --subpath app/logs
ctl bind pvc-xfs /run/crust/pods/web/escape --subpath app/../.. --read-only
ctl bind pvc-xfs /run/crust/pods/web/ro --read-only --recursive-read-only if-possible
echo "  for a pod in a user namespace (KEP-127, hostUsers: false) whose uid 0 is the host's 100000: an idmapped bind,"
echo "  so files the pod writes as its root land on disk as root, and the data's owner (1234) is the pod's 1234:"
ctl bind pvc-xfs /run/crust/pods/userns/logs --subpath app/logs --uid-map 0:100000:65536 --gid-map 0:100000:65536
echo "  mappings that overlap are refused, and nothing is bound:"
ctl bind pvc-xfs /run/crust/pods/userns/bad --uid-map 0:100000:65536 --uid-map 100:300000:10 --gid-map 0:100000:65536
ctl list
ctl --json list
ctl unmount /run/crust/pods/web/ro
ctl unmount /run/crust/pods/web/ro

section "A raw block volume (KEP-565 volumeMode: Block): the disk itself, never read or written by the agent"
run "$CRUSTVM" hotplug --dir "$DEMO/vm" --image "$DEMO/raw.img" --serial vol-raw-0003
echo "  read-only for real: the kernel's device flag (BLKROSET), not a mount flag, which does not stop writes to a device:"
ctl publish pvc-raw --serial vol-raw-0003 --block --read-only
ctl bind pvc-raw /run/crust/pods/db/volumeDevices/raw --read-only
ctl list
echo "  a pod in a user namespace cannot use a block volume (KEP-127): an idmapped bind of one is refused:"
ctl bind pvc-raw /run/crust/pods/userns/dev --uid-map 0:100000:65536 --gid-map 0:100000:65536
ctl stats pvc-raw
echo "  a block volume has no filesystem to name, and its disk is not a filesystem volume's too:"
ctl publish pvc-raw2 --serial vol-raw-0003 --block -o noatime
ctl publish pvc-raw-fs --serial vol-raw-0003 --fs-type ext4
ctl unpublish pvc-raw
echo "  read-write, grown by the host; a read-only bind of a read-write block volume is refused:"
ctl publish pvc-raw --serial vol-raw-0003 --block
ctl bind pvc-raw /run/crust/pods/db/volumeDevices/raw --read-only
ctl bind pvc-raw /run/crust/pods/db/volumeDevices/raw
run "$CRUSTVM" resize --dir "$DEMO/vm" --serial vol-raw-0003 --bytes $((128 << 20))
ctl expand pvc-raw --bytes 128M --wait 30
ctl --json list
ctl unpublish pvc-raw

section "An encrypted volume (LUKS2): a blank disk made and opened in the guest; the host holds only ciphertext"
truncate -s 128M "$DEMO/enc.img"; printf 'the demo passphrase' > "$DEMO/enc.pass"; printf 'not it' > "$DEMO/wrong.pass"
run "$CRUSTVM" hotplug --dir "$DEMO/vm" --image "$DEMO/enc.img" --serial vol-enc-0004
echo "  blank at every offset checked, so the agent writes a LUKS2 header (Argon2id, aes-xts-plain64, 512-bit key), maps it with dm-crypt and makes ext4 inside:"
ctl publish pvc-enc --serial vol-enc-0004 --fs-type ext4 --fs-group 2000 --encryption luks2 --key-file "$DEMO/enc.pass" --format-if-blank
ctl bind pvc-enc /run/crust/pods/vault/data
ctl list
echo "  trim would tell the host which blocks are free: refused unless the publish allowed discards:"
ctl trim pvc-enc
echo "  grown by the host: the disk, then the mapping, then ext4, online:"
run "$CRUSTVM" resize --dir "$DEMO/vm" --serial vol-enc-0004 --bytes $((256 << 20))
ctl expand pvc-enc --bytes 256M --wait 30
ctl unpublish pvc-enc
echo "  a wrong key: PERMISSION_DENIED, nothing left open; the right one opens it again (no format: it is a LUKS2 volume now):"
ctl publish pvc-enc --serial vol-enc-0004 --fs-type ext4 --encryption luks2 --key-file "$DEMO/wrong.pass"
ctl publish pvc-enc --serial vol-enc-0004 --fs-type ext4 --encryption luks2 --key-file "$DEMO/enc.pass"
ctl unpublish pvc-enc

section "Unpublish the ext4 volume (its bind goes with it); Shutdown takes care of the xfs one"
ctl unpublish pvc-ext4
ctl unpublish pvc-ext4
ctl info
run "$CRUSTVM" down --dir "$DEMO/vm"

section "Back on the host: the filesystems are clean, grown, and carry the pod's group"
run e2fsck -f -n "$DEMO/ext4.img"
run sh -c "xfs_repair -n -f $DEMO/xfs.img 2>&1 | grep -v 'host filesystem geometry\|sector size mismatch\|image and the host\|agno =' | tail -4"
for fs in ext4 xfs; do
    m="$DEMO/mnt-$fs"
    mount -o loop,ro "$DEMO/$fs.img" "$m"
    printf '  %s: %s, %s\n' "$fs" "$(df -h --output=size "$m" | tail -1 | tr -d ' ') in all" \
        "$(stat -c '%n %u:%g %A' "$m/app/data" "$m/app/README" | sed "s|$m/||" | paste -sd ';' | sed 's/;/, /')"
    umount "$m"
done
echo "  enc.img: what the host sees of the encrypted volume (cryptsetup, the standard tool, opens the agent's header):"
run sh -c "cryptsetup luksDump $DEMO/enc.img | grep -E '^(Version|Label)|cipher:|PBKDF:|Memory:|Keyslots:|Data segments:' "
run cryptsetup open --test-passphrase --key-file "$DEMO/enc.pass" "$DEMO/enc.img"
if grep -aq 'lost+found' "$DEMO/enc.img"; then
    printf '  %senc.img holds plaintext%s\n' "$red" "$off"
else
    printf '  enc.img: no plaintext directory entry anywhere in its 256 MiB (ext4 inside it has lost+found)\n'
fi
now_sha=$(head -c $((64 << 20)) "$DEMO/raw.img" | sha256sum | cut -d' ' -f1)
if [ "$now_sha" = "$raw_sha" ]; then
    printf '  raw.img: sha256 of its first 64 MiB unchanged (%s…): the agent never touched the block volume\n' "${raw_sha:0:16}"
else
    printf '  %sraw.img changed%s: %s → %s\n' "$red" "$off" "$raw_sha" "$now_sha"
fi

# ---------------------------------------------------------------------------
# What kubelet sees: KEP-2857's RuntimeAssistedStorageManagement on crustd's
# unix socket. crustd finds the sandbox in its registry (crust-vm up wrote
# DIR/pod-demo/sandbox.json), hot-plugs the host's block device over QMP and
# has the agent mount it. crustd-ctl sends what kubelet would send.
SOCK="$DEMO/crustd.sock"
DV="$DEMO/direct-volumes"
kubelet() { run "$CRUSTDCTL" --socket "$SOCK" --direct-volumes "$DV" "$@"; }
start_crustd() {
    "$CRUSTD" --socket "$SOCK" --sandboxes "$DEMO/sandboxes" --direct-volumes "$DV" 2>>"$DEMO/crustd.log" &
    CRUSTD_PID=$!
    while [ ! -S "$SOCK" ]; do sleep 0.05; done
}

section "What kubelet sees: a sandbox registered by crust-vm up, crustd serving CRUST on $SOCK"
make_image "$DEMO/k-ext4.img" ext4 256
make_image "$DEMO/k-xfs.img" xfs 512
E=$(losetup --find --show "$DEMO/k-ext4.img"); X=$(losetup --find --show "$DEMO/k-xfs.img"); LOOPS="$E $X"
echo "  host volumes (loop devices, as a CSI node plugin would attach them): $E (ext4), $X (xfs)"
"$CRUSTVM" up --dir "$DEMO/sandboxes/pod-demo" >/dev/null
run cat "$DEMO/sandboxes/pod-demo/sandbox.json"
start_crustd
kubelet capabilities
kubelet filesystems

section "RuntimePublishVolume: hot-plug + mount + fsGroup in one call"
kubelet publish pod-demo "$E" --fs ext4 -o noatime --fs-group 3000 --target /var/lib/kubelet/pods/uid/volumes/kubernetes.io~csi/pvc-e/mount
kubelet publish pod-demo "$X" --fs xfs --fs-group 3000 --fs-group-policy OnRootMismatch
echo "  again: idempotent, nothing plugged twice:"
kubelet publish pod-demo "$E" --fs ext4 -o noatime --fs-group 3000
echo "  what the guest has now (crustctl straight to the agent):"
run "$CRUSTCTL" --addr "$(sed 's/.*"agent":"\([^"]*\)".*/\1/' "$DEMO/sandboxes/pod-demo/sandbox.json")" list
echo "  a raw block volume (volumeMode: Block): hot-plugged and published as a device, never mounted:"
run truncate -s 64M "$DEMO/k-raw.img"
R=$(losetup --find --show "$DEMO/k-raw.img"); LOOPS="$LOOPS $R"
kubelet publish pod-demo "$R" --block
kubelet stats pod-demo "$R"
kubelet unpublish pod-demo "$R"
echo "  refusals, each with its code:"
kubelet publish pod-demo "$R" --block --fs ext4
kubelet publish pod-gone "$E" --fs ext4
kubelet publish pod-demo dev/loop0 --fs ext4
kubelet publish pod-demo "$PWD/$DEMO/k-ext4.img" --fs ext4

section "RuntimeGetVolumeStats"
kubelet stats pod-demo "$E"

section "crustd restarted between two calls carries on (its state: $DEMO/sandboxes/pod-demo/crustd.json)"
kill "$CRUSTD_PID"; wait "$CRUSTD_PID" 2>/dev/null || true
start_crustd
kubelet stats pod-demo "$X"

section "RuntimeExpandVolume: the host grows the device, crustd resizes QEMU's disk, the agent grows ext4"
run truncate -s 1G "$DEMO/k-ext4.img"
run losetup -c "$E"
kubelet expand pod-demo "$E" --bytes $((1024 << 20))
kubelet expand pod-demo "$E" --bytes $((4096 << 20))
kubelet stats pod-demo "$E"

section "A consistent snapshot through crustd (RuntimeFreezeVolumes across the pod's volumes, all or none), then trim and health"
# The group is a lease: its id (the caller's own here, new for each run) thaws it.
G="demo-snapshot-$(date +%s%N)"
kubelet freeze "pod-demo:$E" "pod-demo:$X" --thaw-after 30 --freeze-id "$G"
run cp --sparse=always "$DEMO/k-ext4.img" "$DEMO/k-ext4.snap"
kubelet thaw "$G"
run e2fsck -f -n "$DEMO/k-ext4.snap"
kubelet trim pod-demo "$E"
kubelet health pod-demo "$E"

section "RuntimeUnpublishVolume: unmount, device_del, DEVICE_DELETED, blockdev-del"
kubelet unpublish pod-demo "$X"
kubelet unpublish pod-demo "$X"
kubelet unpublish pod-demo "$E"
kubelet stats pod-demo "$E"

section "A direct volume: the record a CSI driver writes for Kata (Azure Disk, Alibaba, csi-kata-directvolume), published by crustd"
make_image "$DEMO/k-direct.img" ext4 256
D=$(losetup --find --show "$DEMO/k-direct.img"); LOOPS="$LOOPS $D"
VP=/var/lib/kubelet/pods/demo-uid/volumes/kubernetes.io~csi/pvc-direct/mount
echo "  the driver files its record (kata-runtime direct-volume add's verb and flags):"
kubelet direct-volume add --volume-path "$VP" --mount-info "{\"volume-type\":\"directvol\",\"device\":\"$D\",\"fstype\":\"ext4\",\"metadata\":{\"fsGroup\":\"3000\",\"fsGroupChangePolicy\":\"OnRootMismatch\"},\"options\":[\"noatime\"]}"
run sh -c "find $DV -printf '%m %p\\n' | sort"
echo "  the runtime publishes it (record read and checked, hot-plug, mount, fsGroup; then the sandbox-id file):"
kubelet publish-direct pod-demo --volume-path "$VP"
run sh -c "ls $DV/*/"
kubelet direct-volume stats --volume-path "$VP"
run truncate -s 512M "$DEMO/k-direct.img"
run losetup -c "$D"
kubelet direct-volume resize --volume-path "$VP" --size $((512 << 20))
kubelet direct-volume stats --volume-path "$VP"
echo "  hostile records are refused before anything is plugged, each with its code:"
kubelet direct-volume add --volume-path /demo/encrypted --mount-info "{\"volume-type\":\"directvol\",\"device\":\"$X\",\"fstype\":\"xfs\",\"metadata\":{\"encryptionKey\":\"c2VjcmV0\"}}"
kubelet publish-direct pod-demo --volume-path /demo/encrypted
kubelet direct-volume add --volume-path /demo/root-disk --mount-info "{\"volume-type\":\"block\",\"device\":\"$(findmnt -no SOURCE / 2>/dev/null || echo /dev/sda)\",\"fstype\":\"ext4\"}"
kubelet publish-direct pod-demo --volume-path /demo/root-disk
kubelet direct-volume add --volume-path /demo/panic --mount-info "{\"volume-type\":\"directvol\",\"device\":\"$X\",\"fstype\":\"xfs\",\"options\":[\"errors=panic\"]}"
kubelet publish-direct pod-demo --volume-path /demo/panic
kubelet publish-direct pod-demo --volume-path /demo/never-filed
echo "  createFilesystem: a blank scratch disk is formatted on the host (the guest never formats); a disk holding anything else is left alone:"
run truncate -s 64M "$DEMO/k-scratch.img"
S=$(losetup --find --show "$DEMO/k-scratch.img"); LOOPS="$LOOPS $S"
kubelet direct-volume add --volume-path /demo/scratch --mount-info "{\"volume-type\":\"directvol\",\"device\":\"$S\",\"fstype\":\"ext4\",\"metadata\":{\"createFilesystem\":\"true\"}}"
kubelet publish-direct pod-demo --volume-path /demo/scratch
run blkid -p -s TYPE "$S"
kubelet direct-volume add --volume-path /demo/not-blank --mount-info "{\"volume-type\":\"directvol\",\"device\":\"$X\",\"fstype\":\"ext4\",\"metadata\":{\"createFilesystem\":\"true\"}}"
kubelet publish-direct pod-demo --volume-path /demo/not-blank
echo "  unpublish with the record's device; the sandbox-id file goes, the driver's record stays:"
kubelet unpublish pod-demo "$D"
kubelet unpublish pod-demo "$S"
kubelet direct-volume stats --volume-path "$VP"
kubelet direct-volume remove --volume-path "$VP"
if PYTHONPATH=build/py python3 -c 'import grpc' 2>/dev/null; then
    echo "  any gRPC client, not only Go's: Python's grpcio on a default channel (it sends the socket's path as :authority):"
    run env PYTHONPATH=build/py python3 -c "import grpc; c = grpc.insecure_channel('unix://$PWD/$SOCK'); print(c.unary_unary('/crust.runtime.v1alpha1.RuntimeAssistedStorageManagement/RuntimeGetSupportedFileSystems')(b''))"
fi
echo "  crustd's log, one line per call:"
tail -6 "$DEMO/crustd.log" | sed 's/^/  /'
kill "$CRUSTD_PID"; wait "$CRUSTD_PID" 2>/dev/null || true; CRUSTD_PID=
run "$CRUSTVM" down --dir "$DEMO/sandboxes/pod-demo"
run e2fsck -f -n "$E"
run e2fsck -f -n "$D"
run sh -c "xfs_repair -n $X 2>&1 | tail -2"

printf '\n%sdone%s: every operation ran against the agent as PID 1 in a real VM, and through crustd as kubelet sends it.\n' "$green" "$off"
