"""Tiny NLLB-MoE checkpoints saved by transformers' own NllbMoeForConditionalGeneration, a tiny word-level tokenizer
with NLLB's language-code special tokens, and transformers' reference with its expert dispatch as the original
NLLB-MoE computes it.

transformers 5.24's `NllbMoeExperts.forward` one-hot encodes the router's top-1 *mask* (a 0/1 [N, E] tensor) rather
than the chosen expert ids, so it runs `expert_1` for every token's first choice and `expert_0` for its second,
whatever the router picked (tests/models/test_nllb_moe.py::test_transformers_5_24_dispatch_uses_experts_0_and_1 pins
it). The model as published (fairseq, and transformers before the 5.x refactor: `router_mask = router_probs.bool()`,
each expert over the tokens routed to it) sends each token to its two routed experts. specmoe computes that model,
and the reference here is transformers' NLLB-MoE with `NllbMoeExperts.forward` replaced by that dispatch
(`fixed_experts`): router, capacity rule, attention, embeddings and everything else stay transformers' own.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

WORDS = ("the a cat dog sat on mat house red blue green big small river tree sun moon day night water bird fish "
         "walks runs sees eats under over near far old new happy sad quick slow bright dark song book table").split()
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
LANGS = ["eng_Latn", "fra_Latn", "deu_Latn", "spa_Latn"]


def vocab() -> dict[str, int]:
    toks = SPECIALS + LANGS + WORDS
    return {t: i for i, t in enumerate(toks)}


VOCAB = len(vocab())


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer (tokenizers library) whose language codes and </s> are special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import AddedToken
    tok = Tokenizer(models.WordLevel(vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS + LANGS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                            "pad_token": "<pad>", "unk_token": "<unk>"}))


def save_tiny(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny NLLB-MoE saved by transformers (sparse and dense layers in both stacks unless overridden)."""
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration
    kw = dict(vocab_size=VOCAB, d_model=24, encoder_layers=3, decoder_layers=3, encoder_ffn_dim=20,
              decoder_ffn_dim=20, encoder_attention_heads=2, decoder_attention_heads=3, num_experts=6,
              encoder_sparse_step=2, decoder_sparse_step=2, max_position_embeddings=64, init_std=0.1,
              tie_word_embeddings=False, scale_embedding=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = NllbMoeForConditionalGeneration(NllbMoeConfig(**kw)).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


def _dispatch(self, hidden_states, router_mask, router_probs):
    """Each expert over the tokens routed to it (router_probs > 0), its output times the routing weight and, in
    eval, 1 - moe_token_dropout: transformers' NLLB-MoE before 5.x, and fairseq."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        tok = router_probs[:, e].nonzero()[:, 0]
        if tok.numel():
            y = self[f"expert_{e}"](hidden_states[tok]) * router_probs[tok, e, None]
            if self.moe_token_dropout > 0:
                y = y * (1 - self.moe_token_dropout)
            out.index_add_(0, tok, y.to(hidden_states.dtype))
    return out


@contextlib.contextmanager
def fixed_experts():
    from transformers.models.nllb_moe import modeling_nllb_moe as m
    orig = m.NllbMoeExperts.forward
    m.NllbMoeExperts.forward = _dispatch
    try:
        yield
    finally:
        m.NllbMoeExperts.forward = orig


def hf_model(path: Path):
    from transformers import NllbMoeForConditionalGeneration
    return NllbMoeForConditionalGeneration.from_pretrained(path).eval()
