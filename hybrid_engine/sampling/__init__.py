"""Sampling: counter-based randomness (``rng``) and the per-row sampler (``sampler``); the
contract between them and the rejection sampler is CONTRACT.md."""
