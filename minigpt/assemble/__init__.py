"""The engine assembled: the features an EngineConfig asks for, plugged into the engine through its seams.

    runner.py  the model runner: one process's, or rank 0's of a tensor-parallel group
    engine.py  build_engine: checkpoint, tokenizer, runner, and the features plugged in
"""
