"""Stream tokens of 3 concurrent requests with AsyncLLM (embedded default model, or --model DIR).

    python examples/streaming.py
    python examples/streaming.py --model path/to/hf_dir --max-tokens 64 --spec ngram

Each line printed is one delta: ``[request] +N tokens: text``. The third request arrives while
the first two are already running, and ``--abort-after`` aborts the second one mid-stream.
"""
import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine import AsyncLLM, SamplingParams, SpeculativeConfig  # noqa: E402

PROMPTS = [
    "The river ran through the old town",
    "Once upon a time, a small robot",
    "In the morning the market was full of",
]


async def stream(engine: AsyncLLM, name: str, prompt: str, params: SamplingParams, t0: float) -> None:
    n = 0
    async for out in engine.generate(prompt, params, request_id=name):
        c = out.outputs[0]
        n += len(c.token_ids)
        shown = c.text if c.text is not None else c.token_ids
        end = f"  [done: {c.finish_reason}, {n} tokens]" if out.finished else ""
        print(f"{time.perf_counter() - t0:7.3f}s [{name}] +{len(c.token_ids)}: {shown!r}{end}", flush=True)


async def main(args) -> int:
    spec = SpeculativeConfig(args.spec, args.num_spec_tokens) if args.spec else None
    engine = AsyncLLM(args.model, dtype=args.dtype, device=args.device, speculative_config=spec,
                      async_scheduling=not args.sync)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sample_seed)
    t0 = time.perf_counter()
    try:
        tasks = [asyncio.create_task(stream(engine, f"r{i}", p, params, t0)) for i, p in enumerate(PROMPTS[:2])]
        await asyncio.sleep(args.third_after)            # the third request joins a running batch
        tasks.append(asyncio.create_task(stream(engine, "r2", PROMPTS[2], params, t0)))
        if args.abort_after is not None:
            await asyncio.sleep(args.abort_after)
            print(f"aborting r1: {await engine.abort('r1')}", flush=True)
        await asyncio.gather(*tasks)
    finally:
        engine.shutdown()
    st = engine.stats()
    print(f"{st['requests_finished']} requests, {st['generated_tokens']} tokens, {st['steps']} steps "
          f"in {time.perf_counter() - t0:.2f}s")
    return 0


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF-format folder; default: the embedded small model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sample-seed", type=int, default=None)
    ap.add_argument("--spec", default=None, choices=["ngram", "draft_model", "mtp"])
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="disable async scheduling")
    ap.add_argument("--third-after", type=float, default=0.05, help="seconds before the third request")
    ap.add_argument("--abort-after", type=float, default=None, help="abort r1 this many seconds later")
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
