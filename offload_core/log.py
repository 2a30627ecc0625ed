"""The pack-level logger: one name whatever module path the host imported the pack under."""

import logging

LOGGER_NAME = "diffusers_offload"


def get_logger(part: str) -> logging.Logger:
    """Child logger of the pack logger, e.g. ``diffusers_offload.engine``."""
    return logging.getLogger(f"{LOGGER_NAME}.{part}")
