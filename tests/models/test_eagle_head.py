"""EAGLE heads against a reference forward built from transformers' own Llama modules (LlamaDecoderLayer for
EAGLE-1; LlamaAttention with 2·D q/k/v in-features + LlamaMLP + LlamaRMSNorm for EAGLE-3's midlayer), saved in
the published key layout, read back by `load_eagle_head`, compared in fp32 over a whole sequence and
incrementally through the head's KV cache; and the loader's refusals (pickle-only, missing keys, shapes)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from specmoe.errors import CheckpointError
from specmoe.models.decoder import BatchView
from specmoe.models.eagle import load_eagle_head

D, V, T = 32, 50, 9


def llama_config(layers: int = 1) -> LlamaConfig:
    cfg = LlamaConfig(hidden_size=D, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=layers, vocab_size=V, rms_norm_eps=1e-6, max_position_embeddings=64,
                      rope_theta=10000.0, hidden_act="silu")
    cfg._attn_implementation = "eager"
    return cfg


def causal(T: int) -> torch.Tensor:
    return torch.full((T, T), float("-inf")).triu(1)[None, None]


def randomize(mod: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in mod.parameters():  # norms too, so a swapped norm weight would show
        p.data = torch.randn(p.shape, generator=g) * (0.2 if p.ndim > 1 else 1.0) + (1.0 if p.ndim == 1 else 0.0)


def write_head(path, cfg: LlamaConfig, tensors: dict, extra: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    raw = json.loads(cfg.to_json_string())
    raw.update(extra or {})
    (path / "config.json").write_text(json.dumps(raw))


class Eagle1Ref(nn.Module):
    """EAGLE-1 as published: fc(concat(embed, feature)) → Llama decoder layers, layer 0 without input_layernorm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.fc = nn.Linear(2 * D, D, bias=True)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        del self.layers[0].input_layernorm
        self.layers[0].input_layernorm = nn.Identity()
        self.rope = LlamaRotaryEmbedding(cfg)

    def forward(self, emb, feat):
        x = self.fc(torch.cat((emb, feat), -1))
        pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        pe = self.rope(x, pos)
        for layer in self.layers:
            x = layer(x, attention_mask=causal(x.shape[1]), position_ids=pos, position_embeddings=pe)
        return x


class Eagle3Ref(nn.Module):
    """EAGLE-3's head from transformers' Llama pieces: fc (3·D → D, no bias), a midlayer whose attention reads
    concat(input_layernorm(embed), hidden_norm(h)) (q/k/v in-features 2·D) with residual h, its own norm and a
    reduced-vocabulary lm_head."""

    def __init__(self, cfg: LlamaConfig, Vd: int):
        super().__init__()
        self.fc = nn.Linear(3 * D, D, bias=False)
        attn = LlamaAttention(cfg, 0)
        for p in ("q", "k", "v"):
            old = getattr(attn, f"{p}_proj")
            setattr(attn, f"{p}_proj", nn.Linear(2 * D, old.out_features, bias=False))
        self.self_attn, self.mlp = attn, LlamaMLP(cfg)
        self.input_layernorm, self.hidden_norm = LlamaRMSNorm(D, 1e-6), LlamaRMSNorm(D, 1e-6)
        self.post_attention_layernorm, self.norm = LlamaRMSNorm(D, 1e-6), LlamaRMSNorm(D, 1e-6)
        self.lm_head = nn.Linear(D, Vd, bias=False)
        self.rope = LlamaRotaryEmbedding(cfg)

    def forward(self, emb, aux):
        h = self.fc(aux)
        pos = torch.arange(h.shape[1])[None].expand(h.shape[0], -1)
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(h)), -1)
        a, _ = self.self_attn(x, position_embeddings=self.rope(h, pos), attention_mask=causal(h.shape[1]))
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, self.lm_head(self.norm(h))

    def state(self) -> dict:
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("rope.")}
        out = {"fc.weight": sd.pop("fc.weight"), "norm.weight": sd.pop("norm.weight"),
               "lm_head.weight": sd.pop("lm_head.weight")}
        out.update({f"midlayer.{k}": v for k, v in sd.items()})
        return out


def run_head(head, emb, feat, split: int | None = None):
    """The head over positions 0..T-1 of B sequences, at once or in two forwards through its KV cache."""
    B, n = emb.shape[:2]
    cache = head.new_cache(B, 64, torch.float32, "cpu")
    outs, cuts = [], [0, n] if split is None else [0, split, n]
    for a, b in zip(cuts, cuts[1:]):
        pos = torch.arange(a, b)[None].expand(B, -1)
        bv = BatchView(slots=torch.arange(B), positions=pos, contiguous=slice(0, B), key_len=b)
        outs.append(head(emb[:, a:b], feat[:, a:b], cache, bv))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("layers", [1, 2])
def test_eagle1_matches_transformers_reference(tmp_path, layers):
    torch.manual_seed(0)
    cfg = llama_config(layers)
    ref = Eagle1Ref(cfg)
    randomize(ref, 1)
    sd = {k: v for k, v in ref.state_dict().items() if not k.startswith("rope.")}
    assert "layers.0.input_layernorm.weight" not in sd and ("layers.1.input_layernorm.weight" in sd) == (layers > 1)
    write_head(tmp_path, cfg, sd)
    head = load_eagle_head(tmp_path, target_vocab=V, target_hidden=D)
    assert head.hc.version == 1 and head.hc.num_layers == layers and head.hc.fc_bias
    emb, feat = torch.randn(3, T, D), torch.randn(3, T, D)
    with torch.no_grad():
        want = ref(emb, feat)
        got = run_head(head, emb, feat)
        got_inc = run_head(head, emb, feat, split=5)
    # fp32 to rounding (hidden states ~10 here: 1e-5 is a few ulps; the native kernels' norm sums in another order)
    assert (got - want).abs().max() <= 1e-4
    assert (got_inc - want).abs().max() <= 1e-4
    lm = torch.randn(V, D)  # EAGLE-1 scores with the target's LM head, no norm
    assert torch.equal(head.logits(got, lm), got @ lm.T)


def test_eagle3_matches_transformers_reference(tmp_path):
    torch.manual_seed(0)
    cfg, Vd = llama_config(), 20
    ref = Eagle3Ref(cfg, Vd)
    randomize(ref, 2)
    d2t = torch.randperm(V)[:Vd].sort().values - torch.arange(Vd)  # draft id d -> target id d + d2t[d]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(Vd) + d2t] = True
    write_head(tmp_path, cfg, ref.state() | {"d2t": d2t, "t2d": t2d}, {"draft_vocab_size": Vd})
    head = load_eagle_head(tmp_path, target_vocab=V, target_hidden=D)
    assert head.hc.version == 3 and head.hc.draft_vocab_size == Vd and not head.hc.fc_bias
    assert head.hc.target_layers(12) == (2, 6, 9)
    emb, aux = torch.randn(2, T, D), torch.randn(2, T, 3 * D)
    with torch.no_grad():
        want_h, want_logits = ref(emb, aux)
        got = run_head(head, emb, aux)
        got_inc = run_head(head, emb, aux, split=4)
        logits = head.logits(got, torch.empty(0))
    assert (got - want_h).abs().max() <= 1e-5 and (got_inc - want_h).abs().max() <= 1e-5
    ids = torch.arange(Vd) + d2t
    assert (logits[..., ids] - want_logits).abs().max() <= 1e-5
    assert torch.isinf(logits[..., ~t2d]).all()  # tokens outside the draft vocabulary are never proposed
    # a later draft step feeds the head's own D-wide output back: fc is skipped
    with torch.no_grad():
        h2 = run_head(head, emb, got)
        x = torch.cat((ref.input_layernorm(emb), ref.hidden_norm(got)), -1)
        pos = torch.arange(T)[None].expand(2, -1)
        a, _ = ref.self_attn(x, position_embeddings=ref.rope(got, pos), attention_mask=causal(T))
        want2 = got + a
        want2 = want2 + ref.mlp(ref.post_attention_layernorm(want2))
    assert (h2 - want2).abs().max() <= 1e-5


def test_loader_refusals(tmp_path):
    cfg = llama_config()
    ref = Eagle1Ref(cfg)
    sd = {k: v for k, v in ref.state_dict().items() if not k.startswith("rope.")}
    ok = tmp_path / "ok"
    write_head(ok, cfg, sd)
    load_eagle_head(ok)
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_eagle_head(ok, target_vocab=V + 1)
    with pytest.raises(CheckpointError, match="hidden states of size"):
        load_eagle_head(ok, target_hidden=2 * D)

    pick = tmp_path / "pickle"
    pick.mkdir()
    torch.save(sd, pick / "pytorch_model.bin")
    (pick / "config.json").write_text(cfg.to_json_string())
    with pytest.raises(CheckpointError, match="pickle"):
        load_eagle_head(pick)

    miss = tmp_path / "missing"
    write_head(miss, cfg, {k: v for k, v in sd.items() if k != "layers.0.mlp.up_proj.weight"})
    with pytest.raises(CheckpointError, match="missing key.*up_proj"):
        load_eagle_head(miss)

    bad = tmp_path / "shape"
    write_head(bad, cfg, sd | {"fc.weight": torch.zeros(D, 3 * D)})
    with pytest.raises(CheckpointError, match="fc.weight has shape"):
        load_eagle_head(bad)

    extra = tmp_path / "extra"
    write_head(extra, cfg, sd | {"layers.1.mlp.up_proj.weight": torch.zeros(48, D)})
    with pytest.raises(CheckpointError, match="unexpected key"):
        load_eagle_head(extra)

    with pytest.raises(CheckpointError, match="not found"):
        load_eagle_head(tmp_path / "nope")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"not safetensors")
    (junk / "config.json").write_text(cfg.to_json_string())
    with pytest.raises(CheckpointError, match="safetensors"):
        load_eagle_head(junk)
