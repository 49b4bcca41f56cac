"""`specmoe bench`: throughput, bytes moved, hit rate and τ of every system this build
offers, on the same prompts / tier / cache size, plus peers and a widened model.

    from specmoe.bench import preset, run_bench
    res = run_bench(preset("quick", out="/tmp/bench"))
"""
from specmoe.bench.config import PRESETS, BenchConfig, preset
from specmoe.bench.runner import run_bench

__all__ = ["BenchConfig", "PRESETS", "preset", "run_bench"]
