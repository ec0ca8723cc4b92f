#!/usr/bin/env bash
# Mutation audit (issue 11 item 7) with mutmut 3.8.1: one small change at a time to the code under
# test; each mutant runs only the tests that reached its function in mutmut's stats run (the pool:
# pyproject [tool.mutmut] pytest_add_cli_args_test_selection, which leaves out the slow soak). A
# surviving mutant is a bug the tests would not catch. Slow: not part of CI. Triage of the survivors: docs/mutation.md.
#   bash scripts/mutation.sh --audit                        # the committed, bounded selection (docs/mutation.md)
#   bash scripts/mutation.sh 'kvcanary.faults.accounting*'  # mutants whose name matches (mutmut globs)
#   bash scripts/mutation.sh                                # every mutant of runtime/, engines/sim/, faults/ (hours)
#   MUTATION_JOBS=2 ...   parallel mutants (default 1)      MUTATION_KEEP=1 ...  reuse mutants/ and its stats
# Results: docs/mutation.out.txt (machine, duration, one line per mutant of the selection); mutmut's tree
# is mutants/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."

# The audit selection (docs/mutation.md), by mutmut's mangled function names: fault accounting whole, the
# explicit sweep and its plan, the sweep's pass report, attribution of a row to its request, the sim pool's
# allocators. Bounded so that one job finishes on a shared 2-core machine.
AUDIT=(
  'kvcanary.faults.accounting.*'
  'kvcanary.runtime.sweep.xǁSweeperǁrun*'
  'kvcanary.runtime.sweep.xǁSweeperǁ_fill_plan*'
  'kvcanary.runtime.sweep.xǁSweeperǁpass_report*'
  'kvcanary.runtime.sweep.xǁSweeperǁpass_starts*'
  'kvcanary.runtime.attribution.xǁAttributorǁ_request*'
  'kvcanary.runtime.attribution.xǁStepLogǁ*'
  'kvcanary.runtime.attribution.x_device_rows*'
  'kvcanary.engines.sim.pool.xǁSlotAllocatorǁalloc*'
  'kvcanary.engines.sim.pool.xǁSlotAllocatorǁfree*'
  'kvcanary.engines.sim.pool.xǁSlotAllocatorǁforce_free*'
  'kvcanary.engines.sim.pool.xǁRequestTableǁalloc_row*'
  'kvcanary.engines.sim.pool.xǁRequestTableǁfree_row*'
)
if [[ "${1:-}" == "--audit" ]]; then
  shift
  set -- "${AUDIT[@]}" "$@"
fi

.venv/bin/python -c "import mutmut, sys; sys.exit(mutmut.__version__ != '3.8.1')" 2>/dev/null ||
  .venv/bin/pip install -q "mutmut==3.8.1"
# A stray top-level `tests` package in site-packages (some tools' wheels ship one) would shadow ours.
if [[ -d .venv/lib/python3.11/site-packages/tests ]]; then
  echo "kv-canary: .venv/lib/python3.11/site-packages/tests exists (shadows tests/); remove it first" >&2
  exit 2
fi

[[ "${MUTATION_KEEP:-0}" == 1 ]] || rm -rf mutants
export TRITON_INTERPRET=1
start=$(date +%s)
rc=0
.venv/bin/mutmut run --max-children "${MUTATION_JOBS:-1}" "$@" || rc=$?
took=$(( $(date +%s) - start ))
[[ $rc == 0 ]] || echo "kv-canary: mutmut run exited $rc" >&2

# `mutmut results --all true` lists every mutant of the package; keep those this run checked.
lines=$(.venv/bin/mutmut results --all true | grep -v ': not checked$' || true)
count() { grep -c ": $1\$" <<<"$lines" || true; }
total=$(grep -c ':' <<<"$lines" || true)
killed=$(count killed)
{
  echo "# mutmut 3.8.1 on $(uname -n) ($(nproc) cores, $(uname -m), shared), ${MUTATION_JOBS:-1} job(s), ${took} s;" \
       "$(date -u +%Y-%m-%dT%H:%MZ)"
  echo "# selection: ${*:-all}"
  printf '# mutants %s, killed %s, survived %s, timeout %s, suspicious %s, no tests %s, segfault %s\n' \
    "$total" "$killed" "$(count survived)" "$(count timeout)" "$(count suspicious)" "$(count 'no tests')" \
    "$(count segfault)"
  if [[ $total -gt 0 ]]; then
    echo "# killed / mutants: $(( 1000 * killed / total / 10 )).$(( 1000 * killed / total % 10 )) %"
  fi
  sed 's/^ *//' <<<"$lines" | sort -V
} > docs/mutation.out.txt
head -4 docs/mutation.out.txt
exit $rc
