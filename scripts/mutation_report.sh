#!/usr/bin/env bash
# Mutation testing of the modules where a wrong number is silent: the correction (ops/correction.py),
# the drift metrics (ops/drift.py), the protection state (protection/state.py, its records
# protection/records.py, the diagonal tensors' per-step lists geometry/diagonal/state.py and the path
# protection/path.py), the theta0 checkpoint (protection/checkpoint.py) and the Fisher engines' accumulation
# (fisher/per_sequence_grads.py, fisher/scoring.py), with mutmut. What is mutated and which tests
# run: [tool.mutmut] in pyproject.toml. The surviving mutants and why none changes a result:
# scripts/mutation_survivors.md.
#
# Prints a per-module table (killed / survived / timeout / no tests / other / total, score =
# detected / total, detected = killed + timeout) and every surviving mutant's name; its diff:
# `mutmut show NAME`. Exits 0: a report, not a gate.
#
# mutmut maps tests to functions by the calls it sees in its own process, so the torchrun tests
# (DDP/FSDP/ZeRO workers in subprocesses) cannot kill anything inside it. MUTATION_TORCHRUN=1 adds a
# pass that reruns tests/integration/test_deepspeed.py and test_distributed.py against each
# survivor of hf_cfp.ops / hf_cfp.protection (MUTANT_UNDER_TEST reaches the workers); the mutants
# they kill are counted in the "torchrun" column and as detected.
#
# Time here (2 CPU cores shared with other jobs, 702 mutants, 2 workers): 12.5 min on a quiet
# machine, 28 min under load. The torchrun pass adds about 53 s per survivor it reruns (31 of
# them: 27.5 min). Too slow for .ci/run, which does not run it.
#
# Usage: scripts/mutation_report.sh
#   VENV=path          venv to use (default .venv; mutmut is installed into it if missing)
#   MUTATION_CHILDREN  parallel mutant workers (default 2)
#   MUTATION_KEEP=1    keep mutants/ and its results: mutmut then tests only mutants without one
#   MUTATION_TORCHRUN=1  the torchrun pass above
set -uo pipefail
cd "$(dirname "$0")/.."
venv="$(realpath -m "${VENV:-.venv}")"
python="$venv/bin/python"
"$python" -c "import mutmut" 2>/dev/null || "$python" -m pip install --quiet "mutmut==3.8.1"

# Tests must import mutants/hf_cfp: mutmut puts mutants/ first on sys.path and removes the
# repository root, so this checkout (not an editable install elsewhere) is what gets mutated.
export PYTHONPATH="$PWD"
[[ "${MUTATION_KEEP:-0}" == 1 ]] || rm -rf mutants
mkdir -p mutants
start=$(date +%s)
"$venv/bin/mutmut" run --max-children "${MUTATION_CHILDREN:-2}" >mutants/run.log 2>&1
echo "mutmut run: exit $?, $(($(date +%s) - start)) s (log: mutants/run.log)"
"$venv/bin/mutmut" results --all true >mutants/results.txt 2>/dev/null

: >mutants/torchrun_killed.txt
if [[ "${MUTATION_TORCHRUN:-0}" == 1 ]]; then
  start=$(date +%s)
  torchrun_tests=(tests/integration/test_deepspeed.py tests/integration/test_distributed.py)
  rerun() {  # $1: mutant name ("" = none); exit status of the torchrun tests against it
    (cd mutants && MUTANT_UNDER_TEST="$1" PYTHONPATH="$PWD" timeout 900 \
      "$python" -m pytest -x -q -p no:cacheprovider "${torchrun_tests[@]}" >/dev/null 2>&1)
  }
  if rerun ""; then
    for name in $(sed -nE 's/^ *(hf_cfp\.(ops|protection)\.[^:]+): survived$/\1/p' mutants/results.txt); do
      rerun "$name" || echo "$name" >>mutants/torchrun_killed.txt
    done
    echo "torchrun pass: $(wc -l <mutants/torchrun_killed.txt) more killed, $(($(date +%s) - start)) s"
  else
    echo "torchrun pass skipped: ${torchrun_tests[*]} fail without any mutant"
  fi
fi

"$python" - mutants/results.txt mutants/torchrun_killed.txt <<'EOF'
import re
import sys
from collections import Counter, defaultdict

results, torchrun_file = sys.argv[1:]
torchrun_killed = set(open(torchrun_file).read().split())
counts = defaultdict(Counter)
survivors = []
for line in open(results):
    match = re.match(r"\s*(\S+): (.+)$", line)
    if not match:
        continue
    name, status = match.groups()
    if status == "survived" and name in torchrun_killed:
        status = "torchrun"
    module = re.split(r"\.x[_\u01c1]", name, maxsplit=1)[0]  # hf_cfp.ops.drift.x_free_drift_sq__mutmut_1
    counts[module][status] += 1
    if status == "survived":
        survivors.append(name)

columns = ("killed", "torchrun", "survived", "timeout", "no tests")
print("module".ljust(34) + "".join(c.rjust(9) for c in (*columns, "other", "total")) + "score".rjust(8))
grand = Counter()
for c in counts.values():
    grand.update(c)
for module, c in [*sorted(counts.items()), ("TOTAL", grand)]:
    total = sum(c.values())
    other = total - sum(c[k] for k in columns)
    detected = c["killed"] + c["torchrun"] + c["timeout"]
    cells = (*(c[k] for k in columns), other, total)
    print(module.ljust(34) + "".join(str(v).rjust(9) for v in cells) + f"{detected / total if total else 0:>8.1%}")
print()
print(f"surviving mutants ({len(survivors)}; why each cannot change a result: scripts/mutation_survivors.md):")
for name in survivors:
    print("  " + name)
EOF
exit 0
