"""Per-position values of a text through the engine's own model (evaluation: held-out losses,
logit comparisons), outside the serving loop."""
from __future__ import annotations

import torch


def prefill_hidden(llm, ids: list[int]) -> torch.Tensor:
    """Final-normed hidden states [T, D] of one plain prefill of ``ids`` through an ``LLM``'s model
    and caches (a fresh slot and blocks, given back afterwards; not for a running engine's step
    loop). ``llm.engine.model.compute_logits`` turns them into logits."""
    from hybrid_engine.attention import blocks_needed
    from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch, MambaMetadata

    eng = llm.engine
    slot = eng.scheduler.slots.allocate()
    bs = eng.scheduler.block_size
    blocks = eng.scheduler.blocks.allocate(blocks_needed(len(ids), bs))
    try:
        dev = eng.cfg.device
        t = len(ids)
        pos = torch.arange(t, device=dev)
        bt = torch.tensor([blocks], dtype=torch.int32, device=dev)
        qsl = torch.tensor([0, t], dtype=torch.int32, device=dev)
        fb = ForwardBatch(
            torch.tensor(ids, device=dev), pos,
            AttnMetadata(qsl, torch.tensor([t], dtype=torch.int32, device=dev), bt,
                         bt[0, pos // bs].long() * bs + pos % bs, t, t),
            MambaMetadata(0, 1, torch.zeros(0, dtype=torch.long, device=dev),
                          torch.ones(0, dtype=torch.long, device=dev), qsl.long(), (0, t),
                          torch.tensor([slot], device=dev), torch.tensor([False], device=dev)),
            pos)
        with torch.inference_mode():
            return eng.model(fb, eng.caches)
    finally:
        eng.scheduler.slots.free(slot)
        eng.scheduler.blocks.free(blocks)
