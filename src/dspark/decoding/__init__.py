"""Logits processing and lossless verification, as pure tensor functions."""
from .sampling import SamplingError, SamplingParams, make_generator, sample_from, to_probs
from .verify import VerifyResult, draw_uniforms, verify, verify_greedy

__all__ = ["SamplingError", "SamplingParams", "VerifyResult", "draw_uniforms", "make_generator", "sample_from",
           "to_probs", "verify", "verify_greedy"]
