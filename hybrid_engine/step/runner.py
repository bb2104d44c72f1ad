"""Model runner: one step as a list of phases (docs/design.md, "The step as phases").

    update batch -> choose plan -> prepare -> forward -> [process logits] -> sample/verify
    -> [record processed outputs] -> propose -> finish (D2H)

``execute`` launches one step's device work and returns a handle at once; the only wait is the
caller's, on the handle, one step later. The route a step takes (greedy graph, decode-only, mixed
prefill/decode) is chosen once, by the first plan that ``applies`` (``step/plans/``); whether the
decode rows sample or verify drafts is fixed per engine (``step/sample.py``).
"""
from __future__ import annotations

import numpy as np
import torch

from hybrid_engine.spec.drafters import DraftContext, Drafter

from ..models.nemotron_h import Caches
from ..sampling.logits_processing import LogitsProcessor
from ..sampling.logprobs import logprobs_block
from ..sampling.prompt_logprobs import PromptLogprobsCopy, PromptSpan, prompt_logprobs_block
from ..sampling.sampler import nonfinite_rows
from ..scheduling.scheduler_output import SchedulerOutput
from .fork_state import fork_state
from .input_batch import InputBatch
from .plans import DecodeOnlyPlan, MixedPlan, StepPlan, StepResources
from .plans.base import cat_rows
from .sample import DraftVerifier, TokenSampler
from .step_constants import StepConstants, StepScratch
from .step_io import PrevStep, StepHandle, StepInputs, StepRows, mark_nonfinite
from .transfer import D2H, H2D
from hybrid_engine.spec.adaptive import FixedDrafts


class ModelRunner:
    def __init__(self, model, caches: Caches, drafter: Drafter, *, executor, greedy_graphs=None,
                 max_num_seqs: int, max_model_len: int, block_size: int, max_blocks: int, num_spec: int,
                 device: torch.device, draft_policy=None, forced_acceptance_rate: float | None = None,
                 spec_graphs=None):
        """``executor``: the forward (EagerExecutor / CudaGraphExecutor); ``greedy_graphs``: a
        GreedyStepGraphs (CUDA graphs on; K = 0, or adaptive n-gram at rest) or None; ``draft_policy``: how many drafts the
        next step verifies (``spec/adaptive.py``; default: always ``num_spec``);
        ``forced_acceptance_rate``: benchmark-only forced acceptance (``DraftVerifier``);
        ``spec_graphs``: a fused plan of whole greedy verify steps (``spec_graphs.SpecStepGraphs``:
        n-gram, MTP, draft model) or None."""
        self.model, self.caches, self.drafter = model, caches, drafter
        self.executor = executor
        self.device, self.block_size, self.num_spec = device, block_size, num_spec
        self.batch = InputBatch(max_num_seqs, max_model_len + 2 * (1 + num_spec), max_blocks)
        self.h2d = H2D(device)
        self.d2h = D2H(device)
        self.d2h_prompt: D2H | None = None      # prompt logprobs' own copies (made on first use)
        self.prev: PrevStep | None = None       # the last launched step's device outputs (next step's inputs)
        self.consts = StepConstants(device, num_spec)                   # tensors fixed by a row count
        res = StepResources(batch=self.batch, h2d=self.h2d, consts=self.consts, scratch=StepScratch(device),
                            executor=executor, block_size=block_size, num_spec=num_spec, device=device)
        self.greedy_graphs = greedy_graphs
        for fused in (greedy_graphs, spec_graphs):
            if fused is not None:
                fused.bind(self.batch)
        # asked in order; the first that applies takes the step (MixedPlan takes any step)
        self.plans: tuple[StepPlan, ...] = tuple(
            p for p in (greedy_graphs, spec_graphs, DecodeOnlyPlan(res), MixedPlan(res)) if p is not None)
        self.sampler = DraftVerifier(num_spec, forced_acceptance_rate) if num_spec else TokenSampler()
        # one owner of the per-request draft counts (slot space): asked once per step, told each
        # step's counts when they reach the host (StepHandle)
        self.policy = draft_policy if draft_policy is not None else FixedDrafts(num_spec)
        # per-request penalties, bias, bad words, min_tokens (state by slot, allocated on first use)
        self.processor = LogitsProcessor(caches.mamba.num_slots, model.cfg.vocab_size, num_spec, device)

    def reset(self) -> None:
        """Forget the previous step's outputs (its step was dropped: nothing may read them)."""
        self.prev = None

    def drop_fused_plans(self, *, proposing_only: bool = False) -> None:
        """Serve decode steps without the fused whole-step plans (tests and benchmarks compare the
        paths): all of them (greedy step graphs and verify-step graphs), or with
        ``proposing_only`` the verify-step graphs (``SpecStepGraphs``) only."""
        if not proposing_only:
            self.greedy_graphs = None
        self.plans = tuple(p for p in self.plans
                           if not (p.fused and (not proposing_only or getattr(p, "proposes", False))))

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepHandle:
        step = self._update_batch(sched)                       # rows join / leave; step-row order
        try:
            plan = self._choose_plan(step)                     # greedy graph | decode-only | mixed
            if plan.fused:                                     # prepare + forward + argmax: one replay
                return self._finish_fused(sched, step, plan)
            inp = plan.prepare(step, self.prev)                # host staging, device gathers
            hidden, logits = self.executor.forward(inp.fb)
            processes = self._processes(inp)                   # host flag: a sampling row processes logits
            processed = self._process(logits, inp) if processes else logits
            sampled = self.sampler.sample(processed, inp)      # sample, or verify the drafts (K > 0)
            if processes:
                self.processor.record(sampled, inp.slots)      # counts, output count, history per slot
            nonfinite = self._nonfinite_step_rows(logits, inp)   # [B] bool, rides in the D2H payload
            prompt_logprobs = self._prompt_logprobs(step, inp, hidden)   # None unless a prefill row asks
        except BaseException:
            self.prev = None                                   # a half-launched step's outputs are void
            raise
        num_valid, next_start = self._advance(sampled, inp)
        observe = None
        num_drafts = self.num_spec
        if self.num_spec and not isinstance(self.policy, FixedDrafts):
            # the rows that sampled (decode rows first, in step-row order, then last prefill chunks):
            # the next step verifies their drafts; a partial chunk's row drafts nothing
            rows = inp.rows_sampling_np
            slots_np = self.batch.slot[rows]
            num_drafts = self.policy.width(slots_np)                         # the next step's width
            if self.drafter.has_probs and num_drafts < self.num_spec and self.batch.temperature[rows].any():
                # probabilistic drafts (q != p) of a random row: its tokens depend on how many
                # drafts it verifies, so that count must not depend on timing (async) or on other
                # rows (batch): such steps verify all K (docs/design.md invariant 2)
                num_drafts = self.num_spec
            observe = (self.policy, self.policy.snapshot(slots_np, inp.num_decode, self._width(inp),
                                                         decode_only=not inp.num_prefill, next_width=num_drafts))
        drafts, draft_probs = self.drafter.propose(
            self._draft_context(step.req_ids, inp, hidden, sampled, num_valid, next_start, num_drafts))
        payload = self._d2h_payload(sampled, inp)
        num_logprobs = self._num_logprobs(inp)
        if num_logprobs >= 0:                                  # logprobs ride in the same D2H copy
            payload = torch.cat([payload, logprobs_block(processed, sampled, inp.sample_rows_p, inp.num_decode,
                                                         num_logprobs)], 1)
        payload = mark_nonfinite(payload, nonfinite)
        handle = self._finish(sched, step.req_ids, inp.rows_sampling_np, payload,
                              PrevStep(sampled=sampled, num_valid=num_valid, next_start=next_start,
                                       drafts=drafts, draft_probs=draft_probs),
                              width=self._width(inp), observe=observe)
        handle.prompt_logprobs = prompt_logprobs
        return handle

    def _processes(self, inp: StepInputs) -> bool:
        """Whether a row that samples this step has logits processing (host arrays only)."""
        return self.processor.allocated and bool(self.batch.processed[inp.rows_sampling_np].any())

    def _num_logprobs(self, inp: StepInputs) -> int:
        """The largest ``logprobs`` of this step's sampling rows, -1 when none asks (host arrays)."""
        b = self.batch
        if not b.num_logprob_rows or not len(inp.rows_sampling_np):
            return -1
        return int(b.logprobs[inp.rows_sampling_np].max())

    def _prompt_logprobs(self, step: StepRows, inp: StepInputs, hidden: torch.Tensor) -> PromptLogprobsCopy | None:
        """Prompt logprobs of the prefill rows that ask (sampling/prompt_logprobs.py): host-known
        spans, the lm_head over their hidden rows, one extra D2H copy."""
        b = self.batch
        if not b.num_prompt_logprob_rows or step.order is None:
            return None
        off = inp.num_decode * (1 + self._width(inp))          # prefill tokens follow the verify rows'
        rows, spans, n = [], [], -1
        for r in step.order[inp.num_decode:]:
            row = b.req_id_to_row[r.req_id]
            want = int(b.prompt_logprobs[row])
            count = min(r.start_pos + r.num_tokens, int(b.num_prompt[row]) - 1) - r.start_pos
            if want >= 0 and count > 0:
                rows.append((off, count))
                spans.append(PromptSpan(r.req_id, int(b.epoch[row]), r.start_pos + 1, count))
                n = max(n, want)
            off += r.num_tokens
        if not rows:
            return None
        if self.d2h_prompt is None:
            self.d2h_prompt = D2H(self.device)
        block = prompt_logprobs_block(self.model.compute_logits, hidden, inp.next_input_ids, rows, n)
        return PromptLogprobsCopy(self.d2h_prompt.copy(block), spans, 1 + 2 * n)

    def _process(self, logits: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """The step's logits [L, V] processed per row (sampling/logits_processing.py); verify rows
        position by position with the drafts before each position counted as outputs."""
        return self.processor.apply(logits, inp.slots, inp.sample_rows_p, inp.num_decode,
                                    inp.spec.drafts if inp.spec is not None else None)

    def _choose_plan(self, step: StepRows) -> StepPlan:
        for plan in self.plans:
            if plan.applies(step, self.prev):
                return plan
        raise AssertionError("MixedPlan takes every step")

    def _finish_fused(self, sched: SchedulerOutput, step: StepRows, plan) -> StepHandle:
        """A step replayed whole: a greedy step (``GreedyStepGraphs``; in a spec engine at rest, with
        the n-gram drafter's proposal inside) or a verify step (``SpecStepGraphs``). The replay
        drafted K (or nothing); the policy picks the next width, before the replay (it learns
        nothing in between: at 0 after a resting step a model drafter's graph only follows the
        step), and is told this step's counts later, as on the general path."""
        num_drafts, slots_np, observe = self.num_spec, None, None
        if self.num_spec and not isinstance(self.policy, FixedDrafts):
            slots_np = self.batch.slot[plan.accepted_rows()]
            num_drafts = self.policy.width(slots_np)
        # payload: the tokens (then the verified drafts) with non-finite rows marked NONFINITE
        out = plan.replay(step, self.prev, self.h2d, next_width=num_drafts)
        if slots_np is not None and (out.width or self.policy.times_steps):   # width 0: only its time
            observe = (self.policy, self.policy.snapshot(slots_np, len(out.rows), out.width, decode_only=True,
                                                         next_width=num_drafts))
        drafts = out.drafts if num_drafts == out.drafts.shape[1] else out.drafts[:, :num_drafts]
        handle = self._finish(sched, step.req_ids, out.rows, out.payload,
                              PrevStep(sampled=out.sampled, num_valid=out.num_valid, next_start=out.next_start,
                                       drafts=drafts, draft_probs=None), width=out.width, observe=observe)
        plan.read_by(handle.copy_event)
        return handle

    def _advance(self, sampled: torch.Tensor, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (num_valid [B], next_start [B]): decode rows advance by their valid tokens, prefill
        rows by their chunk."""
        num_decode, num_prefill = inp.num_decode, inp.num_prefill
        if inp.next_start is not None:
            # decode-only K = 0: every row yields exactly one token (docs/design.md invariant 7 by construction)
            return self.consts.full(num_decode, 1), inp.next_start
        num_valid = (sampled != -1).sum(1)                                   # [B], docs/design.md invariant 7
        next_start = inp.start + cat_rows(num_valid[:num_decode] if num_prefill else num_valid,
                                          inp.num_tokens[num_decode:] if num_decode else inp.num_tokens,
                                          num_decode, num_prefill)
        return num_valid, next_start

    def _finish(self, sched: SchedulerOutput, req_ids: tuple[str, ...], rows_sampling: np.ndarray,
                payload: torch.Tensor, prev: PrevStep, width: int = 0, observe=None) -> StepHandle:
        """The step's outputs become the next step's inputs; its payload goes to the host.
        ``width``: the drafts each decode row verified; ``observe``: (policy, snapshot) told the
        step's counts when the host reads them."""
        self.prev = prev
        self.batch.set_prev(req_ids)
        self.batch.append_placeholders(rows_sampling)
        return StepHandle(sched, req_ids, self.d2h.copy(payload), num_spec=width, observe=observe)

    @staticmethod
    def _width(inp: StepInputs) -> int:
        """Drafts each decode row of this step verified (0..K; 0 without speculation)."""
        return 0 if inp.spec is None else inp.spec.drafts.shape[1]

    def _d2h_payload(self, sampled: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """[B, 1+K] sampled tokens, then (K > 0) the [B, K] drafts verified (-1 = none; prefill rows
        verified none): one tensor, one copy; the host derives num_valid and num_drafts from it.
        K is the step's width."""
        k = self._width(inp)
        if not k:
            return sampled
        drafts = inp.spec.drafts
        if inp.num_prefill:
            drafts = torch.cat([drafts, torch.full((inp.num_prefill, k), -1, dtype=torch.int64,
                                                   device=self.device)])
        return torch.cat([sampled, drafts], 1)

    def _nonfinite_step_rows(self, logits: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """[B] bool: step rows with a non-finite logit row (a decode row: any of its 1+K rows).
        logits rows: N_d*(1+K) decode rows, then one per sampling prefill row. One reduction over
        the logits (small beside the lm_head that made them) and a few [B] ops; no sync."""
        bad = nonfinite_rows(logits)
        num_decode, num_prefill, tokens_per_row = inp.num_decode, inp.num_prefill, 1 + self._width(inp)
        decode_bad = bad[:num_decode * tokens_per_row].view(num_decode, tokens_per_row).any(1)
        if not num_prefill:
            return decode_bad
        out = torch.zeros(num_decode + num_prefill, dtype=torch.bool, device=self.device)
        out[:num_decode] = decode_bad
        out[inp.sample_rows_p] = bad[num_decode * tokens_per_row:]
        return out

    def _draft_context(self, req_ids, inp: StepInputs, hidden, sampled, num_valid, next_start,
                       num_drafts: int) -> DraftContext:
        """The drafter's view of this step. For drafters with ``full_context = False`` (n-gram, none)
        input_token and token_index stay None, which saves the device ops that derive them."""
        common = dict(req_ids=req_ids, num_drafts=num_drafts, slots=inp.slots, sampled=sampled, num_valid=num_valid, input_pos=next_start,
                      is_decode=inp.is_decode, query_start_loc=inp.query_start_loc,
                      hidden=hidden, input_ids=inp.fb.input_ids, positions=inp.fb.positions,
                      next_input_ids=inp.next_input_ids, forward_batch=inp.fb,
                      sampling=None if inp.spec is None else inp.spec.sampling_all, block_size=self.block_size)
        if not self.drafter.full_context:
            return DraftContext(input_token=None, token_index=None, **common)
        last_idx = (num_valid - 1).clamp(min=0)
        last_tok = sampled.gather(1, last_idx[:, None]).squeeze(1)
        return DraftContext(
            input_token=last_tok if inp.backup is None else torch.where(num_valid > 0, last_tok, inp.backup),
            token_index=self._token_index(inp, last_idx), **common)

    @staticmethod
    def _token_index(inp: StepInputs, last_idx: torch.Tensor) -> torch.Tensor:
        """Index into hidden of the token whose logits produced each row's last valid sample."""
        qsl = inp.query_start_loc
        end = qsl[1:] - 1                                          # prefill rows: last token
        dec = qsl[:-1] + last_idx                                  # verify rows: the accepted prefix end
        return torch.cat([dec[:inp.num_decode], end[inp.num_decode:]])

    # ------------------------------------------------------------------------------------------
    def _update_batch(self, sched: SchedulerOutput) -> StepRows:
        """Apply the scheduler's joins and leaves to the input batch -> the step's rows."""
        b = self.batch
        steady = sched.decode
        if steady is not None and not (sched.other_rows or sched.new_requests or sched.removed_req_ids):
            # a steady decode step: no row joins or leaves, only grown block lists change
            for i in steady.grown:
                b.set_blocks(b.req_id_to_row[steady.req_ids[i]], steady.block_ids[i])
            return StepRows(req_ids=steady.req_ids, order=None, decode_only=True, steady=steady)
        for rid in sched.removed_req_ids:
            b.remove_request(rid)
        for new in sched.new_requests:
            b.remove_request(new.req_id)           # resumed after preemption: start from a clean row
            b.add_request(new)
            if new.fork is not None:               # an n > 1 sibling: its leader's prefill, copied
                fork_state(self.caches, new.fork, new.slot)
            self.drafter.add_request(new.slot, new.token_ids)
            self.policy.reset(new.slot)
            self.processor.add(new.slot, new.processing, new.token_ids, new.num_prompt_tokens)
        b.condense()
        order = [r for r in sched.rows if r.is_decode] + [r for r in sched.rows if not r.is_decode]
        for r in order:
            b.set_blocks(b.req_id_to_row[r.req_id], r.block_ids)
        return StepRows(req_ids=tuple(r.req_id for r in order), order=order,
                        decode_only=bool(order) and order[-1].is_decode, steady=None)   # decode rows come first
