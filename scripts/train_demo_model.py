#!/usr/bin/env python3
"""Seeded, reproducible CPU training of the specmoe demo model (a tiny Qwen3MoeForCausalLM).

Pipeline position: build_corpus.py -> train_tokenizer.py -> THIS -> model_card.py

* Data: data/corpus/<domain>/train.jsonl, tokenized with models/specmoe-tiny-moe/tokenizer.json,
  documents joined with <|endoftext|> (id 0) into one token stream per domain (cached in
  data/tokens/). Every batch row picks a domain uniformly at random (small domains are thereby
  upsampled) and a random window of seq_len+1 tokens from it.
* Model: Qwen3MoeForCausalLM, all layers MoE, top-2, norm_topk_prob, light load-balancing aux loss
  computed per layer (see per_layer_balance_loss; config.router_aux_loss_coef records the coef).
* AdamW + linear warmup + cosine decay, bf16 autocast on CPU (fp32 master weights).
* Logs to <run_dir>/train_log.jsonl; held-out eval every --eval-every steps; every --ckpt-every
  steps a resumable checkpoint (data/runs/<name>/ckpt.pt) and a bf16 export into --out, so a
  partial run still yields a usable model.

Usage:
  .venv/bin/python scripts/train_demo_model.py --bench          # throughput of fp32/bf16 x experts impls
  nice -n 10 .venv/bin/python scripts/train_demo_model.py --steps 2400 --batch 16 --seq 256
  (add --resume to continue from data/runs/<name>/ckpt.pt)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time

import numpy as np
import torch

DOMAINS = ["code", "docs", "bible", "fortunes"]
EOT_ID = 0


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def model_config(vocab: int, args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.moe_inter * 4,  # unused (no dense MLP layers), kept small
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        hidden_act="silu",
        max_position_embeddings=args.max_pos,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=args.moe_inter,
        num_experts_per_tok=args.top_k,
        num_experts=args.experts,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
    )


def load_token_streams(corpus: str, tok_path: str, split: str, cache_dir: str) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    os.makedirs(cache_dir, exist_ok=True)
    tok = None
    out = {}
    for dom in DOMAINS:
        cache = os.path.join(cache_dir, f"{dom}.{split}.npy")
        src = os.path.join(corpus, dom, f"{split}.jsonl")
        if os.path.exists(cache) and os.path.getmtime(cache) > max(os.path.getmtime(src), os.path.getmtime(tok_path)):
            out[dom] = np.load(cache)
            continue
        tok = tok or Tokenizer.from_file(tok_path)
        with open(src, encoding="utf-8") as f:
            texts = [json.loads(l)["text"] for l in f]
        ids = []
        for enc in tok.encode_batch(texts):
            ids.append(EOT_ID)  # <|endoftext|> before every document
            ids.extend(enc.ids)
        ids.append(EOT_ID)
        arr = np.asarray(ids, dtype=np.uint16)
        np.save(cache, arr)
        out[dom] = arr
    return out


class Sampler:
    """Deterministic balanced-domain random-window sampler."""

    def __init__(self, streams, seq, batch, seed):
        self.streams = streams
        self.seq, self.batch = seq, batch
        self.rng = np.random.default_rng(seed)

    def state(self):
        return self.rng.bit_generator.state

    def set_state(self, s):
        self.rng.bit_generator.state = s

    def next(self):
        doms = self.rng.integers(0, len(DOMAINS), size=self.batch)
        rows = []
        for d in doms:
            arr = self.streams[DOMAINS[d]]
            start = int(self.rng.integers(0, len(arr) - self.seq - 1))
            rows.append(arr[start:start + self.seq + 1].astype(np.int64))
        x = torch.from_numpy(np.stack(rows))
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def eval_windows(stream: np.ndarray, seq: int, max_windows: int, seed: int = 0):
    """Fixed, evenly spaced non-overlapping windows of the held-out stream."""
    n = (len(stream) - 1) // seq
    idx = np.arange(n)
    if n > max_windows:
        idx = np.linspace(0, n - 1, max_windows).round().astype(int)
    xs = [stream[i * seq:(i + 1) * seq + 1].astype(np.int64) for i in idx]
    return torch.from_numpy(np.stack(xs))


@torch.no_grad()
def evaluate(model, held_windows, bf16: bool, bs: int = 16):
    model.eval()
    res = {}
    for dom, w in held_windows.items():
        tot, cnt = 0.0, 0
        for i in range(0, len(w), bs):
            x = w[i:i + bs]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=x[:, :-1], output_router_logits=False).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
            tot += loss.item()
            cnt += x[:, 1:].numel()
        res[dom] = tot / cnt
    res["mean"] = float(np.mean([res[d] for d in DOMAINS]))
    model.train()
    return res


def per_layer_balance_loss(router_logits, n_experts: int, top_k: int) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss computed PER LAYER and averaged over layers.

    transformers' load_balancing_loss_func concatenates the router logits of all layers before
    computing expert load, so a model whose every layer routes to its own few experts still looks
    balanced to it (observed: per-layer collapse to 8-15 of 32 experts after 100 steps with the
    pooled loss at coef 0.002). Value is top_k (=2) for perfectly balanced routing.
    """
    losses = []
    for rl in router_logits:
        probs = torch.softmax(rl.float(), dim=-1)  # (T, E)
        idx = torch.topk(probs, top_k, dim=-1).indices
        load = torch.nn.functional.one_hot(idx, n_experts).float().sum(1).mean(0)  # (E,), sums to top_k
        losses.append(n_experts * (load * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def lr_at(step, total, warmup, peak, min_ratio=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def export_bf16(model, out_dir, tok_dir, meta: dict):
    """Save a bf16 copy of the model + generation config (tokenizer files already live in out_dir)."""
    import copy

    from transformers import GenerationConfig

    m = copy.deepcopy(model).to(torch.bfloat16)
    m.config.output_router_logits = False  # inference default; aux loss is training-only
    m.config.use_cache = True
    tmp = out_dir.rstrip("/") + ".tmp_export"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    m.save_pretrained(tmp, safe_serialization=True)
    gen = GenerationConfig(bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID,
                           do_sample=False, max_new_tokens=128)
    gen.save_pretrained(tmp)
    os.makedirs(out_dir, exist_ok=True)
    for fn in os.listdir(tmp):
        shutil.move(os.path.join(tmp, fn), os.path.join(out_dir, fn))
    shutil.rmtree(tmp)
    # make sure the dtype is recorded as bf16 under both keys
    cp = os.path.join(out_dir, "config.json")
    with open(cp) as f:
        cfg = json.load(f)
    cfg["dtype"] = "bfloat16"
    cfg["torch_dtype"] = "bfloat16"
    with open(cp, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    with open(os.path.join(out_dir, "training_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    del m


def build_model(vocab, args, impl):
    from transformers import Qwen3MoeForCausalLM

    cfg = model_config(vocab, args)
    cfg._experts_implementation = impl
    model = Qwen3MoeForCausalLM(cfg)
    return model


def bench(args, vocab):
    torch.set_num_threads(args.threads)
    seed_all(args.seed)
    x = torch.randint(1, vocab, (args.batch, args.seq + 1))
    results = []
    for impl in args.bench_impls.split(","):
        for bf16 in (False, True):
            seed_all(args.seed)
            try:
                model = build_model(vocab, args, impl)
            except Exception as e:  # noqa
                print(f"{impl}: cannot build ({e})")
                break
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            times = []
            try:
                for i in range(args.bench_steps):
                    t0 = time.perf_counter()
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        out = model(input_ids=x[:, :-1], labels=x[:, :-1])
                    out.loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    times.append(time.perf_counter() - t0)
            except Exception as e:  # noqa
                print(f"{impl} bf16={bf16}: failed ({type(e).__name__}: {str(e)[:200]})")
                continue
            dt = float(np.median(times[1:])) if len(times) > 1 else times[0]
            tps = args.batch * args.seq / dt
            r = {"impl": impl, "bf16": bf16, "sec_per_step": round(dt, 3), "tokens_per_sec": round(tps),
                 "loss": round(out.loss.item(), 3)}
            print(json.dumps(r), flush=True)
            results.append(r)
    n = sum(p.numel() for p in model.parameters())
    print(f"params={n / 1e6:.2f}M batch={args.batch} seq={args.seq} threads={args.threads}")
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, "bench.json"), "w") as f:
        json.dump({"results": results, "params": n, "batch": args.batch, "seq": args.seq,
                   "threads": args.threads}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--out", default="models/specmoe-tiny-moe")
    ap.add_argument("--run-dir", default="data/runs/specmoe-tiny-moe")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    # model
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=96)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="coef of the per-layer balance loss")
    ap.add_argument("--impl", default="grouped_mm", help="config._experts_implementation")
    # training
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-windows", type=int, default=48, help="held-out windows per domain during training")
    ap.add_argument("--ckpt-every", type=int, default=250)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--resume", action="store_true",
                    help="continue from <run-dir>/ckpt.pt; --steps may differ (the LR schedule is recomputed)")
    ap.add_argument("--stop-after", type=int, default=0, help="checkpoint and stop after this step")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--bench-steps", type=int, default=4)
    ap.add_argument("--bench-impls", default="eager,batched_mm,grouped_mm")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tok_path = os.path.join(args.out, "tokenizer.json")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(tok_path).get_vocab_size()
    if args.bench:
        return bench(args, vocab)

    bf16 = not args.no_bf16
    os.makedirs(args.run_dir, exist_ok=True)
    t_start = time.time()
    train = load_token_streams(args.corpus, tok_path, "train", "data/tokens")
    held = load_token_streams(args.corpus, tok_path, "heldout", "data/tokens")
    print({d: len(v) for d, v in train.items()}, {d: len(v) for d, v in held.items()}, flush=True)
    held_w = {d: eval_windows(held[d], args.seq, args.eval_windows) for d in DOMAINS}

    seed_all(args.seed)
    model = build_model(vocab, args, args.impl)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    sampler = Sampler(train, args.seq, args.batch, args.seed)
    step0 = 0
    elapsed_before = 0.0
    ckpt_path = os.path.join(args.run_dir, "ckpt.pt")
    log_path = os.path.join(args.run_dir, "train_log.jsonl")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sampler.set_state(ck["sampler"])
        torch.set_rng_state(ck["torch_rng"])
        step0 = ck["step"]
        elapsed_before = ck["elapsed"]
        print(f"resumed at step {step0}", flush=True)
        if os.path.exists(log_path):  # drop log records of steps after the checkpoint
            keep = [l for l in open(log_path) if json.loads(l)["step"] <= step0]
            with open(log_path, "w") as f:
                f.writelines(keep)
    else:
        with open(log_path, "w"):
            pass
    with open(os.path.join(args.run_dir, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=1)

    def log(rec):
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def meta(step, last_eval):
        return {"step": step, "total_steps": args.steps, "tokens_seen": step * args.batch * args.seq,
                "train_wall_s": round(elapsed_before + time.time() - t_run, 1), "args": vars(args),
                "params": n_params, "last_eval": last_eval, "torch": torch.__version__,
                "bf16_autocast": bf16, "threads": args.threads}

    model.train()
    t_run = time.time()
    last_eval = None
    ema = None
    t_log = time.time()
    for step in range(step0, args.steps):
        lr = lr_at(step, args.steps, args.warmup, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = sampler.next()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=x, output_router_logits=True)
        logits = out.logits.float()
        lm = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        aux_hf = out.aux_loss.float()  # HF pools all layers' tokens -> blind to per-layer collapse
        aux = per_layer_balance_loss(out.router_logits, args.experts, args.top_k)
        loss = lm + args.aux_coef * aux
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = lm.item() if ema is None else 0.95 * ema + 0.05 * lm.item()
        if (step + 1) % args.log_every == 0 or step == step0:
            dt = time.time() - t_log
            t_log = time.time()
            rec = {"step": step + 1, "lm_loss": round(lm.item(), 4), "lm_loss_ema": round(ema, 4),
                   "aux_loss": round(aux.item(), 4), "aux_loss_hf_pooled": round(aux_hf.item(), 4), "lr": lr, "grad_norm": round(gn.item(), 3),
                   "wall_s": round(elapsed_before + time.time() - t_run, 1),
                   "tok_per_s": round(args.log_every * args.batch * args.seq / max(dt, 1e-9))}
            log(rec)
            print(json.dumps(rec), flush=True)
        last = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or last:
            ev = evaluate(model, held_w, bf16)
            last_eval = {"step": step + 1, **{f"heldout_{k}": round(v, 4) for k, v in ev.items()}}
            log({"eval": True, **last_eval, "wall_s": round(elapsed_before + time.time() - t_run, 1)})
            print("EVAL", json.dumps(last_eval), flush=True)
        if (step + 1) % args.ckpt_every == 0 or last or (step + 1) == args.stop_after:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sampler": sampler.state(),
                        "torch_rng": torch.get_rng_state(), "step": step + 1,
                        "elapsed": elapsed_before + time.time() - t_run}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            export_bf16(model, args.out, args.out, meta(step + 1, last_eval))
            print(f"checkpoint + bf16 export at step {step + 1}", flush=True)
        if args.stop_after and step + 1 >= args.stop_after:
            print(f"stopping after step {step + 1} (--stop-after)", flush=True)
            break
    print(f"done: {args.steps} steps, train wall {elapsed_before + time.time() - t_run:.0f}s, "
          f"total incl. data {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
