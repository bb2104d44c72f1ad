"""Draft proposers. Each owns its device state and fills ``[B, K]`` drafts (-1 = no draft).

``DRAFTERS`` maps a SpeculativeConfig method to a factory ``f(build: DrafterBuild) -> Drafter``;
the engine calls it once at start-up with the sizes it chose (tests may register their own
drafters here).
"""
from __future__ import annotations

from typing import Callable

from .base import DraftContext, Drafter, DrafterBuild, NoDrafter

DRAFTERS: dict[str, Callable[..., Drafter]] = {}


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


__all__ = ["DRAFTERS", "DraftContext", "Drafter", "DrafterBuild", "NoDrafter", "make_drafter"]
