"""OpenAI-compatible HTTP server on ``AsyncLLM`` (``hybrid-engine serve``; needs the ``serve``
extra: fastapi, uvicorn, prometheus-client).

Modules: ``app`` (the FastAPI app factory, errors, auth), ``protocol`` (request models and the
mapping to SamplingParams), ``serving`` (admission, one request's run, disconnects), ``completions``
and ``chat`` (the two generation endpoints), ``sse`` (event framing), ``metrics`` (Prometheus),
``cli`` (the ``serve`` subcommand). ``create_app`` is imported lazily so that this package (and
``cli``) can be imported without the extra.
"""


def create_app(llm, config):
    from .app import create_app as _create_app
    return _create_app(llm, config)


__all__ = ["create_app"]
