"""Beam search (`LLM.beam_search`, `use_beam_search`): beams run as ordinary decodes, ranked per step.

    params.py  BeamSearchParams and BeamSearchOutput
    search.py  BeamGroup: a request's live beams and the hypotheses they finish
    plug.py    beam search plugged into the engine: its request kind and postprocessor
"""
