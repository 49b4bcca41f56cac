#!/usr/bin/env bash
# The GPU run kit: one command on a lent CUDA machine (≤ 8 min on one H100/H200-class GPU).
#   benchmarks/gpu/run.sh OUT_DIR                      # CUDA: experts in pinned host RAM over the real link
#   benchmarks/gpu/run.sh OUT_DIR --device cpu --tiny  # CPU dry run (what the test suite runs)
# Needs torch, transformers, safetensors, tokenizers, numpy, tqdm, matplotlib already installed; no pip, no
# downloads. PYTHON selects the interpreter (default: python3). See benchmarks/gpu/kit.py for the steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" benchmarks/gpu/kit.py "$@"
