"""Draft proposers. Each owns its device state and fills ``[B, K]`` drafts (-1 = no draft).

``DRAFTERS`` maps a SpeculativeConfig method to a factory ``f(build: DrafterBuild) -> Drafter``;
the engine calls it once at start-up with the sizes it chose (tests may register their own
drafters here).
"""
from __future__ import annotations

from typing import Callable

from .base import CacheFootprint, DraftContext, Drafter, DrafterBuild, NoDrafter

DRAFTERS: dict[str, Callable[..., Drafter]] = {}
# method -> f(engine_cfg) -> CacheFootprint, for drafters that take memory of their own beside the
# target (a draft model's weights, KV and Mamba pool); methods absent here take none worth budgeting
FOOTPRINTS: dict[str, Callable[..., CacheFootprint]] = {}


def make_drafter(build: DrafterBuild) -> Drafter:
    """Build the drafter named by the engine's SpeculativeConfig (NoDrafter without one)."""
    spec = build.cfg.speculative
    if spec is None:
        return NoDrafter()
    if spec.method not in DRAFTERS:
        _register_builtin()
    if spec.method not in DRAFTERS:
        raise ValueError(f"speculative method {spec.method!r} is not available; have {sorted(DRAFTERS)}")
    return DRAFTERS[spec.method](build)


def drafter_footprint(cfg) -> CacheFootprint:
    """What the drafter named by ``cfg.speculative`` will take beside the target (zero for none)."""
    spec = cfg.speculative
    if spec is None:
        return CacheFootprint()
    if spec.method not in DRAFTERS:
        _register_builtin()
    f = FOOTPRINTS.get(spec.method)
    return f(cfg) if f is not None else CacheFootprint()


def _register_builtin() -> None:
    for name, module, factory in (("ngram", "ngram", "make_ngram"), ("draft_model", "draft_model", "make_draft_model"),
                                  ("mtp", "mtp", "make_mtp")):
        if name in DRAFTERS:
            continue
        try:
            mod = __import__(f"hybrid_engine.spec.drafters.{module}", fromlist=[factory])
        except ModuleNotFoundError as e:
            if e.name != f"hybrid_engine.spec.drafters.{module}":
                raise
            continue
        DRAFTERS[name] = getattr(mod, factory)
        if hasattr(mod, "cache_footprint"):
            FOOTPRINTS[name] = mod.cache_footprint


__all__ = ["DRAFTERS", "FOOTPRINTS", "CacheFootprint", "DraftContext", "Drafter", "DrafterBuild", "NoDrafter",
           "drafter_footprint", "make_drafter"]
