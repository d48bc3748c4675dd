"""What every layer may use.

    errors.py         ParamError, the one error type that carries its field
    transfer.py       host values to device tensors (pinned, non-blocking on CUDA)
    torch_support.py  the torch releases minigpt has run on, checked at start
    cpu_class.py      the x86 class kernels are picked for, and how a run is forced to a lower one
    progress.py       progress lines on stderr for long batches and long waits
    huge_pages.py     a loaded model's weights moved into memory backed by 2 MiB pages
    version.py        the package's version, the one place it is written
"""
