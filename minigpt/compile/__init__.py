"""`compile=True`: the model's steps exported, compiled ahead of time and cached on disk.

    steps.py         CompiledSteps: the compiled programs and the steps they cover
    cache.py         the program cache: keys, signed entries, pruning
    build.py         building the steps: export and AOTInductor, side by side in worker processes
    worker.py        `python -m minigpt.compile.worker`: one step built in a process of its own
    trust.py         what lets the cache load an entry: owned folders and signed manifests
    native.py        the C++ kernels of kernels/ built into signed libraries of torch ops in the cache
    attention.py     the programs' attention: decode rows over their blocks, prompt rows in pieces
    pool_attention.py  the decode programs' attention through the C++ kernel of kernels/, where it runs
    torch_compat.py  the torch internals compiling relies on, in one place
"""
