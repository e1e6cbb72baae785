#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs beyond the GPU machine's image, which has no network.
#
#   bash benchmarks/gpu_carry.sh download   # here (PyPI reachable): fetch them into .gpu_wheels/ (git-ignored),
#                                           # print their sizes, refuse if working tree + wheels > 64 MiB
#   bash benchmarks/gpu_carry.sh install    # there: install from .gpu_wheels/ offline, then report pip check
#
# The image has torch 2.11 + CUDA, transformers 5.17, peft, accelerate. pyproject.toml's floors ask for
# transformers >= 5.23 (which itself needs huggingface-hub >= 1.31) and trl >= 1.12, < 1.17, so those travel
# always; peft (>= 0.18), accelerate (>= 1.4) and datasets (>= 4.7) travel too but are installed only where
# the image's copy is missing or below the floor. All are pure-Python wheels (py3-none-any), installed with
# --no-deps: their own dependencies (tokenizers, safetensors, pyarrow, ...) must come from the image, and
# `pip check` says which do not. The versions are the ones the project's CPU suite runs on.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.gpu_wheels"
LIMIT=$((64 * 1024 * 1024))
PYTHON="${PYTHON:-python}"
# name==version floor-or-"always"
PACKAGES=(
    "transformers==5.24.0 always"
    # 1.x, not 2.x: an image that keeps its own datasets 4.7-4.8 (which ask for huggingface-hub < 2.0) must
    # still import it; 1.33 is inside every carried package's range (transformers 5.24: >= 1.31, < 3.0).
    "huggingface-hub==1.33.0 1.31.0"
    "trl==1.12.0 always"
    "peft==0.21.2 0.18"
    "accelerate==1.15.0 1.4"
    "datasets==5.2.0 4.7"
)

download() {
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl
    for entry in "${PACKAGES[@]}"; do
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$WHEELS" "${entry%% *}"
    done
    local tree wheels
    tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null \
        | awk '$2 == "total" {s += $1} END {print s + 0}')
    wheels=$(du -cb "$WHEELS"/*.whl | awk '$2 == "total" {print $1}')
    du -b "$WHEELS"/*.whl | awk '{printf "%10.2f MiB  %s\n", $1 / 1048576, $2}'
    printf 'wheels %.2f MiB + working tree %.2f MiB = %.2f MiB (limit 64 MiB)\n' \
        "$(echo "$wheels / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" \
        "$(echo "($wheels + $tree) / 1048576" | bc -l)"
    if [ $((wheels + tree)) -gt "$LIMIT" ]; then
        echo "refused: working tree + wheels exceed 64 MiB, the device tool's carry limit" >&2
        exit 1
    fi
}

install() {
    [ -d "$WHEELS" ] || { echo "no $WHEELS: run 'bash benchmarks/gpu_carry.sh download' and carry .gpu_wheels" >&2; exit 1; }
    local chosen=()
    for entry in "${PACKAGES[@]}"; do
        local spec="${entry%% *}" floor="${entry##* }" name="${entry%%==*}"
        if [ "$floor" != always ] && "$PYTHON" - "$name" "$floor" <<'EOF'; then
import sys
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

try:
    sys.exit(0 if Version(version(sys.argv[1])) >= Version(sys.argv[2]) else 1)
except PackageNotFoundError:
    sys.exit(1)
EOF
            echo "kept the image's $name (>= $floor)"
            continue
        fi
        chosen+=("$spec")
    done
    "$PYTHON" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" "${chosen[@]}"
    echo "installed: ${chosen[*]}"
    "$PYTHON" -m pip check || echo "pip check: the image lacks or mismatches the dependencies above"
}

case "${1:-}" in
    download) download ;;
    install) install ;;
    *) echo "usage: bash benchmarks/gpu_carry.sh download|install" >&2; exit 2 ;;
esac
