"""EngineCore: owns the scheduler, the runner and the caches; runs the step loop.

One step may be in flight: ``begin_step()`` schedules and launches step N+1 and hands back step N's
handle; the caller reads its output (the designated wait: ``result()`` in ``step()``, used by LLM,
or ``await result_async()`` in AsyncLLM's asyncio loop) and ``finish_step()`` commits it. With
``async_scheduling=False`` the handed-back handle is the new step's own. Both give identical tokens.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from .attention import KVCache, blocks_needed
from .config import EngineConfig
from .generation_config import read_generation_config
from .step.graphs import make_executor
from .step.greedy_graphs import make_greedy_graphs
from .step.ngram_graphs import make_ngram_graphs
from .models import build_model
from .models.nemotron_h import Caches
from .outputs import CompletionOutput, RequestOutput
from .scheduling.request import Request
from .step.runner import ModelRunner, StepHandle
from .fault_isolation import FaultIsolation
from .sampling_params import SamplingParams, check_stop_ids
from .sampling.stop_strings import StopStrings
from .sampling.logits_processing import MAX_BAD_WORD_TOKENS, ProcessingSpec
from .scheduling.scheduler import Scheduler
from .spec.adaptive import draft_counts, make_policy
from .spec.drafters import DrafterBuild, drafter_footprint, make_drafter
from hybrid_engine.mamba_cache.checkpoints import MambaCheckpoints
from hybrid_engine.mamba_cache.pool import MambaPool
from .scheduling.prefix_cache import PrefixCache

logger = logging.getLogger("hybrid_engine")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def forced_acceptance(cfg: EngineConfig) -> float | None:
    """The benchmark-only forced acceptance rate of the config, or None."""
    return cfg.speculative.forced_acceptance_rate if cfg.speculative else None


def _load_tokenizer(model_dir: Path):
    present = [model_dir / f for f in _TOKENIZER_FILES if (model_dir / f).exists()]
    if not present:
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:          # corrupt JSON, bad vocab, missing referenced file
        raise ValueError(f"the tokenizer in {model_dir} could not be loaded from "
                         f"{', '.join(str(p) for p in present)}: {type(e).__name__}: {e}") from None


class EngineCore(FaultIsolation):
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        mc, sc, cc = cfg.model, cfg.scheduler, cfg.cache
        t0 = time.perf_counter()
        with_mtp = cfg.speculative is not None and cfg.speculative.method == "mtp"
        # the small files first, so a bad one fails before the weights are read
        self.tokenizer = _load_tokenizer(cfg.model_dir)
        self.generation_defaults = read_generation_config(cfg.model_dir, mc.vocab_size)
        # generation stops on any EOS id of config.json or generation_config.json
        self.eos_token_ids = tuple(dict.fromkeys(mc.eos_token_id + self.generation_defaults.eos_token_ids))
        self.model = build_model(mc, cfg.model_dir, cfg.dtype, cfg.device, with_mtp=with_mtp,
                                 quantization=cfg.quantization)
        k = cfg.speculative.num_speculative_tokens if cfg.speculative else 0
        self.num_spec = k
        n_attn = len(mc.attention_layer_ids)
        num_blocks = cc.num_kv_blocks or self._blocks_for_budget(n_attn)
        self.max_model_len = sc.max_model_len or min(8192, (num_blocks - 1) * cc.block_size - 2 * (1 + k))
        max_blocks = blocks_needed(self.max_model_len + 3 * (1 + k), cc.block_size) + 1
        self.max_blocks_per_req = max_blocks
        kv = KVCache(n_attn, num_blocks, cc.block_size, mc.num_key_value_heads, mc.head_dim, cfg.dtype, cfg.device)
        pool = MambaPool(len(mc.mamba_layer_ids), sc.max_num_seqs, mc.conv_dim, mc.conv_kernel, mc.mamba_num_heads,
                         mc.mamba_head_dim, mc.ssm_state_size, k, cfg.dtype, cfg.device)
        self.caches = Caches(kv, pool)
        if sc.max_num_batched_tokens < 1 + k:
            raise ValueError(f"max_num_batched_tokens={sc.max_num_batched_tokens} must be >= 1 + "
                             f"num_speculative_tokens = {1 + k}")
        self.drafter = make_drafter(DrafterBuild(
            cfg=cfg, model=self.model, num_spec=k, max_model_len=self.max_model_len, max_num_seqs=sc.max_num_seqs,
            block_size=cc.block_size, num_kv_blocks=num_blocks, max_blocks_per_req=max_blocks,
            num_slots=pool.num_slots))
        prefix_cache = self._build_prefix_cache(num_blocks) if cc.enable_prefix_caching else None
        self.scheduler = Scheduler(sc, max_model_len=self.max_model_len, block_size=cc.block_size,
                                   num_kv_blocks=num_blocks, num_slots=pool.num_slots, num_spec=k,
                                   prefix_cache=prefix_cache)
        counts = draft_counts(cfg.speculative, k)          # drafts a step may verify (adaptive: several)
        executor = make_executor(self.model, self.caches, cfg, num_spec=k, max_blocks=max_blocks,
                                 max_model_len=self.max_model_len, block_size=cc.block_size,
                                 widths=tuple(1 + c for c in counts))
        # with speculation, steps that verify no drafts replay the fused greedy graphs when the
        # drafter follows a step from its tokens alone (n-gram: full_context False)
        greedy_graphs = make_greedy_graphs(executor, num_spec=k, block_size=cc.block_size, max_blocks=max_blocks,
                                           drafter_follows_fused=not self.drafter.full_context)
        # greedy n-gram verify steps replayed whole (prepare + forward + verify + propose)
        spec_graphs = None if forced_acceptance(cfg) is not None else make_ngram_graphs(
            executor, self.drafter, num_spec=k, widths=counts, block_size=cc.block_size, max_blocks=max_blocks)
        forced = forced_acceptance(cfg)
        if forced is not None:
            logger.warning("FORCED ACCEPTANCE (benchmark only): each draft is accepted with probability %g "
                           "without verification; outputs are NOT the model's and differ from greedy", forced)
        self.runner = ModelRunner(self.model, self.caches, self.drafter, executor=executor,
                                  greedy_graphs=greedy_graphs, max_num_seqs=sc.max_num_seqs,
                                  max_model_len=self.max_model_len, block_size=cc.block_size,
                                  max_blocks=max_blocks, num_spec=k, device=cfg.device,
                                  draft_policy=make_policy(cfg.speculative, k, pool.num_slots,
                                                           counts if executor.widths is not None else None),
                                  forced_acceptance_rate=forced, spec_graphs=spec_graphs)
        self._seed_rng = np.random.default_rng(cfg.seed)
        self._inflight: StepHandle | None = None
        self._req_counter = 0
        self._stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "requests_finished": 0}
        logger.info("engine ready in %.2fs: %s on %s, KV %d blocks x %d (%.1f MiB), max_model_len %d, K=%d",
                    time.perf_counter() - t0, cfg.dtype, cfg.device, num_blocks, cc.block_size,
                    kv.bytes / 2**20, self.max_model_len, k)

    def _blocks_for_budget(self, n_attn: int) -> int:
        """KV blocks that fit the budget once the drafter's own memory is set aside: its fixed bytes
        (a draft model's weights and Mamba pool) and its KV per block id (a draft model indexes its
        own KV cache with the target's block ids, so each block costs target + draft bytes)."""
        cfg, mc, cc = self.cfg, self.cfg.model, self.cfg.cache
        footprint = drafter_footprint(cfg)
        per_block = (KVCache.bytes_per_block(max(n_attn, 1), cc.block_size, mc.num_key_value_heads, mc.head_dim,
                                             cfg.dtype) + footprint.kv_bytes_per_block)
        budget = self._kv_budget() - footprint.fixed_bytes
        if footprint.fixed_bytes:
            logger.info("KV budget: %.1f MiB set aside for the %s drafter, its KV %.1f KiB per block",
                        footprint.fixed_bytes / 2**20, cfg.speculative.method, footprint.kv_bytes_per_block / 1024)
        return max(0, budget // per_block)

    def _build_prefix_cache(self, num_blocks: int):
        """Checkpoint storage (target and drafter) sized by ``mamba_checkpoint_bytes`` (at most one
        row per KV block: a checkpoint is only reachable through its blocks) -> the scheduler's
        factory of the host-side ``PrefixCache``."""
        mc, cc = self.cfg.model, self.cfg.cache
        spec = self.cfg.speculative
        lookahead = 1 if spec is not None and spec.method == "mtp" else 0   # MTP KV pairs a position with the next token
        shape = (mc.conv_dim, mc.conv_kernel, mc.mamba_num_heads, mc.mamba_head_dim, mc.ssm_state_size)
        n_mamba = len(mc.mamba_layer_ids)
        row_bytes = (MambaCheckpoints.bytes_per_row(n_mamba, *shape, self.cfg.dtype)
                     + self.drafter.checkpoint_bytes_per_row())
        rows = max(1, min(cc.mamba_checkpoint_bytes // max(row_bytes, 1), num_blocks - 1))
        self.caches.checkpoints = MambaCheckpoints(n_mamba, rows, *shape, self.cfg.dtype, self.cfg.device)
        self.drafter.attach_checkpoints(rows)
        self._checkpoint_bytes = rows * row_bytes
        logger.info("prefix caching on: checkpoints every %d blocks, %d rows (%.1f MiB), lookahead %d",
                    cc.mamba_checkpoint_interval, rows, rows * row_bytes / 2**20, lookahead)
        return lambda blocks: PrefixCache(block_size=cc.block_size, interval_blocks=cc.mamba_checkpoint_interval,
                                          lookahead=lookahead, blocks=blocks, num_rows=rows)

    def _kv_budget(self) -> int:
        cc = self.cfg.cache
        if self.cfg.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.cfg.device)
            return int(free * cc.kv_cache_memory_fraction)
        return cc.kv_cache_bytes

    # ---- requests ---------------------------------------------------------------------------
    def make_request(self, prompt, params: SamplingParams | None, request_id: str | None = None) -> Request:
        """Validate and tokenize; raises ValueError (a bad value) or TypeError (a bad type) naming the
        field before anything is queued. ``params=None``: the model's defaults (generation_config.json,
        see generation_config.py)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {type(request_id).__name__}")
        ids = self._tokenize(prompt)
        params = self.generation_defaults.sampling_params(len(ids)) if params is None else params
        params.validate()
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to read the output text, but the model "
                             "folder has none: use stop_token_ids")
        processing = ProcessingSpec.of(params, self.eos_token_ids, self._bad_word_ids(params.bad_words)) \
            if params.processes_logits else None
        check_stop_ids(params, self.cfg.model.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} allows at "
                             f"most {self.max_model_len - 1} so that one token can be generated")
        sched = self.scheduler
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        need = blocks_needed(total + 2 * (1 + self.num_spec), sched.block_size)
        if need > sched.blocks.num_total:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks "
                             f"but the whole cache has {sched.blocks.num_total}: lower max_tokens or enlarge "
                             f"the cache (num_kv_blocks / kv_cache_memory_fraction)")
        if params.n > 1:
            sc = self.cfg.scheduler
            first = blocks_needed(len(ids) + 1 + self.num_spec, sched.block_size)
            if (params.n > sc.max_num_seqs or params.n * (1 + self.num_spec) > sc.max_num_batched_tokens
                    or params.n * first > sched.blocks.num_total):
                raise ValueError(f"SamplingParams.n={params.n} samples cannot run together: allowed at most "
                                 f"max_num_seqs={sc.max_num_seqs}, n * (1 + K) <= max_num_batched_tokens="
                                 f"{sc.max_num_batched_tokens}, and n * {first} blocks within the cache's "
                                 f"{sched.blocks.num_total}")
        if request_id is None:
            request_id = f"req-{self._req_counter}"
        self._req_counter += 1
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**62))
        req = self._new_request(str(request_id), ids, params, seed, processing)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        return req

    def _new_request(self, request_id: str, ids: list[int], params: SamplingParams, seed: int,
                     processing) -> Request:
        req = Request(request_id, ids, params, seed, eos_token_ids=self.eos_token_ids)
        if params.stop:
            req.stop_strings = StopStrings(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                           params.min_tokens)
        req.processing = processing
        if params.logprobs is not None:
            req.output_logprobs = []
        req.metrics.arrival_time = time.perf_counter()
        return req

    def make_requests(self, prompt, params: SamplingParams | None, request_id: str | None = None) -> list[Request]:
        """``make_request`` for ``params.n`` samples: the leader (id ``request_id``) and n - 1
        siblings (``{request_id}#{i}``; seed + i when seeded, else drawn). They share one prefill
        (scheduling/fork.py) when the prompt has >= 2 tokens and the drafter keeps no per-request
        caches of its own (none or n-gram); otherwise each prefills for itself. Prompt logprobs
        belong to the leader. Queue them with ``add_requests``."""
        req = self.make_request(prompt, params, request_id)
        p = req.params
        if p.n == 1:
            return [req]
        group = [req]
        for i in range(1, p.n):
            seed = (p.seed + i) % 2**63 if p.seed is not None else int(self._seed_rng.integers(0, 2**62))
            group.append(self._new_request(f"{req.request_id}#{i}", list(req.prompt_token_ids), p, seed,
                                           req.processing))
        spec = self.cfg.speculative
        if len(req.prompt_token_ids) >= 2 and (spec is None or spec.method == "ngram"):
            req.fork_pending = group[1:]
        return group

    def add_requests(self, group: list[Request]) -> None:
        """Queue a group from ``make_requests`` (a forking leader brings its siblings along)."""
        for req in group[:1] if group[0].fork_pending else group:
            self.scheduler.add_request(req)

    def _bad_word_ids(self, words: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Token sequences of the bad words: each word as written and with a leading space (how it
        reads after another word), deduplicated."""
        if not words:
            return []
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer, but the model folder has none")
        out: dict[tuple[int, ...], None] = {}
        for w in words:
            for spelling in (w, " " + w.lstrip(" ")):
                ids = tuple(self.tokenizer.encode(spelling, add_special_tokens=False))
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise ValueError(f"SamplingParams.bad_words: {w!r} is {len(ids)} tokens; allowed at most "
                                     f"{MAX_BAD_WORD_TOKENS}")
                if ids:
                    out[ids] = None
        return list(out)

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model folder has no tokenizer; pass token ids")
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                       for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise ValueError("prompt must be a str or a list of int token ids (no bools, no floats)")
        if not ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.cfg.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def is_current(self, req: Request) -> bool:
        """``req`` is the request registered under its id (not a finished namesake already forgotten)."""
        return self.scheduler.requests.get(req.request_id) is req

    def requests(self) -> list[Request]:
        """Every request the engine still knows (waiting, running, or finished and not yet forgotten)."""
        return list(self.scheduler.requests.values())

    def has_unfinished(self) -> bool:
        """Some request is waiting or running (the step in flight aside: see ``has_work``)."""
        return self.scheduler.has_unfinished()

    def forget(self, req: Request) -> None:
        """Drop a finished request the caller has read, so its id can be used again."""
        if req.finished and self.scheduler.requests.get(req.request_id) is req:
            self.scheduler.pop_finished(req.request_id)

    def drop_inflight(self) -> None:
        """Forget the step in flight without reading it (the caller shuts down; nothing runs after)."""
        self._inflight = None

    @property
    def inflight(self) -> StepHandle | None:
        """The launched step whose output has not been read yet (async scheduling), else None."""
        return self._inflight

    def take_inflight(self) -> StepHandle | None:
        """Hand the step in flight to a caller that reads and commits it itself (``launch`` /
        ``commit`` driven loops); the engine no longer holds it."""
        handle, self._inflight = self._inflight, None
        return handle

    # ---- the step ---------------------------------------------------------------------------
    def launch(self) -> tuple[StepHandle | None, list[Request]]:
        """Schedule and launch one step; returns its handle and requests failed by it (a fault in
        any phase ends only that step's requests: fault_isolation.py)."""
        if not self.scheduler.has_unfinished():
            return None, []
        try:
            sched = self.scheduler.schedule()
        except BaseException as e:
            failed = self.fail_schedule(e)
            if not isinstance(e, Exception):
                raise
            return None, failed
        if not sched.rows:                 # nothing runs: its removals must reach the next step
            self.scheduler.requeue_removed(sched.removed_req_ids)
            return None, []
        self._stats["steps"] += 1
        try:
            return self.runner.execute(sched), []
        except BaseException as e:         # fail this step's requests, keep serving the others
            failed = self.fail_launch(sched, e)
            if not isinstance(e, Exception):
                raise                      # KeyboardInterrupt & co: cleaned up, then passed on
            logger.exception("step %d failed", sched.step_id)
            return None, failed

    def commit(self, handle: StepHandle, out) -> list[Request]:
        return self.scheduler.update_from_output(handle.sched, out)

    def begin_step(self) -> tuple[StepHandle | None, list[Request]]:
        """Launch the next step; return the handle whose output must be read now, and the requests
        failed at launch.

        Async scheduling: the returned handle is the previous step's (the new one stays in flight,
        so the device works on step N+1 while the host reads step N). Sync: it is the new step's own.
        Read its output (``handle.result()`` or ``await handle.result_async()``) and pass it to
        ``finish_step``. ``step()`` (LLM) and the asyncio loop (AsyncLLM) both use this pair.
        """
        cur, failed = self.launch()
        if self.cfg.async_scheduling:
            wait, self._inflight = self._inflight, cur
        else:
            wait = cur
        faulted, self._step_faulted = self._step_faulted, False   # a fault is no lack of progress
        if wait is None and cur is None and not failed and not faulted and self.scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress (cache too small for any waiting request?)")
        return wait, failed

    def finish_step(self, handle: StepHandle | None, out=None, failed: list[Request] | None = None,
                    error: BaseException | None = None) -> list[Request]:
        """Commit the output of ``handle`` (from ``begin_step``); returns the requests that got
        tokens, finished or failed. ``error``: reading the output raised; its requests fail, and
        so do they when the commit itself raises (fault_isolation.py)."""
        touched = list(failed or ())
        if handle is None:
            return touched
        if error is None:
            try:
                touched += self.fail_nonfinite(handle, out)
                touched += self.commit(handle, out)
                return touched
            except BaseException as e:
                touched += self.fail_step(handle, e)
                if not isinstance(e, Exception):
                    raise
                return touched
        return touched + self.fail_step(handle, error)

    def step(self) -> list[Request]:
        """One loop iteration (blocking). Returns requests with new tokens or finished."""
        handle, failed = self.begin_step()
        if handle is None:
            return self.finish_step(None, None, failed)
        try:
            out = handle.result()
        except Exception as e:              # the step's requests fail; the others keep running
            return self.finish_step(handle, None, failed, error=e)
        return self.finish_step(handle, out, failed)

    # ---- outputs ----------------------------------------------------------------------------
    def make_output(self, req: Request, delta_from: int = 0) -> RequestOutput:
        ids = req.output_token_ids[delta_from:]
        strings = req.stop_strings
        if strings is not None and delta_from == 0:     # the text the stop-string search cut
            text = strings.visible_text(req.finished, req.output_token_ids)
        else:
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
        if req.finished:
            self._account(req)
        m = req.metrics
        metrics = {"drafts_proposed": m.drafts_proposed, "drafts_accepted": m.drafts_accepted,
                   "accepted_per_position": list(m.accepted_per_position),
                   "mean_acceptance_length": m.mean_acceptance_length, "num_steps": m.num_steps,
                   "num_preemptions": m.num_preemptions,
                   "arrival_time": m.arrival_time, "first_token_time": m.first_token_time,
                   "finish_time": m.finish_time}
        return RequestOutput(req.request_id, list(req.prompt_token_ids),
                             [CompletionOutput(0, list(ids), text, req.finish_reason,
                                               strings.matched if strings is not None else None,
                                               None if req.output_logprobs is None
                                               else req.output_logprobs[delta_from:])], req.finished,
                             metrics, req.error,
                             prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None
                             and delta_from == 0 else None, num_cached_tokens=req.num_cached_tokens)

    def _account(self, req: Request) -> None:
        if req.accounted:
            return
        req.accounted = True
        s = self._stats
        s["requests_finished"] += 1
        s["prompt_tokens"] += len(req.prompt_token_ids)
        s["generated_tokens"] += len(req.output_token_ids)
        m = req.metrics
        s["drafts_proposed"] = s.get("drafts_proposed", 0) + m.drafts_proposed
        s["drafts_accepted"] = s.get("drafts_accepted", 0) + m.drafts_accepted
        s["verify_steps"] = s.get("verify_steps", 0) + m.num_steps
        per = s.setdefault("accepted_per_position", [0] * self.num_spec)
        for j, a in enumerate(m.accepted_per_position):
            per[j] += a

    def occupancy(self) -> dict:
        """Host-side load: running / waiting request counts and free / total KV blocks and Mamba
        slots (no device read; cheap enough to call per request)."""
        sched = self.scheduler
        return {"num_requests_running": len(sched.running), "num_requests_waiting": len(sched.waiting),
                "free_slots": sched.slots.num_free, "total_slots": sched.slots.num_total,
                "free_blocks": sched.blocks.num_free, "total_blocks": sched.blocks.num_total}

    def stats(self, expert_load: bool = True) -> dict:
        """Counters since start (steps, tokens, drafts), ``occupancy()``, and with ``expert_load``
        the MoE routing counts since the previous such call (a device read that clears them)."""
        s = dict(self._stats)
        s.setdefault("drafts_proposed", 0)
        s.setdefault("drafts_accepted", 0)
        s["acceptance_rate"] = s["drafts_accepted"] / s["drafts_proposed"] if s["drafts_proposed"] else 0.0
        steps = s.get("verify_steps", 0)
        s["mean_acceptance_length"] = (1 + s["drafts_accepted"] / steps) if steps else 0.0
        s.update(self.occupancy())
        s.update(self.scheduler.prefix.stats())
        if self.cfg.cache.enable_prefix_caching:
            s["mamba_checkpoint_bytes"] = self._checkpoint_bytes
        if expert_load:
            load = self.model.read_expert_load()      # device counters, cleared: a window per call
            if load:
                s["moe_expert_tokens"] = load
        return s
