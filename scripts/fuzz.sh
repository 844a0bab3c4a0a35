#!/usr/bin/env bash
# Coverage-guided fuzzing with libFuzzer on the stable toolchain (cargo-fuzz needs nightly only
# for its sanitizers; the coverage instrumentation is stable rustc flags, used here directly).
#
#   scripts/fuzz.sh [RUNS] [TARGET...]     RUNS executions per target (default 1000000)
#
# Targets: client_frame, chat_template, detokenizer, realtime, native (fuzz/fuzz_targets/). Each run starts from
# fuzz/corpus/TARGET and fuzz/seeds/TARGET, and the inputs that found new coverage are merged
# (minimized) back into fuzz/corpus/TARGET, which `cargo test` replays
# (tests/integration/fuzz_corpus.rs). A crash leaves its input in fuzz/work/TARGET/ and stops
# the script: copy it into fuzz/corpus/TARGET/ once fixed, so it stays a regression test.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
runs="${1:-1000000}"
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(client_frame chat_template detokenizer realtime native)
triple="$(rustc -vV | sed -n 's/^host: //p')"
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
# --target keeps the flags off build scripts and proc-macros, as cargo-fuzz does.
cargo build --release --target "$triple" --bins
for t in "${targets[@]}"; do
  work="work/$t"
  mkdir -p "corpus/$t" "seeds/$t" "$work/new"
  start=$(date +%s)
  "target/$triple/release/$t" -runs="$runs" -max_len=4096 -timeout=10 -rss_limit_mb=4096 \
    -artifact_prefix="$work/" -print_final_stats=1 "$work/new" "corpus/$t" "seeds/$t" \
    2>"$work/log" || { tail -40 "$work/log"; echo "fuzz: $t crashed; the input is in fuzz/$work/"; exit 1; }
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log")
  echo "fuzz: $t: ${execs} executions in $(( $(date +%s) - start )) s, no crash"
  # Keep the smallest set of inputs that covers what all of them cover.
  mkdir -p "$work/merged"
  "target/$triple/release/$t" -merge=1 "$work/merged" "corpus/$t" "$work/new" 2>>"$work/log" >/dev/null
  rm -rf "corpus/$t" && mv "$work/merged" "corpus/$t" && rm -rf "$work/new"
  echo "fuzz: $t: corpus $(ls "corpus/$t" | wc -l) inputs"
done
