"""What the prefix-cache benchmark counts about an engine's steps, beside the requests' own metrics
(benchmark-only: each wraps one engine instance's method or reads its counters): the schedule
calls that split a TTFT (``ScheduleLog``), the forward steps by kind (``count_step_kinds``), the
split and mixed steps and prefill-graph captures (``graph_counts``), evictions and Triton kernel
variants."""
from __future__ import annotations

import collections
import time

import numpy as np

from hybrid_engine.triton_variants import compiled_variants, count_variants


def evictions(engine) -> tuple[int, int]:
    """(checkpoint, KV block) evictions so far (cumulative counters: a scenario takes differences)."""
    st = engine.stats(expert_load=False)
    return st.get("mamba_checkpoint_evictions", 0), st.get("prefix_cache_block_evictions", 0)


class ScheduleLog:
    """Wraps the scheduler's ``schedule`` (benchmark-only) to split each request's TTFT into the
    wait before its first prefill chunk is scheduled and the time from there to its first token,
    and to time the steps: ``first_sched[req_id]`` (perf_counter of that schedule call),
    ``chunks[req_id]`` (prefill chunks), ``steps`` ([(t, decode rows, prefill rows, prefill
    tokens)] per schedule call)."""

    def __init__(self, engine):
        self.first_sched, self.chunks, self.steps = {}, collections.Counter(), []
        inner = engine.scheduler.schedule

        def schedule():
            t = time.perf_counter()
            sched = inner()
            nd = len(sched.decode) if sched.decode is not None else 0
            npf = ntok = 0
            for r in sched.other_rows:
                if r.is_decode:
                    nd += 1
                    continue
                npf, ntok = npf + 1, ntok + r.num_tokens
                self.first_sched.setdefault(r.req_id, t)
                self.chunks[r.req_id] += 1
            self.steps.append((t, nd, npf, ntok))
            return sched
        engine.scheduler.schedule = schedule

    def take(self, done) -> dict:
        """Summary of the requests in ``done`` and the steps since the last call (then cleared)."""
        p50 = lambda x: float(np.percentile(x, 50)) if len(x) else None      # noqa: E731
        queue = [self.first_sched[r.request_id] - r.metrics.arrival_time for r in done if r.request_id in self.first_sched]
        run = [r.metrics.first_token_time - self.first_sched[r.request_id] for r in done
               if r.request_id in self.first_sched]
        computed = [len(r.prompt_token_ids) - r.num_cached_tokens for r in done]
        st = np.array(self.steps, dtype=float).reshape(-1, 4)
        gaps = np.diff(st[:, 0]) * 1e3 if len(st) > 1 else np.zeros(0)   # schedule to schedule: one step
        has_pf = st[:-1, 2] > 0 if len(st) > 1 else np.zeros(0, dtype=bool)
        chunks = [self.chunks[r.request_id] for r in done]
        out = dict(queue_p50_ms=p50(np.array(queue) * 1e3), first_chunk_to_token_p50_ms=p50(np.array(run) * 1e3),
                   computed_tokens_p50=p50(computed), prefill_chunks_mean=float(np.mean(chunks)) if chunks else 0.0,
                   step_ms_p50=p50(gaps), step_ms_p50_with_prefill=p50(gaps[has_pf]),
                   step_ms_p50_decode_only=p50(gaps[~has_pf]), steps=len(st),
                   decode_rows_mean=float(st[:, 1].mean()) if len(st) else 0.0,
                   prefill_tokens_per_prefill_step=float(st[st[:, 2] > 0, 3].mean()) if (st[:, 2] > 0).any() else 0.0)
        self.first_sched.clear()
        self.chunks.clear()
        self.steps.clear()
        return out


def count_step_kinds(engine) -> collections.Counter:
    """Wrap the target's forward executor to count its steps by kind -> the counter: 'decode' (the
    decode half of a split step: plain decode steps replay the fused greedy graphs and do not come
    here), 'decode+prefill:1' (decode rows beside one prefill row: a split step where the executor
    has prefill graphs), 'prefill:2+' and 'decode+prefill:2+' (several prefill rows: eager)."""
    ex = engine.runner.executor
    kinds = collections.Counter()
    inner = ex.forward

    def forward(fb):
        md = fb.mamba
        nd, npf = md.num_decode_rows, md.num_prefill_rows
        kinds[("decode" if nd else "") + ("+" if nd and npf else "") +
              (f"prefill:{npf if npf < 2 else '2+'}" if npf else "")] += 1
        return inner(fb)
    ex.forward = forward
    return kinds


def graph_counts(engine, kinds: collections.Counter) -> dict:
    """Since the last call (the counters are reset): step kinds, split steps (two replays), mixed
    steps (one mixed graph), prefill graphs captured (mixed ones among them) and the seconds spent
    capturing them."""
    out = {"step_kinds": dict(kinds)}
    kinds.clear()
    pg = engine.prefill_graphs
    if pg is not None:
        ex = engine.runner.executor                    # a CudaGraphExecutor: it has prefill graphs
        out.update(split_steps=ex.split_steps, mixed_steps=pg.mixed_steps, prefill_graphs_captured=len(pg.graphs),
                   mixed_graphs_captured=sum(k.decode_rows > 0 for k in pg.graphs), prefill_capture_s=pg.capture_s)
        ex.split_steps, pg.mixed_steps, pg.capture_s = 0, 0, 0.0
    return out


def triton_compiled(device: str) -> int:
    """Triton kernel variants this process holds (0 off CUDA): compiled, or loaded from Triton's
    disk cache (a warm machine). A measured run that compiles any stalls its requests for ~0.3-0.6 s
    per variant on a fresh cache."""
    return count_variants(compiled_variants()) if device != "cpu" else 0
