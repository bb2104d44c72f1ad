"""How spec_real times one cell: warm-up, then ``repeats`` timed runs of the cell's generate calls;
tokens/s end to end (prefill included) and the time per output token after the first (TPOT, the
decode-only speed that speculation changes), with the acceptance counts and the plans that took
the steps."""
from __future__ import annotations

import copy
import gc
import statistics
import time

import torch


def sync(device: str) -> None:
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.synchronize()


def stat_delta(after: dict, before: dict) -> dict:
    steps = after.get("verify_steps", 0) - before.get("verify_steps", 0)
    acc = after.get("drafts_accepted", 0) - before.get("drafts_accepted", 0)
    prop = after.get("drafts_proposed", 0) - before.get("drafts_proposed", 0)
    per_a, per_b = after.get("accepted_per_position", []), before.get("accepted_per_position", [])
    per = [(a - (per_b[j] if j < len(per_b) else 0)) / steps if steps else 0.0 for j, a in enumerate(per_a)]
    # tokens per decode step (a request's first token comes from its prefill): the acceptance
    # length, also where forced acceptance accepts columns the drafter left empty
    decoded = (after.get("generated_tokens", 0) - before.get("generated_tokens", 0)
               - (after.get("requests_finished", 0) - before.get("requests_finished", 0)))
    return dict(verify_steps=steps, acceptance_length=decoded / steps if steps else 1.0,
                draft_acceptance_rate=acc / prop if prop else 0.0, per_position=per)


def mean_tpot(outputs) -> float | None:
    """Mean over requests of (finish - first token) / (tokens - 1), seconds: the decode time per
    output token, without the prefill and first token (host commit times, ``RequestOutput.metrics``)."""
    per = []
    for o in outputs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if n > 1 and m.get("first_token_time") is not None and m.get("finish_time") is not None:
            per.append((m["finish_time"] - m["first_token_time"]) / (n - 1))
    return sum(per) / len(per) if per else None


def mean_ttft(outputs) -> float | None:
    """Mean over requests of (first token - arrival), seconds: the prefill and first token of each
    request (host times, ``RequestOutput.metrics``); what end-to-end time holds beside the TPOT."""
    per = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outputs
           if o.metrics.get("first_token_time") is not None and o.metrics.get("arrival_time") is not None]
    return sum(per) / len(per) if per else None


def time_cell(llm, groups, args, timeline) -> tuple[float, list, dict]:
    """``groups``: [(prompts, params)], the generate calls one run makes one after the other (batch
    1 over several prompts: one call each). -> (median seconds of a run, the last run's output
    tokens in order, stats over the timed runs: acceptance, ``tpot_s`` (median over runs of the
    runs' mean TPOT), ``ttft_s`` (the same of the time to first token), ``steps_by_plan`` (which plan took the steps, per run) and ``steps_by_width``
    (steps per run and median interval by plan and width), both from ``timeline``, the engine's
    ``common.StepTimeline``)."""
    for prompts, params in groups:
        llm.generate(prompts, params, use_tqdm=False)                  # warm-up (graphs, caches)
    before = copy.deepcopy(llm.stats())                                # stats() shares its lists
    timeline.clear()
    times, tpots, ttfts, outs = [], [], [], []
    for _ in range(args.repeats):
        sync(args.device)
        t0 = time.perf_counter()
        outs = []
        for prompts, params in groups:
            outs += llm.generate(prompts, params, use_tqdm=False)
            timeline.cut()                   # no step interval spans two generate calls
        sync(args.device)
        times.append(time.perf_counter() - t0)
        tpots.append(mean_tpot(outs))
        ttfts.append(mean_ttft(outs))
    stats = stat_delta(llm.stats(), before)
    stats["tpot_s"] = statistics.median(tpots) if None not in tpots else None
    stats["ttft_s"] = statistics.median(ttfts) if None not in ttfts else None
    stats["steps_by_plan"] = timeline.steps_by_plan(runs=args.repeats)
    stats["steps_by_width"] = timeline.summary(runs=args.repeats)
    return statistics.median(times), [o.outputs[0].token_ids for o in outs], stats


def free() -> None:
    """Collect a dropped engine (the caller deletes its own reference first: a name deleted here would
    leave the caller's alive, and the next engine would size its KV cache beside the old one)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
