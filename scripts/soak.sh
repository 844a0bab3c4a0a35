#!/usr/bin/env bash
# The soak (#13): starts the release server on loopback with the default model and settings (the
# per-address cap raised: every soak client comes from 127.0.0.1), runs `llama-relay-bench soak`
# against it, and checks that the server neither panicked nor died. Bounded: it runs for
# --minutes (default 30), plus start-up.
#
#   scripts/soak.sh [--minutes M] [--sessions N] [--active N] [--wave-s S] ...
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bin llama-relay --bin llama-relay-bench
bin=target/release/llama-relay
log=$(mktemp /tmp/llama-relay-soak.XXXXXX.log)
LLAMA_RELAY__SERVER__PORT=0 LLAMA_RELAY__SERVER__MAX_CONNECTIONS_PER_ADDRESS=5000 \
  RUST_LOG=warn,llama_relay=info,llama_relay::server::session=warn,llama_relay::server::openai=warn "$bin" serve >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
addr=""
for _ in $(seq 600); do
  addr=$(sed -n 's/.*the chat page is at http:\/\/\([0-9.:]*\)\/.*/\1/p' "$log" | head -1)
  [ -n "$addr" ] && curl -sf "http://$addr/health" >/dev/null 2>&1 && break
  sleep 0.1
done
[ -n "$addr" ] || { cat "$log"; echo "soak: the server did not start"; exit 1; }
echo "soak: server pid $pid on $addr, log $log"
status=0
target/release/llama-relay-bench soak --url "ws://$addr/ws" --server-pid "$pid" "$@" || status=$?
if ! kill -0 "$pid" 2>/dev/null; then echo "soak: the server died"; status=1; fi
if grep -q "panicked" "$log"; then grep -m3 -A3 "panicked" "$log"; echo "soak: the server panicked"; status=1; fi
kill -TERM "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
echo "soak: exit $status (server log: $log)"
exit $status
