"""Start-up warm-up: run a few throw-away requests through the engine before it serves, so Triton's
first-sight compiles happen at start-up instead of inside the first users' requests.

Why: a Triton kernel is compiled per set of constexprs (block sizes chosen for a length, dtype
and feature flags) the first time a step meets it; the step path's per-step counts and metadata
pointers are kept out of Triton's value specialisation, so their values compile nothing new
(docs/design.md, invariant 17). CUDA graphs are captured for the
decode buckets when the engine is built, but prefill chunks, mixed prefill + decode steps,
sampling and the drafters' eager paths compile on first sight. On the 8B shape on an H200 that
put 1-6 s into a request's time to first token the first time a new shape came
(benchmarks/results/2026-11-26-serve-h200.md).

What: waves of random-token prompts, ``WARMUP_TOKENS`` new tokens each, ``ignore_eos``:
1. every length of ``warmup_lengths`` at once, greedy: multi-request prefill chunks, mixed steps
   (later prompts' chunks next to earlier ones' decodes), decode batches of several sizes;
2. a few lengths one at a time: single-request prefill and batch-1 decode;
3. sampled requests (temperature, top-k / top-p, a seed, logprobs, ``n`` = 2 sharing a prefill);
4. with prefill CUDA graphs (``EngineCore.prefill_graphs``): a few requests decoding while prompts
   of one length per prefill-graph bucket up to ``MIXED_WARMUP_TOKENS`` arrive one a step, so
   each step is a mixed step (decode rows + one prefill row in one graph, ``prefill_graphs``) and
   captures its key's graph now, not in a user's turn; once with one decoding request and once
   with one more than the smallest mixed decode-row count (``mixed_wave_anchors``: 1 and 5 when
   the counts are 4, 16, ...). With speculation each new prompt makes the next step verify every
   draft, so those waves capture full-width keys; with adaptive speculation the waves run once
   more with the prompts every other step beside requests at rest (no drafts: the width a chat
   turn meets beside resting conversations). A chat turn's prefill beside up to 16 decoding conversations (its
   new message after the restored checkpoint, one or two checkpoint saves) has one of those keys
   (decode rows padded to the mixed count, restores to one, saves to two: ``PrefillKey.of``); the
   captures that remain lazy are those of steps with more decode rows, or that save more than
   twice, or compute no logits.
5. with prefill CUDA graphs: one prompt per bucket up to ``MIXED_WARMUP_TOKENS``, each alone at an
   idle engine, so a request that arrives at an idle server (a prefill-only step: the TTFT of a
   cached prefix) replays a graph captured now.

Every request carries its own seed, so the engine's seed stream is untouched and later sampled
requests get the seeds they would have had without a warm-up. Requests the engine's limits refuse
(``n`` = 2 with ``max_num_seqs`` 1, ...) are skipped. The requests are forgotten and the engine's
counters reset afterwards (``EngineCore.reset_stats``), so ``stats()`` and ``/metrics`` start from
zero. Their blocks in a prefix cache stay until evicted (random tokens: nothing will match them).
Random prompts give n-gram no drafts to accept and the prefix cache (on by default) no hits, so
those two paths still compile on first use: a restore is a few plain copies, so its first use costs
little beside a prefill's kernels. The server runs it by default on CUDA
(``hybrid-engine serve --no-warmup`` skips it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from .sampling_params import SamplingParams
from .spec.adaptive import FixedDrafts

logger = logging.getLogger("hybrid_engine")

RESTING_STEPS = 4               # the anchors' prefill, then decode steps until their rest shows
                                # (a step's width is chosen a step ahead)
WARMUP_TOKENS = 4               # new tokens per warm-up request: a few decode steps each
MIXED_WARMUP_TOKENS = 512       # wave 4's longest prompt: a chat turn's new tokens after its restore
SMALL_LENGTHS = (1, 2, 15, 16, 17, 31, 64, 100, 255, 256, 257)


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    prompt_tokens: int
    steps: int
    seconds: float


def warmup_lengths(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Prompt lengths of wave 1: short ones on both sides of multiples of 16, and one and two chunk
    budgets with their neighbours (chunked prefill's shapes); each leaves room for the new tokens."""
    b = max_num_batched_tokens
    cap = max_model_len - WARMUP_TOKENS - 1
    lengths = {n for n in (*SMALL_LENGTHS, b - 1, b, b + 1, 2 * b + 5) if 1 <= n <= cap}
    return sorted(lengths)


def mixed_warmup_lengths(max_tokens: int, max_prefill_tokens: int) -> list[int]:
    """Wave 4's prompt lengths: the longest length of each prefill-graph bucket below ``max_tokens``
    (``prefill_bucket(b - 1) == b``) that fits ``max_prefill_tokens`` (what a step's token budget
    leaves beside the decode row: the prompt must prefill in one chunk to be a mixed step)."""
    from .step.prefill_layout import prefill_bucket
    out, n = [], 1
    while n < max_tokens:
        b = prefill_bucket(n)
        if b - 1 <= max_prefill_tokens:
            out.append(b - 1)
        n = b
    return out


def _admit(engine, ids: list[int], params: SamplingParams, request_id: str) -> list:
    """Add a warm-up request -> its group ([] when the engine's limits refuse it: n = 2 with
    max_num_seqs 1, a prompt the KV cache cannot hold, ...; skipped, logged)."""
    try:
        group = engine.make_requests(ids, params, request_id=request_id)
    except ValueError as e:
        logger.info("warm-up: skipped a request the engine's limits refuse: %s", e)
        return []
    engine.add_requests(group)
    return group


def _drain(engine, reqs: list) -> int:
    """Step until the engine is idle, then forget ``reqs`` -> steps taken."""
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    for r in reqs:
        engine.forget(r)
    return steps


def _mixed_wave(engine, prompt, seed: int, anchors: int, resting: bool = False) -> tuple[int, int, int]:
    """Wave 4 (module docstring) beside ``anchors`` decoding requests -> (requests, prompt tokens,
    steps). With speculation a step's width is chosen from the previous step's rows, and a new
    request starts at every draft, so a prompt a step keeps every step at full width. ``resting``:
    the anchors are put at rest after their prefill (``AdaptiveDrafts.rest``: no drafts) and decode
    alone for a few steps, then a prompt arrives every other step, after a step of the anchors
    alone: the width a chat turn meets beside conversations at rest."""
    sc = engine.cfg.scheduler
    # the anchors' decode rows (1 + K tokens each) share each step's budget with the new prompt
    lengths = [n for n in mixed_warmup_lengths(MIXED_WARMUP_TOKENS,
                                               sc.max_num_batched_tokens - anchors * (1 + engine.num_spec))
               if n + 2 <= engine.max_model_len]
    if sc.max_num_seqs < anchors + 1 or not lengths:
        return 0, 0, 0
    # the decoding rows: enough tokens to outlive the wave even when every draft is accepted
    anchor = SamplingParams(max_tokens=((2 if resting else 1) * len(lengths) + RESTING_STEPS + 8) * (1 + engine.num_spec),
                            ignore_eos=True, seed=seed)
    # one output token: each prompt finishes in its prefill step, so every step is the anchors'
    # decode rows plus one new prefill row (no queue builds up behind max_num_seqs)
    once = SamplingParams(max_tokens=1, ignore_eos=True, seed=seed)
    reqs = []
    for a in range(anchors):
        reqs += _admit(engine, prompt(8), anchor, f"warmup-mixed-anchor-{a}")
    if len(reqs) < anchors:             # refused: not the decode rows this wave is for, skip it
        for r in reqs:
            engine.abort(r.request_id)
        _drain(engine, reqs)
        return 0, 0, 0
    anchor_reqs = list(reqs)
    requests, tokens, steps = anchors, 8 * anchors, 0

    def keep_resting():
        # at rest by decree, not by rejections (a trained drafter may never give them): again before
        # each prompt, since the anchors-alone steps verify the prompt row's full width and learn
        for r in anchor_reqs:
            engine.runner.policy.rest(r.slot)
    for i in range(RESTING_STEPS if resting else 2):     # their prefill, then they decode
        engine.step()
        steps += 1
        if resting and i == 0:          # slots now given
            keep_resting()
    for i, n in enumerate(lengths):     # one new prompt a step: each step is decode rows + one prefill row
        if resting:
            keep_resting()
        group = _admit(engine, prompt(n), once, f"warmup-mixed-{anchors}-{int(resting)}-{i}")
        if not group:
            continue
        reqs += group
        requests, tokens = requests + 1, tokens + n
        for _ in range(2 if resting else 1):
            engine.step()
            steps += 1
    for a in range(anchors):
        engine.abort(f"warmup-mixed-anchor-{a}")
    return requests, tokens, steps + _drain(engine, reqs)


def _idle_wave(engine, prompt, seed: int) -> tuple[int, int, int]:
    """Wave 5 (module docstring): one prompt per prefill-graph bucket up to ``MIXED_WARMUP_TOKENS``,
    each alone at an idle engine (a prefill-only step) -> (requests, prompt tokens, steps)."""
    lengths = [n for n in mixed_warmup_lengths(MIXED_WARMUP_TOKENS, engine.cfg.scheduler.max_num_batched_tokens)
               if n + 2 <= engine.max_model_len]
    once = SamplingParams(max_tokens=1, ignore_eos=True, seed=seed)
    requests = tokens = steps = 0
    for i, n in enumerate(lengths):
        group = _admit(engine, prompt(n), once, f"warmup-idle-{i}")
        if group:
            requests, tokens = requests + 1, tokens + n
            steps += _drain(engine, group)
    return requests, tokens, steps


def mixed_wave_anchors(decode_buckets: tuple[int, ...]) -> list[int]:
    """Decoding requests of each run of wave 4: one per mixed decode-row count of the first two
    (a chat step has a few decode rows: 1 fills the smallest count, one more than it the next)."""
    return [1 if i == 0 else decode_buckets[i - 1] + 1 for i in range(min(2, len(decode_buckets)))]


def warm_up(engine, *, seed: int = 0) -> WarmupReport:
    """Run the warm-up waves (module docstring) on an idle ``EngineCore``; -> what ran."""
    if engine.has_work():
        raise RuntimeError("warm_up needs an idle engine (requests are queued or running)")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    vocab = engine.cfg.model.vocab_size
    lengths = warmup_lengths(engine.cfg.scheduler.max_num_batched_tokens, engine.max_model_len)
    prompt = lambda n: rng.integers(0, vocab, n).tolist()     # noqa: E731
    # every request has its own seed, so the engine's seed stream (what requests without one draw
    # from) is left untouched: sampled outputs after a warm-up equal those without one
    greedy = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, seed=seed)
    sampled = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9,
                             seed=seed, logprobs=2)
    pair = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, temperature=1.0, n=2, seed=seed + 1)
    waves = [[(prompt(n), greedy) for n in lengths],
             *[[(prompt(n), greedy)] for n in lengths[::4]],
             [(prompt(lengths[len(lengths) // 2]), sampled), (prompt(17), pair)]]
    requests = tokens = steps = 0
    for wave in waves:
        reqs = []
        for ids, params in wave:
            group = _admit(engine, ids, params, f"warmup-{requests}")
            if group:
                reqs += group
                requests += 1
                tokens += len(ids)
        steps += _drain(engine, reqs)
    if engine.prefill_graphs is not None:
        counts = mixed_wave_anchors(engine.prefill_graphs.decode_buckets) or [1]
        # adaptive speculation: conversations at rest (no drafts) meet a new turn at width 1
        adaptive = engine.num_spec and not isinstance(engine.runner.policy, FixedDrafts)
        for anchors, resting in [(a, False) for a in counts] + [(a, True) for a in counts if adaptive]:
            got = _mixed_wave(engine, prompt, seed, anchors, resting=resting)
            requests, tokens, steps = requests + got[0], tokens + got[1], steps + got[2]
        got = _idle_wave(engine, prompt, seed)
        requests, tokens, steps = requests + got[0], tokens + got[1], steps + got[2]
    engine.reset_stats()
    engine.runner.policy.forget_costs()      # warm-up's step times (compiling, odd rows) are not serving's
    report = WarmupReport(requests=requests, prompt_tokens=tokens, steps=steps, seconds=time.perf_counter() - t0)
    logger.info("warm-up: %d requests, %d prompt tokens, %d steps in %.1f s", report.requests,
                report.prompt_tokens, report.steps, report.seconds)
    return report
