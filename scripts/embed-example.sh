#!/bin/sh
# Builds and runs examples/embed.rs (the volume table as a library, no
# server) on an ext4 and an xfs loop device, as `make test` does. Root.
set -eu
cd "$(dirname "$0")/.."
cargo build -q -p crust-agent --example embed
BIN=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/debug/examples/embed
DIR=$(mktemp -d)
LOOPS=""
cleanup() {
    for l in $LOOPS; do losetup -d "$l" 2>/dev/null || true; done
    rm -rf "$DIR"
}
trap cleanup EXIT
for fs in ext4 xfs; do
    truncate -s 320M "$DIR/$fs.img"
    if [ "$fs" = ext4 ]; then mkfs.ext4 -q -F "$DIR/$fs.img"; else mkfs.xfs -q -f "$DIR/$fs.img"; fi
    L=$(losetup --find --show "$DIR/$fs.img"); LOOPS="$LOOPS $L"
    echo "== embed example, $fs on $L"
    "$BIN" "$DIR/root-$fs" "$L" "$fs"
done
