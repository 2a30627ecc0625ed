"""MiniMax-H3: its size grid and the per-run view over a loaded modular pipeline."""
