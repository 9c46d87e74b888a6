#!/bin/sh
# fuzz/run.sh SECS [TARGET...]: builds the fuzz targets with libFuzzer and
# coverage instrumentation, then runs each (all of fuzz_targets/ by default)
# for SECS seconds, one after the other, at the lowest CPU priority. Fails if
# any target finds a crash, a hang (an input running over 10 s) or an
# allocation over 32 MiB (crust_fuzz::Bounded).
#
# Stable rustc suffices: SanitizerCoverage is a stable codegen pass (-C
# passes=sancov-module plus LLVM options), and libfuzzer-sys builds libFuzzer
# from source with the C++ compiler. These are cargo-fuzz's flags for
# `--sanitizer none`; AddressSanitizer would need nightly (-Zsanitizer), and
# the parsers fuzzed here are safe Rust.
#
# Inputs: fuzz/corpus/<target>/ (committed, read only) and
# target/fuzz/corpus/<target>/ (what libFuzzer learns; kept between runs).
# A finding lands in target/fuzz/artifacts/<target>/; once fixed, copy it into
# fuzz/corpus/<target>/ so that `cargo test -p crust-fuzz` replays it.
set -eu
cd "$(dirname "$0")/.."
secs=${1:?usage: fuzz/run.sh SECS [TARGET...]}
shift
targets=${*:-$(cd fuzz/fuzz_targets && ls *.rs | sed 's/\.rs$//')}
out=target/fuzz

# The binaries get the instrumentation; build scripts and proc-macros do not
# (the workspace names its target triple, so RUSTFLAGS stay off host code).
# No `--cfg fuzzing` (cargo-fuzz's default, which it lets one turn off): it
# would switch on dependencies' own fuzz-only code (the vendored h2's does not
# build under the workspace lints), and nothing here reads it.
RUSTFLAGS="-Cpasses=sancov-module \
 -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
 -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares \
 -Cllvm-args=-sanitizer-coverage-stack-depth \
 -Cllvm-args=-simplifycfg-branch-fold-threshold=0" \
    nice -n 19 cargo build -q -p crust-fuzz --features libfuzzer --profile fuzz \
    --target-dir "$out" --bins
bin=$out/x86_64-unknown-linux-gnu/fuzz

failed=""
for t in $targets; do
    mkdir -p "$out/corpus/$t" "$out/artifacts/$t"
    log=$out/$t.log
    echo "fuzz: $t for ${secs}s"
    if RUST_BACKTRACE=1 nice -n 19 "$bin/$t" "$out/corpus/$t" "fuzz/corpus/$t" \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$out/artifacts/$t/" -print_final_stats=1 >"$log" 2>&1; then
        # The totals, and libFuzzer's last "#N DONE cov: C ft: F corp: N/S …".
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
        cov=$(sed -n 's/.*DONE *\(cov: [0-9]* ft: [0-9]* corp: [^ ]*\).*/\1/p' "$log" | tail -1)
        echo "fuzz: $t: $runs runs, $cov"
    else
        failed="$failed $t"
        # The panic's message (a record or an answer may follow it), else the end.
        grep -a -A16 'panicked at' "$log" | grep -a -v '^ *[0-9]*: \|^ *at ' | head -24 ||
            tail -20 "$log"
        echo "fuzz: $t FAILED: the input is in $out/artifacts/$t/ (log: $log);"
        echo "      replay it with $bin/$t FILE, fix the parser, then add FILE to fuzz/corpus/$t/"
    fi
done
[ -z "$failed" ] || { echo "fuzz: findings in:$failed"; exit 1; }
