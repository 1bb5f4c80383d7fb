#!/bin/sh
# run_fake.sh BUILD_DIR [PRELOAD_LIB] - run every t_* program on the fake driver
# (optionally with PRELOAD_LIB in LD_PRELOAD); prints each program's JSON lines and
# exits non-zero if any program failed.
set -u
O=${1:?usage: run_fake.sh BUILD_DIR [PRELOAD_LIB]}
PRE=${2:-}
fail=0
for t in t_direct t_dlsym t_procaddr t_graph t_validate t_fork t_scan t_pause t_threads t_bench; do
	case $t in
	t_bench) args=20000 ;;
	*) args=12345 ;;
	esac
	# t_pause waits for a line before each of its phases 2 and 3
	if [ -n "$PRE" ]; then
		out=$(printf '\n\n' | LD_LIBRARY_PATH="$O/fakecuda" LD_PRELOAD="$PRE" "$O/tests/$t" $args)
	else
		out=$(printf '\n\n' | LD_LIBRARY_PATH="$O/fakecuda" "$O/tests/$t" $args)
	fi
	rc=$?
	printf '%s\n' "$out"
	if [ $rc -ne 0 ]; then
		echo "FAIL: $t (exit $rc)" >&2
		fail=1
	else
		echo "ok: $t" >&2
	fi
done
exit $fail
