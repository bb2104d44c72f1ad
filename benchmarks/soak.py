"""Soak test: many requests, random lengths, sampling settings, aborts and spec methods at high
concurrency through AsyncLLM, for up to ``--seconds`` (or until ``--requests`` are done).

The time is split between the speculative methods (``--methods``; one AsyncLLM each, built,
soaked, checked and shut down in turn). Each of ``--concurrency`` client tasks loops: a random
prompt (1..--max-prompt tokens), max_tokens (1..--max-gen), greedy or sampled (temperature,
top-k/top-p/min-p, seed), sometimes stop ids, sometimes an abort (the client stops reading after a
random number of deltas, or another task calls ``abort``). Every stream must end normally:

  served     finish_reason "stop"/"length", 1..max_tokens tokens, all in the vocabulary;
  aborted    finish_reason "abort" after an abort this script asked for;
  errors     anything else: finish_reason "error", an exception, a bad token, a missing end
             (must be 0).

After each method: every slot and KV block free, no request left in the scheduler, no batch row
outside the pending removals. Reported: requests served / aborted / errors per method, tokens, GPU
memory (allocated, reserved) and host RSS at start and end, free slot/block counts after.
Exit status 1 if any error or leak.

    # H100 (the lead runs this): a small random-weight model, 300 s, 256 clients
    python benchmarks/soak.py --seconds 300 --out $OUT
    # CPU smoke run with a tiny model
    python benchmarks/soak.py --device cpu --seconds 20
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine import AsyncLLM, SamplingParams, SpeculativeConfig  # noqa: E402

METHODS = ("none", "ngram", "draft_model", "mtp")


def host_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory(device: str) -> dict:
    m = {"host_rss_mib": round(host_rss_mib(), 1)}
    if device == "cuda":
        torch.cuda.synchronize()
        m["gpu_allocated_mib"] = round(torch.cuda.memory_allocated() / 2**20, 1)
        m["gpu_reserved_mib"] = round(torch.cuda.memory_reserved() / 2**20, 1)
    return m


def make_model(device: str, root: Path) -> Path:
    """A synthetic checkpoint with MTP weights: tiny on CPU, a small (~30M) shape on CUDA."""
    from hybrid_engine.models.synthetic import make_hf_model
    if device == "cpu":
        return make_hf_model(root / "tiny", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)
    return make_hf_model(root / "small", pattern="M-M*-M-M*-", vocab_size=32000, hidden_size=512,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
                         mamba_num_heads=16, mamba_head_dim=64, n_groups=2, ssm_state_size=64, chunk_size=64,
                         num_nextn_predict_layers=1, scale="hf", seed=1, dtype=torch.bfloat16)


def spec_config(method: str, model_dir: Path, k: int):
    if method == "none":
        return None
    if method == "draft_model":
        return SpeculativeConfig("draft_model", k, model=str(model_dir))
    return SpeculativeConfig(method, k)


def random_params(rng: np.random.Generator, max_gen: int, vocab: int) -> SamplingParams:
    kw = dict(max_tokens=int(rng.integers(1, max_gen + 1)), ignore_eos=bool(rng.random() < 0.8))
    r = rng.random()
    if r < 0.5:
        kw.update(temperature=float(rng.uniform(0.3, 1.5)))
        if rng.random() < 0.5:
            kw["seed"] = int(rng.integers(0, 2**63 - 1))
        if rng.random() < 0.3:
            kw["top_k"] = int(rng.choice([1, 5, 50, vocab * 4]))
        if rng.random() < 0.3:
            kw["top_p"] = float(rng.uniform(0.1, 1.0))
        if rng.random() < 0.2:
            kw["min_p"] = float(rng.uniform(0.0, 0.3))
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 4)))]
    return SamplingParams(**kw)


class Tally:
    def __init__(self):
        self.served = self.aborted = self.errors = self.tokens = self.aborts_asked = 0
        self.error_samples: list[str] = []

    def error(self, msg: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(msg)


async def client(eng: AsyncLLM, cid: int, args, deadline: float, budget: list, tally: Tally, vocab: int):
    rng = np.random.default_rng(args.seed * 100_003 + cid)
    n = 0
    while time.perf_counter() < deadline and budget[0] > 0:
        budget[0] -= 1
        n += 1
        prompt = rng.integers(0, vocab, int(rng.integers(1, args.max_prompt + 1))).tolist()
        params = random_params(rng, args.max_gen, vocab)
        rid = f"c{cid}-{n}"
        r = rng.random()
        stop_after = int(rng.integers(0, 4)) if r < args.abort_rate / 2 else None         # consumer leaves
        abort_after = float(rng.uniform(0, 0.05)) if args.abort_rate / 2 <= r < args.abort_rate else None
        if abort_after is not None:
            async def later(rid=rid, delay=abort_after):
                await asyncio.sleep(delay)
                await eng.abort(rid)
            killer = asyncio.ensure_future(later())
        toks, last, deltas = [], None, 0
        try:
            async with contextlib.aclosing(eng.generate(prompt, params, request_id=rid)) as stream:
                async for out in stream:
                    toks += out.outputs[0].token_ids
                    last, deltas = out, deltas + 1
                    if stop_after is not None and deltas > stop_after and not out.finished:
                        break
        except Exception as e:                      # noqa: BLE001 -- every exception is an error here
            tally.error(f"{rid}: raised {e!r}")
            continue
        finally:
            if abort_after is not None:
                killer.cancel()
        if stop_after is not None and (last is None or not last.finished):
            tally.aborted += 1
            tally.aborts_asked += 1
            continue
        if last is None or not last.finished:
            tally.error(f"{rid}: stream ended without a finished output")
            continue
        reason = last.outputs[0].finish_reason
        if reason == "abort" and (abort_after is not None or stop_after is not None):
            tally.aborted += 1
            tally.aborts_asked += 1
        elif reason in ("stop", "length") and last.error is None:
            if not 1 <= len(toks) <= params.max_tokens or not all(0 <= t < vocab for t in toks):
                tally.error(f"{rid}: {len(toks)} tokens for max_tokens={params.max_tokens} or out of vocabulary")
            else:
                tally.served += 1
                tally.tokens += len(toks)
        else:
            tally.error(f"{rid}: finish_reason={reason!r} error={last.error!r}")


def leaks(eng: AsyncLLM) -> list[str]:
    core = eng.engine
    st, sched = core.stats(), core.scheduler
    out = []
    if st["free_slots"] != st["total_slots"]:
        out.append(f"slots {st['free_slots']}/{st['total_slots']} free")
    if st["free_blocks"] != st["total_blocks"]:
        out.append(f"blocks {st['free_blocks']}/{st['total_blocks']} free")
    if sched.requests:
        out.append(f"{len(sched.requests)} requests left in the scheduler")
    stray = set(core.runner.batch.req_id_to_row) - sched._removed
    if stray:
        out.append(f"{len(stray)} batch rows of no request")
    return out


async def soak_one(eng: AsyncLLM, args, seconds: float, requests: int, vocab: int) -> Tally:
    tally, budget = Tally(), [requests]
    deadline = time.perf_counter() + seconds
    await asyncio.gather(*[client(eng, c, args, deadline, budget, tally, vocab) for c in range(args.concurrency)])
    for _ in range(200):                            # let the step loop drain aborted in-flight work
        if not eng.engine.has_work():
            break
        await asyncio.sleep(0.01)
    return tally


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: a synthetic one)")
    ap.add_argument("--seconds", type=float, default=300.0, help="total soak time, split between methods")
    ap.add_argument("--requests", type=int, default=60_000, help="stop after this many requests in total")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {METHODS}")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=None, help="client tasks (default 256 on CUDA, 8 on CPU)")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-prompt", type=int, default=None)
    ap.add_argument("--max-gen", type=int, default=None)
    ap.add_argument("--abort-rate", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for soak.json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.concurrency = args.concurrency or (256 if cuda else 8)
    args.max_prompt = args.max_prompt or (512 if cuda else 24)
    args.max_gen = args.max_gen or (64 if cuda else 8)
    max_num_seqs = args.max_num_seqs or (256 if cuda else 4)
    methods = [m for m in args.methods.split(",") if m]
    root = Path(tempfile.mkdtemp(prefix="soak-"))
    model_dir = Path(args.model) if args.model else make_model(args.device, root)
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "args": vars(args), "methods": {}}
    failed = False
    per_seconds, per_requests = args.seconds / len(methods), -(-args.requests // len(methods))
    for method in methods:
        kw = dict(device=args.device, dtype="bfloat16" if cuda else "float32", max_num_seqs=max_num_seqs,
                  speculative_config=spec_config(method, model_dir, args.num_spec))
        if not cuda:
            kw.update(max_num_batched_tokens=64, block_size=8, num_kv_blocks=64)
        eng = AsyncLLM(model_dir, **kw)
        vocab = eng.engine.cfg.model.vocab_size
        mem0 = memory(args.device)
        t0 = time.perf_counter()
        tally = asyncio.run(soak_one(eng, args, per_seconds, per_requests, vocab))
        wall = time.perf_counter() - t0
        leak = leaks(eng)
        st = eng.stats()
        row = {"requests": tally.served + tally.aborted + tally.errors, "served": tally.served,
               "aborted": tally.aborted, "errors": tally.errors, "error_samples": tally.error_samples,
               "tokens": tally.tokens, "seconds": round(wall, 1),
               "requests_per_s": round((tally.served + tally.aborted) / wall, 1),
               "memory_start": mem0, "memory_end": memory(args.device),
               "free_slots": f"{st['free_slots']}/{st['total_slots']}",
               "free_blocks": f"{st['free_blocks']}/{st['total_blocks']}", "leaks": leak}
        report["methods"][method] = row
        print(json.dumps({method: row}), flush=True)
        failed |= bool(tally.errors or leak)
        eng.shutdown()
        del eng
        gc.collect()            # the engine's reference cycles hold its caches until collected
        if cuda:
            torch.cuda.empty_cache()
    total = {k: sum(r[k] for r in report["methods"].values()) for k in ("requests", "served", "aborted", "errors")}
    report["total"] = total
    print(json.dumps({"total": total, "ok": not failed}), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "soak.json").write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
