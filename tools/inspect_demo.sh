#!/usr/bin/env bash
# Start `shmslots demo` in the background, inspect its table mid-run, then let it finish.
# Usage (inside the project's virtualenv): bash tools/inspect_demo.sh [inspect args...]
set -euo pipefail
log=$(mktemp)
shmslots demo --requests 200000 > "$log" 2>&1 &
demo=$!
# On an error or Ctrl-C stop the demo; a normal run waits for it to finish below.
trap 'kill "$demo" 2>/dev/null || true; wait "$demo" 2>/dev/null || true; rm -f "$log"' EXIT
name=""
for _ in $(seq 300); do
    name=$(grep -o 'shmslots-flow-[0-9-]*' "$log" | head -n 1 || true)
    [ -n "$name" ] && break
    sleep 0.1
done
[ -n "$name" ] || { echo "the demo did not print its table's name" >&2; cat "$log" >&2; exit 1; }
for _ in $(seq 600); do  # the workers start (each loads torch), then rows flow
    shmslots metrics "$name" 2>/dev/null | grep -q '^shmslots_takes_total{.*} [1-9]' && break
    sleep 0.1
done
sleep 2  # let the traffic settle
COLUMNS=${COLUMNS:-110} shmslots inspect "$name" "$@" || true
wait "$demo" || { echo "the demo failed:" >&2; cat "$log" >&2; exit 1; }
tail -n 2 "$log"  # the demo's own last words: what happened, what to try
