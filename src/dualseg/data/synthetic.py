"""Procedurally drawn street scenes (the ``dualseg demo`` dataset): label and image drawn at
once with OpenCV, with per-object colours and per-class textures so colour alone does not give
the class; poles 1-3 px wide. A pure function of ``(seed, split, index)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np

from dualseg.data.presets import META_FILE, SYNTHETIC
from dualseg.errors import DataError
from dualseg.io import atomic_write_bytes, atomic_write_json, atomic_write_text, encode_image

SKY, BUILDING, ROAD, SIDEWALK, VEGETATION, CAR, POLE, SIGN = range(8)
STAMP_FILE = "synthetic.json"

FORMAT = "dualseg-synthetic/1"

# Per-class texture: (fine-noise amplitude, low-frequency amplitude) in 0..255 units.
_TEXTURE = np.array(
    [(2, 10), (7, 14), (9, 10), (6, 8), (30, 18), (4, 6), (3, 2), (3, 2)], dtype=np.float32
)


def _jitter(rng: np.random.Generator, base, spread: float) -> tuple[float, float, float]:
    c = np.clip(np.asarray(base, dtype=np.float64) + rng.normal(0, spread, 3), 0, 255)
    return tuple(float(v) for v in c)


def _fill(label, canvas, pts, cls, color) -> None:
    pts = [np.round(np.asarray(pts)).astype(np.int32)]
    if cls is not None:
        cv2.fillPoly(label, pts, int(cls))
    cv2.fillPoly(canvas, pts, color)


def _rect(label, canvas, x0, y0, x1, y1, cls, color) -> None:
    _fill(label, canvas, [(x0, y0), (x1, y0), (x1, y1), (x0, y1)], cls, color)


def _buildings(rng, label, canvas, h, w, horizon) -> None:
    x = -rng.uniform(0, 0.1 * w)
    while x < w:
        bw = rng.uniform(0.12, 0.35) * w
        top = rng.uniform(0.04, 0.8) * horizon
        bottom = horizon + rng.uniform(0.0, 0.12) * h
        if rng.random() < 0.8:
            base = rng.choice([(150, 90, 70), (120, 120, 125), (190, 170, 140), (95, 80, 70)])
            color = _jitter(rng, base, 18)
            _rect(label, canvas, x, top, x + bw, bottom, BUILDING, color)
            # window grid: colour only, label stays "building"
            wc = _jitter(rng, rng.choice([(40, 50, 70), (200, 210, 220)]), 15)
            step_x, step_y = rng.uniform(6, 12), rng.uniform(7, 13)
            ww, wh = step_x * rng.uniform(0.35, 0.6), step_y * rng.uniform(0.35, 0.6)
            for yy in np.arange(top + 3, bottom - wh - 2, step_y):
                for xx in np.arange(x + 3, x + bw - ww - 2, step_x):
                    _rect(label, canvas, xx, yy, xx + ww, yy + wh, None, wc)
        x += bw + rng.uniform(-0.05, 0.08) * w


def _trees(rng, label, canvas, h, w, horizon) -> None:
    for _ in range(rng.integers(0, 4)):
        cx, cy = rng.uniform(0, w), horizon - rng.uniform(0.0, 0.25) * h
        color = _jitter(rng, (60, 110, 40), 20)
        for _ in range(rng.integers(3, 7)):
            r = rng.uniform(0.04, 0.1) * w
            c = (int(cx + rng.normal(0, r)), int(cy + rng.normal(0, r * 0.6)))
            cv2.circle(label, c, int(r), VEGETATION, -1)
            cv2.circle(canvas, c, int(r), _jitter(rng, color, 8), -1)


def _ground(rng, label, canvas, h, w, horizon) -> tuple[float, float, float, float]:
    vx = rng.uniform(0.3, 0.7) * w
    road_l, road_r = vx - rng.uniform(0.5, 1.0) * w, vx + rng.uniform(0.5, 1.0) * w
    walk = rng.uniform(0.15, 0.4) * w
    walk_color = _jitter(rng, (170, 160, 150), 15)
    for a, b in ((road_l - walk, road_l), (road_r, road_r + walk)):
        _fill(label, canvas, [(vx, horizon), (a, h), (b, h)], SIDEWALK, walk_color)
    road_color = _jitter(rng, (90, 90, 95), 12)
    _fill(label, canvas, [(vx, horizon), (road_l, h), (road_r, h)], ROAD, road_color)
    # dashed centre line (paint on the road: colour only)
    line = _jitter(rng, (230, 230, 210), 10)
    ts = np.linspace(0.05, 1.0, 9)
    for t0, t1 in zip(ts[::2], ts[1::2]):
        y0, y1 = horizon + t0 * (h - horizon), horizon + t1 * (h - horizon)
        half0, half1 = 0.5 + 2 * t0, 0.5 + 2 * t1
        quad = [(vx - half0, y0), (vx + half0, y0), (vx + half1, y1), (vx - half1, y1)]
        _fill(label, canvas, quad, None, line)
    return vx, road_l, road_r, walk


def _cars(rng, label, canvas, h, w, horizon, vx, road_l, road_r) -> None:
    ys = np.sort(rng.uniform(horizon + 0.12 * h, h + 0.1 * h, rng.integers(0, 4)))
    for y in ys:  # far to near: nearer cars occlude farther ones
        t = (y - horizon) / (h - horizon)  # perspective scale 0 (horizon) .. 1 (bottom)
        cw = (0.18 + 0.25 * t) * w * rng.uniform(0.85, 1.15)
        ch = cw * rng.uniform(0.45, 0.6)
        lo, hi = vx + (road_l - vx) * t, vx + (road_r - vx) * t
        cx = rng.uniform(lo + cw / 2, max(lo + cw / 2 + 1, hi - cw / 2))
        body = _jitter(rng, rng.integers(20, 235, 3), 10)
        x0, x1, top = cx - cw / 2, cx + cw / 2, y - ch
        _rect(label, canvas, x0, y - 0.55 * ch, x1, y - 0.12 * ch, CAR, body)
        for (a, b, dy, dt), cls, color in (
            ((0.18, 0.3, 0.55, 0.0), CAR, body),  # roof
            ((0.26, 0.34, 0.58, 0.12), None, _jitter(rng, (40, 55, 70), 10)),  # glass
        ):
            quad = [(x0 + a * cw, y - dy * ch), (x0 + b * cw, top + dt * ch)]
            quad += [(x1 - b * cw, top + dt * ch), (x1 - a * cw, y - dy * ch)]
            _fill(label, canvas, quad, cls, color)
        r = max(1, int(0.12 * ch))
        for wx in (x0 + 0.22 * cw, x1 - 0.22 * cw):
            c = (int(wx), int(y - 0.12 * ch))
            cv2.circle(label, c, r, CAR, -1)
            cv2.circle(canvas, c, r, (20.0, 20.0, 22.0), -1)


def _poles(rng, label, canvas, h, w, horizon, vx, road_l, road_r, walk) -> None:
    for _ in range(rng.integers(1, 4)):
        t = rng.uniform(0.25, 1.0)
        side = rng.choice([-1, 1])
        edge = vx + ((road_l - 0.5 * walk if side < 0 else road_r + 0.5 * walk) - vx) * t
        if not 0 <= edge < w:
            edge = rng.uniform(0.05, 0.95) * w
        bottom = horizon + t * (h - horizon)
        top = max(0.0, bottom - rng.uniform(0.5, 0.9) * h * (0.4 + 0.6 * t))
        thick = int(rng.integers(1, 4))
        color = _jitter(rng, rng.choice([(70, 70, 70), (140, 140, 135), (50, 60, 45)]), 10)
        _rect(label, canvas, edge, top, edge + thick - 1, bottom, POLE, color)
        if rng.random() < 0.6:  # a sign near the top of the pole
            s = rng.uniform(0.05, 0.09) * w * (0.5 + 0.5 * t)
            sc = _jitter(
                rng, rng.choice([(200, 30, 30), (30, 70, 190), (230, 200, 30), (235, 235, 235)]), 12
            )
            sy = top + rng.uniform(0.0, 0.2) * (bottom - top)
            if rng.random() < 0.5:
                _rect(label, canvas, edge - s / 2, sy, edge + s / 2, sy + s, SIGN, sc)
            else:
                c, r = (int(edge), int(sy + s / 2)), max(2, int(s / 2))
                cv2.circle(label, c, r, SIGN, -1)
                cv2.circle(canvas, c, r, sc, -1)


def draw_scene(rng: np.random.Generator, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One street scene: ``(image uint8 HxWx3, label uint8 HxW)`` with ``SYNTHETIC`` classes."""
    h, w = size
    label = np.zeros((h, w), np.uint8)  # SKY
    canvas = np.zeros((h, w, 3), np.float32)
    horizon = rng.uniform(0.38, 0.55) * h
    top, bottom = _jitter(rng, (90, 140, 215), 20), _jitter(rng, (190, 210, 230), 15)
    ramp = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    canvas[:] = (1 - ramp) * np.array(top, np.float32) + ramp * np.array(bottom, np.float32)
    _rect(label, canvas, 0, horizon, w, h, VEGETATION, _jitter(rng, (80, 120, 50), 15))  # grass
    _buildings(rng, label, canvas, h, w, horizon)
    _trees(rng, label, canvas, h, w, horizon)
    vx, road_l, road_r, walk = _ground(rng, label, canvas, h, w, horizon)
    _cars(rng, label, canvas, h, w, horizon, vx, road_l, road_r)
    _poles(rng, label, canvas, h, w, horizon, vx, road_l, road_r, walk)

    # textures: per-class fine grain + low-frequency blotches, then global light and sensor noise
    fine = rng.normal(0, 1, (h, w, 1)).astype(np.float32)
    low = cv2.resize(rng.normal(0, 1, (h // 12 + 2, w // 12 + 2)).astype(np.float32), (w, h))
    amp = _TEXTURE[label]  # HxWx2
    canvas += amp[..., :1] * fine + amp[..., 1:] * low[..., None]
    light = cv2.resize(rng.normal(1.0, 0.08, (3, 4)).astype(np.float32), (w, h))
    canvas *= light[..., None] * rng.uniform(0.75, 1.2)
    canvas = cv2.GaussianBlur(canvas, (3, 3), 0.6)
    canvas += rng.normal(0, 3.0, canvas.shape).astype(np.float32)
    return np.clip(canvas, 0, 255).astype(np.uint8), label


def holds_foreign_files(root: Path) -> bool:
    """Whether ``root`` is a non-empty folder without the generator's stamp."""
    return not (root / STAMP_FILE).is_file() and root.is_dir() and any(root.iterdir())


def make_synthetic_dataset(
    root: str | Path,
    *,
    n_train: int,
    n_val: int,
    size: tuple[int, int] = (96, 128),
    seed: int = 0,
    replace: bool = False,
) -> Path:
    """Write (or reuse) a synthetic dataset in the list-file layout; return ``root``.

    A complete one with the same arguments is reused; one of other arguments or half-written is
    rewritten; any other non-empty folder is refused unless ``replace`` (the caller owns it).
    """
    root = Path(root)
    h, w = int(size[0]), int(size[1])
    settings = {"format": FORMAT, "n_train": n_train, "n_val": n_val, "size": [h, w], "seed": seed}
    stamp = root / STAMP_FILE
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text(encoding="utf-8")) == settings:
                return root
        except (OSError, ValueError):  # JSONDecodeError, UnicodeDecodeError (not UTF-8)
            pass  # an unreadable stamp (a generated file): regenerate
    elif not replace and holds_foreign_files(root):
        raise DataError(
            f"{root} holds files that make_synthetic_dataset did not write (no {STAMP_FILE}); "
            "give an empty or new folder"
        )
    # the stamp first, marked incomplete, so an interrupted call leaves a folder ours to rewrite
    atomic_write_json(stamp, {**settings, "complete": False})
    for split_id, (split, n) in enumerate((("train", n_train), ("val", n_val))):
        lines = []
        for i in range(n):
            rng = np.random.default_rng([seed, split_id, i])
            image, label = draw_scene(rng, (h, w))
            name = f"{split}_{i:05d}.png"
            atomic_write_bytes(root / "images" / name, encode_image(image))
            atomic_write_bytes(root / "labels" / name, encode_image(label))
            lines.append(f"images/{name} labels/{name}\n")
        atomic_write_text(root / f"{split}.txt", "".join(lines))
    atomic_write_json(root / META_FILE, SYNTHETIC.to_dict())
    atomic_write_json(stamp, settings)
    return root
