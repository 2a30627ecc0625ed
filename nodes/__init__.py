"""ComfyUI adapters of the pack: thin V3 nodes over the host-free engine in ``offload_core``.

Reached only through package-relative imports (``from .nodes import ...``): a top-level ``nodes``
is ComfyUI's own module. ``host.py`` is the one file that talks to ComfyUI's model management.
"""
