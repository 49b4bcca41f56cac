"""Per-phase accounting of decode time (`llm.stats["step_breakdown"]`).

Every decode step is cut into phases timed on the host: a draft forward splits into its non-expert part
and its draft experts; a target forward (verification, or a plain step) into non-expert compute, expert
compute and the wait for expert loads; then the HotTemporal draft-set refresh and acceptance / sampling.
The engine adds its scheduling time; `other_s` is what no phase timed (decode wall minus the parts), so
the parts always add up to the decode wall time. On CUDA the phases are host times between the
synchronisations the strategy already makes."""
from __future__ import annotations

import time

import torch

PARTS = ("draft_setup_s", "draft_nonexpert_s", "draft_experts_s", "target_nonexpert_s", "target_expert_compute_s",
         "fetch_wait_s", "draft_refresh_s", "accept_sample_s")


def now(device: torch.device) -> float:
    """Host time after the device finished what was queued (a synchronisation on CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StepBreakdown:
    def __init__(self):
        self.s = dict.fromkeys(PARTS, 0.0)

    def draft(self, wall: float, expert_s: float) -> None:
        """A draft phase of `wall` seconds of which `expert_s` in the draft experts."""
        self.s["draft_experts_s"] += expert_s
        self.s["draft_nonexpert_s"] += wall - expert_s

    def target(self, wall: float, expert_s: float, fetch_wait_s: float, refresh_s: float = 0.0) -> None:
        """A target forward of `wall` seconds: `expert_s` in the routed experts, of which `fetch_wait_s`
        waiting for loads; `refresh_s` in the draft-set refresh that ends it."""
        self.s["fetch_wait_s"] += fetch_wait_s
        self.s["target_expert_compute_s"] += expert_s - fetch_wait_s
        self.s["draft_refresh_s"] += refresh_s
        self.s["target_nonexpert_s"] += wall - expert_s - refresh_s

    def accept(self, wall: float) -> None:
        self.s["accept_sample_s"] += wall

    def setup(self, wall: float) -> None:
        """The draft set's first selection and load (once per run)."""
        self.s["draft_setup_s"] += wall


def merge(total: dict, part: dict) -> dict:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v
    return total


def finish(parts: dict, *, decode_time_s: float, scheduling_s: float) -> dict:
    """The parts + scheduling + other, which add up to decode_wall_s = decode steps + scheduling."""
    out = {k: parts.get(k, 0.0) for k in PARTS}
    out["scheduling_s"] = scheduling_s
    out["other_s"] = decode_time_s - sum(out[k] for k in PARTS)
    out["decode_wall_s"] = decode_time_s + scheduling_s
    return out


class SpecTally:
    """What speculative steps drafted, verified and accepted, per draft position, and where their time went
    (draft / verify / accept): one tally for every speculative decoder, so their stats mean the same."""

    def __init__(self, gamma: int):
        self.steps = self.seq_steps = self.emitted = self.verified = 0
        self.drafted_pos, self.acc_pos = [0] * gamma, [0] * gamma
        self.draft_s = self.verify_s = self.accept_s = 0.0

    def record(self, out: list[list[int]], gammas: list[int], draft_s: float, verify_s: float,
               accept_s: float) -> None:
        """One step: out[b] = the tokens row b emitted (accepted drafts + 1) of its gammas[b] drafted."""
        self.steps += 1
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.accept_s += accept_s
        for toks, g in zip(out, gammas):
            self.seq_steps += 1
            self.emitted += len(toks)
            self.verified += g + 1
            for j in range(g):
                self.drafted_pos[j] += 1
                if j < len(toks) - 1:
                    self.acc_pos[j] += 1

    def stats(self) -> dict:
        n = self.seq_steps
        return {"steps": self.steps, "tokens_per_step": self.emitted / n if n else 0.0,
                "verified_positions_per_step": self.verified / n if n else 0.0,
                "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(self.acc_pos, self.drafted_pos)],
                "drafted_per_position": list(self.drafted_pos), "accepted_per_position": list(self.acc_pos),
                "drafted_tokens": sum(self.drafted_pos), "accepted_tokens": sum(self.acc_pos),
                "draft_time_s": self.draft_s, "verify_time_s": self.verify_s, "accept_time_s": self.accept_s}
