"""Command line: ``hybrid-engine generate``, ``hybrid-engine chat`` and ``hybrid-engine bench``.

Sampling flags left out take the model's defaults (its generation_config.json, else
``SamplingParams()``: greedy, 16 tokens); a flag given on the command line wins.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time

DEFAULT_PROMPTS = [   # the embedded default model was trained on Python source: code prompts
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_lines(path):\n    with open(path",
    "    for key, value in sorted(",
]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model folder (config.json + *.safetensors) or Hugging Face Hub repo id "
                        "(e.g. nvidia/NVIDIA-Nemotron-Nano-9B-v2); default: the embedded small trained model")
    p.add_argument("--dtype", default="auto",
                   help="weight/activation dtype: auto (config's dtype, else bfloat16 on CUDA, float32 on "
                        "CPU), float32, bfloat16, float16 (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="most requests running at once (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: what the KV cache holds, at most 8192)")
    p.add_argument("--spec", default=None, choices=["ngram", "draft_model", "mtp"],
                   help="speculative decoding method (default: none)")
    p.add_argument("--num-spec-tokens", type=int, default=3,
                   help="tokens proposed per step with --spec, 1..8 (default: %(default)s)")
    p.add_argument("--draft-model", default=None,
                   help="draft model folder for --spec draft_model (default with the embedded model: its "
                        "embedded trained draft)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="--spec mtp: draft over the first N vocabulary ids only (cheaper drafts on large "
                        "vocabularies; greedy outputs unchanged) (default: the whole vocabulary)")
    p.add_argument("--draft-quantization", default=None, choices=["fp8"],
                   help="--spec mtp / draft_model: the drafter's weights in FP8 (half the bytes a draft token "
                        "reads; greedy outputs unchanged) (default: the drafter as stored)")
    p.add_argument("--sync", action="store_true",
                   help="disable async scheduling (no step in flight while the host commits; same tokens)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto (the model dtype) or fp8 (float8_e4m3fn with per-layer "
                        "scales; half the bytes of bf16) (default: %(default)s)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many GPUs (one process each; default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="engine seed for requests without a sampling seed (default: %(default)s)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks and Mamba state of prompt prefixes earlier requests computed "
                        "(default on; --no-enable-prefix-caching turns it off; bench turns it off)")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine info messages")


def _sampling(p: argparse.ArgumentParser, max_tokens_default=None) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens_default,
                   help="tokens to generate per request (default: %s)" %
                        (max_tokens_default or "the model's max_new_tokens, else 16"))
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's generation_config.json, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default: model's, else 1)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens, -1 = off (default: model's, else -1)")
    p.add_argument("--sample-seed", type=int, default=None, help="sampling seed (default: random per request)")


def _llm(args):
    from hybrid_engine import LLM, SpeculativeConfig
    spec = None
    if args.draft_vocab_size is not None and args.spec != "mtp":
        raise ValueError("--draft-vocab-size is used by --spec mtp only, got "
                         + (f"--spec {args.spec}" if args.spec else "no --spec"))
    if args.draft_quantization is not None and not args.spec:
        raise ValueError("--draft-quantization is used by --spec mtp or draft_model only, got no --spec")
    if args.spec:
        draft = args.draft_model
        if args.spec == "draft_model" and draft is None and args.model is None:
            from hybrid_engine.default_model import default_draft_model_dir
            draft = str(default_draft_model_dir())     # the embedded default's own trained draft
        spec = SpeculativeConfig(method=args.spec, num_speculative_tokens=args.num_spec_tokens,
                                 model=draft, draft_vocab_size=args.draft_vocab_size,
                                 quantization=args.draft_quantization)
    return LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
               speculative_config=spec, async_scheduling=not args.sync, seed=args.seed,
               kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
               enable_prefix_caching=args.enable_prefix_caching)


def _params(args, defaults):
    """The model's defaults with the sampling flags given on the command line applied."""
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "top_k": args.top_k, "seed": args.sample_seed}
    return dataclasses.replace(defaults, **{k: v for k, v in given.items() if v is not None})


def cmd_generate(args) -> int:
    llm = _llm(args)
    prompts = args.prompt or DEFAULT_PROMPTS
    params = _params(args, llm.get_default_sampling_params())
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


def _template_kwargs(args) -> dict:
    kw = {}
    if args.chat_template_kwargs:
        try:
            kw = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--chat-template-kwargs must be a JSON object: {e}") from None
        if not isinstance(kw, dict):
            raise ValueError(f"--chat-template-kwargs must be a JSON object, got {args.chat_template_kwargs}")
    if args.no_think:
        kw["enable_thinking"] = False
    return kw


async def _chat_loop(args, inp, out) -> int:
    from hybrid_engine import AsyncLLM
    engine = AsyncLLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                      async_scheduling=not args.sync, seed=args.seed, kv_cache_dtype=args.kv_cache_dtype,
                      tensor_parallel_size=args.tensor_parallel_size, enable_prefix_caching=args.enable_prefix_caching)
    params = _params(args, engine.get_default_sampling_params())
    kwargs = _template_kwargs(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = inp.isatty()
    try:
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            line = await asyncio.to_thread(inp.readline)
            if not line:                                    # end of input
                return 0
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.strip() in ("/exit", "/quit"):
                return 0
            if text.strip() == "/reset":
                history = history[:1] if args.system else []
                continue
            history.append({"role": "user", "content": text})
            reply = []
            async for delta in engine.chat(history, params, chat_template_kwargs=kwargs):
                piece = delta.outputs[0].text or ""
                reply.append(piece)
                out.write(piece)
                out.flush()
                if delta.finished and delta.error:
                    out.write(f"\n[error: {delta.error}]")
            out.write("\n")
            out.flush()
            history.append({"role": "assistant", "content": "".join(reply)})
    finally:
        engine.shutdown()


def cmd_chat(args) -> int:
    _template_kwargs(args)                                   # flag errors before the model loads
    return asyncio.run(_chat_loop(args, sys.stdin, sys.stdout))


def build_parser() -> argparse.ArgumentParser:
    from hybrid_engine import __version__
    ap = argparse.ArgumentParser(prog="hybrid-engine",
                                 description="Inference for hybrid Mamba2/attention models (Nemotron-H).")
    ap.add_argument("--version", action="version", version=f"hybrid-engine {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for a few prompts")
    _common(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in examples")
    _sampling(g, max_tokens_default=32)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = sub.add_parser("chat", help="interactive chat with the model's chat template, streamed; one user "
                                    "message per input line (/reset clears the history, /exit or end of "
                                    "input quits)")
    _common(c)
    _sampling(c)
    c.add_argument("--system", default=None, help="system message opening the conversation")
    c.add_argument("--chat-template-kwargs", default=None,
                   help='JSON object passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    c.add_argument("--no-think", action="store_true",
                   help="pass enable_thinking=false to the chat template (Nemotron 3 reasoning off)")
    b = sub.add_parser("bench", help="end-to-end throughput benchmark (see benchmarks/)")
    _common(b)
    b.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    b.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens (default: %(default)s)")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: %(default)s)")
    # serve: the OpenAI-compatible server (hybrid_engine/server; its arguments live there)
    from hybrid_engine.server.cli import add_serve_parser
    add_serve_parser(sub)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "serve":
            from hybrid_engine.server.cli import run_serve
            return run_serve(args)
        if args.cmd == "generate":
            return cmd_generate(args)
        if args.cmd == "chat":
            return cmd_chat(args)
        from hybrid_engine.bench import run_cli
        return run_cli(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
