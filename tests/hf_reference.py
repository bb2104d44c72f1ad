"""transformers references for the tests: load a checkpoint folder in float32 and run greedy
generation, logits or dt values on it; the engine-side prefill helper; a no-host-sync guard."""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from hybrid_engine.models.synthetic import _quiet_transformers


def _fingerprint(model_dir: Path) -> tuple:
    files = sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]
    return tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.exists())


@functools.lru_cache(maxsize=8)
def _load_hf_cached(path: str, fingerprint: tuple):
    from transformers import AutoModelForCausalLM

    with _quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def load_hf(model_dir):
    """transformers' NemotronHForCausalLM for ``model_dir`` in float32, eval mode, cached (the
    cache key includes the weight files' mtimes, so a rewritten folder is reloaded)."""
    p = Path(model_dir).resolve()
    return _load_hf_cached(str(p), _fingerprint(p))


@torch.no_grad()
def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt by transformers ``generate`` (float32, one prompt at a
    time, do_sample=False). Returns exactly ``max_new_tokens`` new token ids per prompt: EOS does
    not stop generation (``eos_token_id=None`` is passed, which overrides generation_config.json);
    no logits processor touches the scores, so every token is the plain argmax. Compare with the
    engine run with ``ignore_eos=True``."""
    model = load_hf(model_dir)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        with _quiet_transformers():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
        new = out[0, ids.shape[1]:].tolist()
        if len(new) != max_new_tokens:
            raise RuntimeError(f"transformers generated {len(new)} tokens, expected {max_new_tokens}")
        outs.append(new)
    return outs


@torch.no_grad()
def hf_logits(model_dir, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits [T, V] of one full-sequence forward (no cache) over ``token_ids``."""
    model = load_hf(model_dir)
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with _quiet_transformers():
        return model(ids, use_cache=False).logits[0].float()


@torch.no_grad()
def hf_dt_values(model_dir, token_ids: list[int]) -> torch.Tensor:
    """All dt = softplus(dt_proj + dt_bias) values of every Mamba layer on a full forward over
    ``token_ids`` (before any clamp), flattened, float32."""
    model = load_hf(model_dir)
    seen: list[torch.Tensor] = []
    hooks = []
    for mod in model.modules():
        if hasattr(mod, "dt_bias") and hasattr(mod, "in_proj"):
            def hook(_m, _inp, out, mixer=mod):
                raw = out[..., -mixer.num_heads:].float()
                seen.append(torch.nn.functional.softplus(raw + mixer.dt_bias.float()).flatten())
            hooks.append(mod.in_proj.register_forward_hook(hook))
    try:
        with _quiet_transformers():
            model(torch.tensor([list(token_ids)], dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(seen) if seen else torch.empty(0)


from hybrid_engine.evaluation import prefill_hidden as engine_prefill_hidden  # noqa: E402,F401


def fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x through an FP8 KV cache, written with plain torch ops: x / scale clamped to the largest
    finite float8_e4m3fn (448), rounded to e4m3, times scale (float32)."""
    s = torch.tensor(scale, dtype=torch.float32)
    return (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s


@contextlib.contextmanager
def fp8_kv_hooks(model_dir, k_scales, v_scales):
    """Inside the block, transformers' model of ``model_dir`` (``load_hf``) sees its attention
    layers' k_proj / v_proj outputs through ``fp8_round_trip`` with layer i's scales: what an FP8 KV
    cache stores and reads back. Nemotron-H attention has no positional encoding between the
    projections and the cache, so this is exactly the FP8-KV-cache model."""
    model = load_hf(model_dir)
    attn = [m for m in model.modules() if all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    assert len(attn) == len(k_scales) == len(v_scales), (len(attn), len(k_scales), len(v_scales))
    hooks = []
    for m, ks, vs in zip(attn, k_scales, v_scales):
        hooks.append(m.k_proj.register_forward_hook(lambda _m, _a, out, s=float(ks): fp8_round_trip(out, s)))
        hooks.append(m.v_proj.register_forward_hook(lambda _m, _a, out, s=float(vs): fp8_round_trip(out, s)))
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()


_GATED_NORM_CLASSES = {"bamba": ("bamba", "BambaRMSNormGated"),
                       "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridRMSNormGated")}


@functools.lru_cache(maxsize=None)
def hf_groups_the_gated_norm(model_type: str) -> bool:
    """Whether the installed transformers normalizes ``model_type``'s gated RMSNorm per group of the
    Mamba width, as Mamba2 defines it (and the engine does). Older transformers releases (5.17, on
    our GPU machine) normalized Bamba's and Granite-4.0-H's over the whole width even with
    ``mamba_n_groups > 1``: there, their references of a grouped model are not the model, so the
    tests build those families with one group (where the two readings agree)."""
    import importlib
    import inspect
    module, cls = _GATED_NORM_CLASSES[model_type]
    norm = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    return "group_size" in inspect.signature(norm.__init__).parameters


class NoHostSync(torch.overrides.TorchFunctionMode):
    """Test guard: fails on any tensor operation that would read device data back to the host
    (works on CPU tensors too, so CI checks the step path's no-sync rule without a GPU)."""

    BANNED = {"item", "tolist", "cpu", "numpy", "nonzero", "masked_select", "__bool__", "__int__",
              "__float__", "__index__"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        assert name not in self.BANNED, f"host sync: {name}"
        if name == "__getitem__":
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            assert not any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx), \
                "host sync: boolean-mask indexing"
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def hf_stepwise_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers fed one token per forward with its cache, prompt included: every Mamba step
    takes the single-token path, which never clamps dt (the Mamba2 kernels' semantics; the
    multi-token path clamps dt to ``time_step_min``). Returns (greedy new tokens, float32 logits
    [len(prompt) + max_new_tokens - 1, V] of every position fed)."""
    model = load_hf(model_dir)
    cache, logits, seq = None, [], list(prompt)
    with _quiet_transformers():
        for t in range(len(prompt) + max_new_tokens - 1):
            out = model(torch.tensor([[seq[t]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0, -1].float())
            if t >= len(prompt) - 1:
                seq.append(int(out.logits[0, -1].argmax()))
    return seq[len(prompt):], torch.stack(logits)
