"""Layer 7: analyses on top of the library (synthetic GEMM studies, pattern censuses, figures)."""
