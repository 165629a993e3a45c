"""adahop: train LLMs with MXFP4 GEMMs at BF16 quality (AdaHOP, arXiv 2604.02525)."""

__version__ = "0.1.0"
