"""A FAKE vllm 0.31.0 for CPU tests: the import surface TRL 1.16 and this project use (tests/fake_vllm/README.md)."""
__version__ = "0.31.0"
from .sampling_params import SamplingParams  # noqa: E402
from ._engine import LLM, RequestOutput, CompletionOutput, TokensPrompt  # noqa: E402
