"""vllm.exceptions of vLLM 0.31: the errors a request can cause (defined in _fakegen, which also loads alone)."""
from ._fakegen import VLLMClientError, VLLMError, VLLMValidationError  # noqa: F401
