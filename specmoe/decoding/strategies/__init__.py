"""Decoding strategies: plain autoregressive decoding (`autoregressive`) and the one speculative step every drafter
and `decoding="auto"` run (`speculative`), built from the options by `factory`; `budget` is MoE-Spec's lossy
verification expert budget."""
