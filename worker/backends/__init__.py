"""Backends run one forward over a packed batch on a paged KV cache (see base.Backend).

The model itself is defined once, in worker.models.llama; a backend supplies its ops
and KV pool (numpy_decoder_ops, torch_decoder_ops), prepares each step's inputs, and
samples. numpy_backend is the CPU reference and the embedded default; torch_backend
runs on CUDA (and on the CPU for tests). Import the one you need: torch is optional.
"""
