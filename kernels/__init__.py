"""Kernels for minigpt (installed as ``minigpt.kernels``): Triton ones, each beside its torch reference, and C++
sources built where they run by minigpt/compile/native.py: `int8_rows_avx2.cpp` (its reference and packing in
minigpt/quant/int8_rows.py) and `pool_attention_avx2.cpp` (called, its reference named, in
minigpt/compile/pool_attention.py)."""
