"""logit_bias, bad_words, min_tokens and the repetition / frequency / presence penalties against
their definition (written out below, as in the OpenAI / vLLM documentation), on the processor
alone (verify rows position by position) and through the engine against transformers float32
logits: without spec, async on and off, and with every drafter (greedy spec == greedy no spec;
seeded n-gram sample-and-compare == no spec, which holds only if each draft position saw the
processed distribution of its own prefix)."""
import os

import numpy as np
import pytest
import torch

from hf_reference import NoHostSync, hf_logits
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.sampling.logits_processing import LogitsProcessor, ProcessingSpec
from hybrid_engine.prompt_inputs import bad_word_ids
from continuation_drafter import ContinuationDrafter
from hybrid_engine.spec.drafters import DRAFTERS

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
ARGS = dict(dtype="float32", device=DEV, max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=96)
NEG = float("-inf")


def reference(logits, prompt, out, *, bias=(), bad_words=(), min_tokens=0, banned=(), repetition=1.0,
              frequency=0.0, presence=0.0):
    """The definition, one row: logits [V] after everything the request asks for, given its prompt
    and the outputs before this position."""
    x = logits.clone().float()
    for t, b in bias:
        x[t] += b
    for w in bad_words:
        if len(out) >= len(w) - 1 and list(out[len(out) - len(w) + 1:]) == list(w[:-1]):
            x[w[-1]] = NEG
    if len(out) < min_tokens:
        x[list(banned)] = NEG
    counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=len(x))[:len(x)].float()
    seen = counts > 0
    in_prompt = torch.zeros(len(x), dtype=torch.bool)
    in_prompt[list(prompt)] = True
    x = torch.where(seen | in_prompt, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * seen.float()


def spec_of(**kw):
    d = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0,
             min_tokens_banned=(), bias=(), bad_words=())
    d.update(kw)
    return ProcessingSpec(**d)


def ref_kw(spec):
    return dict(bias=spec.bias, bad_words=spec.bad_words, min_tokens=spec.min_tokens, banned=spec.min_tokens_banned,
                repetition=spec.repetition_penalty, frequency=spec.frequency_penalty, presence=spec.presence_penalty)


def test_processor_matches_definition_position_by_position():
    """Verify rows: draft position j is processed with the committed outputs plus drafts[:j];
    after ``record`` the state holds the accepted tokens. No host sync in apply / record."""
    v, k = 40, 2
    g = torch.Generator().manual_seed(0)
    proc = LogitsProcessor(num_slots=6, vocab_size=v, num_spec=k, device=torch.device("cpu"))
    proc.add(5, None, [1, 2, 3], 3)                    # before allocation: nothing happens
    assert not proc.allocated
    specs = {
        1: spec_of(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4),
        3: spec_of(bias=((4, 2.5), (9, -7.0)), bad_words=((7,), (11, 12), (13, 14, 15)), min_tokens=4,
                   min_tokens_banned=(0, 2)),
        4: spec_of(repetition_penalty=0.6, bad_words=((11, 12),), min_tokens=1, min_tokens_banned=(3,)),
    }
    seqs = {1: ([5, 6, 6, 8], [8, 9, 9]), 3: ([1, 2], [13, 11]), 4: ([20, 21, 22], [])}   # (prompt, outputs)
    for slot, spec in specs.items():
        prompt, out = seqs[slot]
        proc.add(slot, spec, prompt + out, len(prompt))
    proc.add(2, None, [30, 31], 2)                     # a neutral request next to them
    specs[2], seqs[2] = spec_of(), ([30, 31], [])
    # step rows: 3 verify rows (slots 3, 1, 2), a prefill chunk that samples nothing (slot 5 is
    # not a sampling row), then a sampling prefill row (slot 4)
    slots = torch.tensor([3, 1, 2, 5, 4])
    sample_rows_p = torch.tensor([4])
    drafts = torch.tensor([[13, 14], [9, -1], [31, 6]])
    logits = torch.randn(3 * (1 + k) + 1, v, generator=g) * 3
    with NoHostSync():
        got = proc.apply(logits, slots, sample_rows_p, 3, drafts)
    rows = [(s, j) for s in (3, 1, 2) for j in range(1 + k)] + [(4, 0)]
    drafts_of = {3: [13, 14], 1: [9, -1], 2: [31, 6], 4: []}
    for i, (slot, j) in enumerate(rows):
        if -1 in drafts_of[slot][:j]:
            continue                                   # after a missing draft nothing is emitted
        prompt, out = seqs[slot]
        want = reference(logits[i], prompt, out + drafts_of[slot][:j], **ref_kw(specs[slot]))
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6, msg=f"slot {slot} position {j}")
    assert torch.isinf(got[2, 15]) and not torch.isinf(got[1, 15])   # bad word 13 14 15 only after 13 14
    # the step accepted: slot 3 both drafts + bonus, slot 1 one token, slot 2 nothing, slot 4 one
    sampled = torch.tensor([[13, 14, 16], [9, -1, -1], [-1, -1, -1], [-1, -1, -1], [17, -1, -1]])
    with NoHostSync():
        proc.record(sampled, slots)
    seqs[3][1].extend([13, 14, 16])
    seqs[1][1].append(9)
    seqs[4][1].append(17)
    # the next step: position 0 of each row sees exactly the recorded outputs
    logits = torch.randn(4 * (1 + k), v, generator=g) * 3
    got = proc.apply(logits, torch.tensor([3, 1, 2, 4]), torch.zeros(0, dtype=torch.int64), 4,
                     torch.full((4, k), -1))
    for i, slot in enumerate((3, 1, 2, 4)):
        prompt, out = seqs[slot]
        r = i * (1 + k)
        torch.testing.assert_close(got[r], reference(logits[r], prompt, out, **ref_kw(specs[slot])),
                                   rtol=0, atol=1e-6, msg=f"slot {slot} after record")
    # a slot reused by a request without processing passes its logits through unchanged
    proc.add(3, None, [1], 1)
    torch.testing.assert_close(proc.apply(logits[:3], torch.tensor([3]), torch.zeros(0, dtype=torch.int64), 1,
                                          torch.tensor([[13, 14]])), logits[:3], rtol=0, atol=0)


# ------------------------------------------------------------------------------- through the engine

PROMPTS = ["a b a b a b a b", "the cat the cat the cat", "1 2 1 2 1 2 1 2 1"]
MAX = 10


@pytest.fixture(scope="module")
def cases(tok_dir):
    """(SamplingParams, token-level definition kwargs, reference tokens) per prompt: the greedy
    continuation under the definition, on transformers float32 logits."""
    llm = LLM(tok_dir, **ARGS)
    tok, eos = llm.tokenizer, llm.engine.eos_token_ids
    plain = [o.outputs[0].token_ids for o in
             llm.generate(PROMPTS, SamplingParams(max_tokens=MAX, ignore_eos=True), use_tqdm=False)]
    word = tok.decode(plain[1][2:4])                  # a two-token stretch the plain run produced
    bad_ids = bad_word_ids((word,), tok)
    params = [
        SamplingParams(max_tokens=MAX, ignore_eos=True, repetition_penalty=1.6, frequency_penalty=0.7,
                       presence_penalty=0.5),
        SamplingParams(max_tokens=MAX, ignore_eos=True, bad_words=[word], logit_bias={plain[1][0]: -3.0, 7: 4.0}),
        # the stop id is biased to win everywhere: banned for 4 outputs, it ends the request at the 5th
        SamplingParams(max_tokens=MAX, ignore_eos=True, stop_token_ids=[plain[2][1]], min_tokens=4,
                       logit_bias={plain[2][1]: 60.0}, repetition_penalty=0.8),
    ]
    out = []
    for prompt, p in zip(PROMPTS, params):
        ids = tok.encode(prompt, add_special_tokens=False)
        kw = dict(bias=p.logit_bias, bad_words=bad_ids if p.bad_words else (), min_tokens=p.min_tokens,
                  banned=p.stop_token_ids, repetition=p.repetition_penalty, frequency=p.frequency_penalty,
                  presence=p.presence_penalty)
        toks = []
        while len(toks) < MAX:
            t = int(reference(hf_logits(tok_dir, ids + toks)[-1], ids, toks, **kw).argmax())
            toks.append(t)
            if t in p.stop_token_ids:
                break
        out.append((p, toks))
    assert all(toks != pl[:len(toks)] for (_, toks), pl in zip(out, plain))   # the processing mattered
    assert len(out[2][1]) == 5 and out[2][1][-1] == plain[2][1]                # min_tokens, then the stop
    return out


def generate(model, cases, spec=None, async_scheduling=False):
    llm = LLM(model, speculative_config=spec, async_scheduling=async_scheduling, **ARGS)
    outs = llm.generate(PROMPTS, [p for p, _ in cases], use_tqdm=False)
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    return [o.outputs[0].token_ids for o in outs], st


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_matches_transformers_reference(tok_dir, cases, async_scheduling):
    toks, _ = generate(tok_dir, cases, async_scheduling=async_scheduling)
    assert toks == [t for _, t in cases]


@pytest.mark.parametrize("method,k,async_scheduling", [("ngram", 3, True), ("draft_model", 2, False),
                                                       ("mtp", 2, True)])
def test_greedy_spec_equals_no_spec(tok_dir, cases, method, k, async_scheduling):
    spec = SpeculativeConfig(method, k, model=str(tok_dir) if method == "draft_model" else None)
    toks, st = generate(tok_dir, cases, spec, async_scheduling)
    assert toks == [t for _, t in cases]
    assert st["drafts_proposed"] > 0


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_seeded_sampling_spec_equals_no_spec(tok_dir, monkeypatch, drafter):
    """Sample-and-compare emits the no-spec token at every position, so equality holds only if the
    verifier's processed distribution at each draft position equals the one decoding without spec
    sees there (counts including the earlier drafts). The oracle drafts the no-spec seeded tokens
    themselves: every draft must then be accepted."""
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=s, repetition_penalty=1.4, frequency_penalty=0.8,
                             presence_penalty=0.6, logit_bias={9: 2.0}, min_tokens=3, ignore_eos=True)
              for s in (1, 2, 3)]
    plain_llm = LLM(tok_dir, **ARGS)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, params, use_tqdm=False)]
    if drafter == "oracle":
        tok = plain_llm.tokenizer
        seqs = {f"q{i}": tok.encode(p, add_special_tokens=False) + plain[i] for i, p in enumerate(PROMPTS)}
        monkeypatch.setitem(DRAFTERS, "ngram", lambda build: ContinuationDrafter(build.num_spec, seqs))
    llm = LLM(tok_dir, speculative_config=SpeculativeConfig("ngram", 3), async_scheduling=True, **ARGS)
    eng = llm.engine
    reqs = [eng.make_request(p, sp, f"q{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        eng.step()
    assert [r.output_token_ids for r in reqs] == plain
    if drafter == "oracle":               # (n-gram rarely finds a match in penalised random text)
        proposed = sum(r.metrics.drafts_proposed for r in reqs)
        assert proposed > 0 and sum(r.metrics.drafts_accepted for r in reqs) == proposed


def test_validation_names_the_field(tok_dir, hybrid_dir):
    for kw, exc, field in [(dict(presence_penalty=2.5), ValueError, "presence_penalty"),
                           (dict(frequency_penalty="1"), TypeError, "frequency_penalty"),
                           (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
                           (dict(min_tokens=-1), ValueError, "min_tokens"),
                           (dict(max_tokens=4, min_tokens=5), ValueError, "min_tokens"),
                           (dict(logit_bias={1: 101.0}), ValueError, "logit_bias"),
                           (dict(logit_bias={"1": 1.0}), TypeError, "logit_bias"),
                           (dict(logit_bias=[1, 2]), TypeError, "logit_bias"),
                           (dict(bad_words=[3]), TypeError, "bad_words"),
                           (dict(bad_words=["x"] * 33), ValueError, "bad_words")]:
        with pytest.raises(exc, match=f"SamplingParams.{field}"):
            SamplingParams(**kw)
    llm = LLM(tok_dir, **ARGS)
    with pytest.raises(ValueError, match="SamplingParams.logit_bias has token id 300"):
        llm.generate(["hi"], SamplingParams(logit_bias={300: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.bad_words"):
        llm.generate(["hi"], SamplingParams(bad_words=["a" * 40 + "\u00e9" * 20]), use_tqdm=False)
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="SamplingParams.bad_words needs a tokenizer"):
        LLM(hybrid_dir, **ARGS).generate([[5]], SamplingParams(bad_words=["x"]), use_tqdm=False)
