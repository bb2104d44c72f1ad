"""``hybrid-engine serve [MODEL_DIR]``: arguments and startup. Importing this module needs only the
standard library, so ``hybrid-engine --help`` works without the ``serve`` extra; ``run_serve``
checks the extra and says how to install it."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
from pathlib import Path

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")

logger = logging.getLogger("hybrid_engine.server")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'serve' extra)",
                       description="Serve MODEL_DIR (default: the embedded default model) with the OpenAI API: "
                                   "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.")
    s.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                   help="HF-format folder; default: the embedded small model")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s)")
    s.add_argument("--api-key", default=os.environ.get("HYBRID_ENGINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $HYBRID_ENGINE_API_KEY, "
                        "which keeps the key out of the process list)")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: the folder "
                   "name, or 'default' for the embedded model)")
    s.add_argument("--chat-template", default=None, help="a Jinja chat template (file path or the template "
                   "itself) overriding the tokenizer's")
    s.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="engine queue bound; beyond it requests get 429 (default 1024)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they are "
                        "aborted (default 10)")
    # engine arguments, as LLM(...) takes them
    s.add_argument("--dtype", default="auto", help="weights and activations: auto (the checkpoint's; bfloat16 "
                   "on CUDA), bfloat16, float16 or float32 (default %(default)s)")
    s.add_argument("--device", default="auto", help="cuda, cpu or auto (CUDA when available; default %(default)s)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once (default %(default)s)")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step, prefill chunks included (default %(default)s)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request (default: what the KV cache holds, at most 8192)")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default %(default)s)")
    s.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache blocks (default: sized from --kv-cache-memory-fraction)")
    s.add_argument("--kv-cache-memory-fraction", type=float, default=0.5,
                   help="fraction of free GPU memory for the KV cache (default %(default)s)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks and Mamba state of prompt prefixes earlier requests computed "
                        "(default on; --no-enable-prefix-caching turns it off)")
    s.add_argument("--mamba-checkpoint-interval", type=int, default=64,
                   help="prefix caching: blocks between Mamba state checkpoints (default %(default)s)")
    s.add_argument("--spec", default=None, choices=["ngram", "draft_model", "mtp"],
                   help="speculative decoding method")
    s.add_argument("--num-speculative-tokens", "--num-spec-tokens", dest="num_spec_tokens", type=int, default=3,
                   help="draft tokens per step with --spec (default %(default)s)")
    s.add_argument("--draft-model", default=None,
                   help="draft model folder (--spec draft_model; default with the embedded model: its embedded draft)")
    s.add_argument("--draft-vocab-size", type=int, default=None,
                   help="--spec mtp: draft over the first N vocabulary ids only (default: the whole vocabulary)")
    s.add_argument("--draft-quantization", default=None, choices=["fp8"],
                   help="--spec mtp / draft_model: FP8 copies of the drafter's layers for few-row calls "
                        "(default: the drafter as stored)")
    s.add_argument("--sync", action="store_true", help="disable async scheduling")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    s.add_argument("--no-prefill-cuda-graphs", dest="prefill_cuda_graphs", action="store_false",
                   help="run one-request prefill-only steps eagerly (default: CUDA graphs captured on first use)")
    s.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="on CUDA, skip the start-up warm-up (a few throw-away requests that compile the Triton "
                        "kernels before the first client's request instead of inside it)")
    s.add_argument("--quantization", default=None, choices=["fp8", "nvfp4", "modelopt"],
                   help="quantize a 16/32-bit checkpoint at load (fp8, nvfp4) or require a ModelOpt one "
                        "(default: the checkpoint's own)")
    s.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto (the model dtype) or fp8 (float8_e4m3fn with per-layer scales: "
                        "the checkpoint's k_scale / v_scale, else 1.0; half the bytes of bf16; default %(default)s)")
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many GPUs (one process each; default %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own (default %(default)s)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default %(default)s)")
    s.add_argument("-v", "--verbose", action="store_true", help="log the engine's INFO messages")
    return s


def missing_extra() -> list[str]:
    return [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]


def _chat_template(arg: str | None, default_model: bool) -> str | None:
    if arg is None:
        if default_model:
            from .chat import DEFAULT_MODEL_TEMPLATE
            return DEFAULT_MODEL_TEMPLATE
        return None
    p = Path(arg).expanduser()
    return p.read_text(encoding="utf-8") if p.is_file() else arg


def build_llm(args):
    from hybrid_engine import AsyncLLM, SpeculativeConfig
    spec = None
    if args.spec:
        draft = args.draft_model
        if args.spec == "draft_model" and draft is None and args.model is None:
            from hybrid_engine.default_model import default_draft_model_dir
            draft = str(default_draft_model_dir())     # the embedded default's own trained draft
        spec = SpeculativeConfig(method=args.spec, num_speculative_tokens=args.num_spec_tokens, model=draft,
                                 draft_vocab_size=args.draft_vocab_size, quantization=args.draft_quantization)
    elif args.draft_vocab_size is not None or args.draft_quantization is not None:
        raise ValueError("--draft-vocab-size and --draft-quantization need --spec")
    return AsyncLLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                    block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                    kv_cache_memory_fraction=args.kv_cache_memory_fraction, speculative_config=spec,
                    enable_prefix_caching=args.enable_prefix_caching,
                    mamba_checkpoint_interval=args.mamba_checkpoint_interval,
                    async_scheduling=not args.sync, seed=args.seed, enforce_eager=args.enforce_eager,
                    quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                    tensor_parallel_size=args.tensor_parallel_size, prefill_cuda_graphs=args.prefill_cuda_graphs)


def maybe_warm_up(llm, args) -> bool:
    """The start-up warm-up (``hybrid_engine/warmup.py``) on CUDA unless ``--no-warmup``: on the CPU
    the kernels are torch's, nothing compiles on first sight. -> whether it ran."""
    if not args.warmup or llm.engine.cfg.device.type != "cuda":
        return False
    from hybrid_engine.warmup import warm_up
    warm_up(llm.engine, seed=args.seed)          # logs what it ran
    return True


def run_serve(args) -> int:
    missing = missing_extra()
    if missing:
        print(f"error: 'hybrid-engine serve' needs the serve extra (missing: {', '.join(missing)}); install it "
              "with: pip install 'hybrid-engine[serve]'", file=sys.stderr)
        return 2
    import uvicorn

    from .app import create_app
    from .serving import ServerConfig

    if args.verbose:
        logging.getLogger("hybrid_engine").setLevel(logging.INFO)
    name = args.served_model_name or (Path(args.model).expanduser().resolve().name if args.model else "default")
    config = ServerConfig(model_name=name, max_waiting_requests=args.max_waiting_requests, api_key=args.api_key,
                          chat_template=_chat_template(args.chat_template, args.model is None))
    llm = build_llm(args)
    maybe_warm_up(llm, args)
    app = create_app(llm, config)
    state = app.state.server

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            state.start_draining(args.shutdown_timeout)     # abort what is still running after the grace
            await super().shutdown(sockets=sockets)

    # uvicorn's own timeout is only a backstop: draining has ended every stream by then
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.shutdown_timeout + 5, lifespan="on"))
    # uvicorn re-raises the signal it caught after a graceful shutdown; with these handlers in place that
    # is a no-op, so a SIGTERM/SIGINT shutdown exits with status 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1
