"""GPT-2's byte-level BPE tokenizer, from a checkpoint's own files.

    tokenizer.py  Tokenizer on tiktoken: encode, decode, incremental detokenizing
    files.py      vocab.json / merges.txt / tokenizer.json read as transformers reads them
"""
