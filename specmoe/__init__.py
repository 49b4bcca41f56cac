"""specmoe: offloaded Mixture-of-Experts inference with expert-aware speculative decoding."""
from specmoe.decoding.runtime.sampling import SamplingParams
from specmoe.engine.llm import LLM
from specmoe.engine.outputs import RequestOutput
from specmoe.errors import SpecMoEError

__all__ = ["LLM", "SamplingParams", "RequestOutput", "SpecMoEError"]
__version__ = "0.1.0"
