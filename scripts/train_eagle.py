#!/usr/bin/env python3
"""Train an EAGLE-1 draft head for the demo model on the project's corpus, on CPU.

Pipeline position: build_corpus.py -> train_tokenizer.py -> train_demo_model.py -> THIS

* Data (train split of data/corpus only; benchmarks/prompts are excerpts of the held-out split):
  - self-distillation rows: a random `--prompt-len`-token window of a domain's train stream (domains drawn
    uniformly), continued greedily by the target for `--gen-len` tokens (`LLM.generate`, EOS ignored): the
    text the head drafts at inference is the target's own greedy output;
  - corpus rows: random train windows of the same length (a `--corpus-frac` share).
  The target's final normed hidden state (the feature the LM head reads) at every position comes from a
  teacher-forced forward of specmoe's own decoder (`ForwardContext.capture_hidden`), stored in bf16 and
  cached in `--cache` (so a rerun skips it).
* Head: `specmoe.models.eagle.EagleHead`, EAGLE-1 layout (fc over [embed, feature] → one Llama layer), the
  target's embedding and LM head frozen and shared. Entry t reads (token t+1, feature t) and predicts
  feature t+1. Loss as EAGLE-1: SmoothL1 on the feature + `--ce` × cross-entropy against the target's
  distribution softmax(LM head(feature t+1)); uniform noise (±`--noise`) on the input features. With
  `--unroll 2` a second pass feeds each entry the head's own prediction of its feature (as a drafted step
  does) and adds its loss with weight `--unroll-weight`.
* Progress bars (tqdm); a wall-clock cap (`--max-minutes`) stops training early, keeping the schedule's
  last checkpoint; the head is written with `save_eagle_head` (config.json + model.safetensors, published
  key names) to `--out`, with `training_meta.json` (args, losses, held-out top-1 agreement per depth).

Usage: .venv/bin/python scripts/train_eagle.py [--threads 1] [--max-minutes 25] [--out models/specmoe-tiny-moe-eagle]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.engine.llm import default_model_path  # noqa: E402
from specmoe.models.decoder import BatchView  # noqa: E402
from specmoe.models.eagle import EagleConfig, EagleHead, save_eagle_head  # noqa: E402
from specmoe.models.kv_cache import KVCache  # noqa: E402
from specmoe.models.moe import ForwardContext  # noqa: E402

DOMAINS = ["code", "docs", "bible", "fortunes"]
EOT_ID = 0


def token_streams(corpus: Path, tok_path: Path, split: str) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_path))
    out = {}
    for dom in DOMAINS:
        src = corpus / dom / f"{split}.jsonl"
        if not src.is_file():
            sys.exit(f"missing {src}: run scripts/build_corpus.py first")
        texts = [json.loads(line)["text"] for line in src.read_text(encoding="utf-8").splitlines()]
        ids: list[int] = []
        for enc in tok.encode_batch(texts):
            ids.append(EOT_ID)
            ids.extend(enc.ids)
        out[dom] = np.asarray(ids, dtype=np.int64)
    return out


def windows(streams, n: int, length: int, rng: np.random.Generator) -> list[list[int]]:
    rows = []
    for d in rng.integers(0, len(DOMAINS), size=n):
        arr = streams[DOMAINS[d]]
        s = int(rng.integers(0, len(arr) - length - 1))
        rows.append(arr[s:s + length].tolist())
    return rows


@torch.inference_mode()
def target_features(llm: LLM, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """The target's final normed hidden state at every position of every row: [N, T, D] bf16."""
    model, L = llm.model, llm.config.num_layers
    N, T = rows.shape
    cache = KVCache(num_layers=L, max_batch=batch, max_seq=T, num_kv_heads=llm.config.num_kv_heads,
                    head_dim=llm.config.head_dim, dtype=torch.float32)
    out = torch.empty(N, T, llm.config.hidden_size, dtype=torch.bfloat16)
    for a in tqdm(range(0, N, batch), desc="target features", unit="batch"):
        x = rows[a:a + batch]
        B = x.shape[0]
        bv = BatchView(slots=torch.arange(B), positions=torch.arange(T)[None].expand(B, -1).contiguous(),
                       contiguous=slice(0, B), key_len=T)
        ctx = ForwardContext(provider=llm.store, capture_hidden=(L,))
        model(x, cache, bv, ctx, logits_at=torch.zeros(B, 1, dtype=torch.long))
        out[a:a + B] = ctx.hidden[L].to(torch.bfloat16)
    return out


def build_data(args, llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    cache = Path(args.cache)
    if cache.is_file():
        d = torch.load(cache)
        if d["args"] == [args.rows, args.prompt_len, args.gen_len, args.corpus_frac, args.seed]:
            print(f"data from {cache}: {tuple(d['tokens'].shape)}")
            return d["tokens"], d["feats"]
    rng = np.random.default_rng(args.seed)
    streams = token_streams(REPO / "data" / "corpus", Path(llm.path) / "tokenizer.json", "train")
    T = args.prompt_len + args.gen_len
    n_corpus = int(args.rows * args.corpus_frac)
    prompts = windows(streams, args.rows - n_corpus, args.prompt_len, rng)
    rows = []
    sp = SamplingParams(max_tokens=args.gen_len, ignore_eos=True)
    for a in tqdm(range(0, len(prompts), args.gen_batch), desc="greedy continuations", unit="batch"):
        outs = llm.generate(prompts[a:a + args.gen_batch], sp)
        rows += [p + o.token_ids for p, o in zip(prompts[a:a + args.gen_batch], outs)]
    rows += windows(streams, n_corpus, T, rng)
    tokens = torch.tensor(rows, dtype=torch.long)
    feats = target_features(llm, tokens, args.feat_batch)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": [args.rows, args.prompt_len, args.gen_len, args.corpus_frac, args.seed], "tokens": tokens,
                "feats": feats}, cache)
    return tokens, feats


def head_pass(head, emb_w, tokens, feats_in, cache):
    """Entries t = 0..T-2 of each row: (token t+1, feature t) → predicted feature t+1 [B, T-1, D]."""
    B, T1 = tokens.shape[0], tokens.shape[1] - 1
    bv = BatchView(slots=torch.arange(B), positions=torch.arange(T1)[None].expand(B, -1).contiguous(),
                   contiguous=slice(0, B), key_len=T1)
    return head(F.embedding(tokens[:, 1:], emb_w), feats_in, cache, bv)


class PassKV:
    """The head's K/V over one training pass of whole rows (positions 0..T-1): kept as computed, so autograd
    flows through them (the inference `KVCache` writes into a preallocated buffer in place)."""

    def write_index(self, slots, positions):
        return None

    def write(self, layer, index, k, v):
        self.kv = (k, v)

    def read(self, layer, slots, contiguous, S):
        return self.kv[0][:, :S], self.kv[1][:, :S]


def fresh_cache(hc: EagleConfig, B: int, T: int) -> PassKV:
    return PassKV()


def losses(pred, target_feat, p_target, lm_w):
    """SmoothL1 to the target's feature, cross-entropy against the target's distribution `p_target`, and top-1
    agreement with the target's argmax."""
    reg = F.smooth_l1_loss(pred, target_feat)
    logits = pred @ lm_w.T
    ce = -(p_target * torch.log_softmax(logits, -1)).sum(-1).mean()
    agree = (logits.argmax(-1) == p_target.argmax(-1)).float().mean()
    return reg, ce, agree


def train_step(head, emb_w, tokens, feats, args, noise: bool):
    B, T = tokens.shape
    f = feats.float()
    with torch.no_grad():
        p = torch.softmax(f[:, 1:] @ emb_w.T, -1)  # the target's distribution at positions 1..T-1 (tied LM head)
    f_in = f[:, :-1]
    if noise and args.noise > 0:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * args.noise
    pred = head_pass(head, emb_w, tokens, f_in, fresh_cache(head.hc, B, T))  # predicts f[:, 1:]
    reg, ce, agree = losses(pred, f[:, 1:], p, emb_w)
    loss = reg + args.ce * ce
    stats = {"reg": reg.item(), "ce": ce.item(), "agree1": agree.item()}
    if args.unroll >= 2:  # entry t now reads the head's own prediction of feature t (from entry t-1)
        f2 = torch.cat((f[:, :1], pred[:, :-1]), 1)
        pred2 = head_pass(head, emb_w, tokens, f2, fresh_cache(head.hc, B, T))
        reg2, ce2, agree2 = losses(pred2[:, 1:], f[:, 2:], p[:, 1:], emb_w)
        loss = loss + args.unroll_weight * (reg2 + args.ce * ce2)
        stats.update(reg2=reg2.item(), ce2=ce2.item(), agree2=agree2.item())
    return loss, stats


@torch.inference_mode()
def evaluate(head, emb_w, tokens, feats, args) -> dict:
    """Held-out top-1 agreement with the target's argmax at depth 1 (true features) and depth 2 (the head's
    own feature for the first step), over the generated part of each row."""
    out = {"agree1": [], "agree2": []}
    P = args.prompt_len
    for a in range(0, tokens.shape[0], args.batch):
        x, f = tokens[a:a + args.batch], feats[a:a + args.batch].float()
        B, T = x.shape
        p = torch.softmax(f[:, 1 + P:] @ emb_w.T, -1)
        pred = head_pass(head, emb_w, x, f[:, :-1], fresh_cache(head.hc, B, T))
        f2 = torch.cat((f[:, :1], pred[:, :-1]), 1)
        pred2 = head_pass(head, emb_w, x, f2, fresh_cache(head.hc, B, T))
        out["agree1"].append(losses(pred[:, P:], f[:, 1 + P:], p, emb_w)[2].item())
        out["agree2"].append(losses(pred2[:, P:], f[:, 1 + P:], p, emb_w)[2].item())
    return {k: float(np.mean(v)) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(REPO / "models" / "specmoe-tiny-moe-eagle"))
    ap.add_argument("--cache", default=str(REPO / "data" / "eagle" / "train_data.pt"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--rows", type=int, default=2400)
    ap.add_argument("--heldout-rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--corpus-frac", type=float, default=0.25)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--feat-batch", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--wd", type=float, default=0.0)
    ap.add_argument("--ce", type=float, default=0.1, help="weight of the cross-entropy term (EAGLE: 0.1)")
    ap.add_argument("--noise", type=float, default=0.1, help="uniform noise on input features (±)")
    ap.add_argument("--unroll", type=int, default=2, choices=(1, 2))
    ap.add_argument("--unroll-weight", type=float, default=0.5)
    ap.add_argument("--max-minutes", type=float, default=25.0, help="wall-clock cap on the training loop")
    ap.add_argument("--init", default=None, help="start from this saved head (e.g. to continue a run)")
    ap.add_argument("--save-dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    llm = LLM(args.model or default_model_path(), dtype="float32", threads=args.threads, max_batch=args.gen_batch)
    mc = llm.config
    tokens, feats = build_data(args, llm)
    # held-out rows: greedy continuations of held-out corpus windows (never trained on)
    ho_args = argparse.Namespace(**{**vars(args), "rows": args.heldout_rows, "corpus_frac": 0.0, "seed": args.seed + 1,
                                    "cache": str(Path(args.cache).with_name("heldout_data.pt"))})
    ho_tokens, ho_feats = build_data_split(ho_args, llm, "heldout")
    data_s = time.time() - t_start

    hc = EagleConfig(version=1, hidden_size=mc.hidden_size, intermediate_size=args.intermediate, num_layers=1,
                     num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                     rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta, vocab_size=mc.vocab_size,
                     max_position_embeddings=mc.max_position_embeddings, target_hidden_size=mc.hidden_size,
                     draft_vocab_size=mc.vocab_size, fc_bias=True)
    head = EagleHead(hc)
    if args.init:  # continue from a saved head (same sizes)
        from specmoe.models.eagle import load_eagle_head
        init = load_eagle_head(args.init, target_vocab=mc.vocab_size, target_hidden=mc.hidden_size)
        head.load_state_dict({k: v.clone() for k, v in init.state_dict().items()})
        print(f"initialised from {args.init}")
    emb_w = llm.model.embed.weight.detach().float()
    assert mc.tie_word_embeddings, "the demo model ties its LM head to the embedding"
    params = [p for p in head.parameters() if p.requires_grad]
    print(f"head: {sum(p.numel() for p in params):,} parameters; data {tuple(tokens.shape)}, "
          f"held-out {tuple(ho_tokens.shape)}; data prep {data_s:.0f} s")
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.95))
    t0 = time.time()

    def lr_factor(s: int) -> float:
        """Linear warmup, then cosine decay over the run's progress: steps done or wall time used, whichever is
        further along (a loaded machine reaches the wall-clock cap first)."""
        progress = min(1.0, max(s / args.steps, (time.time() - t0) / 60 / args.max_minutes))
        return min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * progress))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    rng = np.random.default_rng(args.seed)
    log, ema = [], None
    bar = tqdm(range(args.steps), desc="train eagle head", unit="step")
    step = 0
    for step in bar:
        idx = torch.from_numpy(rng.integers(0, tokens.shape[0], size=args.batch))
        loss, st = train_step(head, emb_w, tokens[idx], feats[idx], args, noise=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema = st if ema is None else {k: 0.95 * ema[k] + 0.05 * v for k, v in st.items()}
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items() if k.startswith(("agree", "ce"))})
        if step % 20 == 0:
            log.append({"step": step, "loss": loss.item(), **st, "s": round(time.time() - t0, 1)})
        if (time.time() - t0) / 60 > args.max_minutes:
            print(f"wall-clock cap reached at step {step + 1}")
            break
    train_s = time.time() - t0
    head.eval()
    ev = evaluate(head, emb_w, ho_tokens, ho_feats, args)
    print(f"held-out top-1 agreement with the target: depth 1 {ev['agree1']:.3f}, depth 2 {ev['agree2']:.3f}")
    save_eagle_head(head, args.out, dtype=getattr(torch, args.save_dtype))
    meta = {"target": str(Path(llm.path).name), "steps_done": step + 1, "train_wall_s": round(train_s, 1),
            "data_prep_s": round(data_s, 1), "threads": args.threads, "torch": torch.__version__,
            "params": sum(p.numel() for p in params), "heldout": ev, "final_ema": ema, "args": vars(args),
            "log": log}
    (Path(args.out) / "training_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.out} ({sum(f.stat().st_size for f in Path(args.out).iterdir()) / 1e6:.2f} MB)")
    return 0


def build_data_split(args, llm: LLM, split: str):
    """`build_data` over another corpus split (the held-out check rows)."""
    cache = Path(args.cache)
    if cache.is_file():
        d = torch.load(cache)
        return d["tokens"], d["feats"]
    rng = np.random.default_rng(args.seed)
    streams = token_streams(REPO / "data" / "corpus", Path(llm.path) / "tokenizer.json", split)
    prompts = windows(streams, args.rows, args.prompt_len, rng)
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.gen_len, ignore_eos=True))
    tokens = torch.tensor([p + o.token_ids for p, o in zip(prompts, outs)], dtype=torch.long)
    feats = target_features(llm, tokens, args.feat_batch)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"tokens": tokens, "feats": feats}, cache)
    return tokens, feats


if __name__ == "__main__":
    sys.exit(main())
