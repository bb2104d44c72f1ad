"""The programmatic-dependent-launch contract (``mamba_cache/ops/triton_pdl.py``), checked on the
source: every Triton kernel that takes a ``PDL`` flag waits (``pdl_enter``) in its first statement,
so no program loads, stores or exits before the previous kernel has completed. Plus the choice of
``pdl_kwargs`` (on only for CUDA >= sm_90, off with HYBRID_ENGINE_PDL=0 or the interpreter)."""
import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from hybrid_engine.mamba_cache.ops import triton_pdl

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(["hybrid_engine"] + parts if parts[0] == "mamba_cache" else parts)


def _sources() -> list[Path]:
    return [p for d in ("hybrid_engine", "mamba_cache") for p in sorted((ROOT / d).rglob("*.py"))]


# every module that launches a kernel with PDL's keyword arguments (found, not listed by hand)
PDL_MODULES = [_module_name(p) for p in _sources()
               if "pdl_kwargs(" in p.read_text() and p.name != "triton_pdl.py"]
# waits later by design: weights (never written by a step) are read first (its GPU tests run
# every PDL mode)
LATE_WAIT = {"_conv_update_cols_kernel"}
# kernels that may load their first weight tile before the wait: ``if PREFETCH:`` holding only
# ``w_first = first_weight_tile(...)`` on the weight pointer (triton_pdl's docstring)
# (the bf16 one-row projection and the MoE router / shared-expert GEMVs measured no gain or a loss:
# benchmarks/results/2026-11-27-weight-prefetch-h100.md)
PREFETCHING = {"_fp8_fma_kernel": "w_ptr"}
# kernels that load an input at addresses no program id enters: that pointer takes z * 16
POINTER_FROM_WAIT = {"_linear_fma_kernel": ("x_ptr",), "_linear_dot_kernel": ("x_ptr",),
                     "_fp8_fma_kernel": ("x_ptr",), "_fp8_dot_kernel": ("x_ptr",), "_nvfp4_fma_kernel": ("x_ptr",),
                     "_nvfp4_fma_persistent_kernel": ("x_ptr",),
                     "_nvfp4_rows_kernel": ("x_ptr",), "_write_kv_kernel": ("ks_ptr", "vs_ptr")}


def _pdl_kernels(module_name: str):
    mod = importlib.import_module(module_name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(mod)))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args + node.args.kwonlyargs):
            yield node


def _calls(node) -> set[str]:
    return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def test_the_pdl_modules_are_found():
    names = set(PDL_MODULES)
    assert {"hybrid_engine.models.skinny_linear", "hybrid_engine.models.triton_moe",
            "hybrid_engine.mamba_cache.ops.triton_conv_update"} <= names, names


@pytest.mark.parametrize("module_name", PDL_MODULES)
def test_pdl_kernels_wait_first(module_name):
    kernels = [k for k in _pdl_kernels(module_name) if k.name not in LATE_WAIT]
    if module_name.endswith("triton_conv_update"):
        return                                    # its one PDL kernel: test_conv_update_waits_in_both_modes
    assert kernels, f"{module_name} launches with pdl_kwargs but has no kernel with a PDL flag"
    for fn in kernels:
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
        if fn.name in PREFETCHING:
            body = _after_prefetch(fn, body, PREFETCHING[fn.name])
        first = body[0]
        assert "pdl_enter" in _calls(first), f"{fn.name}: first statement does not wait ({ast.unparse(first)})"
        # the wait's zero must feed every program id (triton_pdl's docstring)
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.program_id":
                parent = next(p for p in ast.walk(fn) if node in list(ast.iter_child_nodes(p)))
                assert isinstance(parent, ast.BinOp) and ast.unparse(parent.right) in ("z", "pdl_enter(PDL)"), (
                    f"{fn.name}: {ast.unparse(parent)} does not take the wait's zero")
        for ptr in POINTER_FROM_WAIT.get(fn.name, ()):
            assert any(isinstance(s, ast.AugAssign) and ast.unparse(s) == f"{ptr} += z * 16" for s in body[:4]), (
                f"{fn.name}: {ptr} is not addressed from the wait's zero")


def _after_prefetch(fn, body, weight_ptr):
    """The body after the kernel's leading ``if PREFETCH:`` block, checked to hold nothing but an
    optional static assert and ``w_first = first_weight_tile(weight_ptr, ...)`` (no other load, no
    store)."""
    head = body[0]
    assert isinstance(head, ast.If) and ast.unparse(head.test) == "PREFETCH" and not head.orelse, (
        f"{fn.name}: prefetching kernels open with `if PREFETCH:` ({ast.unparse(head)[:80]})")
    tiles = 0
    for stmt in head.body:
        call = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) and isinstance(stmt.value, ast.Call) else None
        name = ast.unparse(call.func) if call is not None else ""
        assert name in ("first_weight_tile", "tl.static_assert"), f"{fn.name}: {ast.unparse(stmt)} before the wait"
        if name == "first_weight_tile":
            assert ast.unparse(call.args[0]) == weight_ptr, f"{fn.name}: loads {ast.unparse(call.args[0])} early"
            tiles += 1
    assert tiles == 1, f"{fn.name}: one first_weight_tile before the wait"
    return body[1:]


def test_prefetching_kernels_take_the_flag():
    """Every kernel named in PREFETCHING has a PREFETCH flag and is launched with
    ``pdl_kwargs(..., prefetch=True)`` somewhere; no other kernel prefetches."""
    found = {}
    for module_name in PDL_MODULES:
        for fn in _pdl_kernels(module_name):
            if any(a.arg == "PREFETCH" for a in fn.args.args + fn.args.kwonlyargs):
                found[fn.name] = module_name
            else:
                assert "first_weight_tile" not in _calls(fn), fn.name
    assert set(found) == set(PREFETCHING), found
    for module_name in set(found.values()):
        src = inspect.getsource(importlib.import_module(module_name))
        assert "prefetch=True" in src, module_name


def test_first_weight_tile_only_loads_the_weight():
    """first_weight_tile's one memory access is a load from its weight pointer: no store."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(triton_pdl.first_weight_tile.fn)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    names = {ast.unparse(n.func) for n in calls}
    assert not {"tl.store", "tl.atomic_add", "tl.inline_asm_elementwise"} & names, names
    (load,) = [n for n in calls if ast.unparse(n.func) == "tl.load"]
    assert ast.unparse(load.args[0]).startswith("w_ptr +")


def test_only_pdl_kernels_launch_early():
    """launch_pdl (an early launch) only where the kernel is also told PDL (and so waits)."""
    users = {p.name for p in _sources() if "launch_pdl" in p.read_text()}
    assert users == {"triton_pdl.py", "triton_conv_update.py"}, users
    conv = (ROOT / "mamba_cache/ops/triton_conv_update.py").read_text()
    assert "launch = dict(launch_pdl=True) if pdl else {}" in conv and "PDL=pdl," in conv


def test_conv_update_waits_in_both_modes():
    from hybrid_engine.mamba_cache.ops import triton_conv_update
    (fn,) = [k for k in _pdl_kernels(triton_conv_update.__name__) if k.name in LATE_WAIT]
    waits = [n for n in ast.walk(fn) if isinstance(n, ast.If) and "PDL ==" in ast.unparse(n.test)
             and "pdl_enter" in _calls(n)]
    assert sorted(ast.unparse(n.test) for n in waits) == ["PDL == 1", "PDL == 2"]


def test_pdl_choice(monkeypatch):
    triton_pdl.reset_pdl_choice()
    assert triton_pdl.pdl_kwargs(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(triton_pdl, "HAS_GDC", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setenv("HYBRID_ENGINE_PDL", "1")
    assert triton_pdl._decide(0)[0] is True
    monkeypatch.setenv("HYBRID_ENGINE_PDL", "0")
    assert triton_pdl._decide(0) == (False, "HYBRID_ENGINE_PDL=0")
    monkeypatch.setenv("HYBRID_ENGINE_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_pdl._decide(0)[0] is False
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    assert triton_pdl._decide(0)[0] is False
    monkeypatch.setattr(triton_pdl, "HAS_GDC", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    assert triton_pdl._decide(0)[0] is False
    triton_pdl.reset_pdl_choice()


def test_prefetch_choice(monkeypatch):
    """PREFETCH comes only with PDL on, and only for callers that ask; HYBRID_ENGINE_PREFETCH=0
    turns it off (read once, until reset_pdl_choice)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for pdl_on, env, asked, want in [(True, "1", True, True), (True, "1", False, False),
                                     (True, "0", True, False), (False, "1", True, False)]:
        triton_pdl.reset_pdl_choice()
        monkeypatch.setattr(triton_pdl, "_decide", lambda i, on=pdl_on: (on, "test"))
        monkeypatch.setenv("HYBRID_ENGINE_PREFETCH", env)
        kw = triton_pdl.pdl_kwargs(cuda, prefetch=asked)
        assert kw["PDL"] is pdl_on and kw.get("PREFETCH", False) is want, (pdl_on, env, asked, dict(kw))
        assert triton_pdl.pdl_kwargs(cuda)["PDL"] is pdl_on and "PREFETCH" not in triton_pdl.pdl_kwargs(cuda)
    assert triton_pdl.pdl_kwargs(torch.device("cpu"), prefetch=True) == {"PDL": False}
    triton_pdl.reset_pdl_choice()
