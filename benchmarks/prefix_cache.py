"""Prefix caching on a multi-turn chat workload: TTFT and throughput with caching on vs off, with
and without MTP, and the memory the Mamba checkpoints take.

Workload (closed loop, or open with ``--think-time``): ``--conversations`` concurrent conversations share one system prompt of
``--system-len`` tokens; each runs ``--turns`` turns: the prompt is the whole history (system +
earlier user turns + the replies generated) plus a new user message of ``--user-len`` tokens
(uniform in [lo, hi]); the reply is ``--reply-len`` greedy tokens; a conversation sends its next
turn as soon as the previous reply finishes. A second scenario with no sharing at all (random
prompts of the same lengths) checks that caching costs no throughput where it cannot hit. A third,
``single``, sends the system prompt plus one new user message one request at a time: the TTFT of a
shared prefix without queueing behind other conversations.

    # H100, the Nemotron-H-8B shape with random bf16 weights (~6-8 minutes):
    python benchmarks/prefix_cache.py --shape 8b --out $OUT
    # CPU smoke test, tiny model and sizes (~1 minute):
    python benchmarks/prefix_cache.py --device cpu --shape tiny --conversations 3 --turns 2 \
        --system-len 40 --user-len 5 10 --reply-len 4 --nosharing-requests 4

Per (scenario, MTP, caching): TTFT p50 / p99 (ms) and its split (wait for the first prefill chunk, then
to the first token; step times), wall time, prompt and generated tokens per
second, hit rate, cached tokens, checkpoint rows used and bytes. Prints a markdown table; --out
writes prefix-cache-<shape>.json.
"""
from __future__ import annotations

import argparse
import collections
import gc
import heapq
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPE_8B, SHAPE_SMALL, random_weights, save_json, write_config  # noqa: E402
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from benchmarks.step_counters import (ScheduleLog, count_step_kinds, evictions, graph_counts,  # noqa: E402
                                      triton_compiled)


def make_model_dir(shape: str, root: Path) -> Path:
    if shape == "tiny":
        from hybrid_engine.models.synthetic import make_hf_model
        return make_hf_model(root / "tiny", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)
    base = {"8b": SHAPE_8B, "small": SHAPE_SMALL}[shape]
    return write_config(root / shape, dict(base, num_nextn_predict_layers=1))


def drive(engine, submit_next, first):
    """Step until every conversation is done; ``submit_next(req)`` is called for each finished
    request (it may add the conversation's next turn). Returns the finished requests."""
    done = []
    for req in first:
        engine.add_request(req)
    while engine.has_work():
        _step(engine, done, submit_next, engine.add_request)
    return done


def _step(engine, done, submit_next, then) -> None:
    """One engine step: finished requests go to ``done`` and their ``submit_next`` result, if
    any, to ``then``."""
    for req in engine.step():
        if req.finished:
            done.append(req)
            engine.forget(req)
            nxt = submit_next(req)
            if nxt is not None:
                then(nxt)


def drive_timed(engine, submit_next, first):
    """``drive`` with arrivals at set times (open loop). ``first``: (due seconds from now, factory)
    pairs; ``submit_next(req)`` returns the next (delay after now, factory) or None. A factory makes
    the request when it is due; its arrival time is the due time, so a wait behind a step that was
    running when it arrived counts in its TTFT, as in a server."""
    t0 = time.perf_counter()
    heap = [(t0 + due, i, make) for i, (due, make) in enumerate(first)]
    heapq.heapify(heap)
    seq, done = len(heap), []

    def later(nxt):
        nonlocal seq
        heapq.heappush(heap, (time.perf_counter() + nxt[0], seq, nxt[1]))
        seq += 1
    while heap or engine.has_work():
        now = time.perf_counter()
        while heap and heap[0][0] <= now:
            due, _, make = heapq.heappop(heap)
            req = make()
            req.metrics.arrival_time = due
            engine.add_request(req)
        if not engine.has_work():
            time.sleep(max(0.0, heap[0][0] - time.perf_counter()))
            continue
        _step(engine, done, submit_next, later)
    return done


def run_chat(engine, args, rng, vocab):
    """Closed loop (--think-time 0): a conversation sends its next turn when its reply finishes.
    With --think-time T (open loop): T seconds after it, and the conversations start spread evenly
    over T seconds; the offered load then barely depends on how fast the engine answers, so TTFT
    with caching on and off compare at the same load."""
    system = rng.integers(3, vocab, args.system_len).tolist()
    users = [[rng.integers(3, vocab, int(rng.integers(args.user_len[0], args.user_len[1] + 1))).tolist()
              for _ in range(args.turns)] for _ in range(args.conversations)]
    sp = SamplingParams(max_tokens=args.reply_len, ignore_eos=True)
    state = {}

    def make(conv: int, turn: int, history: list[int]):
        prompt = history + users[conv][turn]
        req = engine.make_request(prompt, sp, f"c{conv}-t{turn}")
        state[req.request_id] = (conv, turn, prompt)
        return req

    def submit_next(req):
        conv, turn, prompt = state[req.request_id]
        if turn + 1 < args.turns:
            return make(conv, turn + 1, prompt + list(req.output_token_ids))
        return None
    if args.think_time <= 0:
        return drive(engine, submit_next, [make(c, 0, list(system)) for c in range(args.conversations)])

    def submit_later(req):
        conv, turn, prompt = state[req.request_id]
        if turn + 1 < args.turns:
            history = prompt + list(req.output_token_ids)
            return args.think_time, lambda: make(conv, turn + 1, history)
        return None
    gap = args.think_time / args.conversations
    return drive_timed(engine, submit_later, [(c * gap, lambda c=c: make(c, 0, list(system)))
                                              for c in range(args.conversations)])


def run_nosharing(engine, args, rng, vocab):
    sp = SamplingParams(max_tokens=args.reply_len, ignore_eos=True)
    lens = rng.integers(args.system_len, args.system_len + args.user_len[1] * args.turns // 2 + 1,
                        args.nosharing_requests)
    reqs = [engine.make_request(rng.integers(3, vocab, int(n)).tolist(), sp, f"n{i}") for i, n in enumerate(lens)]
    return drive(engine, lambda r: None, reqs)


def run_single(engine, args, rng, vocab):
    """One request at a time (no queueing in the TTFT): the shared system prompt plus a fresh user
    message of --user-len's upper bound (with --single-vary: uniform in --user-len, as the chat's
    turns), one output token, --single-requests times. The first request computes the prefix
    either way and is left out; with caching the others restore it."""
    system = rng.integers(3, vocab, args.system_len).tolist()
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    done = []
    lo, hi = args.user_len
    for i in range(args.single_requests):
        n = int(rng.integers(lo, hi + 1)) if args.single_vary else hi
        user = rng.integers(3, vocab, n).tolist()
        done += drive(engine, lambda r: None, [engine.make_request(system + user, sp, f"s{i}")])
    return done[1:]


SCENARIOS = {"chat": run_chat, "nosharing": run_nosharing, "single": run_single}


def summarize(done, wall, engine, kinds: collections.Counter, evictions0: tuple[int, int] = (0, 0)):
    ttft = np.array([r.metrics.first_token_time - r.metrics.arrival_time for r in done]) * 1e3
    st = engine.stats(expert_load=False)
    prompt = sum(len(r.prompt_token_ids) for r in done)
    gen = sum(len(r.output_token_ids) for r in done)
    # TTFT by cache outcome: requests that restored at least half their prompt, and the others
    deep = np.array([r.num_cached_tokens * 2 >= len(r.prompt_token_ids) for r in done], dtype=bool)
    p50 = lambda x: float(np.percentile(x, 50)) if len(x) else None      # noqa: E731
    # chat turns after the first: restored where the previous turn's prompt ended (its last full
    # block), or less (that checkpoint was evicted, or its blocks)
    bs = engine.cfg.cache.block_size
    plen = {r.request_id: len(r.prompt_token_ids) for r in done}
    prev_end = [(r, plen.get(f"{r.request_id.rsplit('-t', 1)[0]}-t{int(r.request_id.rsplit('-t', 1)[1]) - 1}"))
                for r in done if r.request_id.startswith("c") and not r.request_id.endswith("-t0")]
    prev_end = [(r, n // bs * bs) for r, n in prev_end if n is not None]
    return dict(requests=len(done), wall_s=wall, deep_hits=int(deep.sum()),
                turns_at_previous_end=sum(r.num_cached_tokens >= q for r, q in prev_end),
                turns_short_of_previous_end=sum(r.num_cached_tokens < q for r, q in prev_end),
                checkpoint_evictions=st.get("mamba_checkpoint_evictions", 0) - evictions0[0],
                block_evictions=st.get("prefix_cache_block_evictions", 0) - evictions0[1], ttft_p50_deep_hit_ms=p50(ttft[deep]),
                ttft_p50_other_ms=p50(ttft[~deep]), ttft_p50_ms=float(np.percentile(ttft, 50)),
                ttft_p99_ms=float(np.percentile(ttft, 99)), ttft_mean_ms=float(ttft.mean()),
                prompt_tok_s=prompt / wall, gen_tok_s=gen / wall, prompt_tokens=prompt, gen_tokens=gen,
                cached_tokens=sum(r.num_cached_tokens for r in done),
                hit_rate=sum(r.num_cached_tokens for r in done) / max(prompt, 1),   # this scenario's
                checkpoint_rows_used=st.get("mamba_checkpoints_used", 0),
                checkpoint_rows_total=st.get("mamba_checkpoints_total", 0),
                checkpoint_bytes=st.get("mamba_checkpoint_bytes", 0),
                checkpoint_bytes_used=(st.get("mamba_checkpoint_bytes", 0) * st.get("mamba_checkpoints_used", 0)
                                       // max(st.get("mamba_checkpoints_total", 1), 1)),
                acceptance_length=st.get("mean_acceptance_length", 0.0), **graph_counts(engine, kinds))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["8b", "small", "tiny"], default="8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--user-len", type=int, nargs=2, default=[100, 300])
    ap.add_argument("--reply-len", type=int, default=64)
    ap.add_argument("--think-time", type=float, default=0.0,
                    help="chat: seconds between a reply and the next turn (0: closed loop, the next turn at "
                         "once); > 0 is an open loop whose offered load is the same with caching on and off")
    ap.add_argument("--nosharing-requests", type=int, default=64)
    ap.add_argument("--mtp", type=int, nargs="+", default=[0, 2], help="MTP draft counts to run (0: none)")
    ap.add_argument("--single-requests", type=int, default=9, help="requests of the 'single' scenario")
    ap.add_argument("--caching", choices=["both", "on", "off"], default="both",
                    help="run with prefix caching off and on (default), or only one of them")
    ap.add_argument("--single-vary", action="store_true",
                    help="single: user messages of uniform length in --user-len (default: its upper bound)")
    ap.add_argument("--scenarios", nargs="+", default=["chat", "nosharing", "single"], choices=list(SCENARIOS))
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--checkpoint-interval", type=int, default=64, help="blocks between Mamba checkpoints")
    ap.add_argument("--checkpoint-gib", type=float, default=12.0,
                    help="Mamba checkpoint pool in GiB (0: the engine's default, sized from the KV cache)")
    ap.add_argument("--num-kv-blocks", type=int, default=512,
                    help="KV blocks on CPU (CUDA sizes the cache from --kv-cache-memory-fraction); a CPU "
                         "run of the chat at the 8B run's sizes needs ~12000 not to evict blocks")
    ap.add_argument("--kv-cache-memory-fraction", type=float, default=0.5)
    ap.add_argument("--server-warmup", action="store_true",
                    help="also run the server's start-up warm-up (hybrid_engine/warmup.py: it captures the "
                         "prefill graphs of chat turns, which otherwise are captured during the first turns)")
    ap.add_argument("--no-prefill-graphs", action="store_true",
                    help="prefill_cuda_graphs=False (one-request prefills eager, as before 2026-11-27)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.checkpoint_gib < 0:
        ap.error("--checkpoint-gib must be >= 0 (0: the engine's default pool)")
    root = Path(tempfile.mkdtemp())
    model_dir = make_model_dir(args.shape, root)
    results = []
    for k in args.mtp:
        for on in {"both": (False, True), "on": (True,), "off": (False,)}[args.caching]:
            spec = SpeculativeConfig("mtp", k) if k else None
            kw = dict(dtype="float32" if args.device == "cpu" else "bfloat16", device=args.device,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      speculative_config=spec, enable_prefix_caching=on,
                      mamba_checkpoint_interval=args.checkpoint_interval,
                      mamba_checkpoint_bytes=int(args.checkpoint_gib * 2**30) if args.checkpoint_gib > 0 else None,
                      prefill_cuda_graphs=not args.no_prefill_graphs)
            if args.device == "cpu":
                kw["num_kv_blocks"] = args.num_kv_blocks
            else:
                kw["kv_cache_memory_fraction"] = args.kv_cache_memory_fraction
            ctx = random_weights() if args.shape != "tiny" else _null()
            with ctx:
                llm = LLM(str(model_dir), **kw)
            engine = llm.engine
            vocab = engine.cfg.model.vocab_size
            # warm-up (kernels, graphs): one short request, then with caching a prompt past the first
            # checkpoint sent twice (the second restores it: the restore path compiles here, not in
            # the first measured hit); then a fresh prefix cache per scenario
            llm.generate([[5] * 64], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            # and full-size prefill steps, on and off alike (the first engine of a fresh machine ran
            # its first measured scenario ~2.5x slower without them: Triton compiling prefill shapes)
            long = [[8 + i] * (args.system_len + args.user_len[1]) for i in range(4)]
            llm.generate(long, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
            if on:
                past = [7] * (args.checkpoint_interval * engine.cfg.cache.block_size + 40)
                for _ in range(2):
                    llm.generate([past], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
            if args.server_warmup:
                from hybrid_engine.warmup import warm_up
                warm_up(engine)
            kinds = count_step_kinds(engine)
            graph_counts(engine, kinds)                # the warm-up's counts dropped
            log = ScheduleLog(engine)
            for scenario in args.scenarios:
                if on:
                    engine.scheduler.blocks.reset_cache()
                rng = np.random.default_rng(0)
                log.take([])                             # earlier steps dropped
                compiled, ev0 = triton_compiled(args.device), evictions(engine)
                _sync(args.device)
                t0 = time.perf_counter()
                done = SCENARIOS[scenario](engine, args, rng, vocab)
                _sync(args.device)
                row = dict(scenario=scenario, mtp=k, caching=on, prefill_graphs=not args.no_prefill_graphs,
                           think_time_s=args.think_time if scenario == "chat" else 0.0,
                           single_vary=bool(args.single_vary and scenario == "single"),
                           **summarize(done, time.perf_counter() - t0, engine, kinds, ev0),
                           triton_compiles=triton_compiled(args.device) - compiled, **log.take(done))
                results.append(row)
                print({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
            del llm, engine
            gc.collect()
            if args.device != "cpu":
                torch.cuda.empty_cache()
    print_table(results)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        save_json(args.out / f"prefix-cache-{args.shape}.json", dict(args={k: str(v) for k, v in vars(args).items()},
                                                                      results=results))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _sync(device):
    if device != "cpu":
        torch.cuda.synchronize()


def print_table(results):
    print("| scenario | MTP | caching | TTFT p50 ms | TTFT p99 ms | wall s | prompt tok/s | gen tok/s | hit rate "
          "| ckpt rows | ckpt MiB used | Triton compiles |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['scenario']} | {r['mtp']} | {'on' if r['caching'] else 'off'} | {r['ttft_p50_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.1f} | {r['wall_s']:.2f} | {r['prompt_tok_s']:.0f} | {r['gen_tok_s']:.0f} | "
              f"{r['hit_rate']:.2f} | {r['checkpoint_rows_used']}/{r['checkpoint_rows_total']} | "
              f"{r['checkpoint_bytes_used'] / 2**20:.0f} | {r['triton_compiles']} |")


if __name__ == "__main__":
    main()
