#!/usr/bin/env bash
# Install the built wheel (not the checkout) into a fresh virtualenv and use it from outside the source
# tree, so a module or data file missing from the wheel fails here rather than for a user.
#   bash .ci/check_wheel.sh [dist/trl_sae-*.whl]
# TORCH_INDEX_URL: where to get the CPU torch (unset: pip's own configuration, which here serves the CPU
# wheel on disk; on GitHub's runners, PyTorch's CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=${1:-$(ls dist/trl_sae-*.whl)}
wheel=$(realpath "$wheel")
# Both archives carry the licence text (pyproject's license-files), not only its name.
sdist=$(ls dist/trl_sae-*.tar.gz)
# (Listings are read whole, not piped into `grep -q`: its early exit would fail the pipe under pipefail.)
sdist_files=$(tar -tzf "$sdist")
wheel_files=$(python -m zipfile -l "$wheel")
grep -E '^trl_sae-[^/]+/LICENSE$' <<<"$sdist_files" >/dev/null || { echo "LICENSE missing from $sdist"; exit 1; }
grep -E 'dist-info/licenses/LICENSE ' <<<"$wheel_files" >/dev/null || { echo "LICENSE missing from $wheel"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$py" -m pip install -q "$wheel"
cp .ci/check_public_names.py "$work/"
cd "$work"  # nothing of the checkout is importable from here
"$work/venv/bin/trl-sae" --help >/dev/null
"$py" check_public_names.py
"$work/venv/bin/trl-sae" demo --quick --no-progress --output-dir "$work/demo"
echo "wheel check passed: $(basename "$wheel")"
