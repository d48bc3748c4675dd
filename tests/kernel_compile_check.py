"""Compile every Triton kernel, for every dtype it accepts, to sm_80 and sm_90 machine code (no GPU needed).

The interpreter (``TRITON_INTERPRET=1``) runs kernels as numpy code and lets through some errors that the
real compiler rejects, so this must run in a process where ``TRITON_INTERPRET`` is unset:
``python tests/kernel_compile_check.py`` (``tests/test_kernels.py`` runs it so). Exits non-zero on failure.
"""

import os
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from minigpt.kernels import fused_block, kv_store, paged_attention

TARGETS = [GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32)]
DTYPES = ["fp32", "fp16", "bf16"]


def decode_sources(dtype: str) -> list[ASTSource]:
    """The decode kernel with and without splits, and the split merge, for inputs of ``dtype``."""
    sources = []
    for split in (False, True):
        out = "*fp32" if split else f"*{dtype}"
        signature = {
            "out_ptr": out,
            "m_ptr": out,
            "l_ptr": out,
            "q_ptr": f"*{dtype}",
            "k_cache_ptr": f"*{dtype}",
            "v_cache_ptr": f"*{dtype}",
            "block_tables_ptr": "*i32",
            "context_lens_ptr": "*i32",
            "qk_scale": "fp32",
            "tokens_per_split": "i32",
            **dict.fromkeys(["stride_qb", "stride_qh", "stride_qd", "stride_kb", "stride_kt"], "i32"),
            **dict.fromkeys(["stride_kh", "stride_kd", "stride_tb", "head_dim"], "i32"),
            **dict.fromkeys(["BLOCK_SIZE", "BLOCK_N", "BLOCK_D", "SPLIT"], "constexpr"),
        }
        constexprs = {"BLOCK_SIZE": 16, "BLOCK_N": paged_attention.BLOCK_N, "BLOCK_D": 64, "SPLIT": split}
        sources.append(ASTSource(paged_attention._paged_decode_kernel, signature, constexprs))
    merge_signature = {
        "out_ptr": f"*{dtype}",
        "acc_ptr": "*fp32",
        "m_ptr": "*fp32",
        "l_ptr": "*fp32",
        "num_splits": "i32",
        "head_dim": "i32",
        "BLOCK_S": "constexpr",
        "BLOCK_D": "constexpr",
    }
    sources.append(ASTSource(paged_attention._merge_splits_kernel, merge_signature, {"BLOCK_S": 4, "BLOCK_D": 64}))
    return sources


def store_source(dtype: str) -> ASTSource:
    """The KV store kernel for rows and cache of ``dtype``."""
    signature = {
        **dict.fromkeys(["key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr"], f"*{dtype}"),
        "slot_mapping_ptr": "*i64",
        **dict.fromkeys(["stride_xn", "stride_xh", "stride_xd", "stride_cb", "stride_ct"], "i32"),
        **dict.fromkeys(["stride_ch", "stride_cd", "num_heads", "head_dim"], "i32"),
        **dict.fromkeys(["BLOCK_SIZE", "BLOCK_H", "BLOCK_D"], "constexpr"),
    }
    constexprs = {"BLOCK_SIZE": 16, "BLOCK_H": 16, "BLOCK_D": 64}
    return ASTSource(kv_store._store_kv_kernel, signature, constexprs)


def fused_sources(dtype: str) -> list[ASTSource]:
    """The block's fused kernels: the layernorm of an fp32 stream into ``dtype`` with and without the residual
    add of a ``dtype`` update (rows of gpt2-xl's 1600), and bias + GELU of ``dtype`` rows."""
    norm_signature = {
        "x_ptr": "*fp32",
        "delta_ptr": f"*{dtype}",
        "sum_ptr": "*fp32",
        "out_ptr": f"*{dtype}",
        "weight_ptr": "*fp32",
        "bias_ptr": "*fp32",
        **dict.fromkeys(["n_cols", "stride_x", "stride_delta", "stride_sum", "stride_out"], "i32"),
        "eps": "fp32",
        **dict.fromkeys(["HAS_DELTA", "BLOCK"], "constexpr"),
    }
    gelu_signature = {
        **dict.fromkeys(["h_ptr", "bias_ptr", "out_ptr"], f"*{dtype}"),
        **dict.fromkeys(["n_cols", "stride_h", "stride_out"], "i32"),
        "BLOCK": "constexpr",
    }
    return [
        *(ASTSource(fused_block._add_layernorm_kernel, norm_signature, {"HAS_DELTA": delta, "BLOCK": 2048})
          for delta in (False, True)),
        ASTSource(fused_block._bias_gelu_kernel, gelu_signature, {"BLOCK": fused_block.GELU_BLOCK}),
    ]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile kernels", file=sys.stderr)
        return 2
    failures = 0
    for dtype in DTYPES:
        for src in [*decode_sources(dtype), store_source(dtype), *fused_sources(dtype)]:
            for target in TARGETS:
                try:
                    kernel = compile(src, target=target)
                    print(f"ok   {src.name} {dtype} sm_{target.arch}: {len(kernel.asm['cubin'])} bytes")
                except Exception as exc:  # report every kernel that fails, then fail
                    failures += 1
                    print(f"FAIL {src.name} {dtype} sm_{target.arch}: {exc}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
