"""The engine: requests in, one step at a time: schedule -> run -> postprocess.

    engine.py            Engine: the step loop and its postprocess
    input_processor.py   requests checked and built (the one context check)
    seams.py             what features plug in: postprocessors, speculation
    config.py            EngineConfig: every setting, its default and its help (CLI flags come from it)
    speculative_config.py  the speculative_config dict, checked
    scheduler.py         continuous batching: which sequences run next and how many tokens each
    sequence.py          one sequence in flight: tokens, blocks, why it stopped; its statistics
    sequence_text.py     its text: detokenized as read, cut at a stop string, streamed in deltas
    request.py           the interface of every request kind, the sampled request, its outputs
    kv_cache.py          the paged KV pool and the block manager (prefix cache)
    runner.py            ModelRunner: a scheduled batch laid out flat, run through the model
    cuda_graphs.py       decode steps captured as CUDA graphs at a ladder of batch sizes
    stop_strings.py      stop strings matched as text arrives (Aho-Corasick)
"""
