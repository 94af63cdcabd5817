#!/usr/bin/env bash
# The prepared GPU check: one command, at most 5.5 minutes (two runs fit in 15 minutes of a GPU machine with its
# start), on a GPU machine with its own torch and no network.
#   bash benchmarks/gpu_check.sh                        # on the GPU; the table goes to runs/gpu_check.md, the
#                                                       # profiler traces to runs/gpu_check_traces/, the figures
#                                                       # to benchmarks/gpu_results.json
#   bash benchmarks/gpu_check.sh --device cpu --tiny    # the rehearsal on a CPU (tests/test_gpu_check.py runs it)
# Small wheels the machine lacks (pytorch-metric-learning, faiss-cpu or faiss-gpu) can be carried in .whl/ (ignored
# by git): they are installed from there without the network. Every section has its own time limit
# (benchmarks/gpu_check.py); this script stops the whole check at $GPU_CHECK_TIMEOUT s (330) whatever happens.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --find-links .whl .whl/*.whl || echo "warning: the wheels in .whl/ did not install; going on without them"
fi
timeout --signal=INT --kill-after=10 "${GPU_CHECK_TIMEOUT:-330}" $PY benchmarks/gpu_check.py "$@"
