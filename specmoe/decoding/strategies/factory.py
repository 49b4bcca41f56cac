"""Build the decoding strategy a SpecConfig asks for."""
from __future__ import annotations

import hashlib

from specmoe.decoding.strategies.autoregressive import AutoregressiveDecoder
from specmoe.decoding.runtime.runner import ModelRunner
from specmoe.options import OffloadConfig, SpecConfig


def make_strategy(runner: ModelRunner, cfg: SpecConfig, *, ckpt=None, max_model_len: int | None = None,
                  memo: dict | None = None, controller=None):
    """The strategy `cfg` asks for. Speculative strategies need the checkpoint (`ckpt`: affinity, profiles,
    config) and the context length; `memo` holds parts that outlive one generate call (the caller keeps it);
    `controller`: `decoding="auto"`'s controller (see `build_controller`)."""
    if cfg.decoding == "ar":
        return AutoregressiveDecoder(runner)
    if ckpt is None or max_model_len is None:
        raise ValueError(f"decoding={cfg.decoding!r} needs the checkpoint and the context length")
    if cfg.decoding == "auto" and controller is None:
        raise ValueError('decoding="auto" needs its controller (build_controller)')
    from specmoe.decoding.strategies.budget import ExpertBudget
    from specmoe.decoding.strategies.speculative import SpeculativeDecoder
    from specmoe.decoding.trees.treeselect import TreeSelector
    memo = {} if memo is None else memo
    drafters = {name: make_drafter(name, runner, cfg, ckpt=ckpt, memo=memo)
                for name in drafter_names(cfg, ckpt)}
    budget = ExpertBudget(ckpt.config, cfg.verify_expert_budget) if cfg.verify_expert_budget is not None else None
    width = tree_width(cfg, ckpt.config)
    ctl = memo.get("controller")  # a calibrated cost model, when the engine has one: its read time
    sel = (TreeSelector(cfg.num_draft_tokens, width, experts=cfg.draft_selection == "cost",
                        read_s=ctl.cost_model().read_s if ctl is not None else None)
           if cfg.draft_selection != "all" else None)
    return SpeculativeDecoder(runner, drafters, num_draft_tokens=cfg.num_draft_tokens, max_model_len=max_model_len,
                              width=width, selector=sel, budget=budget,
                              controller=controller if cfg.decoding == "auto" else None)


def tree_width(cfg: SpecConfig, mcfg) -> int:
    """Branches per draft tree: `draft_tree_width` with `draft_tree`, else 1 (chains). A model with
    linear-attention layers always drafts chains: its recurrent state follows one token order, so a verified
    row must continue its predecessor (no per-node states); `draft_tree=True` falls back to chains there."""
    return cfg.draft_tree_width if cfg.draft_tree and not mcfg.linear_layers else 1


def drafter_names(cfg: SpecConfig, ckpt) -> list[str]:
    """The drafters a configuration uses, the default first: `drafter=` alone, or for `decoding="auto"` without
    one every drafter available: self, eagle where a head is found (`eagle_head`, or the one shipped for the
    checkpoint), ngram."""
    if cfg.drafter is not None:
        return [cfg.drafter]
    if cfg.decoding != "auto":
        return ["self"]
    names = ["self"]
    if eagle_head_path(cfg, ckpt) is not None:
        names.append("eagle")
    return names + ["ngram"]


def make_drafter(name: str, runner: ModelRunner, cfg: SpecConfig, *, ckpt, memo: dict):
    from specmoe.decoding.drafters.ngram import NgramDrafter
    if name == "self":
        from specmoe.decoding.drafters.selfdraft import SelfDrafter
        return SelfDrafter(runner, draft_experts(runner, cfg, ckpt=ckpt, memo=memo))
    if name == "eagle":
        return make_eagle(runner, cfg, ckpt=ckpt, memo=memo)
    return NgramDrafter(ckpt.config.vocab_size, runner.device, n_min=cfg.ngram_min, n_max=cfg.ngram_max)


def build_controller(model, provider, *, ckpt, spec: SpecConfig, offload: OffloadConfig, dtype, device):
    """`decoding="auto"`'s controller: its cost model's coefficients are measured once per machine + model + tier
    (cached as JSON, see `costmodel.load_or_calibrate`) and it keeps refining them, and its acceptance
    estimates, as long as the caller keeps it."""
    from specmoe.decoding.control.controller import Controller
    from specmoe.decoding.control.costmodel import CostModel, calibration_key, load_or_calibrate
    from specmoe.decoding.control.routing import RoutingStats
    mcfg = ckpt.config
    tier = offload.offload if offload.offload != "host" else f"host|{offload.link_gbps}|{offload.link_latency_us}"
    nd = min(spec.draft_experts, mcfg.num_experts)
    key = calibration_key(model_fingerprint=ckpt.fingerprint(), dtype=dtype, device=device, tier=f"{tier}|N={nd}")
    coef = load_or_calibrate(model, provider, device, tier=offload.offload, key=key, draft_experts=nd)
    routing = RoutingStats(list(mcfg.moe_layers), mcfg.num_experts, mcfg.top_k)
    names = tuple(drafter_names(spec, ckpt))
    ctl = Controller(CostModel(coef, routing, draft_experts=nd), spec.num_draft_tokens, names)
    if spec.auto_memory:
        from specmoe.decoding.control.learning import ControllerMemory
        raw = f"auto-v2|{key}|{names}|{spec.eagle_head}|{spec.eagle_draft_vocab}|{spec.ngram_min}-{spec.ngram_max}|" \
              f"{spec.substitution}|{spec.draft_policy}|{spec.num_draft_tokens}"
        ctl.remember(ControllerMemory(hashlib.sha1(raw.encode()).hexdigest()[:16]))
    return ctl


def draft_experts(runner: ModelRunner, cfg: SpecConfig, *, ckpt, memo: dict | None = None):
    """The self draft's draft-expert set (`draft.DraftExperts`); `memo` outlives one generate call (the engine
    keeps it): the affinity table is computed once per engine, not once per call."""
    from specmoe.decoding.drafters.affinity import load_or_compute_affinity
    from specmoe.decoding.drafters.draft_experts import DraftExperts, load_profile
    mcfg = ckpt.config
    memo = {} if memo is None else memo
    if cfg.substitution == "affinity" and "affinity" not in memo:
        memo["affinity"] = load_or_compute_affinity(ckpt)
    return DraftExperts(
        mcfg, runner.provider, num_draft=cfg.draft_experts, policy=cfg.draft_policy,
        substitution=cfg.substitution, seed=cfg.seed, device=runner.device,
        affinity=memo.get("affinity") if cfg.substitution == "affinity" else None,
        profile=load_profile(ckpt.path, mcfg) if cfg.draft_policy == "hot-global" else None,
        prefetch=cfg.draft_prefetch)


def eagle_head_path(cfg: SpecConfig, ckpt):
    """The EAGLE head for `ckpt`: `cfg.eagle_head`, else the head that ships for the checkpoint (its own `eagle/`,
    or the demo model's bundled head; `bundled.default_eagle_head`), else None."""
    from specmoe.bundled import default_eagle_head
    return cfg.eagle_head if cfg.eagle_head is not None else default_eagle_head(ckpt.path)


def make_eagle(runner: ModelRunner, cfg: SpecConfig, *, ckpt, memo: dict):
    """The EAGLE drafter over `cfg.eagle_head` (default: the head that ships for the checkpoint,
    `bundled.default_eagle_head`), its weights read once per engine (`memo`)."""
    from pathlib import Path

    from specmoe.decoding.drafters.eagle import EagleDrafter
    from specmoe.errors import InputError
    from specmoe.models.eagle import load_eagle_head, read_draft_vocab, recommended_draft_vocab
    path = eagle_head_path(cfg, ckpt)
    if path is None:
        raise InputError(f"drafter='eagle' needs eagle_head=PATH (--eagle-head): no EAGLE head ships for "
                         f"{ckpt.path}")
    w = runner.model.embed.weight
    n = cfg.eagle_draft_vocab
    if n is None:  # the size recommended beside the head (none: the full vocabulary)
        n = recommended_draft_vocab(path)
    key = ("eagle", str(Path(path).resolve()), w.dtype, str(w.device), n)
    if key not in memo:
        head = load_eagle_head(path, dtype=w.dtype, device=w.device, target_vocab=ckpt.config.vocab_size,
                               target_hidden=ckpt.config.hidden_size)
        if n:
            head.restrict_vocab(runner.model.head_weight(), read_draft_vocab(path, n, ckpt.config.vocab_size))
        memo[key] = head
    return EagleDrafter(runner, memo[key], head_path=path)


def lookahead(cfg: SpecConfig, mcfg=None) -> int:
    """KV positions a strategy may write past a sequence's committed length in one step (of a model of `mcfg`:
    one with linear-attention layers drafts chains, see `tree_width`)."""
    if cfg.decoding == "ar":
        return 1
    width = tree_width(cfg, mcfg) if mcfg is not None else (cfg.draft_tree_width if cfg.draft_tree else 1)
    return cfg.num_draft_tokens * width + 1
