"""dspark: lossless confidence-scheduled speculative decoding (DSpark, arXiv 2607.05147)."""
__version__ = "0.1.0"
