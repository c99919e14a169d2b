"""The rule every figure keeps: each label reads at >= 10 px where GitHub shows it, in a font any
viewer has.

GitHub shows an image at its own width, scaled down to the content column (about 830 px) when
wider. A label of `size` px in a figure `width` px wide therefore reads at
    effective_px = size × min(1, COLUMN_PX / width)
(a 9 pt label in a 1400 px figure: 12 × 830/1400 ≈ 7 px). An SVG's sizes are in its viewBox's
units, which a browser maps to CSS px by width_px / viewBox width (width "648pt" = 864 px).

The text of an SVG is text (svg.fonttype "none"), set in a font the viewer may lack; so every
font-family must end in a generic family (sans-serif, ...) that the browser always has.
`svg_problems` reads a written SVG; `figure_problems` reads a live matplotlib figure (for a PNG,
or before saving).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

COLUMN_PX = 830.0  # GitHub's content column, at its widest
MIN_PX = 10.0  # the smallest label that reads
CSS_PX_PER_INCH = 96.0  # an SVG's "pt" is 1/72 inch; a CSS px 1/96 inch
GENERIC = ("serif", "sans-serif", "monospace", "cursive", "fantasy", "system-ui")
UNITS_PX = {"": 1.0, "px": 1.0, "pt": 4 / 3, "in": 96.0, "cm": 96 / 2.54, "mm": 9.6 / 2.54}


def effective_px(size_px: float, width_px: float) -> float:
    """A label's size on GitHub: `size_px` in an image `width_px` wide."""
    return size_px * min(1.0, COLUMN_PX / width_px)


def min_points(width_in: float) -> float:
    """The smallest font size (pt) that reads at MIN_PX in an SVG `width_in` inches wide."""
    px_per_pt = CSS_PX_PER_INCH / 72 * min(1.0, COLUMN_PX / (width_in * CSS_PX_PER_INCH))
    return MIN_PX / px_per_pt


def has_generic(family: str) -> bool:
    """Whether a CSS font-family list ends in a generic family the viewer always has."""
    names = [n.strip().strip("'\"").lower() for n in family.split(",")]
    return bool(names) and names[-1] in GENERIC


def _length_px(value: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", value)
    if not m or m.group(2) not in UNITS_PX:
        raise ValueError(f"SVG length {value!r}: expected a number with px, pt, in, cm or mm")
    return float(m.group(1)) * UNITS_PX[m.group(2)]


def svg_problems(svg: str) -> list[str]:
    """Each text of an SVG that reads below MIN_PX on GitHub, or whose font has no generic
    fallback, as 'text: why' (empty: the figure is legible)."""
    root = ET.fromstring(svg)
    width_px = _length_px(root.get("width", "0"))
    view_w = float(root.get("viewBox", f"0 0 {width_px} 0").split()[2])
    px_per_unit = min(width_px, COLUMN_PX) / view_w
    problems: list[str] = []

    def walk(node: ET.Element, inherited: dict[str, str]) -> None:
        style = dict(inherited)
        if "scale" in node.get("transform", ""):
            style["scaled"] = "yes"
        for decl in node.get("style", "").split(";"):
            if ":" in decl:
                key, value = decl.split(":", 1)
                style[key.strip()] = value.strip()
        tag = node.tag.rsplit("}", 1)[-1]
        text = (node.text or "").strip()
        if text and (tag == "tspan" or (tag == "text" and not len(node))):
            if "scaled" in style:
                raise ValueError(f"{text!r} is under a scale() transform, so its size cannot be "
                                 f"read: write SVG text as text (svg.fonttype 'none', draw.style)")
            size = _length_px(style.get("font-size", "0"))
            seen = effective_px(size * px_per_unit, COLUMN_PX)
            if seen < MIN_PX - 1e-6:
                problems.append(f"{text!r}: {size:g} units read at {seen:.1f} px on GitHub "
                                f"(< {MIN_PX:g}; the image is {width_px:.0f} px wide)")
            if not has_generic(style.get("font-family", "")):
                problems.append(f"{text!r}: font-family {style.get('font-family')!r} has no "
                                f"generic fallback ({', '.join(GENERIC)})")
        for child in node:
            walk(child, style)

    walk(root, {})
    return problems


def figure_problems(fig, dpi: float = CSS_PX_PER_INCH) -> list[str]:
    """The same rule on a live matplotlib figure saved with bbox_inches="tight" at `dpi` image px
    per inch (an SVG: 96 CSS px per inch; a PNG: its savefig dpi)."""
    import matplotlib as mpl
    from matplotlib.text import Text

    fig.canvas.draw()
    width_px = (fig.get_tightbbox().width + 2 * mpl.rcParams["savefig.pad_inches"]) * dpi
    problems = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip():
            continue
        seen = effective_px(t.get_fontsize() * dpi / 72, width_px)
        if seen < MIN_PX - 1e-6:
            problems.append(f"{t.get_text()!r}: {t.get_fontsize():g} pt reads at {seen:.1f} px on "
                            f"GitHub (< {MIN_PX:g}; the image is {width_px:.0f} px wide)")
    return problems
