"""Triton kernels for minigpt (installed as ``minigpt.kernels``), each beside its torch reference."""
