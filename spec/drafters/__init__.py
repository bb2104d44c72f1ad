"""Draft proposers. Each owns its device state and fills ``[B, K]`` drafts (-1 = no draft)."""
from .base import DraftContext, Drafter, NoDrafter

__all__ = ["DraftContext", "Drafter", "NoDrafter"]


def make_drafter(engine) -> Drafter:
    """Build the drafter named by the engine's SpeculativeConfig (NoDrafter without one)."""
    spec = engine.cfg.speculative
    if spec is None:
        return NoDrafter()
    raise ValueError(f"speculative method {spec.method!r} is not available yet")
