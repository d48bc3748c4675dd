"""`python -m minigpt.precompile`: build compile=True's compiled steps into the cache ahead of time,
for a container image, a CI job or a fleet of replicas that should all start in seconds.

    python -m minigpt.precompile --model gpt2 --quantize w8a8 --kv-cache-dtype float16
    MINIGPT_CACHE_DIR=/opt/minigpt-cache python -m minigpt.precompile --model ./ckpt --threads 4

It takes the engine flags of `minigpt.generate` and `minigpt.serve` (compile=True is implied). The
steps depend on the model's shape and mode, not its weights, the CPU and the number of threads:
build them with the flags and on the kind of machine that will serve. Prints the entry's folder.
"""

from __future__ import annotations

import logging
import sys
import time

from minigpt.cli import OneLineParser, add_engine_arguments, engine_args_from, flag_error_line
from minigpt.common.errors import USER_ERRORS
from minigpt.common.progress import log_to_stderr
from minigpt.demo import add_model_argument, model_or_demo
from minigpt.llm import LLM


def main(argv: list[str] | None = None, prog: str = "python -m minigpt.precompile") -> int:
    parser = OneLineParser(prog=prog, description=" ".join(__doc__.split("\n\n")[0].split()))
    add_model_argument(parser)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    args.model = model_or_demo(args.model, prog)
    log_to_stderr(logging.INFO)
    engine_args = {**engine_args_from(args), "compile": True}
    start = time.perf_counter()
    try:
        with LLM(args.model, **engine_args) as llm:
            entry = llm.engine.runner.forward_path.cache_entry
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as err:
        print(parser.error_line(flag_error_line(err)), file=sys.stderr)
        return 2
    if entry is None:
        print("minigpt.precompile: error: the steps were built but not stored: the compile cache is not private "
              "to this user (see the warning above)", file=sys.stderr)
        return 1
    print(entry)
    logging.getLogger("minigpt").info("ready in %.1f s", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
