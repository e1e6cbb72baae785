#!/usr/bin/env bash
# Install the built wheel with every direct dependency at its declared floor (.ci/min_constraints.py) into
# a fresh virtualenv and run the core tests against it, so the floors in pyproject.toml stay true.
#   bash .ci/min_versions.sh [dist/trl_sae-*.whl]
# torch stays at the CPU 2.13.0 build (its floor, 2.6, has no CPU-only build on PyPI); TORCH_INDEX_URL as
# in .ci/check_wheel.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(realpath "${1:-$(ls dist/trl_sae-*.whl)}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python .ci/min_constraints.py --skip torch > "$work/min.txt"
echo "declared floors: $(tr '\n' ' ' < "$work/min.txt")"
python -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$py" -m pip install -q -c "$work/min.txt" "$wheel" pytest pytest-timeout pytest-xdist hypothesis
"$py" -m pip check
"$py" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|trl|peft|accelerate|datasets) ' | tr -s ' ' | paste -sd ' '
# The tests import trl_sae from the checkout (pytest puts the rootdir first); what is under test here is
# the dependencies' versions, which come from the venv. Two pytest-xdist workers, as `make test`: the 2-core
# CI machine runs them in about half the time of one process.
"$py" -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup \
    tests/test_rollout.py tests/test_trainer.py tests/test_peft.py tests/test_advantages.py
