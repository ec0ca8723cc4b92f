#!/usr/bin/env bash
# Mutation audit (issue 11 item 7) with mutmut: one small change at a time to the code under test,
# the targeted tests (pyproject [tool.mutmut] tests_dir) run against each; a surviving mutant is a
# bug the tests would not catch. Slow: not part of CI.
#   bash scripts/mutation.sh                              # every mutant of runtime/, engines/sim/, faults/
#   bash scripts/mutation.sh 'kvcanary.faults.accounting*' # only mutants whose name matches (mutmut globs)
# Results: docs/mutation.out.txt (machine, duration, one line per mutant); mutmut's tree is mutants/.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c "import mutmut" 2>/dev/null || .venv/bin/pip install -q "mutmut==3.3.1"
export TRITON_INTERPRET=1
start=$(date +%s)
.venv/bin/mutmut run --max-children "${MUTATION_JOBS:-2}" "$@" || true
{
  echo "# mutmut 3.3.1 on $(uname -n), $(nproc) cores, $(( $(date +%s) - start )) s; selection: ${*:-all}"
  .venv/bin/mutmut results --all true
} > docs/mutation.out.txt
for s in killed survived timeout suspicious "no tests" skipped; do
  printf '%s: %s\n' "$s" "$(grep -c ": $s\$" docs/mutation.out.txt || true)"
done
