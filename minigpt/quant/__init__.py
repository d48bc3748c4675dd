"""`quantize="int8" | "w8a8"`: every linear of the model replaced by an int8 one.

    quantize.py     the int8 (weight-only) and w8a8 (dynamic activations) linears
    fbgemm_int8.py  int8 products through fbgemm for CPUs without AVX-512
"""
