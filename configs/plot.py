"""Line plots drawn with PIL (matplotlib is not a dependency): the run's report.png (configs/report.py) and
the step-cache benchmark's plot (scripts/bench_cache.py).

    axes = Axes(draw, (left, top, right, bottom), (x_min, x_max), (y_min, y_max))
    axes.frame("loss"); axes.x_ticks([0, 100]); axes.y_ticks([0.1, 2.0]); axes.line(steps, losses, "navy")
"""

import math

from PIL import ImageFont


def load_font(size: int = 13):
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow < 10.1 or no FreeType: the fixed bitmap font
        return ImageFont.load_default()


def span(low: float, high: float) -> tuple[float, float]:
    """A range of non-zero width: a single value is widened around itself."""
    if high > low:
        return low, high
    pad = abs(low) * 0.05 or 1.0
    return low - pad, high + pad


class Axes:
    """A rectangle of an image (pixels) that shows x_range x y_range (data units), lower y at the bottom."""

    def __init__(self, draw, box, x_range, y_range, font=None):
        self.draw, self.box, self.font = draw, box, font or load_font()
        (self.x0, self.x1), (self.y0, self.y1) = span(*x_range), span(*y_range)

    def at(self, x: float, y: float) -> tuple[float, float]:
        left, top, right, bottom = self.box
        return (
            left + (x - self.x0) / (self.x1 - self.x0) * (right - left),
            bottom - (y - self.y0) / (self.y1 - self.y0) * (bottom - top),
        )

    def text(self, xy, text: str, fill="black", align: str = "left", middle: bool = False) -> None:
        """Text whose left, centre or right edge (align) is at xy[0]; its top at xy[1], or its middle."""
        width = self.draw.textlength(text, font=self.font)
        x = xy[0] - {"left": 0, "centre": width / 2, "right": width}[align]
        y = xy[1] - (self.font.size // 2 + 2 if middle and hasattr(self.font, "size") else 0)
        self.draw.text((x, y), text, fill=fill, font=self.font)

    def frame(self, title: str = "", colour="black") -> None:
        """The x and y axis lines (at the ranges' low ends), and the title above the box."""
        left, top, right, bottom = self.box
        self.draw.line([(left, top), (left, bottom), (right, bottom)], fill=colour)
        if title:
            self.text((left, top - 20), title)

    def x_ticks(self, values, fmt: str = "{:g}") -> None:
        for value in values:
            x, y = self.at(value, self.y0)
            self.draw.line([(x, y), (x, y + 4)], fill="black")
            self.text((x, y + 6), fmt.format(value), align="centre")

    def y_ticks(self, values, fmt="{:.3g}", grid=None) -> None:
        """Labels left of the y axis (fmt: a format string or a function); with `grid` (a colour), a line
        across the box at each."""
        left, _, right, _ = self.box
        for value in values:
            _, y = self.at(self.x0, value)
            if grid:
                self.draw.line([(left + 1, y), (right, y)], fill=grid)
            self.draw.line([(left - 4, y), (left, y)], fill="black")
            label = fmt(value) if callable(fmt) else fmt.format(value)
            self.text((left - 6, y), label, align="right", middle=True)

    def line(self, xs, ys, fill, width: int = 1) -> None:
        """A polyline through the finite points (NaN and inf are left out)."""
        points = [self.at(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
        if len(points) > 1:
            self.draw.line(points, fill=fill, width=width, joint="curve")
        for px, py in points if len(points) == 1 else []:
            self.dot((px, py), fill, 2)

    def dot(self, xy, fill, radius: int = 4) -> None:
        px, py = xy
        self.draw.ellipse([px - radius, py - radius, px + radius, py + radius], fill=fill)
