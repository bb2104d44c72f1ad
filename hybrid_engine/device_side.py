"""What every rank builds: the model (its share of it under tensor parallelism), the caches, the
drafter and the runner with its executor and graphs. ``EngineCore`` builds it on rank 0 and adds
the scheduler and the API side; a tensor-parallel worker (``parallel/worker.py``) builds the same
and runs the steps rank 0 sends it. Ranks agree on the KV cache size (the smallest any rank can
hold) before allocating it, so every rank's caches have the same blocks and slots.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from .attention import KVCache, blocks_needed
from .config import EngineConfig
from .models import build_model
from .models.nemotron_h import Caches
from .quantization.kv_scales import attach_kv_scales, note_unused_kv_scales
from .step.graphs import make_executor
from .step.greedy_graphs import make_greedy_graphs
from .step.spec_graphs import greedy_follower, make_spec_graphs
from .step.runner import ModelRunner
from .spec.adaptive import draft_counts, make_policy
from .spec.drafters import DrafterBuild, drafter_footprint, make_drafter
from hybrid_engine.mamba_cache.checkpoints import MambaCheckpoints
from hybrid_engine.mamba_cache.pool import MambaPool, check_pool_fits

logger = logging.getLogger("hybrid_engine")


def forced_acceptance(cfg: EngineConfig) -> float | None:
    """The benchmark-only forced acceptance rate of the config, or None."""
    return cfg.speculative.forced_acceptance_rate if cfg.speculative else None


@dataclass
class DeviceSide:
    cfg: EngineConfig            # this rank's config: model sizes split by tensor parallelism, its device
    model: object
    caches: Caches
    drafter: object
    runner: ModelRunner
    num_blocks: int              # KV blocks, null block 0 included (the same on every rank)
    max_model_len: int
    max_blocks_per_req: int
    checkpoint_rows: int         # prefix caching: Mamba checkpoint rows (0 when off)
    checkpoint_bytes: int


def rank_config(cfg: EngineConfig, tp) -> EngineConfig:
    """``cfg`` as rank ``tp.rank`` sees it: per-rank model sizes and the rank's device; its
    ``tensor_parallel_size`` is 1 (it describes the rank's own part, which splits no further)."""
    if tp is None:
        return cfg
    from .parallel.sharding import shard_model_config
    return replace(cfg, model=shard_model_config(cfg.model, tp.size), device=tp.device, tensor_parallel_size=1)


def build_device_side(cfg: EngineConfig, tp=None) -> DeviceSide:
    """Build this rank's model, caches, drafter and runner (``tp``: the ``TPGroup``, or None)."""
    local = rank_config(cfg, tp)
    mc, sc, cc = local.model, local.scheduler, local.cache
    with_mtp = cfg.speculative is not None and cfg.speculative.method == "mtp"
    k = cfg.speculative.num_speculative_tokens if cfg.speculative else 0
    n_attn = len(mc.attention_layer_ids)
    try:
        model = build_model(cfg.model, cfg.model_dir, cfg.dtype, local.device, with_mtp=with_mtp,
                            quantization=cfg.quantization, tp=tp)
        num_blocks, error = cc.num_kv_blocks or _blocks_for_budget(local, n_attn), None
        _check_mamba_pool_fits(local, n_attn, num_blocks, k)     # under TP: reported like a build error
    except Exception as e:
        if tp is None:
            raise
        num_blocks, error = 0, e
    if tp is not None:                   # every rank reports; the smallest cache fits them all
        reports = tp.all_gather_object((None if error is None else f"{type(error).__name__}: {error}", num_blocks))
        if error is not None:
            raise error
        failed = [(r, msg) for r, (msg, _) in enumerate(reports) if msg is not None]
        if failed:
            raise RuntimeError(f"tensor-parallel rank {failed[0][0]} failed to build its model: {failed[0][1]}")
        num_blocks = min(n for _, n in reports)
    max_model_len = sc.max_model_len or min(8192, (num_blocks - 1) * cc.block_size - 2 * (1 + k))
    max_blocks = blocks_needed(max_model_len + 3 * (1 + k), cc.block_size) + 1
    kv = KVCache(n_attn, num_blocks, cc.block_size, mc.num_key_value_heads, mc.head_dim, cc.kv_dtype(local.dtype),
                 local.device)
    attach_kv_scales(kv, cfg.model_dir, model)          # FP8: the checkpoint's per-layer scales, else 1.0
    note_unused_kv_scales(cfg)
    # a spec engine defers its verify's state update (one state a slot, not 1+K: CONTRACT item 4b)
    pool = MambaPool(*_pool_args(local, k), local.dtype, local.device, deferred=k > 0)
    caches = Caches(kv, pool)
    if sc.max_num_batched_tokens < 1 + k:
        raise ValueError(f"max_num_batched_tokens={sc.max_num_batched_tokens} must be >= 1 + "
                         f"num_speculative_tokens = {1 + k}")
    prefill_graphs = cfg.prefill_cuda_graphs and tp is None   # the target's, and a draft model's replay
    drafter = make_drafter(DrafterBuild(
        cfg=local, model=model, num_spec=k, max_model_len=max_model_len, max_num_seqs=sc.max_num_seqs,
        block_size=cc.block_size, num_kv_blocks=num_blocks, max_blocks_per_req=max_blocks,
        num_slots=pool.num_slots, prefill_graphs=prefill_graphs,
        checkpoints=cc.enable_prefix_caching))
    rows = row_bytes = 0
    if cc.enable_prefix_caching:
        rows, row_bytes = _attach_checkpoints(local, caches, drafter, num_blocks)
    counts = draft_counts(cfg.speculative, k)          # drafts a step may verify (adaptive: several)
    executor = make_executor(model, caches, local, num_spec=k, max_blocks=max_blocks,
                             max_model_len=max_model_len, block_size=cc.block_size,
                             widths=tuple(1 + c for c in counts),
                             prefill_graphs=prefill_graphs)
    # with speculation, steps that verify no drafts replay the fused greedy graphs when the
    # drafter follows a step inside them (n-gram: its kernel after the argmax)
    greedy_graphs = make_greedy_graphs(executor, num_spec=k, block_size=cc.block_size, max_blocks=max_blocks,
                                       follower=greedy_follower(drafter) if k else None)
    forced = forced_acceptance(cfg)
    # greedy n-gram, MTP and draft-model verify steps replayed whole (prepare + forward + verify + propose);
    # forced acceptance (benchmarks) draws its coins inside them
    spec_graphs = make_spec_graphs(
        executor, drafter, num_spec=k, widths=counts, block_size=cc.block_size, max_blocks=max_blocks,
        max_model_len=max_model_len, forced_acceptance_rate=forced)
    if forced is not None and (tp is None or tp.rank == 0):
        logger.warning("FORCED ACCEPTANCE (benchmark only): each draft is accepted with probability %g "
                       "without verification; outputs are NOT the model's and differ from greedy", forced)
    runner = ModelRunner(model, caches, drafter, executor=executor, greedy_graphs=greedy_graphs,
                         max_num_seqs=sc.max_num_seqs, max_model_len=max_model_len, block_size=cc.block_size,
                         max_blocks=max_blocks, num_spec=k, device=local.device,
                         draft_policy=make_policy(cfg.speculative, k, pool.num_slots,
                                                  counts if executor.widths is not None else None,
                                                  timed=tp is None),
                         forced_acceptance_rate=forced, spec_graphs=spec_graphs)
    return DeviceSide(cfg=local, model=model, caches=caches, drafter=drafter, runner=runner, num_blocks=num_blocks,
                      max_model_len=max_model_len, max_blocks_per_req=max_blocks, checkpoint_rows=rows,
                      checkpoint_bytes=rows * row_bytes)


def _pool_args(cfg: EngineConfig, k: int) -> tuple:
    mc = cfg.model
    return (len(mc.mamba_layer_ids), cfg.scheduler.max_num_seqs, mc.conv_dim, mc.conv_kernel, mc.mamba_num_heads,
            mc.mamba_head_dim, mc.ssm_state_size, k)


def _check_mamba_pool_fits(cfg: EngineConfig, n_attn: int, num_blocks: int, k: int) -> None:
    """On CUDA, a ValueError naming the settings when the Mamba pool cannot fit next to the KV cache
    about to be allocated (memory the allocator holds but does not use counts as free)."""
    if cfg.device.type != "cuda":
        return
    import torch
    mc, cc = cfg.model, cfg.cache
    free = torch.cuda.mem_get_info(cfg.device)[0]
    free += torch.cuda.memory_reserved(cfg.device) - torch.cuda.memory_allocated(cfg.device)
    kv_bytes = num_blocks * KVCache.bytes_per_block(max(n_attn, 1), cc.block_size, mc.num_key_value_heads,
                                                    mc.head_dim, cc.kv_dtype(cfg.dtype))
    pool_bytes = MambaPool.bytes_for(*_pool_args(cfg, k), cfg.dtype, deferred=k > 0)
    check_pool_fits(pool_bytes, free - kv_bytes, max_num_seqs=cfg.scheduler.max_num_seqs, num_spec=k)
    if cc.enable_prefix_caching:         # the checkpoint pool is allocated after both
        ckpt = checkpoint_budget(cfg, kv_bytes)
        left = free - kv_bytes - pool_bytes
        if ckpt > left:
            raise ValueError(
                f"prefix caching's Mamba checkpoint pool needs up to {ckpt / 2**30:.2f} GiB but only "
                f"{left / 2**30:.2f} GiB of device memory are left after the weights, the KV cache and the "
                "Mamba state pool; lower mamba_checkpoint_bytes, or kv_cache_memory_fraction / num_kv_blocks, "
                "or pass enable_prefix_caching=False")


def _blocks_for_budget(cfg: EngineConfig, n_attn: int) -> int:
    """KV blocks that fit the budget once the drafter's own memory is set aside: its fixed bytes
    (a draft model's weights and Mamba pool) and its KV per block id (a draft model indexes its
    own KV cache with the target's block ids, so each block costs target + draft bytes)."""
    mc, cc = cfg.model, cfg.cache
    footprint = drafter_footprint(cfg)
    per_block = (KVCache.bytes_per_block(max(n_attn, 1), cc.block_size, mc.num_key_value_heads, mc.head_dim,
                                         cc.kv_dtype(cfg.dtype)) + footprint.kv_bytes_per_block)
    budget = _kv_budget(cfg) - footprint.fixed_bytes
    if footprint.fixed_bytes:
        logger.info("KV budget: %.1f MiB set aside for the %s drafter, its KV %.1f KiB per block",
                    footprint.fixed_bytes / 2**20, cfg.speculative.method, footprint.kv_bytes_per_block / 1024)
    return max(0, budget // per_block)


def _kv_budget(cfg: EngineConfig) -> int:
    """Bytes for the KV cache. On CUDA: ``kv_cache_memory_fraction`` of free memory less the
    auto-sized checkpoint pool's share (``checkpoint_reserve``), so that turning prefix caching on
    by default leaves the memory beside the budget (activations, CUDA graphs) as it was. On CPU:
    ``kv_cache_bytes`` (the pool then comes beside it)."""
    cc = cfg.cache
    if cfg.device.type == "cuda":
        import torch
        free, _ = torch.cuda.mem_get_info(cfg.device)
        budget = int(free * cc.kv_cache_memory_fraction)
        return budget - checkpoint_reserve(cc, budget, checkpoint_floor_bytes(cfg))
    return cc.kv_cache_bytes


AUTO_CHECKPOINT_MIN_BYTES = 64 * 1024 ** 2
AUTO_CHECKPOINT_MAX_BYTES = 4 * 1024 ** 3
CHECKPOINT_SPARE_ROWS = 16      # the auto pool's rows beyond one per running request (saves in flight)


def auto_checkpoint_bytes(kv_bytes: int, floor_bytes: int = 0) -> int:
    """The Mamba checkpoint pool's default budget (``mamba_checkpoint_bytes=None``): an eighth of the
    KV cache's bytes, at least 64 MiB (small models and small KV pools keep a few rows per
    request), at most 4 GiB; and at least ``floor_bytes`` (``checkpoint_floor_bytes``: a row per
    running request and ``CHECKPOINT_SPARE_ROWS`` more) where that is at most a quarter of the KV
    cache's bytes. The pool always has at least one row, so on a large model with a small KV cache
    a single row can exceed this (an 8B-shape row is ~97 MiB: 12 GiB held 126 rows in
    benchmarks/results/2026-11-25-prefix-cache-8b-h100.md). On CUDA its share is taken out of
    the KV budget before the KV cache is sized (``checkpoint_reserve``)."""
    base = min(AUTO_CHECKPOINT_MAX_BYTES, max(AUTO_CHECKPOINT_MIN_BYTES, kv_bytes // 8))
    return max(base, min(floor_bytes, kv_bytes // 4))


def checkpoint_floor_bytes(cfg: EngineConfig) -> int:
    """The auto pool's floor: ``max_num_seqs + CHECKPOINT_SPARE_ROWS`` rows of the target's
    checkpoint (a draft model's own rows come out of the same bytes, so such an engine gets fewer);
    none when ``num_kv_blocks`` fixes the KV cache (nothing is reserved for the pool then, so a
    larger pool would take memory the user did not plan for).
    Why: each conversation's next turn restores the checkpoint its last turn saved, and saves in
    flight pin rows until their step commits; with fewer rows than that, the checkpoints of
    conversations about to return are evicted, and their misses save more rows (interval and
    divergence saves of the recomputed history), which evicts more. On the 8B shape with MTP the
    eighth-of-KV pool (36 rows) under 32 conversations lost the previous turn's checkpoint in 161
    of 224 turns, and caching on was slower than off; 52 rows lost 14
    (benchmarks/results/2026-11-27-mixed-prefill-graphs-h100.md)."""
    if cfg.cache.num_kv_blocks is not None:
        return 0                    # the user sized the KV cache: the pool stays an eighth of it
    n_mamba, shape = _checkpoint_shape(cfg)
    return (cfg.scheduler.max_num_seqs + CHECKPOINT_SPARE_ROWS) * MambaCheckpoints.bytes_per_row(
        n_mamba, *shape, cfg.dtype)


def _checkpoint_shape(cfg: EngineConfig) -> tuple[int, tuple[int, ...]]:
    """(Mamba layers, (conv dim, conv kernel, heads, head dim, state size)) of a checkpoint row."""
    mc = cfg.model
    return len(mc.mamba_layer_ids), (mc.conv_dim, mc.conv_kernel, mc.mamba_num_heads, mc.mamba_head_dim,
                                     mc.ssm_state_size)


def checkpoint_budget(cfg: EngineConfig, kv_bytes: int) -> int:
    """The checkpoint pool's byte budget: ``mamba_checkpoint_bytes``, or when None
    ``auto_checkpoint_bytes`` of a KV cache of ``kv_bytes`` with its floor."""
    given = cfg.cache.mamba_checkpoint_bytes
    return auto_checkpoint_bytes(kv_bytes, checkpoint_floor_bytes(cfg)) if given is None else given


def checkpoint_reserve(cc, budget: int, floor_bytes: int = 0) -> int:
    """Bytes of a CUDA KV budget set aside for the auto-sized checkpoint pool: what
    ``auto_checkpoint_bytes`` gives the KV cache that is left (an eighth of eight ninths of the
    budget: a ninth of it, within the same bounds; a floor of ``floor_bytes`` where that is at
    most a quarter of what is left: a fifth of the budget), at most half the budget; 0 when
    caching is off, the pool's size is given, or ``num_kv_blocks`` fixes the KV cache. So the pool
    ``_attach_checkpoints`` builds from the KV cache left is what was reserved."""
    if not cc.enable_prefix_caching or cc.mamba_checkpoint_bytes is not None or cc.num_kv_blocks is not None:
        return 0
    return min(budget // 2, auto_checkpoint_bytes(budget // 9 * 8, min(floor_bytes, budget // 5)))


def _attach_checkpoints(cfg: EngineConfig, caches: Caches, drafter, num_blocks: int) -> tuple[int, int]:
    """Prefix caching's checkpoint storage (target and drafter) sized by ``mamba_checkpoint_bytes``
    (None: ``auto_checkpoint_bytes`` of the KV cache, the drafter's KV per block included; at most
    one row per KV block: a checkpoint is only reachable through its blocks) -> (rows, bytes per
    row)."""
    n_mamba, shape = _checkpoint_shape(cfg)
    row_bytes = MambaCheckpoints.bytes_per_row(n_mamba, *shape, cfg.dtype) + drafter.checkpoint_bytes_per_row()
    # the drafter's KV (MTP's attention layers, a draft model's cache) is part of the KV budget that
    # checkpoint_reserve sized the pool's share from: counting the target's alone gave an MTP engine
    # on the 8B shape (4 attention layers + 1 in MTP) 28 rows where the reserve held ~36
    kv_bytes = caches.kv.bytes + num_blocks * drafter_footprint(cfg).kv_bytes_per_block
    rows = max(1, min(checkpoint_budget(cfg, kv_bytes) // max(row_bytes, 1), num_blocks - 1))
    caches.checkpoints = MambaCheckpoints(n_mamba, rows, *shape, cfg.dtype, cfg.device)
    drafter.attach_checkpoints(rows)
    return rows, row_bytes
