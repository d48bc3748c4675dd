__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads this literal without importing
