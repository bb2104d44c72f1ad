"""Run a cases script under Triton's interpreter (TRITON_INTERPRET=1, CPU) in one subprocess.

TRITON_INTERPRET must be set before Triton is imported, so kernels are interpreted in a child
process; the script prints one ``CASE name OK|FAIL detail`` line per case (``case_main`` is
that loop, shared by the scripts). Shared by the interpreter tests
(tests/gpu/test_kernels_interpret.py, tests/gpu/test_moe_kernels.py, tests/spec/test_ngram_triton.py,
tests/engine/test_decode_prep.py).
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cases(script: Path, timeout: int = 300, shards: int = 2) -> dict[str, tuple[str, str]]:
    """-> {case: (status, detail)} plus "_stderr"; skips when Triton (or a working interpreter)
    is missing, fails when the script reports nothing.

    The cases are split over ``shards`` processes run side by side (at most one per CPU core),
    which take the cases in turn from a shared claims folder (``CASE_CLAIMS``, see ``claimed``):
    the interpreter is one Python thread per process, so on a 2-core machine two shards take about
    half the time. Every case still runs exactly once."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    import numpy
    import triton
    ver = lambda v: tuple(int(p) for p in re.findall(r"\d+", v)[:2])   # noqa: E731
    if ver(triton.__version__) < (3, 7) and ver(numpy.__version__) >= (2, 4):
        pytest.skip("triton < 3.7's interpreter breaks with numpy >= 2.4")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(script.parent), str(Path(__file__).resolve().parent),
                                           os.environ.get("PYTHONPATH", "")]))
    env.pop("HYBRID_ENGINE_KERNELS", None)          # the cases pick their backends themselves
    n = max(1, min(shards, os.cpu_count() or 1))
    claims = tempfile.TemporaryDirectory(prefix="case_claims_")
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, CASE_CLAIMS=claims.name), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            outs.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        claims.cleanup()
    res = {}
    for _, stdout, _ in outs:
        for line in stdout.splitlines():
            m = re.match(r"CASE (\S+) (OK|FAIL) ?(.*)", line)
            if m:
                assert m.group(1) not in res, f"case {m.group(1)} ran in two shards"
                res[m.group(1)] = (m.group(2), m.group(3))
    if not res or any(rc != 0 and not re.search(r"^CASE ", out, re.M) for rc, out, _ in outs):
        pytest.fail("interpreter run produced no results:\n" + "\n".join(
            f"shard {i} (rc {rc}):\n{out[-2000:]}\n{err[-4000:]}" for i, (rc, out, err) in enumerate(outs)))
    res["_stderr"] = "\n".join(err for _, _, err in outs)
    return res


def claimed(name: str) -> bool:
    """Whether this process runs case ``name``: always, unless ``run_cases`` started several
    processes with a shared ``CASE_CLAIMS`` folder; then the first process to create the case's
    file there takes it (the others skip it), so the shards share the cases as they free up."""
    claims = os.environ.get("CASE_CLAIMS")
    if not claims:
        return True
    try:
        os.close(os.open(os.path.join(claims, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def assert_case(results: dict, name: str) -> None:
    assert name in results, f"case {name} did not run"
    status, detail = results[name]
    assert status == "OK", f"{name}: {detail}\n{results['_stderr'][-3000:]}"


def case_main(cases: dict, names, run: Callable = lambda case: case()) -> int:
    """A cases script's main loop: run each named case (all when ``names`` is empty) and print its
    ``CASE name OK detail`` / ``CASE name FAIL error`` line; a failing case is reported and the
    rest still run. Under ``run_cases`` each process runs the cases it claims first (``claimed``).
    ``run(case)`` -> the OK line's detail. Returns the exit status."""
    failed = 0
    for name in names or cases:
        if not claimed(name):
            continue
        t0 = time.time()
        try:
            detail = run(cases[name])
            print(f"CASE {name} OK {detail} {time.time() - t0:.2f}s", flush=True)
        except Exception as exc:  # report and go on
            failed += 1
            msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:800]
            print(f"CASE {name} FAIL {msg}", flush=True)
            traceback.print_exc(file=sys.stderr)
    return 1 if failed else 0
