from pathlib import Path

_REAL_FIELDS = {line for line in (Path(__file__).parents[1] / "sampling_fields.txt").read_text().split()
                if not line.startswith("#")} - {"#"}


class StructuredOutputsParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class SamplingParams:
    """Accepts exactly the field names of the real SamplingParams (sampling_fields.txt, read from the wheel)."""

    def __init__(self, **kwargs):
        unknown = set(kwargs) - _REAL_FIELDS
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword(s) {sorted(unknown)} (not fields in vLLM 0.31.0)")
        self.n, self.temperature, self.top_p, self.top_k, self.min_p = 1, 1.0, 1.0, 0, 0.0
        self.max_tokens, self.stop, self.include_stop_str_in_output, self.logprobs, self.seed = 16, None, False, None, None
        self.repetition_penalty = 1.0
        self.__dict__.update(kwargs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
