"""The keyframes the first/last-frame template ships, drawn from formulas (no binary source)."""

from __future__ import annotations

from typing import Any

# The keyframes the first/last-frame template loads: a harbour at dawn and the same harbour at night
# (its prompt), drawn from formulas so the tool rewrites the same pixels; 7:4 like H3's 1344x768.
KEYFRAMES = {"diffusers_offload_h3_first_frame.png": "dawn", "diffusers_offload_h3_last_frame.png": "night"}
KEYFRAME_SIZE = (336, 192)


def keyframe(kind: str) -> Any:
    """The ``"dawn"`` or ``"night"`` harbour as an RGB PIL image of :data:`KEYFRAME_SIZE`."""
    import numpy as np
    from PIL import Image

    night = {"dawn": False, "night": True}[kind]
    width, height = KEYFRAME_SIZE
    horizon = int(height * 0.58)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    image = np.zeros((height, width, 3))

    def blend(top: tuple[int, int, int], bottom: tuple[int, int, int], t: Any) -> Any:
        return np.asarray(top) * (1 - t[..., None]) + np.asarray(bottom) * t[..., None]

    sky, sea = y < horizon, y >= horizon
    light_x, light_y, radius = (0.25 * width, 0.2 * height, 9) if night else (0.7 * width, horizon - 8, 15)
    top, glow = ((5, 8, 25), (28, 38, 75)) if night else ((70, 92, 150), (250, 170, 110))
    image[sky] = blend(top, glow, y / horizon)[sky]
    deep, shallow = ((14, 20, 42), (3, 5, 12)) if night else ((46, 88, 118), (16, 42, 62))
    image[sea] = blend(deep, shallow, (y - horizon) / (height - horizon))[sea]
    disc = (x - light_x) ** 2 + (y - light_y) ** 2 <= radius**2
    halo = np.exp(-((x - light_x) ** 2 + (y - light_y) ** 2) / (2 * (radius * 3.0) ** 2))
    body = (235, 235, 215) if night else (255, 222, 165)
    image[sky] += (halo * (0.25 if night else 0.6))[sky][:, None] * (np.asarray(body) - image[sky])
    image[disc & sky] = body
    ripple = (np.sin(y * 1.9) > 0.5) & (np.abs(x - light_x) < radius * (0.8 + (y - horizon) / 60)) & sea
    image[ripple] = image[ripple] * 0.6 + np.asarray(body) * 0.4
    if night:  # stars from a fixed integer hash: the same sky on every machine
        for i in range(40):
            sx, sy = (i * 7919 + i * i * 613) % width, (i * 331 + i * i * i * 17) % int(horizon * 0.85)
            image[sy, sx] = (220, 220, 235)
    shade = np.asarray((0, 0, 0) if night else (32, 26, 38))
    pier = (y >= horizon + 6) & (y < horizon + 11) & (x < 0.45 * width)
    posts = (y >= horizon + 11) & (y < horizon + 20) & (x < 0.45 * width) & ((x.astype(int) % 18) < 3)
    house = (x >= 0.04 * width) & (x < 0.16 * width) & (y >= horizon - 24) & (y < horizon + 6)
    roof = (y < horizon - 24) & (y >= horizon - 36) & (np.abs(x - 0.10 * width) < (y - (horizon - 36)) * 1.7)
    hull = (y >= horizon + 16) & (y < horizon + 24) & (np.abs(x - 0.63 * width) < 30 - (y - horizon - 16) * 1.5)
    mast = (np.abs(x - 0.63 * width) < 1.2) & (y >= horizon - 30) & (y < horizon + 16)
    image[pier | posts | house | roof | hull | mast] = shade
    window = (x >= 0.08 * width) & (x < 0.12 * width) & (y >= horizon - 16) & (y < horizon - 8)
    image[window] = (255, 196, 84) if night else (60, 52, 66)
    return Image.fromarray(np.clip(np.rint(image), 0, 255).astype(np.uint8), "RGB")
