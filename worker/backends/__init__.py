"""Backends run one forward over a packed batch on a paged KV cache (see base.Backend).

numpy_backend is the CPU reference and the embedded default; torch_backend runs on
CUDA (and on the CPU for tests). Import the one you need: torch is optional.
"""
