"""Tensor parallelism over torch.distributed: the model sharded over `tensor_parallel_size` processes.

    shard.py   which slice of each weight a rank holds; the all-reduce after the row-parallel products
    group.py   the process group and its all-reduce
    runner.py  rank 0's runner that drives the worker ranks, and the workers' loop
"""
