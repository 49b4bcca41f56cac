#!/usr/bin/env bash
# The GPU run kit: one command on a lent CUDA machine (≤ 8 min on one H100/H200-class GPU).
#   benchmarks/gpu/run.sh OUT_DIR                      # CUDA: experts in pinned host RAM over the real link
#   benchmarks/gpu/run.sh OUT_DIR --device cpu --tiny  # CPU dry run (what the test suite runs)
# Needs torch, transformers, safetensors, tokenizers, numpy, tqdm, matplotlib, xxhash, ninja (and pytest for the test step)
# already installed; no pip, no downloads, no serve or ray extras. PYTHON selects the interpreter (default:
# python3). Exits 0 only when every step passed; summary.md gives each step's status. See
# benchmarks/gpu/kit.py for the steps, benchmarks/gpu/bare_venv.py for a bare environment to dry-run it in.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" benchmarks/gpu/kit.py "$@"
