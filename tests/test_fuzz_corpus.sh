#!/bin/sh
# Replays every fuzz target's seed corpus and regression inputs (tests/fuzz/corpus/<name>,
# tests/fuzz/regress/<name>) through its harness built with the project's compiler
# (tests/fuzz/replay_<name>): a crash found and fixed once stays fixed. Not a fuzzing run.
set -u
top=${RO_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
targets=${RO_FUZZ_TARGETS:?RO_FUZZ_TARGETS is set by make check}
rc=0
for t in $targets; do
	bin=tests/fuzz/replay_$t
	corpus=$top/tests/fuzz/corpus/$t
	if [ ! -x "$bin" ]; then
		echo "FAIL $t: $bin not built"; rc=1; continue
	fi
	if [ -z "$(ls -A "$corpus" 2>/dev/null)" ]; then
		echo "FAIL $t: no seed corpus in $corpus"; rc=1; continue
	fi
	log=tests/fuzz/replay_$t.out
	if "$bin" "$corpus" "$top/tests/fuzz/regress/$t" >"$log" 2>&1; then
		echo "ok   $t: $(tail -n 1 "$log")"
	else
		echo "FAIL $t (exit $?): the last input it ran and what it said:"
		grep '^replay: ' "$log" | tail -n 1
		tail -n 40 "$log"
		rc=1
	fi
done
exit $rc
