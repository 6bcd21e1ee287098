"""``python -m kvtier.testing.tinymodels vl DIR``: build the tiny Qwen2.5-VL (or ``text``: the
tiny Qwen2) into DIR, readable by every user (an engine pod runs as another user)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvtier.testing.tinymodels import build_text_model, build_vl_model

BUILDERS = {"vl": build_vl_model, "text": build_text_model}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.testing.tinymodels", description=__doc__
    )
    parser.add_argument("kind", choices=sorted(BUILDERS))
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    out = BUILDERS[args.kind](args.dir)
    for path in [out, *out.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
