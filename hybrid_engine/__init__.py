"""hybrid-engine: inference for hybrid Mamba2/attention models with spec decoding and async scheduling."""
import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys


class _CheckoutSubpackages(_abc.MetaPathFinder):
    """``hybrid_engine.spec`` and ``hybrid_engine.mamba_cache`` are the top-level ``spec/`` and
    ``mamba_cache/`` folders of the repository. An installed wheel has them inside this package
    (``package-dir`` in pyproject.toml); in a source checkout (a clone, a worktree, an editable
    install) they sit beside it, and this finder maps the two names, and only them, to those folders.
    Keeping them under ``hybrid_engine`` means the distribution installs no generic top-level
    ``spec`` package that could collide with another one."""

    def __init__(self, root: str, names: dict[str, str]):
        self.root, self.names = root, names

    def find_spec(self, fullname, path=None, target=None):
        folder = self.names.get(fullname)
        if folder is None:
            return None
        init = _os.path.join(self.root, folder, "__init__.py")
        return _util.spec_from_file_location(fullname, init, submodule_search_locations=[_os.path.dirname(init)])


def _install_checkout_finder() -> None:
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    names = {f"{__name__}.{d}": d for d in ("spec", "mamba_cache")
             if not _os.path.isdir(_os.path.join(here, d)) and _os.path.isfile(_os.path.join(root, d, "__init__.py"))}
    if names:
        _sys.meta_path.insert(0, _CheckoutSubpackages(root, names))


_install_checkout_finder()

from .async_llm import AsyncLLM
from .config import SpeculativeConfig
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
