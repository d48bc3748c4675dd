"""GPT-2 itself: one layer loop every forward runs, the attention it is handed, and loading.

    gpt2.py            GPT2: embeddings, blocks, head; `run` is the layer loop; `load_model` (a WeightLayout)
    attention.py       how a forward's tokens attend (causal, paged, invariant), as a block calls it
    backends.py        decode attention over the paged pool: PyTorch or Triton, chosen once
    activations.py     the activation functions a config.json may name
    config.py          GPT2Config: the fields of config.json that change the math
    weights.py         find a checkpoint (hub id or folder) and read its weights into the parameters
    weights_verify.py  `--verify`: weight files checked against the hub's SHA-256
    linears.py         unquantized CPU linears in their fastest packed form; replace_linears
    checkpoint.py      random-weight checkpoints in Hugging Face's layouts (tests, benchmarks)
"""

from minigpt.model.gpt2 import GPT2

__all__ = ["GPT2"]
