"""Serving benchmark: Poisson arrivals against ``hybrid-engine serve`` (streaming /v1/completions).

Against a running server:

    python benchmarks/serve.py --url http://127.0.0.1:8000 --rates 1 4 16 inf --num-prompts 200

Or let it start one server per configuration (here: no speculation, n-gram and MTP), each on a free
loopback port, and stop it afterwards:

    python benchmarks/serve.py --model path/to/hf_dir --configs none ngram:3 mtp:2 --rates 2 8 inf \
        --input-len 512 --output-len 128 --num-prompts 200 --out $OUT
    python benchmarks/serve.py --configs none ngram:3 --rates 4 inf --num-prompts 16 \
        --input-len 16 --output-len 16 --device cpu           # tiny CPU run on the default model
    python benchmarks/serve.py --shape 8b --configs none mtp:3 --rates 4 8 16 32 --out $OUT
        # the Nemotron-H 8B shape with random bf16 weights (no checkpoint): the server process builds them
    python benchmarks/serve.py --configs none --rates inf --max-concurrency 1 --direct ...
        # batch 1 (one request at a time), through the server and on an in-process AsyncLLM built
        # from the same arguments: the server's overhead on TPOT, same run

Each request is a random token-id prompt (length uniform in input-len * [1 - range, 1 + range]) with
``max_tokens`` drawn the same way from output-len, ``ignore_eos`` and greedy decoding, streamed with
``return_token_ids`` so that chunks carrying several tokens (speculative decoding) are counted
right. Arrivals follow a Poisson process at each rate (``inf``: all at once). Reported per (config,
rate): request and output-token throughput, time to first token (TTFT), time per output token after
the first (TPOT, per request) and inter-token latency (ITL: the gap between chunks, divided over the
tokens a chunk carries), as mean / p50 / p90 / p99 in milliseconds, and the speculative acceptance
rate over the run (from the server's /health counters; "-" without speculation). Prints a markdown table; --out
also writes serve-bench.json.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))            # --direct builds the engine in this process

from benchmarks.serve_process import serve_argv, start_server, stop_server  # noqa: E402
from benchmarks.serve_report import plot, summarize, table  # noqa: E402


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    start: float = 0.0            # perf_counter when the request was sent
    last: float = 0.0             # perf_counter of the last chunk

    def arrived(self, n: int, t0: float) -> None:
        """A chunk of ``n`` tokens arrived now (speculative steps deliver several): the first sets
        TTFT, later ones add n inter-token gaps of (time since the last chunk) / n."""
        now = time.perf_counter()
        if self.output_len == 0:
            self.start, self.ttft = t0, now - t0
        else:
            self.itl += [(now - self.last) / n] * n
        self.last = now
        self.output_len += n

    def done(self, t0: float) -> "Result":
        self.latency = time.perf_counter() - t0
        self.ok = True
        return self


class StreamError(RuntimeError):
    """The server sent an error event or a non-200 status: reported as its message."""


async def timed(chunks, prompt_len: int) -> Result:
    """Time a request whose ``chunks`` (an async iterator, started by this call) yield the number of
    tokens each streamed chunk carries; a failure is recorded on the Result, never raised."""
    t0 = time.perf_counter()
    res = Result(ok=False, prompt_len=prompt_len)
    try:
        async for n in chunks:
            if n:
                res.arrived(n, t0)
    except Exception as e:                       # noqa: BLE001 - a failed request is reported, not fatal
        res.error = str(e) if isinstance(e, StreamError) else f"{type(e).__name__}: {e}"
        return res
    return res.done(t0)


async def _server_chunks(client, url: str, body: dict, timeout: float):
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise StreamError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(chunk["error"]["message"])
            yield sum(len(c.get("token_ids") or []) for c in chunk["choices"])


def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int, timeout: float):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    return timed(_server_chunks(client, url, body, timeout), len(prompt))


def sample_lengths(rng, mean: int, spread: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - spread))), max(1, int(mean * (1 + spread)))
    return rng.integers(lo, hi + 1, n).tolist()


async def _direct_chunks(llm, prompt: list[int], max_tokens: int):
    from hybrid_engine import SamplingParams
    async for out in llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)):
        yield len(out.outputs[0].token_ids)


def one_request_direct(llm, prompt: list[int], max_tokens: int):
    """The same request on an in-process ``AsyncLLM`` (no HTTP): the baseline of the server's overhead."""
    return timed(_direct_chunks(llm, prompt, max_tokens), len(prompt))


async def arrivals(send, rate: float, prompts, out_lens, seed: int, max_concurrency: int | None) -> tuple:
    """``send(prompt, max_tokens)`` for every request at Poisson arrivals of ``rate`` (inf: all at
    once), at most ``max_concurrency`` in flight (None: no limit). -> (results, seconds)."""
    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(p, m):
        if gate is None:
            return await send(p, m)
        async with gate:
            return await send(p, m)
    tasks = []
    t0 = time.perf_counter()
    for p, m in zip(prompts, out_lens):
        tasks.append(asyncio.create_task(limited(p, m)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.exponential(1.0 / rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


async def run_rate(url: str, model: str, rate: float, prompts, out_lens, timeout: float, seed: int,
                   max_concurrency: int | None = None) -> tuple:
    import httpx
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        return await arrivals(lambda p, m: one_request(client, url, model, p, m, timeout), rate, prompts, out_lens,
                              seed, max_concurrency)


def bench_server(args, url: str, config: str) -> list[dict]:
    import httpx
    model = httpx.get(url + "/v1/models", headers=_auth(args), timeout=10).json()["data"][0]["id"]
    lo, hi = args.token_range
    rows = []
    if args.warmup:
        wp, wl = warmup_requests(args)
        asyncio.run(run_rate(url, model, math.inf, wp, wl, args.timeout, args.seed))
    for rate, rng, kept in passes(args):
        in_lens = sample_lengths(rng, args.input_len, args.input_len_range, args.num_prompts)
        out_lens = sample_lengths(rng, args.output_len, args.output_len_range, args.num_prompts)
        prompts = [rng.integers(lo, hi, n).tolist() for n in in_lens]
        h0 = httpx.get(url + "/health", timeout=10).json()
        results, dur = asyncio.run(run_rate(url, model, rate, prompts, out_lens, args.timeout, args.seed,
                                            args.max_concurrency))
        h1 = httpx.get(url + "/health", timeout=10).json()
        s = summarize(results, dur)
        proposed = h1.get("drafts_proposed", 0) - h0.get("drafts_proposed", 0)
        s["spec_acceptance_rate"] = (h1["drafts_accepted"] - h0["drafts_accepted"]) / proposed if proposed else None
        s.update(config=config, rate="inf" if not math.isfinite(rate) else rate)
        print(f"  {config} rate={s['rate']}: {s['completed']} ok, {s['failed']} failed, "
              f"{s['output_throughput']:.1f} tok/s, TTFT p99 {s.get('p99_ttft_ms', float('nan')):.0f} ms, "
              f"TPOT p50 / p99 {s.get('p50_tpot_ms', float('nan')):.1f} / {s.get('p99_tpot_ms', float('nan')):.1f} ms"
              + (f" (first error: {s['first_error']})" if s["failed"] else "")
              + ("" if kept else " (warm-up pass, not kept)"), flush=True)
        if kept:
            rows.append(s)
    return rows


def passes(args):
    """(rate, generator, kept) for every rate of every ``--passes`` pass; each pass draws the same
    workloads (the generator restarts), and only the last pass is kept."""
    for p in range(args.passes):
        rng = np.random.default_rng(args.seed)
        for rate in args.rates:
            yield rate, rng, p == args.passes - 1


def bench_direct(args, config: str) -> list[dict]:
    """The same workloads (same seed: the same prompts and lengths as ``bench_server``) on an
    ``AsyncLLM`` in this process, built from the server's own arguments: what the server adds. It
    runs after the configuration's server, so it reads the compiles the server left in Triton's
    disk cache (compare TTFT only with ``--passes 2``), and its client coroutines share the event
    loop with the engine's step loop (the server's clients are another process)."""
    from hybrid_engine.cli import build_parser
    from hybrid_engine.server.cli import build_llm
    from benchmarks.common import random_weights
    with random_weights() if args.shape else contextlib.nullcontext():
        llm = build_llm(build_parser().parse_args(serve_argv(args, config)))
    lo, hi = args.token_range
    rows = []

    async def run(rate, prompts, out_lens, max_concurrency):
        return await arrivals(lambda p, m: one_request_direct(llm, p, m), rate, prompts, out_lens, args.seed,
                              max_concurrency)

    async def all_rates():
        if args.warmup:                      # one burst, as bench_server's warm-up
            await run(math.inf, *warmup_requests(args), None)
        for rate, rng, kept in passes(args):
            in_lens = sample_lengths(rng, args.input_len, args.input_len_range, args.num_prompts)
            out_lens = sample_lengths(rng, args.output_len, args.output_len_range, args.num_prompts)
            prompts = [rng.integers(lo, hi, n).tolist() for n in in_lens]
            results, dur = await run(rate, prompts, out_lens, args.max_concurrency)
            s = summarize(results, dur)
            s.update(config=f"{config} (AsyncLLM, no server)", rate="inf" if not math.isfinite(rate) else rate)
            print(f"  {s['config']} rate={s['rate']}: {s['completed']} ok, {s['output_throughput']:.1f} tok/s"
                  + ("" if kept else " (warm-up pass, not kept)"), flush=True)
            if kept:
                rows.append(s)
        llm.shutdown()
    asyncio.run(all_rates())
    return rows


def warmup_requests(args) -> tuple[list, list]:
    """``--warmup`` requests drawn from the workload's prompt-length distribution (own generator:
    the measured workloads stay the same), 8 new tokens each, sent at once. Prefill kernels are
    compiled per shape class on first use, and Triton caches them on disk for later processes: a
    warm-up of 2 short prompts left those compiles in the first configuration's first rate (TTFT
    p99 of seconds), one of 16 left a ~5 s stall in its 64-at-once rate, and the configurations
    run after it did not pay them. A rate of few concurrent requests still compiles variants a
    full batch does not (TTFT p99 5.8 s at 4 req/s after a 64-request warm-up): ``--passes 2``."""
    rng = np.random.default_rng(args.seed + 1)
    lo, hi = args.token_range
    lens = sample_lengths(rng, args.input_len, args.input_len_range, args.warmup)
    return [rng.integers(lo, hi, n).tolist() for n in lens], [8] * args.warmup


def _auth(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server; default: start one per --configs entry")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="model folder for the servers it starts (default: embedded)")
    ap.add_argument("--shape", choices=["8b", "small"], default=None,
                    help="serve a published-size shape with random bf16 weights (no checkpoint) instead of --model")
    ap.add_argument("--configs", nargs="+", default=["none"],
                    help="speculative configs of the servers it starts: none | ngram:K | mtp:K | draft_model:K")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--rates", nargs="+", type=float, default=[1.0, 4.0, math.inf],
                    help="request rates (requests/s, Poisson); inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--input-len-range", type=float, default=0.5, help="uniform in len * [1 - r, 1 + r]")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-len-range", type=float, default=0.5)
    ap.add_argument("--token-range", nargs=2, type=int, default=[3, 1000], help="prompt token ids in [lo, hi)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="requests sent at once before measuring, with the workload's prompt lengths "
                         "(default: min(--num-prompts, --max-num-seqs))")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--passes", type=int, default=1,
                    help="run the rates this many times per configuration and keep the last pass (the "
                         "earlier ones are warm-up: they compile what a warm-up batch did not reach)")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="requests in flight at most (1: one at a time, batch 1); default: no limit")
    ap.add_argument("--direct", action="store_true",
                    help="also run each configuration's workloads on an in-process AsyncLLM (no HTTP), the "
                         "baseline of the server's overhead")
    ap.add_argument("--out", default=None, help="folder for serve-bench.json")
    args = ap.parse_args(argv)
    if args.warmup is None:        # as many at once as the run will have: the shapes of a full batch compile here
        args.warmup = min(args.num_prompts, args.max_num_seqs)
    return args


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--replot":      # an earlier run's JSON
        src = Path(sys.argv[2])
        out = src.with_suffix(".png")
        if not plot(json.loads(src.read_text())["rows"], out):
            print("--replot needs matplotlib")
            return 1
        print(f"wrote {out}")
        return 0
    args = parse(argv)
    rows = []
    if args.shape:
        from benchmarks.common import SHAPE_8B, SHAPE_SMALL, write_config
        args.model = str(write_config(Path(tempfile.mkdtemp(prefix="serve-shape-")) / args.shape,
                                      dict({"8b": SHAPE_8B, "small": SHAPE_SMALL}[args.shape], num_nextn_predict_layers=1)))
    if args.url:
        rows += bench_server(args, args.url.rstrip("/"), "server")
    else:
        logs = Path(args.out) / "serve-bench-logs" if args.out else Path(tempfile.mkdtemp(prefix="serve-bench-"))
        logs.mkdir(parents=True, exist_ok=True)
        for config in args.configs:
            print(f"starting server: spec={config}", flush=True)
            try:
                proc, url, log = start_server(args, config, logs / f"server-{config.replace(':', '-')}.log")
            except RuntimeError as e:           # e.g. out of memory at start: keep the other configs' rows
                print(f"  {config}: server did not start: {str(e)[-600:]}", flush=True)
                rows.append(dict(config=config, rate="-", completed=0, failed=1, first_error=str(e)[-300:]))
                continue
            try:
                rows += bench_server(args, url, config)
            finally:
                stop_server(proc, log)
            if args.direct:
                rows += bench_direct(args, config)
            save(args, rows, plot_it=False)          # what has run survives a later config's failure
    ok_rows = [r for r in rows if r["completed"]]
    print()
    print(table(ok_rows))
    save(args, rows, plot_it=True)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def save(args, rows: list[dict], plot_it: bool) -> None:
    if not args.out:
        return
    out = Path(args.out) / "serve-bench.json"
    out.write_text(json.dumps({"args": {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
                                        for k, v in vars(args).items() if k != "rates"},
                               "rates": [r if math.isfinite(r) else "inf" for r in args.rates],
                               "rows": rows}, indent=1))
    ok_rows = [r for r in rows if r["completed"]]
    if plot_it:
        print(f"\nwrote {out}" + (", serve-bench.png" if plot(ok_rows, Path(args.out) / "serve-bench.png") else ""))


if __name__ == "__main__":
    sys.exit(main())
