"""Held-out losses of saved folders, computed by transformers and by our engine.

Both score the same held-out windows (``seq_len + 1`` tokens each): next-token cross-entropy over
every position, averaged over all scored tokens. The engine's numbers come from its own model and
caches: one plain prefill of the window (``engine_prefill_hidden``) then ``compute_logits``. The MTP
loss by the engine runs its loaded ``mtp.layers.*`` modules over the engine's hidden states, as
its MTP drafter does, with the MTP attention as a plain causal attention over the pairs (the
drafter's KV-cached form equals that; tests/spec/test_spec_decode.py checks it).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybrid_engine.evaluation import prefill_hidden as engine_prefill_hidden  # the engine's own model


def heldout_windows(stream: torch.Tensor, seq_len: int, n: int) -> list[torch.Tensor]:
    """The first ``n`` non-overlapping windows of ``seq_len + 1`` tokens of the held-out stream."""
    w = seq_len + 1
    n = min(n, stream.numel() // w)
    if n < 1:
        raise ValueError(f"held-out stream has {stream.numel()} tokens, fewer than one window of {w}; "
                         f"raise --heldout-bytes")
    return [stream[i * w:(i + 1) * w].clone() for i in range(n)]


def _mean(total: float, count: int) -> float:
    return total / max(count, 1)


@torch.no_grad()
def hf_loss(model_dir, windows, device) -> float:
    """Next-token loss of transformers' AutoModelForCausalLM (float32) on the windows."""
    from transformers import AutoModelForCausalLM
    from hybrid_engine.models.synthetic import _quiet_transformers

    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    total, count = 0.0, 0
    for w in windows:
        w = w.to(device)
        logits = model(input_ids=w[None, :-1]).logits[0].float()
        total += F.cross_entropy(logits, w[1:], reduction="sum").item()
        count += w.numel() - 1
    del model
    return _mean(total, count)


def engine_mtp_hidden(model, emb: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
    """The engine's MTP layers over pairs (emb [P, D] = embed(t_1..t_P), prev_hidden [P, D] =
    h_0..h_{P-1}) with causal attention over the pairs -> final-normed [P, D]."""
    mtp = model.mtp
    first = mtp.layers[0]
    h = first.eh_proj(torch.cat([first.enorm(emb), first.hnorm(prev_hidden)], -1))
    t = h.shape[0]
    for layer in mtp.layers:
        x = layer.norm(h)
        if layer.attn:
            a = layer.mixer
            q = a.q_proj(x).view(t, a.nh, a.hd).transpose(0, 1)
            k = a.k_proj(x).view(t, a.nkv, a.hd).transpose(0, 1).repeat_interleave(a.nh // a.nkv, 0)
            v = a.v_proj(x).view(t, a.nkv, a.hd).transpose(0, 1).repeat_interleave(a.nh // a.nkv, 0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.scale)
            h = h + a.o_proj(o.transpose(0, 1).reshape(t, -1))
        else:
            h = h + layer.mixer(x)
    return mtp.layers[-1].final_layernorm(h)


def engine_llm(model_dir, device, seq_len: int, *, dtype: str = "float32", mtp: bool = False):
    """An LLM sized for one window at a time; ``mtp`` loads the MTP layers (the MTP drafter, K=1)."""
    from hybrid_engine import LLM, SpeculativeConfig
    block = 16
    spec = SpeculativeConfig("mtp", 1) if mtp else None
    return LLM(str(model_dir), dtype=dtype, device=str(device), max_num_seqs=1, block_size=block,
               speculative_config=spec,
               num_kv_blocks=math.ceil((seq_len + 2) / block) + 4, max_model_len=seq_len + 8,
               async_scheduling=False, enforce_eager=True)


@torch.no_grad()
def engine_losses(model_dir, windows, device, *, mtp: bool) -> dict:
    """{"next_token": loss, "mtp": loss (when ``mtp``)} by our engine (float32) on the windows."""
    seq_len = windows[0].numel() - 1
    llm = engine_llm(model_dir, device, seq_len, mtp=mtp)
    model = llm.engine.model
    tot, tot_mtp, count, count_mtp = 0.0, 0.0, 0, 0
    with torch.inference_mode():
        for w in windows:
            ids = w.tolist()
            hidden = engine_prefill_hidden(llm, ids[:-1])                   # [T, D]
            labels = w[1:].to(hidden.device)
            tot += F.cross_entropy(model.compute_logits(hidden), labels, reduction="sum").item()
            count += labels.numel()
            if mtp:
                emb = model.backbone.embeddings(labels[:-1])                  # t_1..t_{T-1}
                m = engine_mtp_hidden(model, emb, hidden[:-1])
                tot_mtp += F.cross_entropy(model.compute_logits(m), labels[1:], reduction="sum").item()
                count_mtp += labels.numel() - 1
    out = {"next_token": _mean(tot, count)}
    if mtp:
        out["mtp"] = _mean(tot_mtp, count_mtp)
    del llm
    return out


@torch.no_grad()
def training_losses(target, draft, windows, device) -> dict:
    """The in-memory (training-time) modules' held-out losses, in eval mode."""
    from .models import draft_loss
    target.eval()
    draft.eval()
    t = m = d = 0.0
    for w in windows:
        w = w[None].to(device)
        a, b = target.losses(w)
        t += a.item()
        m += b.item()
        d += draft_loss(draft, w).item()
    n = len(windows)
    target.train()
    draft.train()
    # per-window means of equal-length windows: the same as the per-token mean
    return {"target": t / n, "mtp": m / n, "draft": d / n}
