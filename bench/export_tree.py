"""Export a bare git mirror's HEAD into a folder, skipping the blobs the mirror lacks.

Why: the 2026 ComfyUI tree that `comfy_coexist.sh prep` copies into `.gpu/` comes from the
`fetch` tool's snapshot of kat3ri/ComfyUI, a bare repository whose largest files (two tokenizer
JSONs, never read by the benches) are absent, so `git archive` stops at the first of them.

    python3 bench/export_tree.py /work/.mirror/kat3ri+ComfyUI/repo /work/comfyui-2026
    bash bench/comfy_coexist.sh prep /work/comfyui-2026
"""

from __future__ import annotations

import os
import subprocess
import sys


def export(repo: str, out: str) -> tuple[int, list[str]]:
    """(files written, paths skipped): every blob of HEAD under ``out``, symlinks as symlinks."""
    listing = subprocess.run(["git", "-C", repo, "ls-tree", "-r", "-z", "HEAD"], capture_output=True, check=True)
    written, missing = 0, []
    for entry in filter(None, listing.stdout.split(b"\0")):
        meta, path = entry.split(b"\t", 1)
        mode, kind, sha = meta.split()
        if kind != b"blob":
            continue
        blob = subprocess.run(["git", "-C", repo, "cat-file", "blob", sha], capture_output=True)
        if blob.returncode:
            missing.append(path.decode())
            continue
        target = os.path.join(out, path.decode())
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if mode == b"120000":
            os.symlink(blob.stdout.decode(), target)
        else:
            with open(target, "wb") as f:
                f.write(blob.stdout)
        written += 1
    return written, missing


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    n, skipped = export(sys.argv[1], sys.argv[2])
    print(f"{n} files written; skipped (absent from the mirror): {', '.join(skipped) or 'none'}")
