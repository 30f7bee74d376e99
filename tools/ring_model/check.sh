#!/usr/bin/env bash
# Model-check the ready ring (ring.pml) with Spin: every cast explored whole for the safety
# properties, and all but the largest for livelocks (about 40 s in all on 2 cores).  The ring-full test from before the model (-DWRAPPING_FULL_CHECK) must
# fail it: a model that cannot find the bug it found is no check.
# Needs `spin` (Debian: apt-get install spin) and gcc.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

# pan's searches: safety (assertions, blocked ends), or livelock (-DNP -l: a cycle of
# retries that no process leaves; positions only grow, so any cycle is one).  The livelock
# search leaves out cast 3, the largest (-DSAFETY_ONLY_CAST3).
verify() {  # search, spin's defines -> pan's report
    local search=$1
    shift
    spin "$@" -a "$here/ring.pml" >/dev/null
    if [ "$search" = safety ]; then
        gcc -O2 -w -DSAFETY -DCOLLAPSE -o pan pan.c  # -w: pan.c is Spin's code, not ours
        ./pan -m1000000 || true
    else
        gcc -O2 -w -DNP -DCOLLAPSE -o pan pan.c
        ./pan -m1000000 -l || true
    fi
}

for search in safety livelock; do
    defines=()
    [ $search = livelock ] && defines=(-DSAFETY_ONLY_CAST3)
    report=$(verify $search "${defines[@]}")
    stored=$(grep -o '[0-9]* states, stored' <<<"$report" || true)
    if ! grep -q 'errors: 0' <<<"$report" || grep -q 'max search depth too small' <<<"$report"; then
        echo "$report" >&2
        echo "FAIL: ring.pml, $search: a property does not hold (trail: spin -t -p ring.pml)" >&2
        exit 1
    fi
    echo "ring.pml, $search: every property holds ($stored)"
done
if grep -q 'errors: 0' <<<"$(verify safety -DWRAPPING_FULL_CHECK)"; then
    echo "FAIL: ring.pml no longer finds the wrapping ring-full check's lost rows" >&2
    exit 1
fi
echo "ring.pml with the old ring-full check: rows lost, as found"
