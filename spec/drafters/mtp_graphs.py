"""CUDA graphs for the MTP drafter's two kinds of forward, one graph per bucket B of each.

- ``verify``: the MTP layers over a decode-only step's tokens (B rows x ``tokens_per_row``: 1+K,
  or a narrower width under adaptive speculation; inputs shifted by one token, paired with the
  target's hidden states), then the hidden state and the logits at each row's newest-sample index
  (``token_index``). Steps with prefill rows do not run it (``MTPDrafter.propose``).
- ``step``: one token per row: the MTP layers on the previous draft and the previous MTP hidden
  state (drafts 2..K), or, after a step with prefill rows, on each row's newest sample and its
  target hidden state (draft 1), then the logits. Any step's rows.

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

from hybrid_engine.step.capture import capturing
from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch, MambaMetadata

from .common import single_token_batch

logger = logging.getLogger("hybrid_engine")


class _Bucket:
    """The static buffers and the two graphs of one bucket of ``B`` rows. ``v_*``: the verify
    pass (``T = B * tokens_per_row`` tokens); ``s_*``: the single-token step."""

    def __init__(self, rows: int, tokens_per_row: int, hidden_size: int, max_blocks: int, dtype, device):
        e64 = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)  # noqa: E731
        B, T, D = rows, rows * tokens_per_row, hidden_size
        self.rows = B
        # verify: shifted tokens, target hidden, attention metadata, newest-sample indices
        self.v_tokens, self.v_hidden = e64(T), torch.zeros(T, D, dtype=dtype, device=device)  # [T], [T, D]
        self.v_qsl = torch.arange(B + 1, dtype=torch.int32, device=device) * tokens_per_row  # [B+1] fixed
        self.v_seq_lens = torch.full((B,), tokens_per_row, dtype=torch.int32, device=device)  # [B]
        self.v_bt = torch.zeros(B, max_blocks, dtype=torch.int32, device=device)   # [B, max_blocks]
        # [T], [B]: a pad row's index is its own first token (slot 0: the MTP MoE's load counters
        # skip it), never a real row's
        self.v_slots, self.v_idx = e64(T), self.v_qsl[:-1].to(torch.int64)
        self.v_pos = e64(T)                    # [T] positions (the rotary hook may read them)
        # step: [B] tokens, [B, D] previous MTP hidden, [B] positions, [B, max_blocks], [B] valid
        self.s_tok, self.s_hidden, self.s_pos = e64(B), torch.zeros(B, D, dtype=dtype, device=device), e64(B)
        self.s_bt = torch.zeros(B, max_blocks, dtype=torch.int32, device=device)
        self.s_valid = torch.zeros(B, dtype=torch.bool, device=device)
        self.v_graph = self.s_graph = None
        self.v_out = self.s_out = None          # (hidden [B, D], logits [B, V]) static outputs
        self.v_rows = self.s_rows = B           # rows the last call wrote (pads beyond are clean)


class MTPGraphs:
    def __init__(self, drafter, *, buckets: tuple[int, ...], block_size: int, max_blocks: int,
                 max_model_len: int, device: torch.device, tokens_per_row: int | None = None,
                 with_step: bool = True):
        """``tokens_per_row``: the verify pass's row width (default 1 + K; adaptive speculation
        builds one instance per narrower width, ``with_step=False``: the single-token step graphs
        are width-free and live in the 1 + K instance only)."""
        self.drafter, self.block_size = drafter, block_size
        self.tokens_per_row = 1 + drafter.num_spec if tokens_per_row is None else tokens_per_row
        self.with_step = with_step
        self.max_rows = max(buckets)
        self.max_seq = max_model_len + 2 * (1 + drafter.num_spec) + 1   # host bound of every row's length
        emb = drafter.target.backbone.embeddings.weight
        self.buckets = {rows: _Bucket(rows, self.tokens_per_row, emb.shape[1], max_blocks, emb.dtype, device)
                        for rows in sorted(set(buckets))}
        self._capture_all(device)

    # ---- bodies (captured) ----------------------------------------------------------------
    def _verify_body(self, buf: _Bucket):
        tokens_per_row = self.tokens_per_row
        attn = AttnMetadata(buf.v_qsl, buf.v_seq_lens, buf.v_bt, buf.v_slots, tokens_per_row, self.max_seq)
        placeholder = _no_mamba(buf.rows, tokens_per_row, buf.v_tokens.device)
        fb = ForwardBatch(buf.v_tokens, buf.v_pos, attn, placeholder, buf.v_idx)
        h, normed = self.drafter._step(buf.v_tokens, buf.v_hidden, fb, buf.v_idx)
        return h, self.drafter.draft_logits(normed)

    def _step_body(self, buf: _Bucket):
        fb = single_token_batch(buf.s_tok, buf.s_pos, buf.s_bt, self.block_size, torch.zeros_like(buf.s_pos),
                                buf.s_valid, self.max_seq)
        h, normed = self.drafter._step(buf.s_tok, buf.s_hidden, fb)
        return h, self.drafter.draft_logits(normed)

    @torch.inference_mode()
    def _capture_all(self, device) -> None:
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(device)[0]
        pool = None
        for rows in sorted(self.buckets, reverse=True):         # largest first: one pool fits all
            bucket = self.buckets[rows]
            bodies = (("v", self._verify_body),) + ((("s", self._step_body),) if self.with_step else ())
            for prefix, body in bodies:
                for _ in range(2):                              # warm-up (Triton compiles here)
                    body(bucket)
                torch.cuda.synchronize(device)
                g = torch.cuda.CUDAGraph()
                with capturing(g, pool=pool):
                    out = body(bucket)
                pool = g.pool()
                setattr(bucket, f"{prefix}_graph", g)
                setattr(bucket, f"{prefix}_out", out)
        torch.cuda.synchronize(device)
        logger.info("captured %d MTP graphs (verify%s; B in %s, %d tokens per verify row) in %.1fs, %.1f MiB",
                    (1 + self.with_step) * len(self.buckets), " + step" if self.with_step else "",
                    sorted(self.buckets), self.tokens_per_row, time.perf_counter() - t0,
                    (free0 - torch.cuda.mem_get_info(device)[0]) / 2**20)

    def _bucket(self, num_rows: int) -> _Bucket:
        return self.buckets[next(rows for rows in sorted(self.buckets) if rows >= num_rows)]

    # ---- calls ----------------------------------------------------------------------------
    def verify(self, tokens: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, idx: torch.Tensor):
        """A decode-only step of N <= max_rows rows of ``tokens_per_row`` tokens (T = N * that):
        tokens [T] (shifted), hidden [T, D] (the target's), fb the step's batch, idx [N]
        -> (hidden at idx [N, D], logits [N, V])."""
        n, tokens_per_row = idx.shape[0], self.tokens_per_row
        num_tokens = n * tokens_per_row
        buf = self._bucket(n)
        a = fb.attn
        buf.v_tokens[:num_tokens].copy_(tokens)
        buf.v_hidden[:num_tokens].copy_(hidden)
        buf.v_pos[:num_tokens].copy_(fb.positions)
        buf.v_seq_lens[:n].copy_(a.seq_lens)
        buf.v_bt[:n, :a.block_tables.shape[1]].copy_(a.block_tables)
        buf.v_slots[:num_tokens].copy_(a.slot_mapping)
        buf.v_idx[:n].copy_(idx)
        if buf.v_rows > n:                                       # real rows left by a larger call
            buf.v_seq_lens[n:].fill_(tokens_per_row)
            buf.v_slots[num_tokens:].zero_()
            buf.v_bt[n:].zero_()
            buf.v_idx[n:].copy_(buf.v_qsl[n:-1])
        buf.v_rows = n
        buf.v_graph.replay()
        return buf.v_out[0][:n], buf.v_out[1][:n]

    def step(self, tok: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, block_tables: torch.Tensor,
             valid: torch.Tensor):
        """One token per row for N <= max_rows rows -> (MTP hidden [N, D], logits [N, V])."""
        n = tok.shape[0]
        buf = self._bucket(n)
        buf.s_tok[:n].copy_(tok)
        buf.s_hidden[:n].copy_(hidden)
        buf.s_pos[:n].copy_(pos)
        buf.s_bt[:n, :block_tables.shape[1]].copy_(block_tables)
        buf.s_valid[:n].copy_(valid)
        if buf.s_rows > n:
            buf.s_pos[n:].zero_()
            buf.s_valid[n:].fill_(False)
            buf.s_bt[n:].zero_()
        buf.s_rows = n
        buf.s_graph.replay()
        return buf.s_out[0][:n], buf.s_out[1][:n]


def _no_mamba(num_rows: int, tokens_per_row: int, device) -> MambaMetadata:
    """The MTP layers have no Mamba mixer; a decode-shaped placeholder."""
    z = torch.zeros(0, dtype=torch.int64, device=device)
    return MambaMetadata(num_rows, tokens_per_row, z, z, torch.zeros(1, dtype=torch.int64, device=device), (0,), z,
                         torch.zeros(0, dtype=torch.bool, device=device))
