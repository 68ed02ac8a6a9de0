"""specserve: an LLM inference engine and OpenAI-compatible server (speculative decoding, paged KV)."""

from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model stack; keep `import specserve` light for the CLI.
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
