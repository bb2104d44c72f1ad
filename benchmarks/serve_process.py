"""``benchmarks/serve.py``'s server processes: the ``hybrid-engine serve`` command line of one
configuration ("none" or "method:k"), started on a free loopback port and stopped with SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybrid_engine.parallel.group import free_port

ROOT = Path(__file__).resolve().parents[1]


def serve_argv(args, config: str) -> list[str]:
    """``hybrid-engine serve`` arguments of one configuration ("none" or "method:k"): the server's
    engine, and the in-process one of ``--direct`` (built by the same parser)."""
    argv = ["serve"] + ([args.model] if args.model else []) + [
        "--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-waiting-requests", str(max(1024, args.num_prompts)),
        "--no-enable-prefix-caching"]          # passes replay the same prompts: a cache would serve them
    if config != "none":
        method, _, k = config.partition(":")
        argv += ["--spec", method, "--num-speculative-tokens", k or "3"]
        if method == "draft_model" and args.draft_model:
            argv += ["--draft-model", args.draft_model]
    return argv


def start_server(args, config: str, log_path: Path):
    """A ``hybrid-engine serve`` process for one configuration ("none" or "method:k")."""
    import httpx
    port = free_port()
    argv = [*serve_argv(args, config), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    cmd = [sys.executable, "-m", "hybrid_engine.cli", *argv]
    if args.shape:              # a shape with no checkpoint: the server builds random weights
        cmd = [sys.executable, "-c", "import sys; from benchmarks.common import random_weights; "
               "from hybrid_engine.cli import main\nwith random_weights(): sys.exit(main(sys.argv[1:]))", *argv]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log: {log_path}\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not ready after {args.startup_timeout}s; log: {log_path}")


def stop_server(proc, log) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
