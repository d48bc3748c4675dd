"""Print the README's first ```bash block under a heading, one command a line (continuations joined).

    python .ci/readme_block.py "Quick start"
"""

import sys
from pathlib import Path


def block(readme: str, heading: str) -> list[str]:
    lines = iter(readme.splitlines())
    for line in lines:
        if line.startswith("#") and line.lstrip("#").strip().startswith(heading):
            break
    else:
        raise SystemExit(f"README.md has no heading starting {heading!r}")
    for line in lines:
        if line.strip() == "```bash":
            break
    else:
        raise SystemExit(f"README.md has no ```bash block under {heading!r}")
    commands, current = [], ""
    for line in lines:
        if line.strip() == "```":
            return commands
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
        elif current.strip():
            commands.append(current.strip())
            current = ""
    raise SystemExit(f"README.md's block under {heading!r} is not closed")


if __name__ == "__main__":
    print("\n".join(block(Path(__file__).parent.parent.joinpath("README.md").read_text(encoding="utf-8"), sys.argv[1])))
