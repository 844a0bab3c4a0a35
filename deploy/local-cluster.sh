#!/usr/bin/env bash
# A local cluster (docs/deploy.md): three replicas of the release server (one engine thread
# each, the embedded default model, one shared conversation secret, a support widget) behind
# HAProxy configured from deploy/haproxy.cfg, all on loopback. It runs the cluster workload
# (`llama-relay-bench cluster`: conversations of a widget's visitors, a new connection
# every turn) three times and prints each run's figures:
#
#   1. routed by conversation (the shipped configuration): the prefix hit rate of turns 2 and later;
#   2. the same with `balance roundrobin`, for comparison;
#   3. routed by conversation while one replica is drained (SIGTERM) and another killed
#      (SIGKILL) mid-run: failed conversations, restores, replies asked again and their wait,
#      and how long the drained replica took to exit against its grace.
#
# Bounded: every process it starts is stopped on exit; about five minutes on two cores.
# Needs HAProxy (`apt-get install haproxy`).
#
#   deploy/local-cluster.sh [--users N] [--turns N] [--failure-turns N] [--max-tokens N]
#                           [--context-words N] [--drain-at S] [--kill-at S]   (S: whole seconds)
set -euo pipefail
cd "$(dirname "$0")/.."

users=24 turns=3 failure_turns=6 max_tokens=48 context_words=200 drain_at=6 kill_at=12
while [ $# -gt 0 ]; do
  case "$1" in
    --users) users=$2 ;;
    --turns) turns=$2 ;;
    --failure-turns) failure_turns=$2 ;;
    --max-tokens) max_tokens=$2 ;;
    --context-words) context_words=$2 ;;
    --drain-at) drain_at=$2 ;;
    --kill-at) kill_at=$2 ;;
    *) echo "unknown argument $1 (see the top of $0)"; exit 2 ;;
  esac
  shift 2
done

command -v haproxy >/dev/null || { echo "local-cluster: needs HAProxy (apt-get install haproxy)"; exit 1; }
cargo build --release --bin llama-relay --bin llama-relay-bench
bin=target/release/llama-relay
work=$(mktemp -d /tmp/llama-relay-cluster.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

grace=10
origin=http://shop.localhost
cat >"$work/relay.toml" <<EOF
[server]
port = 0
# Every replica seals with the same secret, so a transcript restores on any of them.
conversation_secret = "local-cluster-secret-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
# Every client reaches a replica from the proxy's address.
max_connections_per_address = 5000
shutdown_grace_s = $grace
[engine]
threads = 1
[[tenants]]
name = "shop"
[[tenants.widgets]]
id = "help"
origins = ["$origin"]
system_prompt = "You are the shop's support assistant."
EOF

# Starts replica $1; sets $addr and $pid.
start_replica() {
  local log="$work/relay$1.log"
  RUST_LOG=warn,llama_relay=info,llama_relay::server::session=warn "$bin" --config "$work/relay.toml" serve >"$log" 2>&1 &
  pid=$!
  pids+=("$pid")
  addr=""
  for _ in $(seq 600); do
    addr=$(sed -n 's/.*the chat page is at http:\/\/\([0-9.:]*\)\/.*/\1/p' "$log" | head -1)
    [ -n "$addr" ] && curl -sf "http://$addr/health/ready" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  cat "$log"
  echo "local-cluster: replica $1 did not start"
  exit 1
}

declare -a addrs rpids
for i in 1 2 3; do
  start_replica "$i"
  addrs[$i]=$addr
  rpids[$i]=$pid
done
proxy_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

# HAProxy from the shipped configuration: these replicas, this port, and $1 as the balance line.
haproxy_pid=""
start_proxy() {
  local cfg="$work/haproxy-$2.cfg"
  sed -e "s|bind 127.0.0.1:8080|bind 127.0.0.1:$proxy_port|" \
      -e "s|^    balance hash var(txn.conversation)|    $1|" \
      -e '/^    server relay[0-9]/d' deploy/haproxy.cfg >"$cfg"
  for i in 1 2 3; do echo "    server relay$i ${addrs[$i]}" >>"$cfg"; done
  haproxy -c -q -f "$cfg"
  haproxy -db -f "$cfg" >"$work/haproxy-$2.log" 2>&1 &
  haproxy_pid=$!
  pids+=("$haproxy_pid")
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$proxy_port/health/ready" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "local-cluster: HAProxy did not start"; cat "$work/haproxy-$2.log"; exit 1
}
stop_proxy() { kill "$haproxy_pid" 2>/dev/null || true; wait "$haproxy_pid" 2>/dev/null || true; }

bench() {
  target/release/llama-relay-bench cluster --url "ws://127.0.0.1:$proxy_port/ws" --widget help "$origin" \
    --users "$users" --max-tokens "$max_tokens" --prompt-words "$context_words" --think-ms 500 "$@"
}

echo "local-cluster: replicas ${addrs[1]} ${addrs[2]} ${addrs[3]} (one engine thread each), HAProxy on 127.0.0.1:$proxy_port, logs in $work"
status=0

start_proxy "balance hash var(txn.conversation)" hash
bench --turns "$turns" --label "conversation hash" | tee -a "$work/figures" || status=1
stop_proxy

start_proxy "balance roundrobin" roundrobin
bench --turns "$turns" --label "round-robin" | tee -a "$work/figures" || status=1
stop_proxy

# Routed by conversation; replica 1 drains at --drain-at s, replica 2 dies at --kill-at s.
start_proxy "balance hash var(txn.conversation)" failures
bench --turns "$failure_turns" --label "drain relay1 at ${drain_at}s, SIGKILL relay2 at ${kill_at}s" \
  >"$work/failures.out" 2>&1 &
bench_pid=$!
sleep "$drain_at"
t0=$(date +%s.%N)
kill -TERM "${rpids[1]}"
(
  # The drained replica's exit (a zombie until this script reaps it counts as exited).
  while [ -e "/proc/${rpids[1]}" ] && [ "$(awk '/^State/{print $2}' "/proc/${rpids[1]}/status" 2>/dev/null)" != Z ]; do
    sleep 0.05
  done
  awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { print a - b }' >"$work/drain-exit-s"
) &
sleep $((kill_at - drain_at))
kill -KILL "${rpids[2]}"
wait "$bench_pid" || status=1
cat "$work/failures.out" | tee -a "$work/figures"
wait "${rpids[1]}" && drain_rc=0 || drain_rc=$?
printf 'drain: relay1 exited %.1f s after SIGTERM (shutdown_grace_s %d), exit status %d\n' \
  "$(cat "$work/drain-exit-s")" "$grace" "$drain_rc" | tee -a "$work/figures"
[ "$drain_rc" = 0 ] || status=1
stop_proxy

if grep -q "panicked" "$work"/relay*.log; then grep -m3 -A3 "panicked" "$work"/relay*.log; status=1; fi
echo "local-cluster: exit $status (figures and logs in $work)"
exit $status
