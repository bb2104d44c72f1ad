"""Harness of the server tests: a real ``hybrid-engine serve`` process on a free loopback port
(one per test module), the official openai client pointed at it, and bounded polling helpers."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 120          # import torch + build/load the default model, on a busy CPU
SHUTDOWN_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m hybrid_engine.cli serve ARGS`` bound to 127.0.0.1 on a free port."""

    def __init__(self, *args: str, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # one intra-op thread: the tiny model gains nothing from more, and on a shared CPU OpenMP's
        # spinning threads slow every step down by an order of magnitude
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "hybrid_engine.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--device", "cpu", "--dtype", "float32", "--log-level", "warning", *args]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_S}s:\n{self.log()}")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def terminate(self) -> int:
        """SIGTERM (graceful shutdown); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"server did not exit within {SHUTDOWN_S}s of SIGTERM:\n{self.log()}")
        finally:
            self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict:
    """Poll /health until nothing runs or waits and every KV block and Mamba slot is free."""
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        if (h["num_requests_running"] == 0 and h["num_requests_waiting"] == 0
                and h["free_blocks"] == h["total_blocks"] and h["free_slots"] == h["total_slots"]):
            return h
        assert time.monotonic() < deadline, f"engine not idle after {timeout}s: {h}"
        time.sleep(0.05)


def wait_for(cond, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def start_module_server(tmp_path_factory, *args):
    """Start a server for a module fixture; the fixture's teardown must call ``check_clean_exit``."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    return ServerProcess(*args, log_path=log)


def check_clean_exit(server: ServerProcess) -> None:
    rc = server.terminate()
    assert rc == 0, f"server exited with {rc} after SIGTERM:\n{server.log()}"
    assert "Traceback" not in server.log(), server.log()


def client(server: ServerProcess, api_key: str = "unused", **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)
