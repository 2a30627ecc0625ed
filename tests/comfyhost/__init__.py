"""Test-only helpers that run a real ComfyUI in-process (``comfyhost.harness``).

Named ``comfyhost`` and not ``comfy`` because ``comfy`` is ComfyUI's own top-level package.
"""
