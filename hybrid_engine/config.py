"""Frozen configuration dataclasses.

ModelConfig is read from a transformers-style ``config.json``: ``nemotron_h`` (see
``hybrid_engine/_config_parse.py`` for the accepted spellings) or another Mamba2 hybrid whose
config adapter is registered in ``hybrid_engine/models/families.py``. CacheConfig, SchedulerConfig,
SpeculativeConfig (``speculative_config.py``, imported here) and EngineConfig validate themselves
in ``__post_init__``; every error is a ``ValueError`` naming the field, the bad value and what is
allowed (integers: ``_validate.check_int``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._validate import check_int as _check_int
from .device_dtype import resolve_device, resolve_dtype  # noqa: F401 (also the public names here)
from .quantization.config import QuantConfig, resolve_quantization
from .speculative_config import SpeculativeConfig

# Layer kinds, one character each, as in ``hybrid_override_pattern``; HYBRID is a layer holding a
# Mamba2 mixer and an attention in parallel (Falcon-H1): it owns one Mamba state and one KV cache.
MAMBA, ATTENTION, MLP, MOE, HYBRID = "M", "*", "-", "E", "H"


@dataclass(frozen=True)
class ModelConfig:
    layer_types: tuple[str, ...]          # one of MAMBA/ATTENTION/MLP/MOE per block
    vocab_size: int
    hidden_size: int
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # MLP
    intermediate_size: int
    mlp_hidden_act: str = "relu2"
    # Mamba2
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    n_groups: int = 8
    ssm_state_size: int = 128
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    time_step_min: float = 0.001
    # MoE
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    moe_latent_size: int | None = None
    # MTP
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = (ATTENTION, MOE)
    # misc
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = (2,)
    torch_dtype: str | None = None        # dtype recorded in config.json, used by dtype="auto"
    # added by the config parser (defaults = transformers' NemotronHConfig defaults)
    mlp_bias: bool = False                # bias on MLP / expert up_proj and down_proj
    mamba_hidden_act: str = "silu"        # activation after the Mamba conv
    # other families (set by their config adapters, models/families.py; defaults = Nemotron-H)
    model_type: str = "nemotron_h"
    attention_bias: bool = False          # bias on q/k/v/o_proj
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    rope_theta: float | None = None       # RoPE base; None: no positional encoding (Nemotron-H)
    rotary_dim: int = 0                   # leading dims of each head RoPE rotates (partial rotary)
    moe_router: str = "sigmoid"           # "sigmoid" (Nemotron-H) | "softmax" (softmax of the top-k logits)
    moe_activation: str = "relu2"         # routed experts: "relu2" | "swiglu" (up [E, 2F, D]: gate rows first)
    family: object = None                 # the family's own frozen settings (multipliers, ...), or None
    # how the checkpoint stores its weights (None: 16/32-bit); see hybrid_engine.quantization
    quantization: "QuantConfig | None" = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_intermediate(self) -> int:   # I = H * P
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:             # I + 2 G N
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t in (MAMBA, HYBRID))

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t in (ATTENTION, HYBRID))

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Parse a config.json dict (transformers 5 form or the published legacy form)."""
        from hybrid_engine._config_parse import model_config_kwargs
        return cls(**model_config_kwargs(d))

    @classmethod
    def from_json(cls, path) -> "ModelConfig":
        """Read ``path`` (a config.json file or the model folder holding one)."""
        from hybrid_engine._config_parse import read_config_json
        from hybrid_engine.quantization.config import merge_hf_quant_config
        d = read_config_json(path)
        folder = Path(path).expanduser()
        return cls.from_dict(merge_hf_quant_config(d, folder if folder.is_dir() else folder.parent))


# --------------------------------------------------------------------------- engine-side configs

# LLM(kv_cache_dtype=...) -> how K and V are stored: None = the model dtype; float8_e4m3fn = FP8 codes
# with one float32 scale per attention layer for K and one for V (attention/kv_cache.py)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing and storage. ``num_kv_blocks=None`` sizes the pool automatically: from
    ``kv_cache_memory_fraction`` of free GPU memory on CUDA, from ``kv_cache_bytes`` on CPU.
    ``kv_cache_dtype``: "auto" (K and V in the model dtype) or "fp8" / "fp8_e4m3" (float8_e4m3fn
    codes and a float32 scale per attention layer for K and for V: the checkpoint's ``k_scale`` /
    ``v_scale`` when it stores them, else 1.0). The target's, the MTP block's and a draft model's
    KV caches all use it; the Mamba conv / SSM state is not affected."""
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.5
    kv_cache_bytes: int = 256 * 1024 * 1024
    kv_cache_dtype: str = "auto"
    # prefix caching (docs/design.md, "Prefix caching"): KV blocks shared by hash chain, Mamba
    # checkpoints every ``mamba_checkpoint_interval`` blocks (and at each prompt's last full
    # block) in a pool of at most ``mamba_checkpoint_bytes`` (None: an eighth of the KV cache's
    # bytes with the drafter's KV, 64 MiB to 4 GiB, at least max_num_seqs + 16 rows within a quarter of
    # the KV; on CUDA its share comes out of the KV budget: device_side's auto_checkpoint_bytes,
    # checkpoint_floor_bytes and checkpoint_reserve)
    enable_prefix_caching: bool = True
    mamba_checkpoint_interval: int = 64
    mamba_checkpoint_bytes: int | None = None

    def __post_init__(self):
        _check_int("block_size", self.block_size, 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {type(self.enable_prefix_caching).__name__}")
        _check_int("mamba_checkpoint_interval", self.mamba_checkpoint_interval, 1,
                   allowed="an integer >= 1 (blocks between Mamba checkpoints)")
        if self.mamba_checkpoint_bytes is not None:
            _check_int("mamba_checkpoint_bytes", self.mamba_checkpoint_bytes, 1,
                       allowed="None (auto: an eighth of the KV cache, 64 MiB to 4 GiB, at least max_num_seqs + 16 rows) "
                               "or an integer >= 1")
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 2,
                       allowed="None (auto) or an integer >= 2 (block 0 is the null block)")
        f = self.kv_cache_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0.0 < f <= 1.0):
            raise ValueError(f"kv_cache_memory_fraction must be a number in (0, 1], got {f!r}")
        _check_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {self.kv_cache_dtype!r}")

    @property
    def kv_fp8(self) -> bool:
        """True when K and V are stored as FP8 codes with per-layer scales."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] is not None

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's storage dtype for a model running in ``model_dtype``."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None      # None: no limit beyond the KV cache capacity

    def __post_init__(self):
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1, allowed="None or an integer >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    async_scheduling: bool = True
    seed: int = 0
    enforce_eager: bool = False
    # CUDA graphs for steps of one prefill row (step/prefill_graphs.py); CUDA graphs only
    prefill_cuda_graphs: bool = True
    # the quantization the model runs with (the checkpoint's, or one applied at load); None: none
    quantization: QuantConfig | None = None
    # ranks the model is split over (parallel/): one process per rank, rank 0 in this process
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a SpeculativeConfig or None, "
                             f"got {type(self.speculative).__name__}")
        if (self.speculative is not None and self.speculative.method == "mtp"
                and self.model.num_nextn_predict_layers < 1):
            raise ValueError("speculative method 'mtp' needs a model with MTP layers "
                             "(num_nextn_predict_layers >= 1 in config.json), this model has none")
        _check_int("seed", self.seed, 0)
        if not isinstance(self.prefill_cuda_graphs, bool):
            raise TypeError(f"prefill_cuda_graphs must be a bool, got {self.prefill_cuda_graphs!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.speculative is not None and self.speculative.draft_vocab_size is not None:
            self._check_draft_vocab(self.speculative.draft_vocab_size)
        if self.speculative is not None and self.speculative.quantization is not None:
            self._check_draft_quantization(self.speculative.quantization)
        if self.speculative is not None and self.speculative.adaptive_step_cost and self.tensor_parallel_size > 1:
            raise ValueError("adaptive_step_cost needs tensor_parallel_size 1 (every rank must choose the same "
                             "widths, and timings differ between ranks), "
                             f"got tensor_parallel_size={self.tensor_parallel_size}")
        if self.cache.kv_fp8:
            self._check_fp8_kv_cache()
        if self.tensor_parallel_size > 1:
            from .parallel.sharding import shard_model_config
            shard_model_config(self.model, self.tensor_parallel_size)     # ValueError naming the field
            if self.device.type == "cuda":
                first = self.device.index or 0
                if first + self.tensor_parallel_size > torch.cuda.device_count():
                    raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs GPUs "
                                     f"{first}..{first + self.tensor_parallel_size - 1} but "
                                     f"{torch.cuda.device_count()} are visible")

    def _check_draft_vocab(self, rows: int) -> None:
        if rows > self.model.vocab_size:
            raise ValueError(f"draft_vocab_size must be at most the model's vocab_size ({self.model.vocab_size}), "
                             f"got {rows}")
        if self.tensor_parallel_size > 1:
            raise ValueError("draft_vocab_size needs tensor_parallel_size 1 (the lm_head is split by vocabulary "
                             f"rows over the ranks), got tensor_parallel_size={self.tensor_parallel_size}")

    def _check_draft_quantization(self, name: str) -> None:
        """FP8 drafter weights pay off only through the FP8 decode kernels: on CUDA they need a GPU
        with float8 conversions. Any engine dtype works: the kernels read bfloat16, float16 or
        float32 rows (a float32 engine's drafter then reads a quarter of its bytes). CPU runs the
        dequantizing reference (tests)."""
        if self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config.quantization={name!r} needs tensor_parallel_size 1, "
                             f"got tensor_parallel_size={self.tensor_parallel_size}")
        if self.device.type != "cuda":
            return
        from .quantization.config import MIN_CUDA_CAPABILITY
        cap = torch.cuda.get_device_capability(self.device)
        if cap < MIN_CUDA_CAPABILITY:
            raise ValueError(f"speculative_config.quantization={name!r} needs a GPU with float8 support (compute "
                             f"capability >= {MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]}); "
                             f"{torch.cuda.get_device_name(self.device)} has {cap[0]}.{cap[1]}")

    def _check_fp8_kv_cache(self) -> None:
        """An FP8 KV cache needs float8 conversions on the device (the attention kernel reads the
        codes), and a checkpoint whose KV scales describe FP8 (or none)."""
        from .quantization.config import MIN_CUDA_CAPABILITY
        name = self.cache.kv_cache_dtype
        if self.device.type == "cuda":
            cap = torch.cuda.get_device_capability(self.device)
            if cap < MIN_CUDA_CAPABILITY:
                raise ValueError(f"kv_cache_dtype={name!r} needs a GPU with float8 support (compute capability "
                                 f">= {MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]}, Ada or Hopper); "
                                 f"{torch.cuda.get_device_name(self.device)} has {cap[0]}.{cap[1]}; "
                                 "use kv_cache_dtype='auto'")
        from .quantization.kv_scales import check_fp8_scale_format
        check_fp8_scale_format(self.model.quantization, name)

    @classmethod
    def resolve(cls, model, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
                max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                max_model_len: int | None = None, block_size: int = 16,
                num_kv_blocks: int | None = None, kv_cache_memory_fraction: float = 0.5,
                kv_cache_bytes: int = 256 * 1024 * 1024,
                enable_prefix_caching: bool = True, mamba_checkpoint_interval: int = 64,
                mamba_checkpoint_bytes: int | None = None,
                speculative_config: SpeculativeConfig | None = None,
                async_scheduling: bool = True, seed: int = 0,
                enforce_eager: bool = False, quantization: str | None = None,
                kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                prefill_cuda_graphs: bool = True) -> "EngineConfig":
        """Build an EngineConfig from user-level arguments (as ``LLM(...)`` takes them). ``model``
        is a local folder or a Hugging Face Hub repo id (see ``hybrid_engine.hub``). ``quantization``:
        None (the checkpoint's own, if any), "fp8" / "nvfp4" (quantize a 16/32-bit checkpoint at load,
        or confirm a stored one), "modelopt" (require the checkpoint's); see
        ``hybrid_engine.quantization.config.resolve_quantization``. ``kv_cache_dtype``: "auto" (K and V
        in the model dtype; a checkpoint's FP8 KV scales are then unused, as in vLLM) or "fp8" /
        "fp8_e4m3" (float8_e4m3fn K and V with per-layer scales: the checkpoint's ``k_scale`` /
        ``v_scale``, else 1.0; see ``CacheConfig``). ``tensor_parallel_size``: ranks the model is
        split over (``hybrid_engine.parallel``; one GPU each on CUDA, processes sharing the CPU else).
        ``prefill_cuda_graphs``: replay CUDA graphs for prefill-only steps of one request of up to
        2048 tokens (the time to first token of a request arriving at an idle engine; captured the
        first time each padded size is seen); off, or with ``enforce_eager``, they run eagerly."""
        # the cache arguments are checked first: a bad one fails before the model is looked up
        cache = CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                            kv_cache_memory_fraction=kv_cache_memory_fraction,
                            kv_cache_bytes=kv_cache_bytes, enable_prefix_caching=enable_prefix_caching,
                            mamba_checkpoint_interval=mamba_checkpoint_interval,
                            mamba_checkpoint_bytes=mamba_checkpoint_bytes, kv_cache_dtype=kv_cache_dtype)
        from .hub import resolve_model_dir
        model_dir = resolve_model_dir(model)
        model_cfg = ModelConfig.from_json(model_dir)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, model_cfg, dev)
        return cls(
            model_dir=model_dir, model=model_cfg, cache=cache,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            speculative=speculative_config, dtype=dt, device=dev,
            async_scheduling=bool(async_scheduling), seed=seed, enforce_eager=bool(enforce_eager),
            prefill_cuda_graphs=prefill_cuda_graphs,
            quantization=resolve_quantization(quantization, model_cfg.quantization, dev, dt),
            tensor_parallel_size=tensor_parallel_size)
