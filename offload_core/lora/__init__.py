"""LoRA under offload: reading files (``files``) and making a set effective (``apply``)."""

from .apply import INTO, LoraSpec, activate, check, set_signature
from .files import LoraError

__all__ = ["INTO", "LoraError", "LoraSpec", "activate", "check", "set_signature"]
