"""EAGLE draft heads: one (or a few) Llama decoder layers that predict the target's next feature from the
target's own features and the next token's embedding, sharing the target's embeddings (and, for EAGLE-1,
its LM head).

Two published layouts (config.json + model.safetensors), told apart by their weight names:

- **EAGLE-1** (`fc.weight` [D, 2·D] (+ `fc.bias`), `layers.{i}.*`): x = fc(concat(embed(token), feature)),
  then Llama decoder layers (layer 0 has no `input_layernorm`: fc's output enters attention directly), then
  the target's LM head on the layer's output (no norm: the feature it regresses is the target's final,
  normed hidden state, the one the LM head reads).
- **EAGLE-3** (`fc.weight` [D, 3·Dt], `midlayer.*`, `norm.weight`, `lm_head.weight` [Vd, D], `d2t` [Vd],
  `t2d` [V]): the concatenation of three target hidden states (low / middle / high layers) goes through fc
  (no bias) to D; the midlayer's attention reads concat(input_layernorm(embed(token)), hidden_norm(h)) of
  width 2·D with the residual h; its own `norm` and `lm_head` score a reduced draft vocabulary, draft id d
  being target id d + d2t[d]. A draft step past the first feeds the head's own output (width D) back, which
  skips fc.

A head entry at position t reads (token t+1, feature of position t) and predicts the feature of position
t+1; its keys/values live in a one-layer `KVCache` addressed like the target's (slot, position), so drafting
extends it and rolling back is a length change. `load_eagle_head` reads a head directory and refuses
pickle-only heads, missing or unexpected keys and shape mismatches with a `CheckpointError`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from specmoe.config import Fields, ModelConfig, read_json_object
from specmoe.errors import CheckpointError, UnsupportedModelError
from specmoe.models.decoder import Attention, BatchView
from specmoe.models.kv_cache import KVCache
from specmoe.models.layers import DenseMLP, RMSNorm, linear
from specmoe.models.rope import inv_freq, rope_tables

# B=batch, T=positions, D=head hidden, Dt=target hidden, V=target vocab, Vd=draft vocab

WEIGHTS = "model.safetensors"
PICKLES = ("pytorch_model.bin", "model.pt", "model.pth", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class EagleConfig:
    version: int  # 1 (EAGLE / EAGLE-2 heads) or 3
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    target_hidden_size: int
    draft_vocab_size: int  # EAGLE-1: vocab_size (it scores with the target's LM head)
    fc_bias: bool = True
    attention_bias: bool = False
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3: which target layers' inputs feed fc (None: default)

    @property
    def feature_layers(self) -> int:
        """Target hidden states concatenated into fc's input (1: the final normed one)."""
        return 3 if self.version == 3 else 1

    def layer_config(self) -> ModelConfig:
        """The decoder-layer sizes as a `ModelConfig` (the attention and RoPE code read one)."""
        return ModelConfig(model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, num_experts=1, top_k=1, expert_intermediate_size=0,
                           dense_intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
                           qkv_bias=self.attention_bias, o_proj_bias=self.attention_bias)

    def target_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """Target layer indices whose input hidden state the drafter needs; `num_target_layers` means the
        final normed state (EAGLE-1). EAGLE-3's default: layers 2, L//2 and L-3 (clamped into [1, L-1])."""
        L = num_target_layers
        if self.version == 1:
            return (L,)
        ids = self.aux_layers or (2, L // 2, L - 3)
        return tuple(min(max(i, 1), L - 1) for i in ids)

    @staticmethod
    def from_json(raw: dict, version: int, source: str) -> "EagleConfig":
        f = Fields(raw, source)
        D = f.int("hidden_size")
        heads = f.int("num_attention_heads")
        kv = f.int("num_key_value_heads", default=heads, hi=heads)
        if heads % kv:
            f.fail("num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv)
        if raw.get("head_dim") is None and D % heads:
            f.fail("hidden_size", f"a multiple of num_attention_heads ({heads}) when head_dim is absent", D)
        act = f.str("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            f.fail("rope_scaling", "an object or null", rope)
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in ("default", None):
            raise UnsupportedModelError(f"{source}: rope type {rtype!r} is not supported for EAGLE heads")
        V = f.int("vocab_size")
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        if aux is not None and (not isinstance(aux, list) or len(aux) != 3 or any(type(i) is not int for i in aux)):
            f.fail("eagle_aux_hidden_state_layer_ids", "a list of 3 layer indices", aux)
        return EagleConfig(
            version=version, hidden_size=D, intermediate_size=f.int("intermediate_size"),
            num_layers=f.int("num_hidden_layers", default=1), num_heads=heads, num_kv_heads=kv,
            head_dim=f.int("head_dim", default=D // heads), rms_norm_eps=f.float("rms_norm_eps", 1e-6),
            rope_theta=f.float("rope_theta", 10000.0, value=rope.get("rope_theta", raw.get("rope_theta"))),
            vocab_size=V, max_position_embeddings=f.int("max_position_embeddings", default=4096),
            target_hidden_size=f.int("target_hidden_size", default=D),
            draft_vocab_size=f.int("draft_vocab_size", default=V) if version == 3 else V,
            attention_bias=f.bool("attention_bias", False), aux_layers=tuple(aux) if aux else None)


class EagleLayer(nn.Module):
    """A Llama decoder layer whose attention reads `in_dim` features (2·D for EAGLE-3's midlayer)."""

    def __init__(self, cfg: ModelConfig, in_dim: int, input_norm: bool):
        super().__init__()
        D = cfg.hidden_size
        self.input_norm = RMSNorm(D, cfg.rms_norm_eps) if input_norm else None
        self.attn = Attention(cfg)
        if in_dim != D:  # EAGLE-3: q/k/v project the 2·D concatenation
            self.attn.q_proj = nn.Linear(in_dim, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
            self.attn.k_proj = nn.Linear(in_dim, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
            self.attn.v_proj = nn.Linear(in_dim, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.post_attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.mlp = DenseMLP(D, cfg.dense_intermediate_size)

    def forward(self, attn_in, residual, cos, sin, mask, cache: KVCache, layer: int, bv: BatchView):
        """attn_in [B·T, in_dim], residual [B·T, D] → [B·T, D]."""
        h = residual + self.attn(attn_in, cos, sin, mask, cache, layer, bv)
        return h + self.mlp(self.post_attn_norm(h))


class EagleHead(nn.Module):
    def __init__(self, hc: EagleConfig):
        super().__init__()
        self.hc = hc
        self.cfg = cfg = hc.layer_config()
        D = hc.hidden_size
        if hc.version == 1:
            self.fc = nn.Linear(2 * D, D, bias=hc.fc_bias)
            self.layers = nn.ModuleList(EagleLayer(cfg, D, input_norm=i > 0) for i in range(hc.num_layers))
            self.norm = self.lm_head = None  # the target's LM head scores drafts, until `restrict_vocab`
            self.d2t: torch.Tensor | None = None
        else:
            self.fc = nn.Linear(3 * hc.target_hidden_size, D, bias=hc.fc_bias)
            self.embed_norm = RMSNorm(D, hc.rms_norm_eps)
            self.hidden_norm = RMSNorm(D, hc.rms_norm_eps)
            self.layers = nn.ModuleList([EagleLayer(cfg, 2 * D, input_norm=False)])
            self.norm = RMSNorm(D, hc.rms_norm_eps)
            self.lm_head = nn.Linear(D, hc.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(hc.draft_vocab_size, dtype=torch.long))
        self._rope: tuple | None = None

    def new_cache(self, max_batch: int, max_seq: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(num_layers=len(self.layers), max_batch=max_batch, max_seq=max_seq,
                       num_kv_heads=self.hc.num_kv_heads, head_dim=self.hc.head_dim, dtype=dtype, device=device)

    def forward(self, embeds: torch.Tensor, feats: torch.Tensor, cache: KVCache, bv: BatchView) -> torch.Tensor:
        """embeds [B, T, D] (the target's embedding of each entry's token), feats [B, T, F] (each entry's
        feature: the target's (F = D), EAGLE-3's three target states (F = 3·Dt, through fc) or the head's own
        previous output (F = D)) → the head's output [B, T, D], the predicted next feature (see `logits`).
        Writes K/V at `bv`'s positions (or at the rows `bv.write_index` names, when set)."""
        B, T, D = embeds.shape
        if self._rope is None or self._rope[0].device != embeds.device:
            self._rope = inv_freq(self.cfg, embeds.device)
        cos, sin = rope_tables(bv.positions, *self._rope, embeds.dtype)
        cos, sin = cos.reshape(B * T, 1, 1, -1), sin.reshape(B * T, 1, 1, -1)  # the decoder's [B·T, 1, 1, R]
        keys = torch.arange(bv.key_len, device=embeds.device)
        mask = (keys[None, None, :] <= bv.positions[:, :, None])[:, None]  # [B, 1, T, S]
        if bv.write_index is None:  # a caller may direct some entries elsewhere (the drafter's padding)
            bv.write_index = cache.write_index(bv.slots, bv.positions)
        e, h = embeds.reshape(B * T, D), feats.reshape(B * T, -1)
        if self.hc.version == 1:
            x = linear(torch.cat((e, h), dim=-1), self.fc.weight, self.fc.bias)
            for i, layer in enumerate(self.layers):
                x = layer(x if layer.input_norm is None else layer.input_norm(x), x, cos, sin, mask, cache, i, bv)
        else:
            if h.shape[-1] != D:  # the target's three hidden states; the head's own output skips fc
                h = linear(h, self.fc.weight, self.fc.bias)
            x = self.layers[0](torch.cat((self.embed_norm(e), self.hidden_norm(h)), dim=-1), h, cos, sin, mask,
                               cache, 0, bv)
        return x.view(B, T, D)

    def restrict_vocab(self, target_head: torch.Tensor, token_ids: torch.Tensor) -> None:
        """EAGLE-1: draft over `token_ids` (target ids) only, like EAGLE-3's reduced vocabulary: their rows of the
        target's LM head `target_head` [V, D] are gathered once into the head's own contiguous `lm_head`
        [Vd, D] and `d2t` maps draft id d to target id d + d2t[d]."""
        if self.hc.version != 1 or self.lm_head is not None:
            raise UnsupportedModelError("a reduced draft vocabulary applies to an EAGLE-1 head over the full "
                                        "vocabulary (an EAGLE-3 head ships its own)")
        ids = torch.unique(token_ids.to(device=target_head.device, dtype=torch.long))  # sorted, distinct
        if ids.numel() < 1 or int(ids[0]) < 0 or int(ids[-1]) >= target_head.shape[0]:
            raise CheckpointError(f"draft vocabulary: token ids outside [0, {target_head.shape[0]})")
        self.lm_head = nn.Linear(self.hc.hidden_size, ids.numel(), bias=False, device=target_head.device,
                                 dtype=target_head.dtype)
        self.lm_head.weight = nn.Parameter(target_head.index_select(0, ids).contiguous(), requires_grad=False)
        self.d2t = ids - torch.arange(ids.numel(), device=ids.device)
        self.hc = replace(self.hc, draft_vocab_size=ids.numel())

    def draft_logits(self, x: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
        """[..., D] → scores over the draft vocabulary [..., Vd] (`to_target` maps a draft id back); an EAGLE-1
        head without a reduced vocabulary: the target's LM head (Vd = V, draft id = target id)."""
        if self.lm_head is None:
            return linear(x, target_head)
        # EAGLE-1 regresses the normed feature
        return linear(x if self.norm is None else self.norm(x), self.lm_head.weight)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids → target ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def logits(self, x: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
        """[..., D] → target-vocabulary logits [..., V] (-inf outside a reduced draft vocabulary)."""
        d = self.draft_logits(x, target_head)
        if self.d2t is None:
            return d
        out = d.new_full((*d.shape[:-1], self.hc.vocab_size), float("-inf"))
        return out.index_copy_(-1, torch.arange(d.shape[-1], device=d.device) + self.d2t, d)


def _head_keys(hc: EagleConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """module parameter name → (published key, shape)."""
    D, I, Dh = hc.hidden_size, hc.intermediate_size, hc.head_dim
    q, kv = hc.num_heads * Dh, hc.num_kv_heads * Dh
    out: dict[str, tuple[str, tuple[int, ...]]] = {}

    def layer(mod: str, key: str, in_dim: int, input_norm: bool):
        if input_norm:
            out[f"{mod}.input_norm.weight"] = (f"{key}.input_layernorm.weight", (D,))
        for p, n in (("q", q), ("k", kv), ("v", kv)):
            out[f"{mod}.attn.{p}_proj.weight"] = (f"{key}.self_attn.{p}_proj.weight", (n, in_dim))
            if hc.attention_bias:
                out[f"{mod}.attn.{p}_proj.bias"] = (f"{key}.self_attn.{p}_proj.bias", (n,))
        out[f"{mod}.attn.o_proj.weight"] = (f"{key}.self_attn.o_proj.weight", (D, q))
        if hc.attention_bias:
            out[f"{mod}.attn.o_proj.bias"] = (f"{key}.self_attn.o_proj.bias", (D,))
        out[f"{mod}.post_attn_norm.weight"] = (f"{key}.post_attention_layernorm.weight", (D,))
        for p, shape in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
            out[f"{mod}.mlp.{p}_proj.weight"] = (f"{key}.mlp.{p}_proj.weight", shape)

    if hc.version == 1:
        out["fc.weight"] = ("fc.weight", (D, 2 * D))
        if hc.fc_bias:
            out["fc.bias"] = ("fc.bias", (D,))
        for i in range(hc.num_layers):
            layer(f"layers.{i}", f"layers.{i}", D, i > 0)
    else:
        out["fc.weight"] = ("fc.weight", (D, 3 * hc.target_hidden_size))
        if hc.fc_bias:
            out["fc.bias"] = ("fc.bias", (D,))
        out["embed_norm.weight"] = ("midlayer.input_layernorm.weight", (D,))
        out["hidden_norm.weight"] = ("midlayer.hidden_norm.weight", (D,))
        layer("layers.0", "midlayer", 2 * D, False)
        out["norm.weight"] = ("norm.weight", (D,))
        out["lm_head.weight"] = ("lm_head.weight", (hc.draft_vocab_size, D))
        out["d2t"] = ("d2t", (hc.draft_vocab_size,))
    return out


# keys a published head may carry that the drafter does not use: its copy of the target's embedding (the
# target's own is shared), EAGLE-3's target → draft membership mask (d2t carries the mapping)
OPTIONAL_KEYS = ("embed_tokens.weight", "t2d")


def load_eagle_head(path: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu",
                    target_vocab: int | None = None, target_hidden: int | None = None) -> EagleHead:
    """Read an EAGLE-1 or EAGLE-3 head directory (config.json + model.safetensors in the published key
    layout). `target_vocab` / `target_hidden`, when given, must match the head's (a head trained for
    another model is refused)."""
    from safetensors import SafetensorError, safe_open
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"EAGLE head directory not found: {path}")
    wpath = path / WEIGHTS
    if not wpath.is_file():
        pick = [p for p in PICKLES if (path / p).exists()]
        if pick:
            raise CheckpointError(f"{path}: the EAGLE head ships only pickle weights ({pick[0]}); specmoe loads "
                                  f"{WEIGHTS} only (pickles can run code when read): convert it to safetensors")
        raise CheckpointError(f"{path}: no {WEIGHTS}")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: missing config.json")
    raw = read_json_object(path / "config.json")
    try:
        with safe_open(str(wpath), framework="pt") as f:
            keys = set(f.keys())
            version = 3 if any(k.startswith("midlayer.") for k in keys) else 1
            hc = EagleConfig.from_json(raw, version, f"{path / 'config.json'} (EAGLE-{version} head)")
            hc = EagleConfig(**{**hc.__dict__, "fc_bias": "fc.bias" in keys})
            if version == 1 and not any(k.startswith("layers.0.") for k in keys):
                raise CheckpointError(f"{wpath}: neither an EAGLE-1 head (layers.0.*) nor an EAGLE-3 head "
                                      "(midlayer.*)")
            if target_vocab is not None and hc.vocab_size != target_vocab:
                raise CheckpointError(f"{path}: the head's vocab_size {hc.vocab_size} != the target's {target_vocab}")
            tgt = target_hidden if target_hidden is not None else hc.target_hidden_size
            if hc.target_hidden_size != tgt or (version == 1 and hc.hidden_size != tgt):
                raise CheckpointError(f"{path}: the head reads hidden states of size "
                                      f"{hc.target_hidden_size if version == 3 else hc.hidden_size}; "
                                      f"the target's are {tgt}")
            names = _head_keys(hc)
            want = {k for k, _ in names.values()}
            missing = sorted(want - keys)
            if missing:
                raise CheckpointError(f"{wpath}: missing key(s) {', '.join(missing[:5])}"
                                      f"{' ...' if len(missing) > 5 else ''} of an EAGLE-{version} head")
            extra = sorted(keys - want - set(OPTIONAL_KEYS))
            if extra:
                raise CheckpointError(f"{wpath}: unexpected key(s) {', '.join(extra[:5])} for an EAGLE-{version} "
                                      f"head with {hc.num_layers} layer(s)")
            with torch.device("meta"):
                head = EagleHead(hc)
            for pname, (key, shape) in names.items():
                t = f.get_tensor(key)
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"{wpath}: {key} has shape {tuple(t.shape)}, expected {shape} "
                                          f"from config.json")
                t = t.to(device=device, dtype=torch.long if pname == "d2t" else dtype)
                mod_name, attr = pname.rsplit(".", 1) if "." in pname else ("", pname)
                mod = head.get_submodule(mod_name)
                if pname == "d2t":
                    mod.register_buffer("d2t", t)
                else:
                    setattr(mod, attr, nn.Parameter(t, requires_grad=False))
            if version == 3:
                ids = torch.arange(hc.draft_vocab_size, device=device) + head.d2t
                if int(ids.min()) < 0 or int(ids.max()) >= hc.vocab_size or len(set(ids.tolist())) != len(ids):
                    raise CheckpointError(f"{wpath}: d2t maps draft ids outside [0, {hc.vocab_size}) or onto the "
                                          "same target id twice")
    except SafetensorError as e:
        raise CheckpointError(f"{wpath}: not a readable safetensors file ({e})") from None
    return head.eval()


DRAFT_VOCAB = "draft_vocab.safetensors"  # beside a head: `token_ids` [V], target ids by falling frequency


def read_draft_vocab(path: str | Path, n: int, vocab_size: int) -> torch.Tensor:
    """The `n` most frequent target token ids from a head directory's `draft_vocab.safetensors` (a ranking of
    target ids, most frequent first, with their `counts`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    f = Path(path) / DRAFT_VOCAB
    if not f.is_file():
        raise CheckpointError(f"{path}: no {DRAFT_VOCAB} (the token frequency ranking a reduced draft vocabulary "
                              "is chosen from); use eagle_draft_vocab=0 (the full vocabulary)")
    try:
        ranking = load_file(str(f)).get("token_ids")
    except SafetensorError as e:
        raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
    if ranking is None or ranking.dim() != 1 or ranking.dtype != torch.long:
        raise CheckpointError(f"{f}: expected a 1-D int64 tensor token_ids")
    if not 0 < n < vocab_size or n > ranking.numel():
        top = min(ranking.numel(), vocab_size - 1)
        raise CheckpointError(f"{f}: eagle_draft_vocab={n}: choose 0 (full vocabulary) or 1..{top}")
    ids = ranking[:n]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or torch.unique(ids).numel() != n:
        raise CheckpointError(f"{f}: token_ids outside [0, {vocab_size}) or repeated")
    return ids


def recommended_draft_vocab(path: str | Path) -> int:
    """The draft vocabulary size recommended for a head (`draft_vocab.safetensors` metadata
    `recommended_size`, measured by benchmarks/eagle_bench.py); 0 (full vocabulary) when there is none."""
    from safetensors import safe_open
    f = Path(path) / DRAFT_VOCAB
    if not f.is_file():
        return 0
    with safe_open(str(f), framework="pt") as fh:
        raw = (fh.metadata() or {}).get("recommended_size", "0")
    if not raw.isdigit():
        raise CheckpointError(f"{f}: metadata recommended_size {raw!r} is not a whole number")
    return int(raw)


def save_eagle_head(head: EagleHead, path: str | Path, *, dtype: torch.dtype = torch.float32,
                    extra_config: dict | None = None) -> None:
    """Write a head in the published layout (config.json + model.safetensors with the published keys)."""
    from safetensors.torch import save_file
    hc, path = head.hc, Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = dict(head.named_parameters()) | dict(head.named_buffers())
    tensors = {key: state[p].detach().to("cpu", torch.long if p == "d2t" else dtype).contiguous()
               for p, (key, _) in _head_keys(hc).items()}
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLM" if hc.version == 1 else "LlamaForCausalLMEagle3"],
           "model_type": "llama", "hidden_size": hc.hidden_size, "intermediate_size": hc.intermediate_size,
           "num_hidden_layers": hc.num_layers, "num_attention_heads": hc.num_heads,
           "num_key_value_heads": hc.num_kv_heads, "head_dim": hc.head_dim, "rms_norm_eps": hc.rms_norm_eps,
           "rope_theta": hc.rope_theta, "vocab_size": hc.vocab_size, "hidden_act": "silu",
           "max_position_embeddings": hc.max_position_embeddings, "attention_bias": hc.attention_bias,
           "torch_dtype": str(dtype).removeprefix("torch.")}
    if hc.version == 3:
        cfg.update(draft_vocab_size=hc.draft_vocab_size, target_hidden_size=hc.target_hidden_size)
        if hc.aux_layers:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(hc.aux_layers)}
    cfg.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
