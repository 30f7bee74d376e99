#!/usr/bin/env bash
# Start `shmslots demo` in the background, inspect its table mid-run, then let it finish.
# Usage (inside the project's virtualenv): bash tools/inspect_demo.sh [inspect args...]
set -euo pipefail
shmslots demo --requests 200000 > /dev/null 2>&1 &
demo=$!
trap 'kill "$demo" 2>/dev/null || true; wait "$demo" 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    name=$(ls /dev/shm | grep '^shmslots-flow-' | head -n 1 || true)
    [ -n "$name" ] && break
    sleep 0.1
done
[ -n "$name" ] || { echo "the demo's table did not appear" >&2; exit 1; }
sleep 3  # let the workers attach and the traffic settle
COLUMNS=${COLUMNS:-110} shmslots inspect "$name" "$@" || true
