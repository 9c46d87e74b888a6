# Sourced by the scripts that boot a probe as PID 1 of a guest of its own
# (dm-guest.sh, integrity-guest.sh, mkfs-guest.sh), from the repository's
# root: where the kernel and the debug builds are, and a scratch directory
# removed on exit.
#   CRUST_BUILD=dir   where the kernel is (default: build)
BUILD=${CRUST_BUILD:-build}
VER=$(ls "$BUILD/kernel/lib/modules" | head -n1)
T=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/debug
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
