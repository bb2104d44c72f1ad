"""mamba-ssm's Triton SSD scan and state update, for cross-checks and benchmarks (optional).

mamba-ssm's package ``__init__`` imports the compiled ``selective_scan_cuda`` extension (Mamba-1
only), which a GPU machine without internet lacks; the Triton ops we compare
against do not need it, so an empty stub module stands in for it.
"""
from __future__ import annotations

import importlib
import sys
import types


def load_mamba_ssm():
    """-> (mamba_chunk_scan_combined, selective_state_update), or (None, None) plus the reason."""
    try:
        importlib.import_module("selective_scan_cuda")
    except ImportError:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as exc:
        return None, None, str(exc)
    return mamba_chunk_scan_combined, selective_state_update, None
