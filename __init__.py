"""ComfyUI entry point of the Diffusers Offload pack.

Only the extension and the web directory live here; ComfyUI is imported lazily so that the
engine (``offload_core``) stays importable without a ComfyUI on the path.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes.extension import DiffusersOffloadExtension

    return DiffusersOffloadExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
