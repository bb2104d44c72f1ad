"""How a Nemotron-H model is split over the ranks of a tensor-parallel group.

The hidden stream is replicated: every rank holds the whole [T, D] residual, norms and routers,
and each mixer works on its own share of heads or width, then one all-reduce per mixer sums the
shares (the row-parallel output projections: Mamba ``out_proj``, attention ``o_proj``, MLP
``down_proj``, and the MoE block's routed + shared sum). The backbone's sums happen in the next
block's norm (``ReducingNorm``: on CUDA one kernel all-reduces, adds the residual and normalises,
``allreduce_norm.py``). Split by mixer:

- Mamba2: heads (``mamba_num_heads / N`` per rank) and the B / C groups with them
  (``n_groups / N`` per rank when N divides ``n_groups``). With fewer groups than ranks (N a
  multiple of ``n_groups``: every published Nemotron-H release has 8, so TP 16, or a one-group
  model at TP 2) each rank's heads lie in one group, whose B / C it holds (replicated on the
  N / n_groups ranks sharing it), and the gated norm's groups span ranks: ``SplitGroupGatedNorm``
  sums each rank's squares of its channels over the group (one small all-reduce per Mamba layer)
  and the decode SSU kernel leaves the norm to it.
  ``in_proj`` rows (z, x, B, C, dt sections), ``conv1d`` channels (x, B, C), ``dt_bias`` /
  ``A_log`` / ``D`` / ``norm.weight`` by head, ``out_proj`` columns. The conv and SSM state pools
  are sized by the per-rank config, so they are split the same way.
- Attention: query heads (``num_attention_heads / N``); KV heads split when N divides them, else
  replicated (each rank keeps the KV head its query heads read); the paged KV cache holds the
  rank's KV heads.
- MLP (and the MoE's shared expert): ``up_proj`` rows, ``down_proj`` columns.
- MoE: by width (every rank holds every expert, ``moe_intermediate_size / N`` of each); the router
  and the latent projections are replicated (``fc2_latent_proj`` is linear, so it is applied to the
  partial routed sum before the one all-reduce).
- Embedding and lm_head: by vocabulary rows (padded to a multiple of N); the embedding sums the
  ranks' masked lookups, the lm_head gathers the ranks' logits.
- The MTP block is split like the backbone (its mixers are the same classes); a draft model is
  replicated (small; every rank drafts the same tokens).

Biases of row-parallel projections are kept by rank 0 only (the all-reduce adds them once).
A model is split by building it from ``shard_model_config`` (the per-rank sizes: module shapes and
cache pools follow), then ``apply_tensor_parallel`` swaps the vocabulary-parallel modules and the
reducing norms, hooks an all-reduce onto the MTP block's mixers and returns the loader's ``Shard``
per parameter, which reads each rank's rows of every checkpoint tensor (``models/loader.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..models.layers import RMSNorm
from ..models.nemotron_h import RMSNormWeight


@dataclass(frozen=True)
class Shard:
    """One rank's part of a checkpoint tensor: ``sections`` ((start, length) ranges of the full
    tensor along ``dim``, concatenated; rows past ``full`` are zero padding), or ``zero`` (a
    row-parallel bias on ranks > 0: the all-reduce must add it once)."""
    dim: int = 0
    sections: tuple[tuple[int, int], ...] = ()
    full: int = 0                    # the full tensor's length along dim
    zero: bool = False

    def full_shape(self, local_shape: tuple[int, ...], offset: int = 0) -> tuple[int, ...]:
        """The checkpoint shape this rank's ``local_shape`` comes from (``offset``: leading dims the
        disk tensor lacks, e.g. one expert of a merged [E, ...] parameter)."""
        if self.zero:
            return tuple(local_shape)
        shape = list(local_shape)
        shape[self.dim - offset] = self.full
        return tuple(shape)

    def take(self, full: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """This rank's part of the checkpoint tensor ``full``."""
        if self.zero:
            return torch.zeros_like(full)
        dim = self.dim - offset
        parts = []
        for start, length in self.sections:
            have = max(0, min(length, full.shape[dim] - start))
            if have:
                parts.append(full.narrow(dim, start, have))
            if have < length:                # vocabulary padding
                shape = list(full.shape)
                shape[dim] = length - have
                parts.append(full.new_zeros(shape))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


@dataclass(frozen=True)
class TPLayout:
    """Where this rank sits: ``rank`` of ``size``, and the full (unsplit) model config."""
    rank: int
    size: int
    full: ModelConfig


def _split(what: str, total: int, size: int) -> int:
    if total % size:
        raise ValueError(f"tensor_parallel_size={size} must divide {what} (={total})")
    return total // size


def shard_model_config(mc: ModelConfig, size: int) -> ModelConfig:
    """The per-rank model config: heads and widths divided by ``size`` (vocabulary and hidden size
    stay whole). ValueError naming the config field that ``size`` cannot split."""
    if size == 1:
        return mc
    if mc.model_type != "nemotron_h":
        raise ValueError(f"tensor_parallel_size > 1 is available for model_type 'nemotron_h' only, "
                         f"got {mc.model_type!r}")
    if mc.quantization is not None and mc.quantization.source == "checkpoint":
        raise ValueError("tensor_parallel_size > 1 with a quantized checkpoint is not available yet; "
                         "serve the BF16 release with quantization='fp8' (quantized at load, per rank)")
    heads = _split("mamba_num_heads", mc.mamba_num_heads, size)
    if mc.n_groups % size and size % mc.n_groups:
        raise ValueError(f"tensor_parallel_size={size} must divide n_groups (={mc.n_groups}) or be a multiple of it "
                         f"(each group's B / C are then replicated on the ranks sharing it)")
    groups = max(1, mc.n_groups // size)
    nkv = mc.num_key_value_heads
    if nkv % size and size % nkv:
        raise ValueError(f"tensor_parallel_size={size} must divide num_key_value_heads (={nkv}) or be a "
                         f"multiple of it (KV heads are then replicated)")
    kwargs = dict(mamba_num_heads=heads, n_groups=groups,
                  num_attention_heads=_split("num_attention_heads", mc.num_attention_heads, size),
                  num_key_value_heads=max(1, nkv // size))
    if any(k == "-" for k in mc.layer_types + mc.mtp_layer_types):
        kwargs["intermediate_size"] = _split("intermediate_size", mc.intermediate_size, size)
    if any(k == "E" for k in mc.layer_types + mc.mtp_layer_types):
        kwargs["moe_intermediate_size"] = _split("moe_intermediate_size", mc.moe_intermediate_size, size)
        kwargs["moe_shared_expert_intermediate_size"] = _split(
            "moe_shared_expert_intermediate_size", mc.moe_shared_expert_intermediate_size, size)
    return replace(mc, **kwargs)


# ------------------------------------------------------------------------------ modules
class VocabParallelEmbedding(nn.Module):
    """The rank's rows [V / N (padded), D] of the embedding; the lookup of ids outside them is zero,
    and the ranks' lookups are summed."""

    def __init__(self, rows: int, dim: int, first: int, reduce):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.first, self.rows, self._reduce = first, rows, reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self._reduce(out)


class VocabParallelHead(nn.Module):
    """The rank's rows [V / N (padded), D] of the lm_head; logits of every rank gathered -> [L, V]."""

    def __init__(self, rows: int, dim: int, vocab: int, gather):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.vocab, self._gather = vocab, gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..models.linear import linear
        return self._gather(linear(x, self.weight))[:, :self.vocab]


def _mixer_shards(name: str, mixer: nn.Module, lay: TPLayout) -> dict[str, Shard]:
    """The Shard of each parameter of one mixer (``name``: its module path)."""
    from ..models.layers import MLP
    from ..models.moe import MoE
    from ..models.nemotron_h import Attention, Mamba2Mixer
    full, r, n = lay.full, lay.rank, lay.size
    out: dict[str, Shard] = {}

    def put(param: str, dim: int, sections, length: int) -> None:
        out[f"{name}.{param}"] = Shard(dim=dim, sections=tuple(sections), full=length)

    def row_parallel(proj: str, length: int, part: int) -> None:
        put(f"{proj}.weight", 1, [(r * part, part)], length)
        if mixer.get_submodule(proj).bias is not None and r > 0:
            out[f"{name}.{proj}.bias"] = Shard(zero=True)      # added once, by rank 0

    def mlp(prefix: str, width: int) -> None:
        part = width // n
        put(f"{prefix}up_proj.weight", 0, [(r * part, part)], width)
        if mixer.get_submodule(f"{prefix}up_proj").bias is not None:
            put(f"{prefix}up_proj.bias", 0, [(r * part, part)], width)
        row_parallel(f"{prefix}down_proj", width, part)

    if isinstance(mixer, Mamba2Mixer):
        H, P, G, N = full.mamba_num_heads, full.mamba_head_dim, full.n_groups, full.ssm_state_size
        I, hl, gl = H * P, H // n, max(1, G // n)
        il = hl * P
        g0 = r * gl if G >= n else r // (n // G)      # the rank's first group (fewer groups: its heads')
        z, x = (r * il, il), (I + r * il, il)
        b, c = (2 * I + g0 * N, gl * N), (2 * I + G * N + g0 * N, gl * N)
        dt = (2 * I + 2 * G * N + r * hl, hl)
        proj_len = 2 * I + 2 * G * N + H
        put("in_proj.weight", 0, [z, x, b, c, dt], proj_len)
        if mixer.in_proj.bias is not None:
            put("in_proj.bias", 0, [z, x, b, c, dt], proj_len)
        conv = [(r * il, il), (I + g0 * N, gl * N), (I + G * N + g0 * N, gl * N)]
        put("conv1d.weight", 0, conv, I + 2 * G * N)
        if mixer.conv1d.bias is not None:
            put("conv1d.bias", 0, conv, I + 2 * G * N)
        for p in ("dt_bias", "A_log", "D"):
            put(p, 0, [(r * hl, hl)], H)
        if mixer.norm is not None:
            put("norm.weight", 0, [(r * il, il)], I)
        row_parallel("out_proj", I, il)
    elif isinstance(mixer, Attention):
        hd, nh, nkv = full.head_dim, full.num_attention_heads, full.num_key_value_heads
        qh = nh // n
        kvh = max(1, nkv // n)
        kv0 = r * kvh if nkv % n == 0 else r * nkv // n         # replicated: the KV head its queries read
        for p, sec, length in (("q_proj", (r * qh * hd, qh * hd), nh * hd), ("k_proj", (kv0 * hd, kvh * hd), nkv * hd),
                               ("v_proj", (kv0 * hd, kvh * hd), nkv * hd)):
            put(f"{p}.weight", 0, [sec], length)
            if getattr(mixer, p).bias is not None:
                put(f"{p}.bias", 0, [sec], length)
        row_parallel("o_proj", nh * hd, qh * hd)
    elif isinstance(mixer, MoE):
        if full.moe_activation != "relu2":
            raise ValueError("tensor parallelism splits relu² experts only (moe_activation 'relu2')")
        f = full.moe_intermediate_size
        fl = f // n
        put("experts.up_proj", 1, [(r * fl, fl)], f)
        put("experts.down_proj", 2, [(r * fl, fl)], f)
        mlp("shared_experts.", full.moe_shared_expert_intermediate_size)
        if mixer.fc2_latent_proj is not None and mixer.fc2_latent_proj.bias is not None and r > 0:
            out[f"{name}.fc2_latent_proj.bias"] = Shard(zero=True)    # applied to a partial sum
    elif isinstance(mixer, MLP):
        mlp("", full.intermediate_size)
    else:
        raise ValueError(f"tensor parallelism cannot split mixer {name} ({type(mixer).__name__})")
    return out


class ReducingNorm(RMSNorm):
    """A block's input norm (or ``norm_f``) whose input is the previous mixer's partial output: its
    residual add + RMSNorm first sums the partials over the ranks. Steps of at most
    ``fused.max_rows`` tokens take one kernel (``allreduce_norm.AllReduceNorm``: all-reduce, add
    and norm in one launch); larger ones, and CPU, the group's all-reduce and then the norm."""

    def __init__(self, dim: int, eps: float, *, all_reduce, fused, slot: int):
        super().__init__(dim, eps)
        self.all_reduce, self.fused, self.slot = all_reduce, fused, slot

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if (self.fused is not None and residual is not None and x.shape == residual.shape
                and self.fused.fits(x) and self.fused.fits(residual)):
            return self.fused(x, residual, self.weight, self.eps, self.slot)
        return super().add_norm(self.all_reduce(x), residual)


class SplitGroupGatedNorm(RMSNormWeight):
    """A Mamba2 mixer's gated norm (``gate_then_norm``) when its groups span ranks (fewer B / C
    groups than ranks): this rank holds ``1 / ranks_per_group`` of group ``group``'s channels, so
    the mean of squares is the sum over the ranks sharing the group. One all-reduce of a [T, G]
    float32 table (each rank fills its group's column) gives every rank its group's sum; the rest
    is ``gated_rmsnorm_ref``'s arithmetic (float32, cast, then the weight)."""
    local = False

    def __init__(self, dim: int, *, group: int, groups: int, group_channels: int, all_reduce):
        super().__init__(dim)
        self.group, self.groups, self.group_channels, self._all_reduce = group, groups, group_channels, all_reduce

    def forward(self, y: torch.Tensor, z: torch.Tensor, group_size: int, eps: float, mode: str) -> torch.Tensor:
        if mode != "gate_then_norm":
            raise ValueError(f"a gated norm split over ranks supports mode 'gate_then_norm' only, got {mode!r}")
        g = y.float() * F.silu(z.float())                                   # [T, I / N]
        sums = g.new_zeros(g.shape[0], self.groups)                         # [T, G]
        sums[:, self.group] = g.pow(2).sum(-1)
        sums = self._all_reduce(sums)
        inv = torch.rsqrt(sums[:, self.group] / self.group_channels + eps)   # [T]
        return (self.weight * (g * inv[:, None]).to(y.dtype)).to(y.dtype)


def _split_group_norms(model: nn.Module, lay: TPLayout, group) -> None:
    """Fewer B / C groups than ranks: every Mamba2 mixer's gated norm becomes a
    ``SplitGroupGatedNorm`` over its rank's group."""
    from ..models.nemotron_h import Mamba2Mixer
    full, n = lay.full, lay.size
    if full.n_groups >= n:
        return
    for mixer in model.modules():
        if isinstance(mixer, Mamba2Mixer) and mixer.norm is not None:
            if mixer.gate_mode != "gate_then_norm":
                raise ValueError(f"tensor_parallel_size={n} > n_groups={full.n_groups} needs the gated norm "
                                 f"mode 'gate_then_norm', got {mixer.gate_mode!r}")
            mixer.norm = SplitGroupGatedNorm(
                mixer.norm.weight.shape[0], group=lay.rank // (n // full.n_groups), groups=full.n_groups,
                group_channels=full.mamba_num_heads * full.mamba_head_dim // full.n_groups,
                all_reduce=group.all_reduce)


def apply_tensor_parallel(model: nn.Module, lay: TPLayout, group, dtype: torch.dtype | None = None
                          ) -> dict[str, Shard]:
    """Make ``model`` (built on the meta device from ``shard_model_config``) this rank's part:
    vocabulary-parallel embedding and lm_head, every mixer's output summed over the ranks: by the
    next block's norm (``ReducingNorm``, the all-reduce fused into it on CUDA; ``dtype`` is the
    hidden stream's) for the backbone, by an all-reduce hook for other mixers (the MTP block).
    Returns the loader's {parameter name: Shard} (parameters not listed are replicated)."""
    full, r, n = lay.full, lay.rank, lay.size
    rows = -(-full.vocab_size // n)
    vocab = Shard(dim=0, sections=((r * rows, rows),), full=full.vocab_size)
    shards = {"backbone.embeddings.weight": vocab, "lm_head.weight": vocab}
    dim = full.hidden_size
    emb = VocabParallelEmbedding(rows, dim, r * rows, group.all_reduce)
    model.backbone.embeddings = emb
    model.lm_head = VocabParallelHead(rows, dim, full.vocab_size, group.all_gather_last)
    if full.tie_word_embeddings:
        model.lm_head.weight = emb.weight
    reduced_by_norm = _reduce_in_norms(model, group, dtype or torch.get_default_dtype())
    _split_group_norms(model, lay, group)
    for name, module in list(model.named_modules()):
        if name.endswith(".mixer"):
            shards.update(_mixer_shards(name, module, lay))
            if module not in reduced_by_norm:
                module.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))
    return shards


def _reduce_in_norms(model: nn.Module, group, dtype: torch.dtype) -> set[nn.Module]:
    """Swap the backbone's norms 1..L-1 and ``norm_f`` for ``ReducingNorm``s (each sums the mixer
    before it; block 0's input is the embedding, which sums itself). -> the mixers so covered."""
    from .allreduce_norm import AllReduceNorm
    layers, final = model.backbone.layers, model.backbone.norm_f
    fused = AllReduceNorm.create(group, slots=len(layers), hidden=final.weight.shape[0], dtype=dtype)

    def reducing(norm: RMSNorm, slot: int) -> ReducingNorm:
        return ReducingNorm(norm.weight.shape[0], norm.eps, all_reduce=group.all_reduce, fused=fused, slot=slot)
    for slot, layer in enumerate(layers[1:]):
        layer.norm = reducing(layer.norm, slot)
    model.backbone.norm_f = reducing(final, len(layers) - 1)
    return {layer.mixer for layer in layers}
