"""Host-independent offload engine: places every component of a diffusers pipeline by role.

Data flows one way: a host (the ComfyUI nodes, a script, a test) builds an `OffloadConfig`, calls
`Engine.place(pipe, config)` and gets a `PlacementReport`; `Engine.release(pipe)` takes everything
back. Nothing here imports ComfyUI.
"""

from .components import Components
from .config import OffloadConfig, OffloadConfigError
from .engine import Engine
from .report import ComponentReport, PlacementReport

__all__ = [
    "Components",
    "ComponentReport",
    "Engine",
    "OffloadConfig",
    "OffloadConfigError",
    "PlacementReport",
]
