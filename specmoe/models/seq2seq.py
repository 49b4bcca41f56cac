"""The encoder–decoder model (NLLB-MoE, M2M100-style): what is new next to the generic decoder.

- embeddings scaled by `embed_scale`, plus sinusoidal positions (transformers' M2M100 table: position p of a
  sequence without padding is row p + pad + 1);
- pre-LayerNorm layers with biased multi-head attention (`BiasedAttention`) and ReLU FFNs: dense (`ReluFFN`) or the
  generic `MoEBlock` (top-2 router `routers.top2_capacity`, ReLU experts computed from the expert store's slots,
  the same store and cache as every family's experts);
- the encoder (`Seq2SeqModel.encode`), run once per request over its source alone, whose output the decoder's
  cross-attention reads: each decoder layer's cross K/V over the source are computed once, right after the encoder,
  and kept per sequence in the KV cache's `cross` part (`kv_cache.EncDecCache`);
- the decoder (`Seq2SeqModel.forward`, the same signature as `decoder.Transformer.forward`): self-attention over the
  KV cache (masks, tree verification and the attention kernel shared with the decoder-only model), cross-attention
  over the sequence's source, the FFN.

Layers are numbered encoder first (`config.Seq2Seq`): `layers[i]` is encoder layer i, `layers[Le + j]` decoder layer
j, so the MoE layers' ids are the expert store's layer ids; the decoder's KV cache is indexed by j.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import ModelConfig
from specmoe.errors import UnsupportedModelError
from specmoe.models.attention import attention, fixed_split, padded_keys, read_keys
from specmoe.models.decoder import BatchView, attention_mask, set_write_index
from specmoe.models.kv_cache import EncDecCache
from specmoe.models.rowclasses import deterministic_rows
from specmoe.models.layers import Embedding, LayerNorm, linear, set_min_rows
from specmoe.models.moe import ForwardContext, MoEBlock

# B=batch, T=new decoder tokens per sequence, S=positions (source or decoder keys), D=hidden, H=heads, Dh=head dim


def sinusoidal_table(n: int, dim: int, padding_idx: int) -> torch.Tensor:
    """transformers' `M2M100SinusoidalPositionalEmbedding.get_embedding`: [n, dim] fp32, [sin | cos] halves (a zero
    column for odd dims), row `padding_idx` zero."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    emb = torch.arange(n, dtype=torch.int64).float()[:, None] * freq[None]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros(n, 1)], dim=1)
    emb[padding_idx] = 0
    return emb


class BiasedAttention(nn.Module):
    """Multi-head attention with biased q/k/v/out projections (no RoPE, no GQA): the encoder's self-attention
    (bidirectional, `encoder`), the decoder's self-attention (`self_attend`, over the KV cache) and cross-attention
    (`cross_attend`, over the cross K/V `kv` computes once per request)."""
    rows = 1  # see `layers.linear`; set on a deterministic model

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def _proj(self, p: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] → [N, H, 1, Dh]."""
        return linear(x, p.weight, p.bias, self.rows).view(x.shape[0], self.heads, 1, self.head_dim)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of x [N, D]: [N, H, 1, Dh] each."""
        return self._proj(self.k_proj, x), self._proj(self.v_proj, x)

    def _out(self, out: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """[B, H, T, Dh] → out_proj [B·T, D]."""
        out = out.reshape(B, -1) if T == 1 else out.transpose(1, 2).reshape(B * T, -1)
        return linear(out, self.out_proj.weight, self.out_proj.bias, self.rows)

    def _queries(self, x: torch.Tensor, B: int, T: int) -> torch.Tensor:
        q = self._proj(self.q_proj, x)  # [B·T, H, 1, Dh]
        return q.view(B, self.heads, 1, self.head_dim) if T == 1 else \
            q.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]

    def encoder(self, x: torch.Tensor) -> torch.Tensor:
        """One source, x [S, D] → [S, D]: every position sees every position."""
        S = x.shape[0]
        q = self._queries(x, 1, S)
        k, v = (t.view(1, S, self.heads, self.head_dim).transpose(1, 2) for t in self.kv(x))  # [1, H, S, Dh]
        fixed = fixed_split(q, self.rows)
        if fixed and padded_keys(S) > S:  # the fixed split reads whole blocks (keys past S hidden)
            k, v = (F.pad(t, (0, 0, 0, padded_keys(S) - S)) for t in (k, v))
        return self._out(attention(q, k, v, None, self.head_dim ** -0.5, S, invariant=fixed), 1, S)

    def self_attend(self, x: torch.Tensor, cache: EncDecCache, layer: int, bv: BatchView,
                    mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder's self-attention: x [B·T, D] → [B·T, D]; writes the tokens' K/V into `cache` (decoder layer
        `layer`) at `bv.write_index` and attends over the sequence's positions (`mask`: `decoder.attention_mask`)."""
        B, T = bv.positions.shape
        q = self._queries(x, B, T)
        k, v = self.kv(x)
        cache.write(layer, bv.write_index, k, v)
        fixed = fixed_split(q, self.rows)
        keys, values = read_keys(cache, layer, bv, fixed)
        return self._out(attention(q, keys, values, mask, self.head_dim ** -0.5, bv.key_len, invariant=fixed), B, T)

    def cross_attend(self, x: torch.Tensor, cache: EncDecCache, layer: int, bv: BatchView, src: BatchView,
                     mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder's cross-attention: x [B·T, D] → [B·T, D] over each sequence's source K/V (`cache.cross`,
        decoder layer `layer`); `src` the view of the source positions, `mask` [B, 1, T, S] or None (every row's
        source spans src.key_len)."""
        B, T = bv.positions.shape
        q = self._queries(x, B, T)
        fixed = fixed_split(q, self.rows)
        keys, values = read_keys(cache.cross, layer, src, fixed)
        return self._out(attention(q, keys, values, mask, self.head_dim ** -0.5, src.key_len, invariant=fixed), B, T)


class ReluFFN(nn.Module):
    """The dense FFN: fc2(relu(fc1 x)), both biased."""
    rows = 1

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, inter), nn.Linear(inter, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.relu(linear(x, self.fc1.weight, self.fc1.bias, self.rows)), self.fc2.weight, self.fc2.bias,
                      self.rows)


class Seq2SeqLayer(nn.Module):
    """One pre-LayerNorm layer: x + self-attention, (decoder) x + cross-attention, x + FFN (MoE or dense).
    `layer`: its global index (encoder first); `index`: its index within its stack (the decoder's KV cache layer)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        s2s, D = cfg.seq2seq, cfg.hidden_size
        self.layer, self.encoder = layer, layer < s2s.encoder_layers
        self.index = layer if self.encoder else layer - s2s.encoder_layers
        eps = s2s.layer_norm_eps
        self.self_attn_layer_norm = LayerNorm(D, eps)
        self.self_attn = BiasedAttention(D, s2s.encoder_heads if self.encoder else cfg.num_heads)
        if not self.encoder:
            self.cross_attention_layer_norm = LayerNorm(D, eps)
            self.cross_attention = BiasedAttention(D, cfg.num_heads)
        self.ff_layer_norm = LayerNorm(D, eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoEBlock(cfg, layer) if self.is_moe else \
            ReluFFN(D, s2s.encoder_ffn if self.encoder else cfg.dense_intermediate_size)

    def ffn(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.ff_layer_norm(x)
        return x + (self.mlp(h, ctx) if self.is_moe else self.mlp(h))


class Seq2SeqModel(nn.Module):
    """See the module docstring. Built on `meta`; the loader assigns the weights (`weights.names`)."""
    rows = 1  # see `set_deterministic`

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg, s2s = cfg, cfg.seq2seq
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Seq2SeqLayer(cfg, i) for i in range(s2s.encoder_layers + cfg.num_layers))
        self.encoder_norm = LayerNorm(cfg.hidden_size, s2s.layer_norm_eps)
        self.decoder_norm = LayerNorm(cfg.hidden_size, s2s.layer_norm_eps)
        if not cfg.tie_word_embeddings:  # transformers then unties the stacks' embeddings too
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.encoder_embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self._positions: tuple | None = None  # (device, dtype, table [P, D])

    @property
    def encoder_layers(self) -> list[Seq2SeqLayer]:
        return list(self.layers[: self.cfg.seq2seq.encoder_layers])

    @property
    def decoder_layers(self) -> list[Seq2SeqLayer]:
        return list(self.layers[self.cfg.seq2seq.encoder_layers:])

    def fuse(self) -> "Seq2SeqModel":
        """After loading (the loader's contract): nothing to fuse here."""
        return self

    def set_deterministic(self, on: bool) -> "Seq2SeqModel":
        """As `decoder.Transformer.set_deterministic`."""
        set_min_rows(self, deterministic_rows() if on else 1)
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations and the KV cache are in."""
        return self.embed.weight.dtype

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def embed_at(self, tokens: torch.Tensor, positions: torch.Tensor, encoder: bool = False) -> torch.Tensor:
        """tokens [N], their positions [N] (0-based, no padding) → scaled embeddings (the encoder's own when untied)
        + sinusoidal positions [N, D]."""
        s2s, w = self.cfg.seq2seq, self.embed.weight
        tab = self._positions
        if tab is None or tab[0] != w.device or tab[1] != w.dtype:
            n = self.cfg.max_position_embeddings + s2s.pad_token_id + 2
            table = sinusoidal_table(n, self.cfg.hidden_size, s2s.pad_token_id).to(w.device, w.dtype)
            tab = self._positions = (w.device, w.dtype, table)
        embed = self.encoder_embed if encoder and not self.cfg.tie_word_embeddings else self.embed
        return embed(tokens) * s2s.embed_scale + tab[2][positions + s2s.pad_token_id + 1]

    @torch.inference_mode()
    def encode(self, source: torch.Tensor, cache: EncDecCache, slot: int, ctx: ForwardContext) -> None:
        """Run the encoder over one source (token ids [S], its special tokens included) and write every decoder
        layer's cross-attention K/V over it into `cache.cross` at `slot` (its source length:
        `cache.cross.lengths[slot]`). The encoder's MoE layers fetch their experts through ctx.provider, like the
        decoder's. One source per call: the encoder's capacity rule counts that source's tokens only."""
        S = source.shape[0]
        x = self.embed_at(source, torch.arange(S, device=source.device), encoder=True)
        ctx.padding, ctx.real_tokens = None, None
        for layer in self.encoder_layers:
            x = x + layer.self_attn.encoder(layer.self_attn_layer_norm(x))
            x = layer.ffn(x, ctx)
        h = self.encoder_norm(x)
        cache.reserve_source(S)
        where = (torch.full((S,), slot, device=source.device), torch.arange(S, device=source.device))
        for layer in self.decoder_layers:
            k, v = layer.cross_attention.kv(h)
            cache.cross.write(layer.index, where, k, v)
        cache.cross.lengths[slot] = S

    def source_view(self, cache: EncDecCache, bv: BatchView) -> tuple[BatchView, torch.Tensor | None]:
        """The cross-attention's view of the forward's rows (their slots, over the longest source) and its mask
        [B, 1, T, S] (None when every row's source is that long)."""
        slots = bv.slots.tolist() if bv.slots is not None else list(range(bv.contiguous.start, bv.contiguous.stop))
        lens = [cache.cross.lengths[s] for s in slots]
        src = BatchView(slots=bv.slots, positions=bv.positions, contiguous=bv.contiguous, key_len=max(lens))
        if min(lens) == src.key_len:
            return src, None
        B, T = bv.positions.shape
        visible = torch.arange(src.key_len, device=bv.positions.device)[None] < \
            torch.tensor(lens, device=bv.positions.device)[:, None]  # [B, S]
        return src, visible[:, None, None, :].expand(B, 1, T, src.key_len)

    def forward(self, tokens: torch.Tensor, cache: EncDecCache, bv: BatchView, ctx: ForwardContext,
                logits_at: torch.Tensor | None = None, flat: bool = False) -> torch.Tensor:
        """The decoder, as `decoder.Transformer.forward`: tokens [B, T] → logits [B, T, V] (or [B, n, V] at
        `logits_at` [B, n]; with `flat`, [B·T, V]). Each row's source must have been encoded (`encode`)."""
        if not isinstance(cache, EncDecCache):  # a decoder-only path (profiling, the cost model's calibration)
            raise UnsupportedModelError("profiling the experts (cache_policy='static' without expert_profile.json, "
                                        "`specmoe profile`) runs decoder-only forwards, without sources: not "
                                        f"supported for an encoder–decoder model ({self.cfg.model_type})")
        B, T = tokens.shape
        set_write_index(bv, cache, tokens.device)
        positions = bv.flat_positions if bv.flat_positions is not None else bv.positions.reshape(-1)
        x = self.embed_at(tokens.reshape(-1), positions)  # [B·T, D]
        mask = attention_mask(bv, None)
        src, src_mask = self.source_view(cache, bv)
        ctx.padding = None if bv.valid is None else ~bv.valid.reshape(-1, 1)  # [B·T, 1]
        ctx.real_tokens = None if bv.valid is None else bv.real_tokens
        for layer in self.decoder_layers:
            x = x + layer.self_attn.self_attend(layer.self_attn_layer_norm(x), cache, layer.index, bv, mask)
            x = x + layer.cross_attention.cross_attend(layer.cross_attention_layer_norm(x), cache, layer.index, bv,
                                                       src, src_mask)
            x = layer.ffn(x, ctx)
        if flat:
            return linear(self.decoder_norm(x), self.head_weight(), None, self.rows)
        x = x.view(B, T, -1)
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        return linear(self.decoder_norm(x), self.head_weight(), None, self.rows)
