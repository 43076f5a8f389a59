"""specdecode: lossless speculative decoding for Llama-family language models."""

from .api import LLM, GenerationOutput, TextStream, load
from .engine import Generation, GenerationStats, generate_ids
from .sampling import SamplingParams

__all__ = ["LLM", "GenerationOutput", "TextStream", "load", "Generation", "GenerationStats", "generate_ids",
           "SamplingParams"]
__version__ = "0.1.0"
