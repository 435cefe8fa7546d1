#!/bin/sh
# The chaos soak at CI size (make check): three agents, a few dozen units, a dozen faults of
# every kind (tests/chaos/README.md), then the invariant checker.
# RO_CHAOS_SEED pins the schedule; RO_CHAOS_ARGS adds options (e.g. "--kinds all").
# Exit 77 (skip) when redis-server or python3 is missing, as the other suites need them too.
set -u
b=${RO_BUILDDIR:-$(pwd)}
command -v python3 >/dev/null 2>&1 || { echo "soak_ci: no python3 (mock IMDS)"; exit 77; }
seed=${RO_CHAOS_SEED:+--seed $RO_CHAOS_SEED}
# shellcheck disable=SC2086
exec "$b/tests/chaos/chaos" --check "$b/tests/chaos/check" $seed ${RO_CHAOS_ARGS:-}
