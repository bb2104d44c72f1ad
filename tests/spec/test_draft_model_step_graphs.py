"""The fused draft-model proposal (``DraftModelStepGraphs._propose``, captured in the verify
step's CUDA graph on GPU) computes the general path's drafts: on CPU, at steady greedy verify
steps of a real engine, the draft's caches are snapshotted before ``DraftModelDrafter.propose``
runs; the fused proposal then runs from the same caches on the same step and must give the same
drafts and leave the draft's caches in the same state. The trained default target and draft on
code make rows accept drafts (num_valid up to 4), so the accepted-count logic (the newest sample,
the fork from checkpoint a-1) is exercised, not only num_valid = 1. (Not covered here: pad rows,
``__init__`` and the capture and replay themselves: tests/gpu/test_spec_step_graphs.py.)"""
import sys
from pathlib import Path

from hybrid_engine import LLM, SpeculativeConfig
from hybrid_engine.spec.drafters.draft_model import DraftModelDrafter
from hybrid_engine.step.draft_model_step_graphs import DraftModelStepGraphs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_proposal import check_fused_proposal  # noqa: E402


def _cache_tensors(d):
    return list(d.pool.conv_state) + list(d.pool.ssm_state) + list(d.kv.k) + list(d.kv.v)


def test_fused_proposal_equals_the_general_paths(monkeypatch):
    from hybrid_engine.default_model import default_draft_model_dir, default_model_dir
    llm = LLM(default_model_dir(), dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("draft_model", 3, model=str(default_draft_model_dir()),
                                                   adaptive=False))
    check_fused_proposal(monkeypatch, llm, DraftModelDrafter, DraftModelStepGraphs, _cache_tensors)


def test_fused_follow_equals_the_general_paths_at_rest(monkeypatch):
    """The follow-only graphs' body (``_follow``) at the resting steps of an adaptive engine."""
    from hybrid_engine.default_model import default_draft_model_dir, default_model_dir
    llm = LLM(default_model_dir(), dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("draft_model", 3, model=str(default_draft_model_dir())))
    check_fused_proposal(monkeypatch, llm, DraftModelDrafter, DraftModelStepGraphs, _cache_tensors, at_rest=True)
