#!/usr/bin/env bash
# Build .venv-sglang: SGLang 0.5.23's own Python package (no CUDA kernels) and the modules its
# request schemas, weight-update helper, OpenAI protocol and bench_serving import, so that the
# tests marked sglang_ref can run this project against SGLang's code.  ~3 minutes, ~6.3 GB.
#     bash tools/sglang_ref/install.sh            # from the project's root
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.venv-sglang
check='import sglang.srt.utils.common, sglang.bench_serving, sglang.srt.entrypoints.openai.protocol
from sglang.api.v1.api_types import GenerateRequest
from sglang.srt.sampling.sampling_params import SamplingParams
import sglang
assert sglang.__version__ == "0.5.23", sglang.__version__'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "[sglang_ref] .venv-sglang is ready (sglang 0.5.23)"
  exit 0
fi
python3 -m venv "$venv"
# --no-cache-dir: the CUDA build of torch and its libraries are ~4 GB of wheels that a cache would
# keep a second copy of; a failed install shows the free disk (a full disk is the likely cause)
pip_install() {
  "$venv/bin/pip" install -q --no-cache-dir "$@" || { df -h . >&2; exit 1; }
}
pip_install -r tools/sglang_ref/requirements.txt
pip_install --no-deps sglang==0.5.23
"$venv/bin/python" -c "$check"  # the same imports as the readiness check above
echo "[sglang_ref] sglang 0.5.23 importable in .venv-sglang"
