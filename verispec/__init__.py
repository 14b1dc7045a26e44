"""verispec: lossless speculative decoding you can trust.

The offline API has vLLM's shape: `from verispec import LLM, SamplingParams`.
"""
from verispec.outputs import CompletionOutput, LLMRequestOutput
from verispec.sampling import SamplingParams
from verispec.structured.spec import GuidedDecodingParams, StructuredOutput, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "StructuredOutputsParams", "GuidedDecodingParams",
           "CompletionOutput", "LLMRequestOutput"]
__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch and the model code; import it lazily so `import verispec`
    # stays cheap for the CLI's argument parsing and for pure-Python tools.
    if name == "LLM":
        from verispec.engine.llm import LLM
        return LLM
    raise AttributeError(name)
