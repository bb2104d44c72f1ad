"""The Triton kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1), tiny float32 cases
(interpret_cases.py), plus the backend dispatch on CPU.  Not marked gpu: runs in CPU CI.

TRITON_INTERPRET must be set before Triton is imported, so the cases run in one subprocess
(about 10 s on 2 cores); skipped when Triton is not installed.
"""
import logging
import sys
from pathlib import Path

import pytest
import torch

from hybrid_engine.mamba_cache.ops import triton_common

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from triton_interpret import assert_case, assert_compiles_for_sm90, run_cases  # noqa: E402
KERNEL_CASES = ["conv_varlen", "conv_varlen_long_rows", "conv_varlen_no_tokens", "conv_varlen_w2", "conv_update", "conv_update_k8",
                "conv_update_channel_major", "conv_varlen_channel_major", "ssu", "ssu_k0", "ssu_load_ahead",
                "ssu_out_f16", "ssd", "ssd_odd", "ssd_out_f16", "ssd_fp16_variants", "ssd_pblocks",
                "ssd_sequential", "norm", "norm_then_gate", "norm_gate_only", "norm_opts", "linear_fma",
                "linear_fma_rows_invariant", "linear_dot",
                "attention_decode", "attention_split", "attention_decode_row_split", "attention_prefill",
                "attention_prefill_split", "attention_prefill_split_auto_f16",
                "attention_fp8_decode", "attention_fp8_decode_row_split", "attention_fp8_split_f16",
                "attention_fp8_prefill", "attention_long_padding_g3", "attention_long_padding_g3_split",
                "attention_leading_tokens"]
KERNEL_CASES += ["rmsnorm", "add_rmsnorm", "add_rmsnorm_f16", "relu2", "relu2_f16"]   # models/
KERNEL_CASES += ["conv_update_window", "conv_update_cols", "conv_update_cols_rows", "conv_update_cols_taps_w3",  # conv
                 "conv_update_cols_flat_w2_f16", "conv_update_cols_order_hints",       # variants
                 "conv_update_tap_major_weight"]
KERNEL_CASES += ["ssd_default_f16", "ssd_cb_model_f16",   # SSD chunk output
                 "ssd_heads_loop", "ssd_heads_cb_pre_f16", "ssd_f32_no_cb_pre"]
KERNEL_CASES += ["ssd_state_opts", "ssd_state_opts_f16"]          # SSD chunk state
KERNEL_CASES += ["ssd_fused_long", "ssd_unfused", "ssd_pooled_fused_emit", "ssd_emit_fused_f16",
                 "ssd_pooled_unfused_emit", "ssd_fused_emits", "ssd_fused_emit_edges",
                 "ssd_emit_blocks_f16"]  # steps 2+3 fused
KERNEL_CASES += ["ssd_pooled", "ssd_pooled_emit", "ssd_pooled_step_layout",
                 "engine_prefix_hits"]  # the engine on the Triton Mamba ops                  # SSD reading / writing the pool by slot
KERNEL_CASES += ["ssd_emit", "ssd_emit_lowp_f16",                  # prefix-cache emits
                 "restore_rows", "restore_rows_padding", "restore_rows_f16",
                 "emit_kernel", "emit_kernel_long_chunks", "emit_kernel_one_seq", "emit_kernel_rows", "conv_windows_rows",
                 "conv_windows", "conv_windows_w2_channel_major"]
KERNEL_CASES += ["ssu_deferred"]                                   # SSU, deferred (item 4b)
KERNEL_CASES += ["ssu_norm", "ssu_norm_k0", "ssu_norm_pblocks", "ssu_norm_f16",  # SSU + norm
                 "ssu_norm_dispatch"]
KERNEL_CASES += ["linear_fma_relu2", "linear_dispatch_relu2"]      # the relu² MLP's down_proj


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases(HERE / "interpret_cases.py")


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_in_interpreter(interpreter_results, name):
    assert_case(interpreter_results, name)


def test_launched_kernels_compile_for_sm90(interpreter_results):
    """The kernels as the cases launched them also compile for the GPU (the interpreter skips
    the compiler's checks)."""
    assert_compiles_for_sm90(interpreter_results)


# ----------------------------------------------------------------------------- dispatch on CPU

def test_cpu_tensors_use_the_reference(monkeypatch, caplog):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)
    triton_common._logged.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        assert triton_common.kernel_backend("gated_rmsnorm", torch.device("cpu")) == "torch_ref"
        assert triton_common.kernel_backend("gated_rmsnorm", torch.device("cpu")) == "torch_ref"
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gated_rmsnorm")]
    assert msgs == ["gated_rmsnorm backend on cpu: torch_ref"]


def test_cuda_without_triton_warns_loudly(monkeypatch, caplog):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)
    monkeypatch.setattr(triton_common, "_triton_ok", False)
    triton_common._logged.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        assert triton_common.kernel_backend("ssd_scan_varlen", torch.device("cuda")) == "torch_ref"
    warns = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warns and "Triton missing" in warns[0].getMessage()


def test_env_forces_reference(monkeypatch):
    monkeypatch.setenv("HYBRID_ENGINE_KERNELS", "torch")
    assert triton_common.kernel_backend("ssd_scan_varlen", torch.device("cuda")) == "torch_ref"
    from hybrid_engine.attention.ops import _backend_for
    assert _backend_for(torch.device("cuda")) == "torch_ref"


def test_cdiv_is_the_ceiling_of_the_quotient():
    """The launch grids' host-side ceil division (plain ints, not triton.cdiv's wrapper)."""
    import math
    from hybrid_engine.mamba_cache.ops.triton_common import cdiv
    for a in range(0, 70):
        for b in (1, 2, 16, 64):
            assert cdiv(a, b) == math.ceil(a / b) and isinstance(cdiv(a, b), int)


def test_every_case_of_the_script_is_asserted(interpreter_results):
    """A case added to interpret_cases.py but not to KERNEL_CASES would run and never be checked."""
    ran = {k for k in interpreter_results if not k.startswith("_")}
    assert ran == set(KERNEL_CASES), (sorted(ran - set(KERNEL_CASES)), sorted(set(KERNEL_CASES) - ran))


def test_split_combine_form_at_its_boundaries():
    """Which combine the split attention launches (the interpreter case `attention_decode_row_split`
    runs both, but its outputs do not tell them apart): one load for decode rows and for verify rows
    with more than 8 ranges, the loop for verify rows with at most 8, for prefill tiles, and when
    the partials would not fit (more than 16384 values)."""
    from hybrid_engine.attention.triton_attention import _combine_in_one_load as one_load
    assert one_load(nqb=1, n_splits=5, BLOCK_D=128, Qm=1)
    assert not one_load(nqb=1, n_splits=8, BLOCK_D=128, Qm=4)
    assert one_load(nqb=1, n_splits=9, BLOCK_D=128, Qm=4)
    assert not one_load(nqb=2, n_splits=22, BLOCK_D=128, Qm=32)
    assert one_load(nqb=1, n_splits=128, BLOCK_D=128, Qm=1)
    assert not one_load(nqb=1, n_splits=129, BLOCK_D=128, Qm=1)
