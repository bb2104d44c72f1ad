"""The CPU stand-in for prefill CUDA graphs (tests/engine/test_prefill_graphs.py, the warm-up's
split-step wave in tests/engine/test_warmup.py): ``install_reruns(llm)`` routes an engine's
prefill steps through ``RerunPrefillGraphs``, whose "capture" runs the real warm-up and checks it
left the caches alone, and whose "replay" reruns the eager forward on the static buffers; steps of
decode rows plus one prefill row replay a mixed graph as on CUDA, or split (``forward_split``)
where the harness has no mixed graphs."""
import os

import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.step.graphs import EagerExecutor, default_buckets
from hybrid_engine.step.prefill_graphs import PrefillGraphs, forward_split
from hybrid_engine.step.prefill_layout import PrefillKey, mixed_decode_buckets

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
BS = 4                  # small_engine's block size


def small_engine(hybrid_dir, **kw):
    """The CPU engine of the prefill-graph tests: chunks of at most 12 tokens, a checkpoint every 2
    blocks."""
    from hybrid_engine import LLM
    return LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=2, max_num_batched_tokens=12, block_size=BS,
               num_kv_blocks=48, enable_prefix_caching=True, mamba_checkpoint_interval=2, **kw)


def _snapshot(caches):
    ck = caches.checkpoints
    return {"conv": caches.mamba.conv_all.clone(), "ssm": caches.mamba.ssm_all.clone(),
            "k": [t.clone() for t in caches.kv.k], "v": [t.clone() for t in caches.kv.v],
            "ck_conv": ck.conv_all.clone(), "ck_ssm": ck.ssm_all.clone(),
            **{f"pending{i}": t.clone() for i, t in enumerate(caches.mamba.pending_all)}}


def _changed_outside(before, caches, save_rows):
    """Names of the cache tensors the warm-up changed outside what it may write: pool slot
    NULL_SLOT, KV block 0 (the null block) and the step's own checkpoint rows."""
    ck = caches.checkpoints
    keep_slots = [s for s in range(caches.mamba.conv_all.shape[1]) if s != NULL_SLOT]
    keep_rows = [r for r in range(ck.conv_all.shape[1]) if r not in set(save_rows)]
    bad = []
    pending = [(f"pending{i}", t, 1, keep_slots) for i, t in enumerate(caches.mamba.pending_all)]
    for name, now, slots_dim, keep in (("conv", caches.mamba.conv_all, 1, keep_slots),
                                       ("ssm", caches.mamba.ssm_all, 1, keep_slots),
                                       ("ck_conv", ck.conv_all, 1, keep_rows), ("ck_ssm", ck.ssm_all, 1, keep_rows),
                                       *pending):
        idx = torch.tensor(keep, dtype=torch.long, device=now.device)
        if not torch.equal(before[name].index_select(slots_dim, idx), now.index_select(slots_dim, idx)):
            bad.append(name)
    for name in ("k", "v"):
        for layer, (a, b) in enumerate(zip(before[name], getattr(caches.kv, name))):
            if not torch.equal(a[1:], b[1:]):
                bad.append(f"{name}{layer}")
    return bad


class RerunPrefillGraphs(PrefillGraphs):
    """CPU stand-in for the CUDA capture: the warm-up runs as on CUDA (and is checked to leave the
    caches alone outside slot NULL_SLOT, the null block and the step's checkpoint rows); a
    "replay" reruns the eager forward on the static buffers into the static outputs."""

    def __init__(self, *a, caches, **kw):
        super().__init__(*a, **kw)
        self.caches = caches
        self.captured: list[tuple[PrefillKey, list[str]]] = []
        self.replays = 0

    def _capture(self, key, fb):
        self._key, self._before = key, _snapshot(self.caches)
        self._saves = [] if fb.mamba.ckpt_rows is None else fb.mamba.ckpt_rows.tolist()
        return super()._capture(key, fb)

    def _record(self, fresh):
        self._forward(fresh())                                     # the warm-up, as on CUDA
        self.captured.append((self._key, _changed_outside(self._before, self.caches, self._saves)))
        hidden, logits = (t.clone() for t in self._forward(fresh()))
        graphs = self

        class Rerun:
            def replay(self):
                graphs.replays += 1
                h, lg = graphs._forward(fresh())
                hidden.copy_(h)
                logits.copy_(lg)
        return Rerun(), hidden, logits


class PrefillRerunExecutor(EagerExecutor):
    """CudaGraphExecutor's routing on CPU: steps of one prefill row through the prefill graphs
    (alone, or beside decode rows in a mixed graph), else steps of decode rows plus one prefill row
    split (the decode part runs eagerly here, in place of the decode graph), everything else eager."""

    def __init__(self, inner, prefill):
        super().__init__(inner.model, inner.caches)
        self.prefill = prefill
        self.splits = 0

    def prefill_dest(self, num_tokens, *, restores, saves, logits):
        return self.prefill.dest(num_tokens, restores=restores, saves=saves, logits=logits)

    def forward(self, fb):
        got = self.prefill.forward(fb)
        md = fb.mamba
        if got is None and md.num_prefill_rows == 1 and md.num_decode_rows:
            got = forward_split(fb, self.prefill.forward, super().forward)
            self.splits += got is not None
        return got if got is not None else super().forward(fb)


def install_reruns(llm, max_tokens=2048, cls=None, decode_buckets=None):
    """Route ``llm``'s one-prefill-row steps through ``cls`` (default RerunPrefillGraphs) -> it.
    ``decode_buckets``: its mixed graphs' decode-row counts (default: CUDA's for this engine's
    ``max_num_seqs``; ``()``: none, so steps with decode rows split)."""
    eng = llm.engine
    runner = eng.runner
    inner = runner.executor
    if decode_buckets is None:
        decode_buckets = mixed_decode_buckets(default_buckets(eng.cfg.scheduler.max_num_seqs))
    pg = (cls or RerunPrefillGraphs)(lambda fb: EagerExecutor.forward(inner, fb), max_blocks=eng.max_blocks_per_req,
                                     max_model_len=eng.max_model_len, device=torch.device(DEV),
                                     max_tokens=max_tokens, caches=inner.caches,
                                     pad_restores=inner.caches.checkpoints is not None,
                                     decode_buckets=decode_buckets)
    runner.executor = PrefillRerunExecutor(inner, pg)
    for plan in runner.plans:                  # the plans stage prefill-only steps into its graphs' arenas
        if hasattr(plan, "res"):
            plan.res.executor = runner.executor
    return pg


def serve_with_arrivals(eng, prompts, sp, admit) -> list[list[int]]:
    """Step ``eng`` until every prompt has finished, adding the next prompt when the engine is
    idle or ``admit(eng)`` says so (requests that arrive while others decode) -> each prompt's
    output tokens, in prompt order."""
    done, waiting = {}, list(enumerate(prompts))
    while waiting or eng.has_work():
        if waiting and (not eng.has_work() or admit(eng)):
            i, p = waiting.pop(0)
            eng.add_request(eng.make_request(p, sp, f"r{i}"))
        for r in eng.step() if eng.has_work() else ():
            if r.finished:
                done[r.request_id] = list(r.output_token_ids)
                eng.forget(r)
    return [done[f"r{i}"] for i in range(len(prompts))]
