"""Run a cases script under Triton's interpreter (TRITON_INTERPRET=1, CPU) in one subprocess.

TRITON_INTERPRET must be set before Triton is imported, so kernels are interpreted in a child
process; the script prints one ``CASE name OK|FAIL detail`` line per case (``case_main`` is
that loop, shared by the scripts). Shared by the interpreter tests
(tests/gpu/test_kernels_interpret.py, tests/gpu/test_moe_kernels.py, tests/spec/test_ngram_triton.py,
tests/engine/test_decode_prep.py).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
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


def run_cases(script: Path, timeout: int = 300, shards: int = 2,
              log_launches: bool = True) -> dict[str, tuple[str, str]]:
    """-> {case: (status, detail)} plus "_stderr"; skips when Triton (or a working interpreter)
    is missing, fails when the script reports nothing. ``log_launches``: also "_launches", every
    distinct kernel launch of the cases (``launch_record``), for ``compile_for_sm90``.

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
    if log_launches:
        env[LAUNCH_LOG] = os.path.join(claims.name, "launches")
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
        launches = sorted({line for f in Path(claims.name).glob("launches.*") for line in f.read_text().splitlines()})
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
    if log_launches:
        res["_launches"] = [json.loads(line) for line in launches]
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


LAUNCH_LOG = "CASE_LAUNCH_LOG"      # set by run_cases(log_launches=True): where case_main logs launches


def _jit_type(v, specialize: bool, align: bool):
    """(Triton type, divisible by 16) of a runtime argument as the JIT specialises it (Triton's
    own ``native_specialize_impl``, in every Triton this project supports): an int equal to 1
    becomes the constexpr 1 unless ``specialize`` is off (``do_not_specialize``), ints and tensor
    addresses divisible by 16 are marked so unless ``align`` is off; -> ("constexpr", 1) for the
    former."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    ty, spec = native_specialize_impl(BaseBackend, v, False, specialize, align)
    return ("constexpr", v) if ty == "constexpr" else (ty, spec == "D")


def _names(fn, spec) -> set[str]:
    """do_not_specialize* entries (names or positions) as parameter names."""
    params = list(inspect.signature(fn).parameters)
    return {params[x] if isinstance(x, int) else x for x in (spec or ())}


def launch_record(fn, args, kwargs, jit_kwargs=None) -> dict:
    """One interpreted launch of the kernel function ``fn`` as JSON-able data: its module and
    name, each runtime argument's Triton type as the JIT specialises it (``_jit_type``: a 1 is a
    constexpr, ``aligned`` lists the arguments marked divisible by 16), the constexprs' values and
    the launch options, or ``unrecordable`` with the reason (a constexpr that is not a plain
    value). ``jit_kwargs``: the
    ``@triton.jit`` options (``do_not_specialize``...)."""
    jit_kwargs = jit_kwargs or {}
    no_spec = _names(fn, jit_kwargs.get("do_not_specialize"))
    no_align = _names(fn, jit_kwargs.get("do_not_specialize_on_alignment"))
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    rec = dict(module=fn.__module__, name=fn.__qualname__, signature={}, constexprs={}, aligned=[],
               options={k: kwargs[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs})
    for p in params:
        v = bound.get(p.name, p.default)
        if "constexpr" in str(p.annotation) or v is None:
            if not (v is None or isinstance(v, (bool, int, float, str))):
                return dict(rec, unrecordable=f"constexpr {p.name} = {v!r}")
            rec["signature"][p.name] = "constexpr"
            rec["constexprs"][p.name] = v
            continue
        # (raises for a type the JIT does not take: the launch is logged as unrecordable)
        ty, aligned = _jit_type(v, p.name not in no_spec, p.name not in no_align)
        rec["signature"][p.name] = ty
        if ty == "constexpr":
            rec["constexprs"][p.name] = aligned          # the value, 1
        elif aligned:
            rec["aligned"].append(p.name)
    return rec


def start_launch_log() -> None:
    """In a cases script under ``run_cases``: log each distinct kernel launch's ``launch_record``
    (``case_main`` calls this; a script with its own loop calls it first)."""
    if os.environ.get(LAUNCH_LOG):
        _log_launches(f"{os.environ[LAUNCH_LOG]}.{os.getpid()}")


def _log_launches(path: str) -> None:
    """Under the interpreter: append each distinct launch's ``launch_record`` to ``path``."""
    from triton.runtime.interpreter import InterpretedFunction
    real_run, seen = InterpretedFunction.run, set()

    def run(self, *args, **kwargs):
        try:
            rec = launch_record(self.fn, args, kwargs, getattr(self, "kwargs", None))
        except Exception as exc:      # never fail a case for the log: the compile test reports it
            rec = dict(module=self.fn.__module__, name=self.fn.__qualname__, constexprs={},
                       unrecordable=f"{type(exc).__name__}: {exc}")
        line = json.dumps(rec, sort_keys=True)
        if line not in seen:
            seen.add(line)
            with open(path, "a") as f:
                f.write(line + "\n")
        return real_run(self, *args, **kwargs)
    InterpretedFunction.run = run


def compile_for_sm90(launches: list[dict]) -> list[str]:
    """Compiles each launch of ``launches`` (``run_cases(log_launches=True)``) for sm_90 with
    Triton's compiler (no GPU needed) -> one message per launch that failed or could not be
    recorded. The interpreter runs a kernel's Python without the compiler's checks (types that
    change between branches, for one), so a case can pass on the CPU with a kernel the GPU
    refuses."""
    failures = []
    for rec in launches:
        where = f"{rec['module']}.{rec['name']} {rec['constexprs']}"
        if "unrecordable" in rec:
            failures.append(f"{where}: not recorded ({rec['unrecordable']})")
            continue
        where += f" {rec['signature']} {rec['options']}"
        try:
            compile_launch_for_sm90(rec)
        except Exception as exc:
            failures.append(f"{where}: {type(exc).__name__}: {str(exc)[-600:]}")
    return failures


def compile_launch_for_sm90(rec: dict):
    """One recorded launch (``launch_record``) compiled for sm_90 -> Triton's compiled kernel
    (``.asm["ttir"]`` and the rest: what the GPU would run, read on the CPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernel = getattr(importlib.import_module(rec["module"]), rec["name"])
    while not isinstance(kernel, triton.JITFunction):      # autotuner / heuristics wrappers
        kernel = kernel.fn
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in rec["aligned"]}
    return triton.compile(ASTSource(kernel, rec["signature"], constexprs=rec["constexprs"], attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=rec["options"])


OLDEST_TRITON = "3.6"        # pyproject.toml: triton>=3.6
# a folder holding that Triton (pip install --no-deps --target DIR triton==3.6.0; .ci/run makes one)
OLDEST_TRITON_ENV = "HYBRID_ENGINE_OLDEST_TRITON"


def compile_with_oldest_triton(launches: list[dict], folder: str) -> tuple[str, list[str]]:
    """``compile_for_sm90(launches)`` in a subprocess whose path starts with ``folder`` (another
    Triton than the installed one) -> (that Triton's version, the failures)."""
    with tempfile.TemporaryDirectory(prefix="launches_") as tmp:
        path = os.path.join(tmp, "launches.json")
        with open(path, "w") as f:
            json.dump(launches, f)
        script = ("import json, triton; from triton_interpret import compile_for_sm90; "
                  "print('TRITON', triton.__version__); "
                  f"print('FAILURES', json.dumps(compile_for_sm90(json.load(open({path!r})))))")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([folder, str(ROOT), str(Path(__file__).resolve().parent)]))
        env.pop("TRITON_INTERPRET", None)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"compiling with the Triton in {folder} failed to run:\n{out.stderr[-3000:]}"
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("TRITON ", "FAILURES ")))
    return lines["TRITON"], json.loads(lines["FAILURES"])


def assert_compiles_for_sm90(results: dict) -> None:
    """Every kernel launch ``run_cases`` recorded compiles for sm_90 (``compile_for_sm90``), with
    the installed Triton and, when ``HYBRID_ENGINE_OLDEST_TRITON`` names a folder holding it, with
    the oldest one we support (Triton 3.6 aborted on a kernel that 3.9 compiles, 2026-11-28)."""
    assert "_launches" in results, "run_cases(log_launches=False): no launches were logged"
    launches = results["_launches"]
    assert launches, "the cases launched no kernel (nothing to compile)"
    failures = compile_for_sm90(launches)
    assert not failures, f"{len(failures)} of {len(launches)} launches do not compile for sm_90:\n" + \
        "\n".join(failures)
    folder = os.environ.get(OLDEST_TRITON_ENV)
    if folder:
        version, failures = compile_with_oldest_triton(launches, folder)
        assert version.startswith(OLDEST_TRITON), f"{folder} holds triton {version}, not {OLDEST_TRITON}"
        assert not failures, f"{len(failures)} of {len(launches)} launches do not compile for sm_90 with " \
            f"triton {version}:\n" + "\n".join(failures)


def case_main(cases: dict, names, run: Callable = lambda case: case()) -> int:
    """A cases script's main loop: run each named case (all when ``names`` is empty) and print its
    ``CASE name OK detail`` / ``CASE name FAIL error`` line; a failing case is reported and the
    rest still run. Under ``run_cases`` each process runs the cases it claims first (``claimed``)
    and, with ``log_launches``, logs the kernels' launches. ``run(case)`` -> the OK line's detail.
    Returns the exit status."""
    start_launch_log()
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
