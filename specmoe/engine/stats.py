"""Engine-level counters; strategies and expert providers add their own sections."""
from __future__ import annotations


def new_stats() -> dict:
    return {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "prefill_time_s": 0.0,
            "decode_time_s": 0.0, "decode_steps": 0}


def derived(s: dict) -> dict:
    total = s["prefill_time_s"] + s["decode_time_s"]
    return {"tokens_per_s": s["generated_tokens"] / total if total else 0.0,
            "decode_tokens_per_s": s["generated_tokens"] / s["decode_time_s"] if s["decode_time_s"] else 0.0,
            "prefill_tokens_per_s": s["prompt_tokens"] / s["prefill_time_s"] if s["prefill_time_s"] else 0.0}
