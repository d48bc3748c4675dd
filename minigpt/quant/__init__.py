"""`quantize="int8" | "w8a8"`: every linear of the model replaced by an int8 one.

    quantize.py     the int8 (weight-only) and w8a8 (dynamic activations) linears
    fbgemm_int8.py  int8 products through fbgemm for CPUs without AVX-512
    int8_rows.py    int8 products of a few rows there: our AVX2 kernel (kernels/int8_rows_avx2.cpp), its packing
"""
