"""The fused MTP proposal (``MTPStepGraphs._propose``, captured in the verify step's CUDA graph on
GPU) computes the general path's drafts and MTP KV (``fused_proposal.check_fused_proposal``, on
CPU). The trained default target and its MTP block on code make rows accept drafts, so the
newest-sample index (num_valid up to 4) is exercised. (Pad rows, capture and replay:
tests/gpu/test_spec_step_graphs.py.)"""
import sys
from pathlib import Path

from hybrid_engine import LLM, SpeculativeConfig
from hybrid_engine.spec.drafters.mtp import MTPDrafter
from hybrid_engine.step.mtp_step_graphs import MTPStepGraphs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_proposal import check_fused_proposal  # noqa: E402


def test_fused_mtp_proposal_equals_the_general_paths(monkeypatch):
    from hybrid_engine.default_model import default_model_dir
    llm = LLM(default_model_dir(), dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("mtp", 3, adaptive=False))
    check_fused_proposal(monkeypatch, llm, MTPDrafter, MTPStepGraphs, lambda d: list(d.kv.k) + list(d.kv.v))


def test_fused_mtp_follow_equals_the_general_paths_at_rest(monkeypatch):
    """The follow-only graphs' body (``_follow``: ``MTP.follow``) at the resting steps of an
    adaptive engine."""
    from hybrid_engine.default_model import default_model_dir
    llm = LLM(default_model_dir(), dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("mtp", 3))
    check_fused_proposal(monkeypatch, llm, MTPDrafter, MTPStepGraphs, lambda d: list(d.kv.k) + list(d.kv.v),
                         at_rest=True)
