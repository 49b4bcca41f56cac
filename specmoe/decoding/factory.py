"""Build the decoding strategy a SpecConfig asks for."""
from __future__ import annotations

from specmoe.decoding.autoregressive import AutoregressiveDecoder
from specmoe.decoding.runner import ModelRunner
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
    if cfg.drafter != "self" or cfg.draft_tree:
        return make_drafted(runner, cfg, ckpt=ckpt, max_model_len=max_model_len, memo=memo)
    if cfg.decoding == "auto" and controller is None:
        raise ValueError('decoding="auto" needs its controller (build_controller)')
    return make_specmoe(runner, cfg, ckpt=ckpt, max_model_len=max_model_len, memo=memo,
                        controller=controller if cfg.decoding == "auto" else None)


def build_controller(model, provider, *, ckpt, spec: SpecConfig, offload: OffloadConfig, dtype, device):
    """`decoding="auto"`'s controller: its cost model's coefficients are measured once per machine + model + tier
    (cached as JSON, see `costmodel.load_or_calibrate`) and it keeps refining them, and its acceptance
    estimates, as long as the caller keeps it."""
    from specmoe.decoding.controller import Controller
    from specmoe.decoding.costmodel import CostModel, RoutingStats, calibration_key, load_or_calibrate
    mcfg = ckpt.config
    tier = offload.offload if offload.offload != "host" else f"host|{offload.link_gbps}|{offload.link_latency_us}"
    nd = min(spec.draft_experts, mcfg.num_experts)
    key = calibration_key(model_fingerprint=ckpt.fingerprint(), dtype=dtype, device=device, tier=f"{tier}|N={nd}")
    coef = load_or_calibrate(model, provider, device, tier=offload.offload, key=key, draft_experts=nd)
    routing = RoutingStats(list(mcfg.moe_layers), mcfg.num_experts, mcfg.top_k)
    return Controller(CostModel(coef, routing, draft_experts=nd), spec.num_draft_tokens)


def make_specmoe(runner: ModelRunner, cfg: SpecConfig, *, ckpt, max_model_len: int, memo: dict | None = None,
                 controller=None):
    """`memo` outlives one generate call (the engine keeps it): the affinity table is computed once per
    engine, not once per call."""
    from specmoe.decoding.specmoe import SpecMoEDecoder
    return SpecMoEDecoder(runner, draft_experts(runner, cfg, ckpt=ckpt, memo=memo),
                          num_draft_tokens=cfg.num_draft_tokens, max_model_len=max_model_len, controller=controller)


def draft_experts(runner: ModelRunner, cfg: SpecConfig, *, ckpt, memo: dict | None = None):
    """The self draft's draft-expert set (`draft.DraftExperts`)."""
    from specmoe.decoding.affinity import load_or_compute_affinity
    from specmoe.decoding.draft import DraftExperts, load_profile
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


def make_drafted(runner: ModelRunner, cfg: SpecConfig, *, ckpt, max_model_len: int, memo: dict | None = None):
    """Speculation with a `Drafter` (`drafters.py`): the ngram lookup, the EAGLE head (`eagle.py`), or the
    self draft's trees."""
    from specmoe.decoding.budget import ExpertBudget
    from specmoe.decoding.chainselect import ChainSelector
    from specmoe.decoding.drafted import DraftedDecoder
    from specmoe.decoding.drafters import NgramDrafter
    if cfg.drafter == "self":
        from specmoe.decoding.selfdraft import SelfDrafter
        drafter = SelfDrafter(runner, draft_experts(runner, cfg, ckpt=ckpt, memo=memo))
    elif cfg.drafter == "eagle":
        drafter = make_eagle(runner, cfg, ckpt=ckpt, memo={} if memo is None else memo)
    else:
        drafter = NgramDrafter(ckpt.config.vocab_size, runner.device, n_min=cfg.ngram_min, n_max=cfg.ngram_max)
    budget = ExpertBudget(ckpt.config, cfg.verify_expert_budget) if cfg.verify_expert_budget is not None else None
    if cfg.draft_tree:
        from specmoe.decoding.treedecode import TreeDecoder
        from specmoe.decoding.treeselect import TreeSelector
        w = cfg.draft_tree_width
        ctl = (memo or {}).get("controller")  # a calibrated cost model, when the engine has one: its read time
        sel = (TreeSelector(cfg.num_draft_tokens, w, experts=cfg.draft_selection == "cost",
                            read_s=ctl.cost.c.read_s if ctl is not None else None)
               if cfg.draft_selection != "all" else None)
        return TreeDecoder(runner, drafter, num_draft_tokens=cfg.num_draft_tokens, max_model_len=max_model_len,
                           width=w, budget=budget, selector=sel)
    selector = ChainSelector(cfg.num_draft_tokens) if cfg.draft_selection != "all" else None
    return DraftedDecoder(runner, drafter, num_draft_tokens=cfg.num_draft_tokens, max_model_len=max_model_len,
                          budget=budget, selector=selector)


def make_eagle(runner: ModelRunner, cfg: SpecConfig, *, ckpt, memo: dict):
    """The EAGLE drafter over `cfg.eagle_head` (default: the head that ships for the checkpoint,
    `bundled.default_eagle_head`), its weights read once per engine (`memo`)."""
    from pathlib import Path

    from specmoe.bundled import default_eagle_head
    from specmoe.decoding.eagle import EagleDrafter
    from specmoe.errors import InputError
    from specmoe.models.eagle import load_eagle_head, read_draft_vocab, recommended_draft_vocab
    path = cfg.eagle_head if cfg.eagle_head is not None else default_eagle_head(ckpt.path)
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


def lookahead(cfg: SpecConfig) -> int:
    """KV positions a strategy may write past a sequence's committed length in one step."""
    if cfg.decoding == "ar":
        return 1
    return cfg.num_draft_tokens * (cfg.draft_tree_width if cfg.draft_tree else 1) + 1
