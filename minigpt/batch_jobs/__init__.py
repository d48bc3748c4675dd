"""Batch jobs (`python -m minigpt.batch`): a file of OpenAI Batch request lines in, a file of result lines out.

    answer.py   one input line answered as the server answers its body (the server's own plan and builders)
    files.py    the input read lazily, duplicates refused, the output resumed (a torn last line cut) and appended
    window.py   the bound on engine requests in flight, first come first served
    job.py      the run: every line through the engine at once within the window, progress, the summary
"""
