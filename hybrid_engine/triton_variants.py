"""The Triton kernel variants this process has compiled, for checks and benchmarks (not used by
the engine).

Triton compiles a kernel once per set of constexprs *and* per value class of its other arguments:
an int equal to 1 or a multiple of 16, a pointer 16-byte aligned or not. A per-step count or an
offset view in that class would compile new variants in the middle of serving (~0.3-0.6 s each on
an H100 host), so the step path's kernels exclude such arguments from specialisation
(``do_not_specialize`` / ``do_not_specialize_on_alignment``). ``value_recompiles`` finds variants
that break this: tests/gpu/test_kernel_variants_cuda.py; ``benchmarks/prefix_cache.py`` reports
the compiles of each measured run (``count_variants``)."""
from __future__ import annotations

import ast
import gc
import warnings

OURS = ("hybrid_engine", "mamba_cache", "spec")

# {kernel "module.name": {its constexprs and argument types: the cache keys compiled for them}}
Variants = dict[str, dict[str, set[str]]]


def specialization(key) -> list | None:
    """The leading ``[(type, flag), ...]`` of a Triton kernel-cache key (the rest is options);
    None when unreadable."""
    s, depth = str(key), 0
    for i, ch in enumerate(s):
        depth += (ch == "[") - (ch == "]")
        if depth == 0:
            try:
                return list(ast.literal_eval(s[:i + 1]))
            except (ValueError, SyntaxError):
                return None
    return None


def value_class_free(spec: list, constexpr: list[bool]) -> str:
    """A key without its value classes: constexprs by value, other arguments by type only (an int
    compiled as the constant 1 counts as an i32; a None argument stays: it is a real variant)."""
    return repr([s if (c or (s[0] == "constexpr" and s[1] is None)) else
                 ("i32" if s[0] == "constexpr" else s[0]) for s, c in zip(spec, constexpr)])


def _our_kernels():
    """-> (name "module.kernel", its JITFunction, its compiled cache keys) for every kernel of ours
    this process has compiled (or loaded from Triton's disk cache)."""
    from triton.runtime.jit import JITFunction
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # deprecated torch objects warn on isinstance
        fns = [o for o in gc.get_objects() if isinstance(o, JITFunction)]
    for fn in fns:
        if fn.__module__.startswith(OURS):
            keys = [key for entry in fn.device_caches.values() for key in entry[0]]
            if keys:
                yield f"{fn.__module__}.{fn.__name__}", fn, keys


def _spec_of(fn, key) -> list:
    spec = specialization(key)
    if spec is None:
        raise ValueError(f"unreadable Triton cache key of {fn.__name__}: {str(key)[:200]}")
    return spec


def compiled_variants() -> Variants:
    """Every compiled variant of our ``@triton.jit`` kernels in this process, grouped by
    ``value_class_free`` key."""
    out: Variants = {}
    for name, fn, keys in _our_kernels():
        constexpr = [p.is_constexpr for p in fn.params]
        groups = out.setdefault(name, {})
        for key in keys:
            spec = _spec_of(fn, key)
            groups.setdefault(value_class_free(spec, constexpr), set()).add(repr(spec))
    return out


def constexpr_values(arg: str) -> dict[str, set]:
    """{kernel of ours with a constexpr named ``arg``: the values it was compiled with}."""
    out: dict[str, set] = {}
    for name, fn, keys in _our_kernels():
        if arg in fn.arg_names:
            i = fn.arg_names.index(arg)
            out[name] = {repr(_spec_of(fn, key)[i]) for key in keys}
    return out


def count_variants(variants: Variants) -> int:
    return sum(len(keys) for groups in variants.values() for keys in groups.values())


def value_recompiles(before: Variants, after: Variants) -> dict[str, list[str]]:
    """Variants compiled between two snapshots for constexprs and argument types that ``before``
    had already compiled -> {kernel: their keys}. New constexprs (a block size chosen for a new
    length) are not counted, nor value classes ``before`` had already seen (a width that is a
    multiple of 16 in one layer and not in another is fixed by the model, not by the step)."""
    out: dict[str, list[str]] = {}
    for name, groups in after.items():
        for norm, keys in groups.items():
            new = keys - before.get(name, {}).get(norm, keys)
            if new:
                out.setdefault(name, []).extend(sorted(new))
    return out
