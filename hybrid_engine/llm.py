"""Offline API: ``LLM(model=...).generate(prompts, params)``."""
from __future__ import annotations

import time
from typing import Sequence

from tqdm.auto import tqdm

from .config import EngineConfig
from .engine import EngineCore
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


def build_engine(model=None, **engine_args) -> EngineCore:
    """An EngineCore from user-level arguments: those of ``EngineConfig.resolve`` (dtype, device,
    max_num_seqs, max_num_batched_tokens, max_model_len, speculative_config, async_scheduling, seed,
    block_size, num_kv_blocks, kv_cache_memory_fraction, kv_cache_bytes, enable_prefix_caching,
    mamba_checkpoint_interval, mamba_checkpoint_bytes, enforce_eager, quantization, kv_cache_dtype,
    tensor_parallel_size, prefill_cuda_graphs). ``kv_cache_dtype``: "auto" (K and V in the model dtype) or "fp8" /
    "fp8_e4m3" (float8_e4m3fn with per-layer K and V scales: the checkpoint's, else 1.0).
    ``model=None`` uses the embedded default model."""
    if model is None:
        from .default_model import default_model_dir
        model = default_model_dir()
    return EngineCore(EngineConfig.resolve(model, **engine_args))


class _Progress:
    """The ``generate`` progress bar: requests finished / total, and live input and output tokens/s
    (input: prompt tokens of requests that produced a token; output: tokens generated so far), as
    vLLM's. It reads only host-side request fields (committed token lists, status), at most every
    ``REFRESH_S`` seconds, so the step loop pays one clock read per step."""

    REFRESH_S = 0.1

    def __init__(self, reqs):
        self.reqs = reqs
        self.bar = tqdm(total=len(reqs), desc="Processed prompts", unit="req")
        self.t0 = self._next = time.perf_counter()
        self.done = 0

    def poll(self, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now < self._next:
            return
        self._next = now + self.REFRESH_S
        done = n_in = n_out = 0
        for r in self.reqs:
            k = len(r.output_token_ids)
            done += r.finished
            n_out += k
            n_in += len(r.prompt_token_ids) if (k or r.finished) else 0
        dt = max(now - self.t0, 1e-9)
        self.bar.set_postfix_str(f"input: {n_in / dt:.1f} toks/s, output: {n_out / dt:.1f} toks/s", refresh=False)
        if done > self.done:
            self.bar.update(done - self.done)     # redraws with the new postfix
        else:
            self.bar.refresh()
        self.done = done

    def close(self) -> None:
        self.bar.close()


class LLM:
    """Batch generation (docs/design.md, "Public API"). Arguments: see ``build_engine``."""

    def __init__(self, model=None, **engine_args):
        self.engine = build_engine(model, **engine_args)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device; they also stop when the
        LLM is garbage-collected or the interpreter exits). The LLM generates nothing afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every prompt is validated before any is queued."""
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                              and all(isinstance(t, int) for t in prompts))
        prompt_list = [prompts] if single else list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompt_list):
                raise ValueError(f"params has {len(params)} entries but there are {len(prompt_list)} "
                                 f"prompts; pass one SamplingParams or one per prompt")
            param_list = list(params)
        else:
            param_list = [params] * len(prompt_list)
        eng = self.engine
        groups = [eng.make_requests(p, sp) for p, sp in zip(prompt_list, param_list)]   # n samples each
        reqs = [r for g in groups for r in g]
        for g in groups:
            eng.add_requests(g)
        progress = _Progress(reqs) if use_tqdm else None
        try:
            while eng.has_work():
                eng.step()
                if progress is not None:
                    progress.poll()
            if progress is not None:
                progress.poll(final=True)
        except BaseException as e:          # KeyboardInterrupt, or the loop itself broke
            _abandon(eng, reqs, e)
            raise
        finally:
            if progress is not None:
                progress.close()
        outs = [group_output([_output(eng, r) for r in g]) for g in groups]
        for r in reqs:
            eng.forget(r)
        return outs

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (generation_config.json over ``SamplingParams()``); what a
        request with ``params=None`` uses. ``dataclasses.replace`` it to change a field."""
        return self.engine.generation_defaults.sampling_params()

    def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` dicts) or to a list of
        them; one RequestOutput per conversation. The prompt is the tokenizer's own chat template
        applied to the messages (``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``, go
        to the template). Everything is validated before anything is queued."""
        from .chat import conversations_of, render_chat
        convs = conversations_of(messages)
        prompts = [render_chat(self.tokenizer, c, chat_template_kwargs, add_generation_prompt) for c in convs]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        return self.engine.stats()


def _abandon(eng: EngineCore, reqs, error: BaseException) -> None:
    """``generate`` is leaving early: abort its unfinished requests (they must not run silently
    during the next call) and forget them; with nothing left running, the step in flight is
    dropped too (nobody will read it)."""
    for r in reqs:
        if eng.abort(r.request_id):
            r.error = f"generate() was interrupted by {error!r}"
        eng.forget(r)
    if not eng.has_unfinished():
        eng.drop_step_state()


def _output(eng: EngineCore, req) -> RequestOutput:
    """The request's output; if building it raises (e.g. the tokenizer fails on its ids), the
    request alone reports the error, with its tokens and no text."""
    try:
        return eng.make_output(req)
    except Exception as e:
        return error_output(req, f"building the output failed: {e!r}", 0)


def group_output(parts: list[RequestOutput]) -> RequestOutput:
    """The outputs of one prompt's n samples as one RequestOutput (``outputs[i]`` sample i, under
    the leader's id, metrics and prompt logprobs; finished when all are; the first error)."""
    if len(parts) == 1:
        return parts[0]
    lead = parts[0]
    outputs = []
    for i, p in enumerate(parts):
        c = p.outputs[0]
        c.index = i
        outputs.append(c)
    return RequestOutput(lead.request_id, lead.prompt_token_ids, outputs, all(p.finished for p in parts),
                         lead.metrics, next((p.error for p in parts if p.error is not None), None),
                         prompt_logprobs=lead.prompt_logprobs)


def error_output(req, message: str, delta_from: int) -> RequestOutput:
    """A final RequestOutput (tokens from ``delta_from`` on, no text) for a request whose output
    could not be built normally."""
    return RequestOutput(req.request_id, list(req.prompt_token_ids),
                         [CompletionOutput(0, list(req.output_token_ids[delta_from:]), None, "error")], True, {},
                         message)
