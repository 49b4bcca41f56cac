"""What every decoding strategy runs on: `ModelRunner` (sequences + new tokens → one batched forward over the KV
cache and the expert store), `Sequence`, sampling (temperature / top-k / top-p, the seeded Gumbel-max rule) and the
per-phase time accounting (`breakdown`)."""
