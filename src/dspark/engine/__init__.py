"""Generation loops: the single-request speculative loop (and, later, the batched engine)."""
from .speculative import Generation, GenerationStats, PromptTooLongError, Target, TransformerTarget

__all__ = ["Generation", "GenerationStats", "PromptTooLongError", "Target", "TransformerTarget"]
