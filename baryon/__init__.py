"""baryon: a lightweight, fast LLM inference engine."""

from baryon.outputs import CompletionOutput, Logprob, RequestOutput
from baryon.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the engine; import it on first use so `import baryon` stays light.
    if name == "LLM":
        from baryon.llm import LLM

        return LLM
    raise AttributeError(f"module 'baryon' has no attribute {name!r}")
