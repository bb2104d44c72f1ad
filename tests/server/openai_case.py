"""The server the OpenAI-API tests drive, and their in-process reference (``test_openai_api.py``,
``test_openai_load.py``): one real ``hybrid-engine serve`` process shared by both modules (embedded
default model, n-gram speculative decoding, an API key, a chat template from a file; the
session-scoped ``server`` and ``oai`` fixtures, which tests/server/conftest.py provides) and
``AsyncLLM`` run directly without speculation (``direct``, per module: test modules import it by
name)."""
import asyncio

import pytest
import torch

from server_harness import check_clean_exit, client, start_module_server
from hybrid_engine import AsyncLLM, SamplingParams

KEY = "test-key-123"
MAX_TOKENS = 12
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}{% if shout %}!{% endif %}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
PROMPTS = ["The river ran through the old town", "Once upon a time, a small robot",
           "a b c a b c a b c a b", "In the morning the market was full of",
           "A good engine serves many requests", "to be or not to be, to be or not",
           "1 2 3 4 1 2 3 4 1 2", "the cat sat on the mat and the cat"]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    tpl = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    tpl.write_text(TEMPLATE)
    srv = start_module_server(tmp_path_factory, "--api-key", KEY, "--spec", "ngram", "--num-speculative-tokens", "2",
                              "--max-num-seqs", "16", "--chat-template", str(tpl))
    yield srv
    check_clean_exit(srv)


@pytest.fixture(scope="session")
def oai(server):
    return client(server, KEY)


@pytest.fixture(scope="module")
def direct():
    """``AsyncLLM`` in this process (no speculation): ``run(list of prompts or token lists)`` gives
    each one's greedy tokens, one request at a time; ``tokenizer`` renders chat references."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # as the server process: the tiny model runs fastest on one thread
    llm = AsyncLLM(None, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    async def solo(prompts):
        res = []
        for p in prompts:
            toks = []
            async for out in llm.generate(p, params):
                toks += out.outputs[0].token_ids
            res.append(toks)
        return res

    class Direct:
        tokenizer = llm.tokenizer
        cache: dict = {}

        def run(self, prompts):
            key = lambda p: tuple(p) if isinstance(p, list) else p  # noqa: E731
            todo = [p for p in prompts if key(p) not in self.cache]
            for p, toks in zip(todo, asyncio.run(solo(todo))):
                self.cache[key(p)] = toks
            return [self.cache[key(p)] for p in prompts]
    yield Direct()
    llm.shutdown()
    torch.set_num_threads(threads)


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def _chat_ids(direct, messages, shout=False):
    from jinja2 import Environment
    env = Environment(trim_blocks=True, lstrip_blocks=True)      # as transformers renders templates
    text = env.from_string(TEMPLATE).render(messages=messages, add_generation_prompt=True, shout=shout)
    return direct.tokenizer.encode(text, add_special_tokens=False)
