"""Take the README's screenshots (docs/node_view.png, panel.png, preview.png) from a browser session.

Why a tool and not the tests: the browser tests must write nothing tracked, so the pictures are
retaken only on purpose (``make screenshots``), from the same session the tests check, its server
launched with previews on (``--preview-method latent2rgb``) for the generate node's preview. Needs what
``tests/web/setup.sh`` installs (the make target runs it first).

    .venv/bin/python tools/screenshots.py [--out docs]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "web"))  # tests/web and, through it, tests/ and tools/
from browser_session import SHOT_NAMES, SessionUnavailable, failure, run_session  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder the pictures are written to")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    shots = {key: args.out.resolve() / name for key, name in SHOT_NAMES.items()}
    with tempfile.TemporaryDirectory(prefix="offload-shots-") as work:
        try:
            record = run_session(Path(work), shots, previews=True)
        except SessionUnavailable as exc:
            print(f"cannot take screenshots: {exc}", file=sys.stderr)
            return 2
    problem = failure(record)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    for path in shots.values():
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
