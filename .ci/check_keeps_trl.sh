#!/usr/bin/env bash
# A user's environment with a current TRL: TRL 1.16 installed first, then the built wheel. pip must keep TRL
# at 1.16 (trl-sae must not downgrade it), and trl-sae must work on it from outside the checkout: every
# public name imports and `trl-sae demo --quick` trains.
#   bash .ci/check_keeps_trl.sh [dist/trl_sae-*.whl]
# KEEP_TRL: the TRL version the environment has (1.16.0, the newest on the index). TORCH_INDEX_URL as in
# .ci/check_wheel.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
trl_version=${KEEP_TRL:-1.16.0}
wheel=$(realpath "${1:-$(ls dist/trl_sae-*.whl)}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$py" -m pip install -q "trl==$trl_version"
"$py" -m pip install -q "$wheel"
installed=$("$py" -c 'import importlib.metadata as m; print(m.version("trl"))')
if [ "$installed" != "$trl_version" ]; then
    echo "installing $(basename "$wheel") changed TRL from $trl_version to $installed" >&2
    exit 1
fi
"$py" -m pip check
cp .ci/check_public_names.py "$work/"
cd "$work"  # nothing of the checkout is importable from here
"$py" check_public_names.py
"$work/venv/bin/trl-sae" demo --quick --no-progress --output-dir "$work/demo"
echo "TRL $installed kept: $(basename "$wheel") installs and runs beside it"
