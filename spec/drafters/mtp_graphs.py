"""CUDA graphs for the MTP drafter's two kinds of forward, one graph per bucket B of each.

- ``verify``: the MTP layers over a decode-only step's tokens (B rows x 1+K, inputs shifted by
  one token, paired with the target's hidden states), then the hidden state and the logits at
  each row's newest-sample index (``token_index``). Mixed steps run it eagerly.
- ``step``: one token per row (drafts 2..K): the MTP layers on the previous draft and the previous
  MTP hidden state, then the logits. Any step's rows.

Everything a graph reads is a buffer owned here; a call copies the real rows in and the graph
runs over the bucket. Pad rows (rows >= N of the bucket) write KV only into the null block
(slot mapping 0 / ``valid`` False) and read at most the null block's few positions; their
outputs are never returned. Pads are reset only where a previous, larger call left real rows.
Sampling (``draw``) stays outside the graphs: it branches on host flags of the step's rows.
"""
from __future__ import annotations

import logging
import time

import torch

from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch, MambaMetadata

from .common import single_token_batch

logger = logging.getLogger("hybrid_engine")


class _Bucket:
    """The static buffers and the two graphs of one bucket of ``b`` rows."""

    def __init__(self, b: int, s: int, d: int, max_blocks: int, dtype, device):
        e64 = lambda *sh: torch.zeros(*sh, dtype=torch.int64, device=device)  # noqa: E731
        self.b = b
        # verify: [b*s] shifted tokens, [b*s, D] target hidden, attention metadata, [b] indices
        self.v_tokens, self.v_hidden = e64(b * s), torch.zeros(b * s, d, dtype=dtype, device=device)
        self.v_qsl = torch.arange(b + 1, dtype=torch.int32, device=device) * s     # [b+1] fixed
        self.v_seq_lens = torch.full((b,), s, dtype=torch.int32, device=device)    # [b]
        self.v_bt = torch.zeros(b, max_blocks, dtype=torch.int32, device=device)   # [b, max_blocks]
        self.v_slots, self.v_idx = e64(b * s), e64(b)                              # [b*s], [b]
        self.v_pos = e64(b * s)                # [b*s] positions (the rotary hook may read them)
        # step: [b] tokens, [b, D] previous MTP hidden, [b] positions, [b, max_blocks], [b] valid
        self.s_tok, self.s_hidden, self.s_pos = e64(b), torch.zeros(b, d, dtype=dtype, device=device), e64(b)
        self.s_bt = torch.zeros(b, max_blocks, dtype=torch.int32, device=device)
        self.s_valid = torch.zeros(b, dtype=torch.bool, device=device)
        self.v_graph = self.s_graph = None
        self.v_out = self.s_out = None          # (hidden [b, D], logits [b, V]) static outputs
        self.v_rows = self.s_rows = b           # rows the last call wrote (pads beyond are clean)


class MTPGraphs:
    def __init__(self, drafter, *, buckets: tuple[int, ...], block_size: int, max_blocks: int,
                 max_model_len: int, device: torch.device, width: int | None = None, with_step: bool = True):
        """``width``: tokens per row of the verify pass (default 1 + K; adaptive speculation builds
        one instance per narrower width, ``with_step=False``: the single-token step graphs are
        width-free and live in the 1 + K instance only)."""
        self.d, self.block_size = drafter, block_size
        self.s = 1 + drafter.num_spec if width is None else width
        self.with_step = with_step
        self.max_rows = max(buckets)
        self.max_seq = max_model_len + 2 * (1 + drafter.num_spec) + 1   # host bound of every row's length
        emb = drafter.target.backbone.embeddings.weight
        self.buckets = {b: _Bucket(b, self.s, emb.shape[1], max_blocks, emb.dtype, device)
                        for b in sorted(set(buckets))}
        self._capture_all(device)

    # ---- bodies (captured) ----------------------------------------------------------------
    def _verify_body(self, k: _Bucket):
        b, s = k.b, self.s
        attn = AttnMetadata(k.v_qsl, k.v_seq_lens, k.v_bt, k.v_slots, s, self.max_seq)
        fb = ForwardBatch(k.v_tokens, k.v_pos, attn, _no_mamba(b, s, k.v_tokens.device), k.v_idx)
        h, normed = self.d._step(k.v_tokens, k.v_hidden, fb)
        return h[k.v_idx], self.d.target.compute_logits(normed[k.v_idx])

    def _step_body(self, k: _Bucket):
        fb = single_token_batch(k.s_tok, k.s_pos, k.s_bt, self.block_size, torch.zeros_like(k.s_pos),
                                k.s_valid, self.max_seq)
        h, normed = self.d._step(k.s_tok, k.s_hidden, fb)
        return h, self.d.target.compute_logits(normed)

    @torch.inference_mode()
    def _capture_all(self, device) -> None:
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(device)[0]
        pool = None
        for b in sorted(self.buckets, reverse=True):            # largest first: one pool fits all
            k = self.buckets[b]
            bodies = (("v", self._verify_body), ("s", self._step_body)) if self.with_step else (("v", self._verify_body),)
            for name, body in bodies:
                for _ in range(2):                              # warm-up (Triton compiles here)
                    body(k)
                torch.cuda.synchronize(device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = body(k)
                pool = g.pool()
                setattr(k, f"{name}_graph", g)
                setattr(k, f"{name}_out", out)
        torch.cuda.synchronize(device)
        logger.info("captured %d MTP graphs (verify%s; B in %s, %d tokens per verify row) in %.1fs, %.1f MiB",
                    (1 + self.with_step) * len(self.buckets), " + step" if self.with_step else "",
                    sorted(self.buckets), self.s, time.perf_counter() - t0,
                    (free0 - torch.cuda.mem_get_info(device)[0]) / 2**20)

    def _bucket(self, n: int) -> _Bucket:
        return self.buckets[next(b for b in sorted(self.buckets) if b >= n)]

    # ---- calls ----------------------------------------------------------------------------
    def verify(self, tokens: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, idx: torch.Tensor):
        """A decode-only step of N <= max_rows rows: tokens [N*s] (shifted), hidden [N*s, D]
        (the target's), fb the step's batch, idx [N] -> (hidden at idx [N, D], logits [N, V])."""
        n, s = idx.shape[0], self.s
        k = self._bucket(n)
        a = fb.attn
        k.v_tokens[:n * s].copy_(tokens)
        k.v_hidden[:n * s].copy_(hidden)
        k.v_pos[:n * s].copy_(fb.positions)
        k.v_seq_lens[:n].copy_(a.seq_lens)
        k.v_bt[:n, :a.block_tables.shape[1]].copy_(a.block_tables)
        k.v_slots[:n * s].copy_(a.slot_mapping)
        k.v_idx[:n].copy_(idx)
        if k.v_rows > n:                                       # real rows left by a larger call
            k.v_seq_lens[n:].fill_(s)
            k.v_slots[n * s:].zero_()
            k.v_bt[n:].zero_()
            k.v_idx[n:].zero_()
        k.v_rows = n
        k.v_graph.replay()
        return k.v_out[0][:n], k.v_out[1][:n]

    def step(self, tok: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, block_tables: torch.Tensor,
             valid: torch.Tensor):
        """One token per row for N <= max_rows rows -> (MTP hidden [N, D], logits [N, V])."""
        n = tok.shape[0]
        k = self._bucket(n)
        k.s_tok[:n].copy_(tok)
        k.s_hidden[:n].copy_(hidden)
        k.s_pos[:n].copy_(pos)
        k.s_bt[:n, :block_tables.shape[1]].copy_(block_tables)
        k.s_valid[:n].copy_(valid)
        if k.s_rows > n:
            k.s_pos[n:].zero_()
            k.s_valid[n:].fill_(False)
            k.s_bt[n:].zero_()
        k.s_rows = n
        k.s_graph.replay()
        return k.s_out[0][:n], k.s_out[1][:n]


def _no_mamba(b: int, s: int, device) -> MambaMetadata:
    """The MTP layers have no Mamba mixer; a decode-shaped placeholder."""
    z = torch.zeros(0, dtype=torch.int64, device=device)
    return MambaMetadata(b, s, z, z, torch.zeros(1, dtype=torch.int64, device=device), (0,), z,
                         torch.zeros(0, dtype=torch.bool, device=device))
