"""The fixed list of planted bugs `python -m specmoe.dev.mutate` runs (docs/mutation.md). Each is one plausible
mistake: an exact snippet of a file (present exactly once), what replaces it, and the few tests that must catch
it. The first seven are the bugs issue 38's audit found passing every test.

Not here on purpose: specmoe/experts/, specmoe/kernels/, specmoe/models/moe.py, specmoe/models/layers.py and
specmoe/weights/autodtype.py, which were being rewritten when the list was made (their mutants would go stale at
once); the draft set's expert bookkeeping (decoding/drafters/draft_experts.py, affinity.py) stands for the expert
side meanwhile."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str  # decoding | experts | models | families | serve | bench
    file: str  # relative to the repository root
    original: str  # exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest node ids / files that cover it (run with -x -q)
    why: str  # the bug, in words
    equivalent: str | None = None  # why no test can tell it from the original (then it is not run)


T_CTL = "tests/decoding/test_controller.py"
T_ORI = "tests/models/test_orientation.py"
T_API = "tests/serve/test_openai_api.py"
T_ORR = "tests/bench/test_overram_report.py"
T_CFG = "tests/validation/test_config_files.py"
T_MIX = "tests/decoding/test_mixed_drafters.py::test_auto_reports_what_it_chose"
T_SPEC = "tests/decoding/test_specmoe.py"
T_HF = "tests/models/test_hf_equivalence.py"
T_FAM = "tests/models/test_families.py"
T_SAMPLE = "tests/decoding/test_sampling.py"

MUTANTS: list[Mutant] = [
    # ---------------------------------------------------------------- issue 38's seven survivors
    Mutant("controller_first_drafter_only", "decoding", "specmoe/decoding/control/controller.py",
           "names = self.planned = [n for n in self.names if n in avail]",
           "names = self.planned = [n for n in self.names[:1] if n in avail]",
           (f"{T_CTL}::test_every_drafter_is_planned_over_not_only_the_first",
            "tests/decoding/test_auto_choice.py::test_auto_converges_to_the_drafter_that_measures_faster_not_the_one_predicted"),
           "the controller plans over its first drafter only"),
    Mutant("weight_major_threshold_ignored", "models", "specmoe/models/orientation.py",
           "return at is not None and numel >= at[0] and ", "return at is not None and ",
           (f"{T_ORI}::test_weight_major_only_from_the_threshold_and_up_to_its_rows",
            f"{T_ORI}::test_dense_layers_keep_f_linear_below_the_threshold"),
           "weight-major products taken for weights below the probe's threshold"),
    Mutant("probe_first_winning_size", "models", "specmoe/models/orientation.py",
           "if all(wins[i:])), None)", "if wins[i]), None)",
           (f"{T_ORI}::test_probe_takes_the_smallest_size_from_which_every_larger_one_wins",),
           "the probe's threshold is the first size that wins, not the one from which every larger size wins"),
    Mutant("api_key_any_bearer", "serve", "specmoe/serve/app.py",
           'if not hmac.compare_digest(got.encode(), f"Bearer {config.api_key}".encode()):',
           'if not got.startswith("Bearer "):',
           (f"{T_API}::test_a_wrong_key_is_refused_over_the_socket",),
           "any 'Bearer ...' header is accepted as the API key"),
    Mutant("overram_ratio_inverted", "bench", "specmoe/bench/overram_report.py",
           'out[f"auto@{b} / lru@{b}"] = auto / lru', 'out[f"auto@{b} / lru@{b}"] = lru / auto',
           (f"{T_ORR}::test_ratios_by_hand",), "the over-RAM report's auto ÷ LRU ratio upside down"),
    Mutant("overram_fewer_bytes_target_inverted", "bench", "specmoe/bench/overram_report.py",
           "                lambda x: x <= 0.5)", "                lambda x: x > 0.5)",
           (f"{T_ORR}::test_targets_natural_forced_at_2x_by_hand",),
           "the 'auto reads at most half llama.cpp's bytes per token' target met when it reads more"),
    Mutant("kv_heads_default_one", "families", "specmoe/families/reader.py",
           'n_kv = f.int("num_key_value_heads", default=n_heads, hi=n_heads)',
           'n_kv = f.int("num_key_value_heads", default=1, hi=n_heads)',
           (f"{T_CFG}::test_missing_num_key_value_heads_means_one_per_attention_head",),
           "a config without num_key_value_heads reads as one K/V head instead of one per attention head"),
    # ---------------------------------------------------------------- decoding
    Mutant("tally_tokens_per_row_counts_accepted", "decoding", "specmoe/decoding/strategies/speculative.py",
           '"tokens_per_step": self.emitted / self.rows if self.rows else 0.0,',
           '"tokens_per_step": self.accepted / self.rows if self.rows else 0.0,',
           (T_MIX,), "a drafter's tokens per row leave out the bonus token"),
    Mutant("plain_step_share_inverted", "decoding", "specmoe/decoding/strategies/speculative.py",
           '"plain_step_share": self.plain_steps / max(1, self.plain_steps + self.tally.steps),',
           '"plain_step_share": self.tally.steps / max(1, self.plain_steps + self.tally.steps),',
           (T_MIX,), "auto's plain-step share reports the speculative share"),
    Mutant("draft_limit_past_max_tokens", "decoding", "specmoe/decoding/strategies/speculative.py",
           "return max(0, min(self.gamma, left - 1))", "return max(0, min(self.gamma, left))",
           (f"{T_SPEC}::test_a_step_never_emits_more_than_a_sequence_may",),
           "a sequence may draft one token more than it may still emit"),
    Mutant("top_p_drops_the_crossing_token", "decoding", "specmoe/decoding/runtime/sampling.py",
           "drop = cum - sorted_p > p.top_p", "drop = cum > p.top_p",
           (T_SAMPLE,), "top-p drops the token whose mass crosses top_p (the kept set falls short of top_p)"),
    Mutant("top_k_drops_ties_at_k", "decoding", "specmoe/decoding/runtime/sampling.py",
           "logits = logits.masked_fill(logits < kth, float(\"-inf\"))",
           "logits = logits.masked_fill(logits <= kth, float(\"-inf\"))",
           (T_SAMPLE,), "top-k keeps k - 1 tokens"),
    Mutant("temperature_multiplies", "decoding", "specmoe/decoding/runtime/sampling.py",
           "logits = (logits - logits.amax(-1, keepdim=True)) / p.temperature",
           "logits = (logits - logits.amax(-1, keepdim=True)) * p.temperature",
           (T_SAMPLE,), "the temperature multiplies the logits instead of dividing them"),
    Mutant("ngram_shortest_match_wins", "decoding", "specmoe/decoding/drafters/ngram.py",
           "for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):\n            start = ",
           "for n in range(self.n_min, min(self.n_max, L - 1) + 1):\n            start = ",
           ("tests/decoding/test_ngram.py",), "the n-gram lookup takes the shortest matching suffix, not the longest"),
    Mutant("ngram_suffix_matches_itself", "decoding", "specmoe/decoding/drafters/ngram.py",
           "self._index_upto(L - 1)  # the suffix itself", "self._index_upto(L)  # the suffix itself",
           ("tests/decoding/test_ngram.py",), "the n-gram lookup finds the suffix itself (nothing follows it)"),
    Mutant("rejection_residual_is_p", "decoding", "specmoe/decoding/trees/tree.py",
           "resid = (p - q).clamp_min(0)", "resid = p.clone()",
           ("tests/decoding/test_sampled_speculation.py::test_accept_converges_to_target_with_greedy_rows_in_the_batch",),
           "after a rejected draft, the correction samples p instead of the residual max(0, p - q)"),
    Mutant("exact_walk_follows_mismatch", "decoding", "specmoe/decoding/trees/tree.py",
           "nxt = next((c for c in kids[r] if tree.tokens[c - 1] == pick[r]), None)",
           "nxt = next((c for c in kids[r] if tree.tokens[c - 1] != pick[r]), None)",
           ("tests/decoding/test_trees.py::test_tree_accepts_off_chain_paths_and_compacts_their_kv",),
           "greedy verification follows a child that differs from the target's pick"),
    Mutant("acceptance_not_a_chain_product", "decoding", "specmoe/decoding/control/learning.py",
           "p = np.cumprod((self.hit[:, 0] + self.w * self.prior) / n)",
           "p = (self.hit[:, 0] + self.w * self.prior) / n",
           ("tests/decoding/test_controller_feedback.py::"
            "test_acceptance_per_position_is_the_product_of_the_chain_conditionals",),
           "a chain's P_j is taken as its depth's conditional, not the product of the conditionals before it"),
    Mutant("acceptance_not_recorded_once", "decoding", "specmoe/decoding/strategies/speculative.py",
           "            self.record_acceptance(plan, seqs, trees, paths, out)", "            pass",
           ("tests/decoding/test_pricing_shared.py::"
            "test_the_selector_and_the_controller_price_with_one_acceptance_estimate_recorded_once",),
           "the decoder no longer records the shared acceptance estimate (selector and controller price on priors)"),
    Mutant("crossing_interpolates_wrong", "bench", "specmoe/bench/auto_control.py",
           "t = (1 - s0) / (s1 - s0)", "t = (1 - s0) / (s1 + s0)",
           ("tests/bench/test_control.py::test_crossing_interpolates_in_log_phi",),
           "the φ where speculation starts to pay is interpolated with the wrong weight"),
    # ---------------------------------------------------------------- experts (the draft set)
    Mutant("draft_hits_count_every_assignment", "experts", "specmoe/decoding/drafters/draft_experts.py",
           "self.hits += sum(counts[e] for e in self.ids[layer])", "self.hits += sum(counts)",
           (f"{T_SPEC}::test_greedy_specmoe_equals_plain_greedy[mixtral-1-3-mask-hot-global]",),
           "every routed assignment counts as a draft-set hit"),
    Mutant("draft_set_takes_coldest", "experts", "specmoe/decoding/drafters/draft_experts.py",
           "order = sorted(range(len(counts)), key=lambda e: (-counts[e], e not in prefer, e))",
           "order = sorted(range(len(counts)), key=lambda e: (counts[e], e not in prefer, e))",
           ("tests/decoding/test_draft.py::test_profile_formats_and_top_n",),
           "the draft set takes the least-used experts"),
    Mutant("draft_ties_ignore_resident", "experts", "specmoe/decoding/drafters/draft_experts.py",
           "key=lambda e: (-counts[e], e not in prefer, e))", "key=lambda e: (-counts[e], e))",
           ("tests/decoding/test_draft.py::test_profile_formats_and_top_n",),
           "ties for the draft set ignore what is already resident (needless refreshes)"),
    # ---------------------------------------------------------------- models
    Mutant("probe_rows_past_never_worse", "models", "specmoe/models/orientation.py",
           "if max(at.values()) > WIN:", "if max(at.values()) > NEVER_WORSE:",
           (f"{T_ORI}::test_probe_win_needs_the_median_and_every_row_count",),
           "past the probed rows, weight-major is kept while merely no worse, not while it wins"),
    Mutant("softmax_topk_not_renormalised", "models", "specmoe/models/routers.py",
           "return torch.softmax(values, dim=-1), ids",
           "return torch.softmax(logits, dim=-1).gather(-1, ids), ids",
           ("tests/models/test_routers.py",), "Mixtral-style routing weights not renormalised over the top-k"),
    Mutant("group_score_best_one", "models", "specmoe/models/routers.py",
           "group_scores = choice.view(N, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)",
           "group_scores = choice.view(N, n_group, E // n_group).topk(1, dim=-1)[0].sum(dim=-1)",
           (f"{T_FAM}::test_routers_match_transformers",),
           "a sigmoid router's expert group scores its best expert instead of its two best"),
    Mutant("rope_sin_sign_swapped", "models", "specmoe/models/rope.py",
           "sin = torch.cat((-sin, sin), dim=-1)", "sin = torch.cat((sin, -sin), dim=-1)",
           (f"{T_HF}::test_logits_match_transformers[mixtral]",), "rotary embeddings rotate the wrong way"),
    Mutant("yarn_ramp_reversed", "models", "specmoe/models/rope.py",
           "extrapolation = 1 - ramp  #", "extrapolation = ramp  #",
           (f"{T_FAM}::test_logits_and_greedy_match_transformers[deepseek_v3]",),
           "YaRN scales the high frequencies and keeps the low ones"),
    # ---------------------------------------------------------------- families
    Mutant("head_dim_default_from_kv_heads", "families", "specmoe/families/reader.py",
           'head_dim = f.int("head_dim", default=H // n_heads)', 'head_dim = f.int("head_dim", default=H // n_kv)',
           (f"{T_HF}::test_logits_match_transformers[mixtral]",),
           "a config without head_dim divides the hidden size by the K/V heads"),
    Mutant("qwen2_qkv_bias_default_off", "families", "specmoe/families/qwen2_moe.py",
           '"qkv_bias": f.bool("qkv_bias", True)', '"qkv_bias": f.bool("qkv_bias", False)',
           (f"{T_CFG}::test_qwen2_moe_without_qkv_bias_has_the_biases",),
           "a Qwen2-MoE config without qkv_bias (Qwen1.5-MoE's) loses its q/k/v biases"),
    Mutant("olmoe_o_proj_bias_dropped", "families", "specmoe/families/olmoe.py",
           '"o_proj_bias": bias,', '"o_proj_bias": False,',
           (f"{T_HF}::test_attention_bias_checkpoint_matches_transformers[olmoe]",),
           "OLMoE with attention_bias ignores the output projection's bias"),
    Mutant("qwen_sparse_step_off_by_one", "families", "specmoe/families/parts.py",
           "(i + 1) % step == 0)", "i % step == 0)",
           (f"{T_CFG}::test_sparse_step_picks_the_moe_layers",),
           "decoder_sparse_step counts MoE layers from the first layer instead of the step-th"),
    # ---------------------------------------------------------------- serve
    Mutant("top_p_zero_accepted", "serve", "specmoe/serve/protocol.py",
           '"top_p": _number(body, "top_p", 1.0, lo=0.0, lo_open=True, hi=1.0)',
           '"top_p": _number(body, "top_p", 1.0, lo=0.0, lo_open=False, hi=1.0)',
           (f"{T_API}::test_bad_request_gets_an_openai_error_then_the_server_serves[completions-top_p-4]",),
           "top_p = 0 accepted (it keeps no token)"),
    Mutant("max_tokens_checked_against_context_only", "serve", "specmoe/serve/protocol.py",
           "    if v > left:\n", "    if v > max_model_len:\n",
           (f"{T_API}::test_bad_request_gets_an_openai_error_then_the_server_serves[completions-max_tokens-7]",),
           "max_tokens is not checked against the context left after the prompt"),
    Mutant("n_choices_share_one_seed", "serve", "specmoe/serve/protocol.py",
           "seed = p.seed + j\n", "seed = p.seed\n", (f"{T_API}::test_n_choices_and_seeds",),
           "the n choices of a seeded request all use the same seed (identical choices)"),
    Mutant("n_zero_accepted", "serve", "specmoe/serve/protocol.py",
           '"n": _int(body, "n", 1, lo=1, hi=config.max_n)', '"n": _int(body, "n", 1, lo=0, hi=config.max_n)',
           (f"{T_API}::test_bad_request_gets_an_openai_error_then_the_server_serves[completions-n-10]",),
           "n = 0 accepted"),
    # ---------------------------------------------------------------- bench
    Mutant("control_report_error_one_decimal", "bench", "specmoe/bench/auto_control.py",
           "{_f(sy.get('median_abs_err_all'), '{:.0%}')}", "{_f(sy.get('median_abs_err_all'), '{:.1%}')}",
           ("tests/bench/test_control.py::test_committed_control_md_is_generated_from_control_json",),
           "control.md's median error printed otherwise than the committed page"),
    Mutant("timeline_steady_from_the_start", "bench", "specmoe/bench/sysprobe.py",
           '"steady_tokens": n_end - nk,', '"steady_tokens": n_end,',
           ("tests/bench/test_over_ram.py::test_timeline_windows",),
           "the steady window's token count includes the first window's"),
    Mutant("plot_skip_returns_none", "bench", "specmoe/bench/plots.py",
           "        return False\n    return draw(res, path)", "        return None\n    return draw(res, path)",
           ("tests/bench/test_plots_optional.py",),
           "a skipped plot is reported as drawn (callers name a PNG that was never written)"),
]
