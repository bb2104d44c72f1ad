"""Nemotron-H: Mamba2 mixers, attention (no positional encoding), relu^2 MLP and MoE blocks.

The model holds weights only. Caches (paged KV, Mamba pool) are passed in with each forward, and
all per-step metadata arrives as a typed ``ForwardBatch``.
"""
from __future__ import annotations

import torch
from torch import nn

from hybrid_engine.mamba_cache import ops as mops

from ..attention import paged_attention, write_kv
from ..config import ATTENTION, MAMBA, MLP as MLP_KIND, MOE, ModelConfig
from ..step.forward_batch import ForwardBatch
from .causal_lm import HybridCausalLM
from .layers import MLP, RMSNorm
from .linear import Linear
from .moe import ROUTER_FP32_WEIGHTS, MoE
from .rope import RotaryEmbedding


class Caches:
    """Per-layer cache tensors handed to the model: KV per attention layer, state per Mamba layer."""

    def __init__(self, kv_cache, mamba_pool, checkpoints=None):
        self.kv = kv_cache            # attention.KVCache: .k[i], .v[i], .scales(i) by attention ordinal
        self.mamba = mamba_pool       # mamba_cache.pool.MambaPool: by Mamba ordinal
        self.checkpoints = checkpoints  # mamba_cache.checkpoints.MambaCheckpoints (prefix caching) or None


class Mamba2Mixer(nn.Module):
    """The Mamba2 mixer every family shares (state in the Mamba pool, by Mamba ordinal).

    Family parameters (defaults: Nemotron-H, Bamba, Granite-4.0-H): ``gate_mode`` how the gate z
    meets the output (``mops.GATE_MODES``: norm(y * silu(z)), norm(y) * silu(z), or y * silu(z)
    with no norm weight); ``in_scale`` multiplies the input and ``proj_scales`` (5 numbers) the
    in_proj output's z / x / B / C / dt sections (Falcon-H1's ssm_in_multiplier and muP
    ssm_multipliers); ``out_bias`` the out_proj bias (default: ``cfg.use_bias``)."""

    def __init__(self, cfg: ModelConfig, ordinal: int, *, gate_mode: str = "gate_then_norm", in_scale: float = 1.0,
                 proj_scales: tuple[float, ...] | None = None, out_bias: bool | None = None):
        super().__init__()
        self.ordinal = ordinal
        self.H, self.P, self.G, self.N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        self.I, self.conv_dim = cfg.mamba_intermediate, cfg.conv_dim
        self.chunk_size, self.eps = cfg.chunk_size, cfg.layer_norm_epsilon
        self.dt_limit = tuple(cfg.time_step_limit)
        if gate_mode not in mops.GATE_MODES:
            raise ValueError(f"gate_mode must be one of {mops.GATE_MODES}, got {gate_mode!r}")
        self.gate_mode, self.in_scale = gate_mode, float(in_scale)
        if proj_scales is not None and all(float(m) == 1.0 for m in proj_scales):
            proj_scales = None
        self.proj_scales = None if proj_scales is None else tuple(float(m) for m in proj_scales)
        if self.proj_scales is not None:       # [I + C + H] float32, rebuilt by reset_runtime_state
            self.register_buffer("proj_scale", self._proj_scale_vector(), persistent=False)
        self.in_proj = Linear(cfg.hidden_size, self.I + self.conv_dim + self.H, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(self.H))
        self.A_log = nn.Parameter(torch.zeros(self.H))
        self.D = nn.Parameter(torch.ones(self.H))
        self.norm = RMSNormWeight(self.I) if gate_mode != "gate_only" else None
        self.out_proj = Linear(self.I, cfg.hidden_size, bias=cfg.use_bias if out_bias is None else out_bias)

    def _proj_scale_vector(self) -> torch.Tensor:
        gn = self.G * self.N
        sizes = (self.I, self.I, gn, gn, self.H)
        if len(self.proj_scales) != 5:
            raise ValueError(f"proj_scales needs 5 multipliers (z, x, B, C, dt), got {self.proj_scales}")
        return torch.cat([torch.full((n,), m, dtype=torch.float32) for n, m in zip(sizes, self.proj_scales)])

    def reset_runtime_state(self) -> None:
        if self.proj_scales is not None:
            self.proj_scale = self._proj_scale_vector().to(device=self.proj_scale.device,
                                                           dtype=self.in_proj.weight.dtype)

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The modules that read this mixer's input, and nothing else does (``RMSNorm.add_norm_for``);
        none when the input is scaled first."""
        return (self.in_proj,) if self.in_scale == 1.0 else ()

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_scale != 1.0:
            x = x * self.in_scale
        p = self.in_proj(x)
        return p if self.proj_scales is None else p * self.proj_scale
    def _A(self) -> torch.Tensor:
        """A = -exp(A_log) in float32, recomputed only when A_log changes (weights are constant
        while serving, so decode steps and CUDA graphs read a cached tensor)."""
        key = (self.A_log.data_ptr(), self.A_log._version)
        if getattr(self, "_A_key", None) != key:
            self._A_cache, self._A_key = -torch.exp(self.A_log.detach().float()), key
        return self._A_cache

    def forward(self, x: torch.Tensor, fb: ForwardBatch, caches: Caches) -> torch.Tensor:
        conv_state = caches.mamba.conv_state[self.ordinal]   # [S, C, W-1+K]
        ssm_state = caches.mamba.ssm_state[self.ordinal]     # [S, 1+K, H, P, N] f32 ([S, 1, ...] deferred)
        pending = caches.mamba.pending[self.ordinal]         # PendingInputs of a deferred pool, else None
        md = fb.mamba
        z, xbc, dt = self._project(x).split([self.I, self.conv_dim, self.H], dim=-1)
        weight = self.conv1d.weight.squeeze(1)               # [C, W]
        A = self._A()                                        # [H] float32
        nd = md.num_decode_tokens
        ys = []
        if md.num_decode_rows:
            n, s = md.num_decode_rows, md.decode_len
            xbc_d = mops.causal_conv1d_update(xbc[:nd].view(n, s, -1), weight, self.conv1d.bias, conv_state,
                                              md.decode_slots, md.num_accepted)
            xd, bd, cd = xbc_d.split([self.I, self.G * self.N, self.G * self.N], dim=-1)
            ssu_args = (ssm_state, xd.reshape(n, s, self.H, self.P), dt[:nd].view(n, s, self.H), self.dt_bias,
                        A, bd.reshape(n, s, self.G, self.N), cd.reshape(n, s, self.G, self.N), self.D,
                        md.decode_slots, md.num_accepted)
            if not md.num_prefill_rows and self.gate_mode == "gate_then_norm" and self.norm.local:
                # decode-only step: the gated norm runs inside the SSU kernel
                y = mops.selective_state_update_gated(*ssu_args, z[:nd], self.norm.weight, self.I // self.G,
                                                      self.eps, dt_limit=self.dt_limit, pending=pending)  # [n, s, I]
                return self.out_proj(y.view(nd, self.I))
            y = mops.selective_state_update(*ssu_args, dt_limit=self.dt_limit, out_dtype=x.dtype, pending=pending)
            ys.append(y.reshape(nd, self.I))
        if md.num_prefill_rows:
            ckpts = caches.checkpoints
            # prefix-cache hit: the slot starts from a checkpoint. The first Mamba layer restores
            # it for every layer (one gather/scatter a step; ordinals follow the layer order, and
            # no layer touches another's state)
            if md.restore_rows is not None and self.ordinal == 0:
                if ckpts is None:
                    raise RuntimeError("a prefix-cache restore reached a model without checkpoint storage "
                                       "(Caches.checkpoints is None)")
                ckpts.restore(caches.mamba, md.restore_slots, md.restore_rows)
            saving = md.ckpt_rows is not None and ckpts is not None
            if saving:      # conv windows after the saved boundaries, into their checkpoint rows: they
                mops.conv_windows_before(   # read the pool's old windows, so before the conv
                    xbc[nd:], conv_state, weight.shape[-1], md.prefill_query_start_loc, md.prefill_slots,
                    md.has_initial_state, md.ckpt_seq, md.ckpt_token, out=ckpts.conv[self.ordinal],
                    out_rows=md.ckpt_rows)
            xbc_p = mops.causal_conv1d_varlen(xbc[nd:], weight, self.conv1d.bias, conv_state,
                                              md.prefill_query_start_loc, md.prefill_slots,
                                              md.has_initial_state)
            xp, bp, cp = xbc_p.split([self.I, self.G * self.N, self.G * self.N], dim=-1)
            # each row starts from its slot's checkpoint 0 (zeros where it starts fresh, whatever
            # the slot holds: a stale NaN times 0 is NaN) and its final state lands there; the
            # states after the block boundaries the chunks crossed go into their checkpoint rows
            y = mops.ssd_scan_varlen_pooled(
                xp.reshape(-1, self.H, self.P), dt[nd:], self.dt_bias, A, bp.reshape(-1, self.G, self.N),
                cp.reshape(-1, self.G, self.N), self.D, md.prefill_query_start_loc, ssm_state[:, 0],
                md.prefill_slots, md.has_initial_state, self.chunk_size, dt_limit=self.dt_limit,
                max_seqlen=md.max_prefill_len, out_dtype=x.dtype, chunk_layout=md.ssd_chunk_layout(self.chunk_size),
                **(dict(emit_at=md.ckpt_token, emit_out=ckpts.ssm[self.ordinal], emit_rows=md.ckpt_rows,
                        emits_sorted=True)       # by construction (test_ckpt_tokens_sorted)
                   if saving else {}))
            ys.append(y.reshape(-1, self.I))
        # y arrives in the model dtype: the kernels round their float32 result once (no cast kernel)
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        if self.norm is None:
            y = mops.gated_rmsnorm(y, z, None, self.I // self.G, self.eps, self.gate_mode)
        else:
            y = self.norm(y, z, self.I // self.G, self.eps, self.gate_mode)
        return self.out_proj(y)


class RMSNormWeight(nn.Module):
    """Holds the gated-norm weight under the checkpoint name ``mixer.norm.weight``, and applies the
    gated norm (y, z [T, I] -> [T, I]). ``local``: every norm group lies within this module's
    channels, so the decode SSU kernel may apply the norm itself (tensor parallelism with fewer
    B/C groups than ranks swaps in a norm whose groups span ranks: ``parallel/sharding.py``)."""
    local = True

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor, group_size: int, eps: float, mode: str) -> torch.Tensor:
        return mops.gated_rmsnorm(y, z, self.weight, group_size, eps, mode)


class Attention(nn.Module):
    """Paged attention over the KV cache of attention ordinal ``ordinal``. Shared by the families:
    ``cfg.attention_bias`` (q/k/v/o biases), ``cfg.attention_scale`` (softmax scale, default
    head_dim ** -0.5), ``cfg.rope_theta`` / ``cfg.rotary_dim`` (RoPE on the first rotary_dim dims of
    each head, ``rope.py``; none for Nemotron-H) and ``key_scale`` (k multiplied before RoPE:
    Falcon-H1's key_multiplier)."""

    def __init__(self, cfg: ModelConfig, ordinal: int, key_scale: float = 1.0):
        super().__init__()
        self.ordinal = ordinal
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.hd ** -0.5 if cfg.attention_scale is None else float(cfg.attention_scale)
        self.key_scale = float(key_scale)
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(d, self.nh * self.hd, bias=bias)
        self.k_proj = Linear(d, self.nkv * self.hd, bias=bias)
        self.v_proj = Linear(d, self.nkv * self.hd, bias=bias)
        self.o_proj = Linear(self.nh * self.hd, d, bias=bias)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta) if cfg.rope_theta is not None else None

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The modules that read this mixer's input, and nothing else does (``RMSNorm.add_norm_for``)."""
        return (self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, caches: Caches) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.nh, self.hd)
        k = self.k_proj(x).view(t, self.nkv, self.hd)
        v = self.v_proj(x).view(t, self.nkv, self.hd)
        if self.key_scale != 1.0:
            k = k * self.key_scale
        q, k = self.rotary(q, k, fb.positions)
        kc, vc = caches.kv.k[self.ordinal], caches.kv.v[self.ordinal]
        ks, vs = caches.kv.scales(self.ordinal)          # FP8 cache: [] float32 each; else None
        a = fb.attn
        write_kv(k, v, kc, vc, a.slot_mapping, ks, vs)
        o = paged_attention(q, kc, vc, a.query_start_loc, a.seq_lens, a.block_tables, self.scale,
                            max_query_len=a.max_query_len, max_seq_len=a.max_seq_len, k_scale=ks, v_scale=vs)
        return self.o_proj(o.reshape(t, self.nh * self.hd))

    def write_kv_only(self, x: torch.Tensor, fb: ForwardBatch, caches: Caches) -> None:
        """Only the cache writes of ``forward`` (k and v of x's tokens, the same ops: the same
        bits): no query, attention or output projection. For a pass that must keep this layer's
        cache but reads nothing of its output (``MTP.follow``)."""
        t = x.shape[0]
        k = self.k_proj(x).view(t, self.nkv, self.hd)
        v = self.v_proj(x).view(t, self.nkv, self.hd)
        if self.key_scale != 1.0:
            k = k * self.key_scale
        if self.rope is not None:     # RoPE rotates q and k alike: a one-head stand-in for q
            _, k = self.rotary(k[:, :1], k, fb.positions)
        ks, vs = caches.kv.scales(self.ordinal)
        write_kv(k, v, caches.kv.k[self.ordinal], caches.kv.v[self.ordinal], fb.attn.slot_mapping, ks, vs)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Positional encoding: none (Nemotron-H) or RoPE (``cfg.rope_theta`` set)."""
        return (q, k) if self.rope is None else self.rope(q, k, positions)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, ordinal: int):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg, ordinal)
        elif kind == ATTENTION:
            self.mixer = Attention(cfg, ordinal)
        elif kind == MLP_KIND:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        elif kind == MOE:
            self.mixer = MoE(cfg)
        else:
            raise ValueError(f"unsupported layer kind {kind!r}; allowed: M, *, -, E")
        self.stateful = kind in (MAMBA, ATTENTION)
        # mixers whose forward takes the step metadata: the cache owners, and MoE (for its counters)
        self.takes_batch = self.stateful or getattr(self.mixer, "takes_batch", False)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                caches: Caches) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous block's mixer output (the embeddings for the first block, with residual
        None) [T, D] -> (this mixer's output [T, D], residual stream [T, D]). The residual add
        ``residual + h`` happens inside this block's norm kernel instead of as a separate kernel
        at the end of the previous block; the stream is bit-identical to ``h + mixer(norm(h))``."""
        projections = self.mixer.input_projections() if hasattr(self.mixer, "input_projections") else ()
        x, residual = self.norm.add_norm_for(h, residual, projections)
        return (self.mixer(x, fb, caches) if self.takes_batch else self.mixer(x)), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        ordinals = {MAMBA: 0, ATTENTION: 0, MLP_KIND: 0, MOE: 0}
        blocks = []
        for kind in cfg.layer_types:
            if kind not in ordinals:
                raise ValueError(f"unsupported layer kind {kind!r}; allowed: M, *, -, E")
            blocks.append(Block(cfg, kind, ordinals[kind]))
            ordinals[kind] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class NemotronHForCausalLM(HybridCausalLM):
    # loader: these tensors stay float32 whatever the model dtype (the router runs in float32)
    keep_in_fp32 = ("e_score_correction_bias",) + ROUTER_FP32_WEIGHTS
    embedding_name = "backbone.embeddings.weight"
    supports_mtp = True

    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.backbone = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        if with_mtp:                        # loaded from mtp.* tensors; used by the MTP drafter
            from .mtp import MTP
            self.mtp = MTP(cfg)

    def follow(self, fb: ForwardBatch, caches: Caches) -> None:
        """``forward``'s cache writes alone: the blocks up to the last that owns a cache (Mamba
        state or KV), that one only writing its KV if it is an attention block; no later block, no
        final norm. The caches are forward's, bit for bit (the same ops up to the writes)."""
        layers = self.backbone.layers
        last = max((j for j, layer in enumerate(layers) if layer.stateful), default=-1)
        if last < 0:
            return
        h, residual = self.backbone.embeddings(fb.input_ids), None
        for layer in layers[:last]:
            h, residual = layer(h, residual, fb, caches)
        block = layers[last]
        if block.kind == ATTENTION:
            x, _ = block.norm.add_norm_for(h, residual, block.mixer.input_projections())
            block.mixer.write_kv_only(x, fb, caches)
        else:
            block(h, residual, fb, caches)

    def forward(self, fb: ForwardBatch, caches: Caches) -> torch.Tensor:
        """Returns the final-normed hidden states [T, D] of every scheduled token."""
        h, residual = self.backbone.embeddings(fb.input_ids), None     # [T, D]
        for layer in self.backbone.layers:
            h, residual = layer(h, residual, fb, caches)
        return self.backbone.norm_f.add_norm(h, residual)[0]           # last add fused into norm_f

