"""hybrid-engine: inference for hybrid Mamba2/attention models with spec decoding and async scheduling."""
from .async_llm import AsyncLLM
from .config import SpeculativeConfig
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
