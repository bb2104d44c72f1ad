"""tests/server needs the `serve` extra and the official openai client (both in `.[test]`, which CI
installs). Where they are missing (a GPU machine running the CPU suite on CUDA with only torch's
stack), the directory is skipped as a whole, with the reason, instead of failing at import."""
import importlib.util

_MISSING = [m for m in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx")
            if importlib.util.find_spec(m) is None]
collect_ignore_glob = ["test_*.py"] if _MISSING else []
if _MISSING:
    import warnings
    warnings.warn(f"tests/server skipped: {', '.join(_MISSING)} not installed (pip install -e '.[test]')")
else:
    # the OpenAI-API server (openai_case.py), session-scoped: test_openai_api.py and
    # test_openai_load.py share one server process instead of starting one each (the metric and
    # abort tests count deltas from their own start; an idle server uses no CPU until teardown)
    from openai_case import oai, server  # noqa: E402,F401 (fixtures)
