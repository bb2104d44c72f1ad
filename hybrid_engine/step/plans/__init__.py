"""Step plans: the routes a step can take through input preparation.

The runner asks its plans, in order, whether they take the step (``StepPlan.applies``); the first
that does prepares it. The order is fixed when the runner is built:

- ``GreedyStepGraphs`` (``step/greedy_graphs.py``, CUDA graphs on, K = 0 or adaptive n-gram at
  rest): a decode-only step whose rows all take the argmax; *fused*: one graph replay prepares,
  runs the forward and samples (and the n-gram kernel drafts).
- ``DecodeOnlyPlan`` (``decode_only.py``): every row decodes or verifies drafts; one staged host
  array and one ``prepare_decode`` launch.
- ``MixedPlan`` (``mixed.py``): prefill chunks, alone or with decode rows; host-exact prefill
  metadata in one H2D copy, decode rows gathered from the previous step's outputs. Takes any step.

A new kind of step (a prefix-cache restore, MoE routing metadata, ...) is a new plan placed before
the one it specialises; see docs/design.md, "Adding a step kind".
"""
from .base import StepPlan, StepResources
from .decode_only import DecodeOnlyPlan
from .mixed import MixedPlan

__all__ = ["DecodeOnlyPlan", "MixedPlan", "StepPlan", "StepResources"]
