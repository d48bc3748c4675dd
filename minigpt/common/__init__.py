"""What every layer may use: device transfers, the torch releases supported, progress lines, the version.

    transfer.py       host values to device tensors (pinned, non-blocking on CUDA)
    torch_support.py  the torch releases minigpt has run on, checked at start
    progress.py       progress lines on stderr for long batches and long waits
    version.py        the package's version, the one place it is written
"""
