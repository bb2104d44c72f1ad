"""Mamba state ops (see CONTRACT.md).  Public names dispatch to a kernel where one exists; the
``*_ref`` twins are the torch references (CPU or CUDA), ``ssd_scan_naive`` the sequential oracle."""
from hybrid_engine.mamba_cache.ops.conv1d import (
    causal_conv1d_update,
    causal_conv1d_update_ref,
    causal_conv1d_varlen,
    causal_conv1d_varlen_ref,
    conv_windows_at,
    conv_windows_before,
    conv_windows_before_ref,
)
from hybrid_engine.mamba_cache.ops.gated_norm import GATE_MODES, gated_rmsnorm, gated_rmsnorm_ref
from hybrid_engine.mamba_cache.ops.ssd import (
    ssd_scan_naive,
    ssd_scan_varlen,
    ssd_scan_varlen_pooled,
    ssd_scan_varlen_pooled_ref,
    ssd_scan_varlen_ref,
)
from hybrid_engine.mamba_cache.ops.state_update import (
    reserve_ssu_norm_counters,
    selective_state_update,
    selective_state_update_gated,
    selective_state_update_gated_ref,
    selective_state_update_ref,
)

__all__ = [
    "causal_conv1d_varlen", "causal_conv1d_varlen_ref",
    "causal_conv1d_update", "causal_conv1d_update_ref", "conv_windows_at",
    "conv_windows_before", "conv_windows_before_ref",
    "ssd_scan_varlen", "ssd_scan_varlen_ref", "ssd_scan_naive", "ssd_scan_varlen_pooled",
    "ssd_scan_varlen_pooled_ref",
    "selective_state_update", "selective_state_update_ref",
    "selective_state_update_gated", "selective_state_update_gated_ref", "reserve_ssu_norm_counters",
    "gated_rmsnorm", "gated_rmsnorm_ref", "GATE_MODES",
]
