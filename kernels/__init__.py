"""Kernels for minigpt (installed as ``minigpt.kernels``): Triton ones, each beside its torch reference, and C++
sources built where they run (`int8_rows_avx2.cpp`, built by minigpt/compile/native.py; its reference and packing
are in minigpt/quant/int8_rows.py)."""
