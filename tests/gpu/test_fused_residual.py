"""The fused residual stream (each add done inside the next block's norm kernel, relu² in one
kernel) gives the same final hidden states, bit for bit, as the unfused pre-norm blocks
``h = h + mixer(norm(h))`` with ``F.relu(x).square()``. On CPU both run torch twins (a check of
the restructuring); the CUDA case compares the Triton kernels with the old torch add and relu²."""
import pytest
import torch

from hybrid_engine import LLM
from hybrid_engine.models import layers
from hybrid_engine.models.activation import relu2_ref
from hybrid_engine.models.nemotron_h import NemotronHForCausalLM
from hf_reference import engine_prefill_hidden


def unfused_forward(model, fb, caches):
    """The model forward as it was before the fusion (a reference, not used by the engine)."""
    h = model.backbone.embeddings(fb.input_ids)                          # [T, D]
    for layer in model.backbone.layers:
        x = layer.norm(h)
        h = h + (layer.mixer(x, fb, caches) if layer.stateful else layer.mixer(x))
    return model.backbone.norm_f(h)


# float16 on CPU adds nothing over bfloat16 (same torch code path), so it is not a case
CASES = [("cpu", "float32"), ("cpu", "bfloat16")] + [
    pytest.param("cuda", d, marks=pytest.mark.gpu) for d in ("float32", "bfloat16", "float16")]


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_residual_stream_is_bit_identical(hybrid_dir, device, dtype, monkeypatch):
    llm = LLM(hybrid_dir, dtype=dtype, device=device, max_num_seqs=2)
    ids = [(7 * i + 3) % 200 for i in range(37)]
    fused = engine_prefill_hidden(llm, ids)                              # [T, D]
    with monkeypatch.context() as m:
        m.setattr(NemotronHForCausalLM, "forward", unfused_forward)
        m.setattr(layers, "relu2", relu2_ref)
        ref = engine_prefill_hidden(llm, ids)
    assert fused.dtype == ref.dtype and bool(torch.isfinite(ref).all())
    bits = {torch.float32: torch.int32}.get(fused.dtype, torch.int16)
    assert torch.equal(fused.view(bits), ref.view(bits))
