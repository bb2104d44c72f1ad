"""Command line: ``hybrid-engine generate`` and ``hybrid-engine bench``."""
from __future__ import annotations

import argparse
import logging
import sys
import time

DEFAULT_PROMPTS = [
    "The river ran through the old town",
    "Once upon a time, a small robot",
    "In the morning the market was full of",
    "A good engine serves many requests",
]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF-format folder; default: the embedded small model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--spec", default=None, choices=["ngram", "draft_model", "mtp"],
                   help="speculative decoding method")
    p.add_argument("--num-spec-tokens", type=int, default=3)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--sync", action="store_true", help="disable async scheduling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true")


def _llm(args):
    from hybrid_engine import LLM, SpeculativeConfig
    spec = None
    if args.spec:
        spec = SpeculativeConfig(method=args.spec, num_speculative_tokens=args.num_spec_tokens,
                                 model=args.draft_model)
    return LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, speculative_config=spec,
               async_scheduling=not args.sync, seed=args.seed)


def cmd_generate(args) -> int:
    from hybrid_engine import SamplingParams
    llm = _llm(args)
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        shown = c.text if c.text is not None else c.token_ids
        print(f"--- prompt: {p!r}\n    output: {shown!r}  [{len(c.token_ids)} tokens, {c.finish_reason}]")
    print(f"{len(outs)} requests, {n} tokens in {dt:.2f}s: {n / dt:.1f} tokens/s")
    st = llm.stats()
    if st.get("drafts_proposed"):
        print(f"spec: acceptance {st['acceptance_rate']:.2f}, mean acceptance length "
              f"{st['mean_acceptance_length']:.2f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hybrid-engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for a few prompts")
    _common(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in examples")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--no-progress", action="store_true")
    b = sub.add_parser("bench", help="end-to-end throughput benchmark (see benchmarks/)")
    _common(b)
    b.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    b.add_argument("--prompt-len", type=int, default=32)
    b.add_argument("--max-tokens", type=int, default=64)
    # serve: the OpenAI-compatible server (hybrid_engine/server; its arguments live there)
    from hybrid_engine.server.cli import add_serve_parser
    add_serve_parser(sub)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "serve":
            from hybrid_engine.server.cli import run_serve
            return run_serve(args)
        if args.cmd == "generate":
            return cmd_generate(args)
        from hybrid_engine.bench import run_cli
        return run_cli(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
