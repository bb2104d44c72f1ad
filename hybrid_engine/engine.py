"""EngineCore: owns the scheduler, the runner and the caches; runs the step loop.

One step may be in flight: ``begin_step()`` schedules and launches step N+1 and hands back step N's
handle; the caller reads its output (the designated wait: ``result()`` in ``step()``, used by LLM,
or ``await result_async()`` in AsyncLLM's asyncio loop) and ``finish_step()`` commits it. With
``async_scheduling=False`` the handed-back handle is the new step's own. Both give identical tokens.
"""
from __future__ import annotations

import logging
import time
import weakref

import numpy as np

from .attention import blocks_needed
from .config import EngineConfig
from .device_side import build_device_side
from .generation_config import read_generation_config
from .outputs import CompletionOutput, RequestOutput
from .prompt_inputs import bad_word_ids, load_tokenizer, prompt_token_ids
from .parallel import start_tensor_parallel
from .scheduling.request import Request
from .step.runner import StepHandle
from .fault_isolation import FaultIsolation, is_fatal
from .sampling_params import SamplingParams, check_stop_ids
from .sampling.stop_strings import StopStrings
from .sampling.logits_processing import ProcessingSpec
from .scheduling.scheduler import Scheduler
from .scheduling.prefix_cache import PrefixCache

logger = logging.getLogger("hybrid_engine")


def _zero_stats() -> dict:
    return {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "requests_finished": 0}


class EngineCore(FaultIsolation):
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        mc, sc, cc = cfg.model, cfg.scheduler, cfg.cache
        t0 = time.perf_counter()
        # the small files first, so a bad one fails before the weights are read
        self.tokenizer = load_tokenizer(cfg.model_dir)
        self.generation_defaults = read_generation_config(cfg.model_dir, mc.vocab_size)
        # generation stops on any EOS id of config.json or generation_config.json
        self.eos_token_ids = tuple(dict.fromkeys(mc.eos_token_id + self.generation_defaults.eos_token_ids))
        self.tp = start_tensor_parallel(cfg)        # None, or rank 0 of the group with its workers started
        if self.tp is not None:                     # workers stop when the engine is dropped or at exit
            weakref.finalize(self, self.tp.shutdown)
        try:
            side = build_device_side(cfg, None if self.tp is None else self.tp.group)
        except BaseException:
            self.shutdown()
            raise
        self.model, self.caches, self.drafter = side.model, side.caches, side.drafter
        k = cfg.speculative.num_speculative_tokens if cfg.speculative else 0
        self.num_spec = k
        num_blocks, self.max_model_len, self.max_blocks_per_req = side.num_blocks, side.max_model_len, \
            side.max_blocks_per_req
        self._checkpoint_bytes = side.checkpoint_bytes
        prefix_cache = self._prefix_cache_factory(side) if cc.enable_prefix_caching else None
        self.scheduler = Scheduler(sc, max_model_len=self.max_model_len, block_size=cc.block_size,
                                   num_kv_blocks=num_blocks, num_slots=side.caches.mamba.num_slots, num_spec=k,
                                   prefix_cache=prefix_cache)
        # the engine's only use of the runner: execute(sched) and reset(); under tensor
        # parallelism the same calls reach every rank (parallel/worker.py)
        self.runner = side.runner if self.tp is None else self.tp.runner(side.runner)
        kv = side.caches.kv
        self._seed_rng = np.random.default_rng(cfg.seed)
        self._inflight: StepHandle | None = None
        self._req_counter = 0
        self._stats = _zero_stats()
        logger.info("engine ready in %.2fs: %s on %s, KV %d blocks x %d in %s (%.1f MiB), max_model_len %d, K=%d",
                    time.perf_counter() - t0, cfg.dtype, cfg.device, num_blocks, cc.block_size, kv.dtype,
                    kv.bytes / 2**20, self.max_model_len, k)

    def _prefix_cache_factory(self, side):
        """The scheduler's factory of the host-side ``PrefixCache`` over the checkpoint rows the
        device side allocated."""
        cc = self.cfg.cache
        spec = self.cfg.speculative
        lookahead = 1 if spec is not None and spec.method == "mtp" else 0   # MTP KV pairs a position with the next token
        rows = side.checkpoint_rows
        logger.info("prefix caching on: checkpoints every %d blocks, %d rows (%.1f MiB), lookahead %d",
                    cc.mamba_checkpoint_interval, rows, side.checkpoint_bytes / 2**20, lookahead)
        return lambda blocks: PrefixCache(block_size=cc.block_size, interval_blocks=cc.mamba_checkpoint_interval,
                                          lookahead=lookahead, blocks=blocks, num_rows=rows)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (nothing to do on one
        device). Idempotent; the engine serves no step afterwards."""
        tp = getattr(self, "tp", None)
        if tp is not None:
            tp.shutdown()

    # ---- requests ---------------------------------------------------------------------------
    def make_request(self, prompt, params: SamplingParams | None, request_id: str | None = None) -> Request:
        """Validate and tokenize; raises ValueError (a bad value) or TypeError (a bad type) naming the
        field before anything is queued. ``params=None``: the model's defaults (generation_config.json,
        see generation_config.py)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {type(request_id).__name__}")
        ids = prompt_token_ids(prompt, self.tokenizer, self.cfg.model.vocab_size)
        params = self.generation_defaults.sampling_params(len(ids)) if params is None else params
        params.validate()
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to read the output text, but the model "
                             "folder has none: use stop_token_ids")
        processing = ProcessingSpec.of(params, self.eos_token_ids, bad_word_ids(params.bad_words, self.tokenizer)) \
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
            if is_fatal(e):
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
            if is_fatal(e):
                raise                      # KeyboardInterrupt & co, a lost rank: cleaned up, then passed on
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
                if is_fatal(e):
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
            touched = self.finish_step(handle, None, failed, error=e)
            if is_fatal(e):
                raise
            return touched
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

    @property
    def prefill_graphs(self):
        """The target's prefill CUDA graphs (``step/prefill_graphs.PrefillGraphs``), or None (CPU,
        ``enforce_eager``, ``prefill_cuda_graphs=False``, tensor parallelism)."""
        return None if self.tp is not None else self.runner.executor.prefill

    def occupancy(self) -> dict:
        """Host-side load: running / waiting request counts and free / total KV blocks and Mamba
        slots (no device read; cheap enough to call per request)."""
        sched = self.scheduler
        return {"num_requests_running": len(sched.running), "num_requests_waiting": len(sched.waiting),
                "free_slots": sched.slots.num_free, "total_slots": sched.slots.num_total,
                "free_blocks": sched.blocks.num_free, "total_blocks": sched.blocks.num_total}

    def reset_stats(self) -> None:
        """Counters back to zero (after a warm-up, ``warmup.py``): steps, tokens and drafts, the
        prefix cache's queries and hits, the MoE routing counts."""
        self._stats = _zero_stats()
        self.scheduler.prefix.reset_counters()
        self.model.read_expert_load()                 # a device read that clears them

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
