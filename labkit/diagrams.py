"""The labs' diagrams, drawn from what the library computes, as plain SVG: no plotting package, the same bytes on every
machine. Pipeline schedules are the estimator's own (labkit.estimate.timing plays out 1F1B and interleaved 1F1B);
what each layer keeps under activation recomputation is labkit.estimate.recompute's.

`python -m labkit.diagrams [--out images]` (or `labkit diagrams`) regenerates images/. In a notebook,
`show(pipeline_schedule_svg(4, 8, 2))` draws one inline.
"""
from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from labkit.paths import course_dir, example
from labkit.spec import RunSpec, load_spec
from labkit.spec.layout import layout_of

if TYPE_CHECKING:
    from labkit.estimate.timing import Event

FORWARD_COLOR = "#4c78a8"
CHUNK_SHADES = ("#4c78a8", "#72b7b2", "#54a24b", "#b279a2")  # forward colour per model chunk (virtual stage)
BACK_SHADES = ("#f58518", "#e45756", "#eeca3b", "#9d755d")
GPU_COLORS = {"A100-40GB": "#4c78a8", "A100-80GB": "#4c78a8", "H100-80GB": "#54a24b", "A10": "#f58518",
              "V100-32GB": "#b279a2", "T4": "#9d755d", "cpu": "#bab0ac"}


# --- a minimal SVG writer ---------------------------------------------------------------------------------------------

class Svg:
    """Accumulates SVG elements; numbers are rounded so output bytes never depend on float noise."""

    def __init__(self, width: float, height: float):
        self.width, self.height = width, height
        self.items: list[str] = []

    @staticmethod
    def _n(x: float) -> str:
        return f"{round(x, 2):g}"

    def rect(self, x, y, w, h, fill, stroke="#333", extra=""):
        self.items.append(f'<rect x="{self._n(x)}" y="{self._n(y)}" width="{self._n(w)}" height="{self._n(h)}" '
                          f'fill="{fill}" stroke="{stroke}" stroke-width="0.8"{extra}/>')

    def text(self, x, y, content, size=12, anchor="start", weight="normal", fill="#222"):
        self.items.append(f'<text x="{self._n(x)}" y="{self._n(y)}" font-size="{size}" text-anchor="{anchor}" '
                          f'font-weight="{weight}" fill="{fill}">{html.escape(str(content))}</text>')

    def line(self, x1, y1, x2, y2, stroke="#333", width=1.2, arrow=False, dash=""):
        marker = ' marker-end="url(#arrow)"' if arrow else ""
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<line x1="{self._n(x1)}" y1="{self._n(y1)}" x2="{self._n(x2)}" y2="{self._n(y2)}" '
                          f'stroke="{stroke}" stroke-width="{width}"{marker}{dashed}/>')

    def render(self) -> str:
        defs = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#333"/></marker>'
                '<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
                '<rect width="6" height="6" fill="#fff"/><line x1="0" y1="0" x2="0" y2="6" stroke="#e45756" '
                'stroke-width="3"/></pattern></defs>')
        body = "\n".join(self.items)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self._n(self.width)}" '
                f'height="{self._n(self.height)}" viewBox="0 0 {self._n(self.width)} {self._n(self.height)}" '
                f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">\n{defs}\n'
                f'<rect width="100%" height="100%" fill="#fff"/>\n{body}\n</svg>\n')


# --- pipeline schedules -----------------------------------------------------------------------------------------------

def pipeline_schedule(stages: int, micro_batches: int, chunks: int = 1, forward_time: float = 1.0,
                      backward_time: float = 2.0) -> list[Event]:
    """The events of a 1F1B (chunks=1) or interleaved (chunks > 1 model chunks per stage) step over equal stages
    with free sends, as the estimator plays it out (labkit.estimate.timing.schedule_1f1b) with the sends posted
    asynchronously, as Megatron does on GPUs (overlap_p2p_comm) and SC21 draws it; a chunk's work is 1/chunks of a
    stage's.

    Taught in lab 07.
    """
    from labkit.estimate.timing import Pipeline  # numpy, with the estimator: not for `labkit --help`

    if stages < 1 or micro_batches < 1 or chunks < 1:
        raise ValueError("stages, micro_batches and chunks must be >= 1")
    work = forward_time + backward_time
    return Pipeline((work,) * stages, (0.0,) * (stages - 1), micro_batches, chunks,
                    backward_shares=(backward_time / work,) * stages, overlap_sends=True).events()


def pipeline_schedule_svg(stages: int = 4, micro_batches: int = 8, chunks: int = 1, title: str | None = None,
                          time_scale: float = 26.0) -> str:
    ops = pipeline_schedule(stages, micro_batches, chunks)
    return _schedules_svg([(title or _schedule_title(stages, micro_batches, chunks), ops)], stages, time_scale)


def _schedule_title(stages, micro_batches, chunks):
    name = "1F1B" if chunks == 1 else f"interleaved 1F1B, {chunks} chunks per stage"
    return f"{name}: {stages} stages, {micro_batches} micro-batches"


def _schedules_svg(panels, stages, time_scale=26.0) -> str:
    from labkit.estimate.timing import bubble_fraction

    left, row_h, panel_gap = 70, 26, 54
    span = max(max(op.end_s for op in ops) for _, ops in panels)
    width = left + span * time_scale + 30
    height = 20 + len(panels) * (stages * row_h + panel_gap) + 30
    svg = Svg(width, height)
    y0 = 20
    for title, ops in panels:
        bubble = bubble_fraction(ops)
        svg.text(left, y0 + 14, f"{title}  (bubble {bubble:.0%})", size=14, weight="bold")
        top = y0 + 24
        for s in range(stages):
            svg.text(left - 8, top + s * row_h + row_h / 2 + 4, f"stage {s}", anchor="end")
        for op in ops:
            shades = CHUNK_SHADES if op.op == "forward" else BACK_SHADES
            x, w = left + op.start_s * time_scale, (op.end_s - op.start_s) * time_scale
            svg.rect(x, top + op.stage * row_h, w, row_h - 4, shades[op.chunk % len(shades)])
            if w >= 11:
                svg.text(x + w / 2, top + op.stage * row_h + row_h / 2 + 2, op.micro_batch + 1, size=10,
                         anchor="middle", fill="#fff")
        end = max(op.end_s for op in ops)
        svg.line(left + end * time_scale, top - 4, left + end * time_scale, top + stages * row_h, dash="4,3")
        y0 = top + stages * row_h + panel_gap - 24
    svg.rect(left, height - 26, 14, 12, CHUNK_SHADES[0])
    svg.text(left + 20, height - 16, "forward (number = micro-batch)", size=11)
    svg.rect(left + 230, height - 26, 14, 12, BACK_SHADES[0])
    svg.text(left + 250, height - 16, "backward (twice the forward)", size=11)
    svg.text(left + 450, height - 16, "lighter shades: the second model chunk", size=11)
    return svg.render()


def pipeline_schedules_svg(stages: int = 4, micro_batches: int = 8, chunks: int = 2) -> str:
    """1F1B above interleaved 1F1B for the same work: the interleaved bubble is 1/chunks as long."""
    panels = [(_schedule_title(stages, micro_batches, 1), pipeline_schedule(stages, micro_batches, 1)),
              (_schedule_title(stages, micro_batches, chunks), pipeline_schedule(stages, micro_batches, chunks))]
    return _schedules_svg(panels, stages)


# --- activation checkpointing -----------------------------------------------------------------------------------------

def activation_checkpointing_svg(layers: int = 8) -> str:
    from labkit.estimate.recompute import stored_activations  # pandas: not for `labkit --help`

    rows = [("no recompute", stored_activations(layers, None)),
            ("full, uniform, 2 layers per group", stored_activations(layers, "full", "uniform", 2)),
            ("full, block, first 3 layers", stored_activations(layers, "full", "block", 3)),
            ("selective (attention core only)", stored_activations(layers, "selective"))]
    left, box, gap, row_h = 250, 46, 8, 60
    svg = Svg(left + layers * (box + gap) + 20, 70 + len(rows) * row_h + 60)
    svg.text(20, 26, "What each layer keeps for the backward pass", size=15, weight="bold")
    for i in range(layers):
        svg.text(left + i * (box + gap) + box / 2, 52, f"layer {i + 1}", size=10, anchor="middle")
    for r, (label, kept) in enumerate(rows):
        y = 64 + r * row_h
        svg.text(left - 12, y + box / 2 + 4, label, anchor="end")
        for i, what in enumerate(kept):
            x = left + i * (box + gap)
            if what == "all":
                svg.rect(x, y, box, box, FORWARD_COLOR)
            elif what == "input":
                svg.rect(x, y, box, box, "url(#hatch)")
                svg.rect(x, y, 8, box, FORWARD_COLOR)
            elif what == "inner":
                svg.rect(x, y, box, box, "url(#hatch)")
            else:  # selective: the attention core's share is recomputed
                svg.rect(x, y, box, box, FORWARD_COLOR)
                svg.rect(x + box * 0.55, y, box * 0.45, box * 0.5, "url(#hatch)")
            if i < layers - 1:
                svg.line(x + box, y + box / 2, x + box + gap, y + box / 2, width=1)
    y = 64 + len(rows) * row_h + 10
    svg.rect(20, y, 14, 14, FORWARD_COLOR)
    svg.text(40, y + 12, "activations kept in memory", size=11)
    svg.rect(230, y, 14, 14, "url(#hatch)")
    svg.text(250, y + 12, "recomputed in the backward pass (memory saved, time paid)", size=11)
    svg.rect(20, y + 22, 4, 14, FORWARD_COLOR)
    svg.text(40, y + 34, "only the layer's input kept (the checkpoint)", size=11)
    return svg.render()


# --- ZeRO stages ------------------------------------------------------------------------------------------------------

ZERO_STAGES = (
    ("data parallel (replicated)", set()),
    ("ZeRO-1: optimizer state sharded", {"optimizer"}),
    ("ZeRO-2: + gradients sharded", {"optimizer", "gradients"}),
    ("ZeRO-3: + parameters sharded", {"optimizer", "gradients", "parameters"}),
)
# Bytes per parameter under mixed-precision Adam (ZeRO paper, section 3.1): fp16 weights 2, fp16 gradients 2,
# fp32 master weights + momentum + variance 12.
STATE_BYTES = (("parameters", 2, "#4c78a8"), ("gradients", 2, "#f58518"), ("optimizer", 12, "#54a24b"))


def zero_stages_svg(gpus: int = 4) -> str:
    left, scale, bar_h, gpu_gap, stage_gap = 260, 18, 16, 4, 26
    full = sum(b for _, b, _ in STATE_BYTES)
    height = 60 + len(ZERO_STAGES) * (gpus * (bar_h + gpu_gap) + stage_gap) + 40
    svg = Svg(left + full * scale + 190, height)
    svg.text(20, 26, f"Model state per GPU across {gpus} data-parallel GPUs (mixed-precision Adam)", size=15,
             weight="bold")
    y = 50
    for label, sharded in ZERO_STAGES:
        svg.text(left - 12, y + gpus * (bar_h + gpu_gap) / 2 + 4, label, anchor="end")
        per_gpu = sum(b / gpus if name in sharded else b for name, b, _ in STATE_BYTES)
        for g in range(gpus):
            x = left
            for name, nbytes, color in STATE_BYTES:
                if name in sharded:
                    # each GPU holds its 1/gpus slice, drawn at its offset in the full tensor
                    part = nbytes * scale / gpus
                    svg.rect(x, y, nbytes * scale, bar_h, "#f4f4f4", stroke="#ccc")
                    svg.rect(x + g * part, y, part, bar_h, color)
                else:
                    svg.rect(x, y, nbytes * scale, bar_h, color)
                x += nbytes * scale
            y += bar_h + gpu_gap
        svg.text(left + full * scale + 10, y - (gpus * (bar_h + gpu_gap)) / 2, f"{per_gpu:g} bytes/param per GPU",
                 size=11)
        y += stage_gap
    x = left
    for name, nbytes, color in STATE_BYTES:
        svg.rect(x, height - 30, 14, 12, color)
        svg.text(x + 20, height - 20, f"{name} ({nbytes} B/param)", size=11)
        x += 150
    return svg.render()


# --- heterogeneous pipeline -------------------------------------------------------------------------------------------

def heterogeneous_pipeline_svg(spec: RunSpec) -> str:
    """Each pipeline stage as a box as wide as its share of transformer layers, coloured by its GPU type."""
    from labkit.megatron_args import pipeline_layout

    partition, gpus = spec.layer_partition, spec.stage_gpus
    layouts = pipeline_layout(partition).split("|")
    par, ranks = spec.parallel, layout_of(spec)
    unit, box_h, gap, left = 11, 64, 22, 20
    widths = [58 + layers * unit for layers in partition]
    svg = Svg(max(left + sum(widths) + gap * (len(widths) - 1) + 20, 900), 220)
    svg.text(left, 24, f"{spec.name}: {spec.model.preset or ''} pipeline, PARTITION=\"{spec.partition_string}\", "
             f"{ranks.per_stage} GPU(s) per stage (TP {par.tensor} x CP {par.context} x DP {ranks.data})", size=14,
             weight="bold")
    x = left
    for stage, (layers, gpu, layout, w) in enumerate(zip(partition, gpus, layouts, widths)):
        svg.rect(x, 50, w, box_h, GPU_COLORS.get(gpu, "#bab0ac"))
        svg.text(x + w / 2, 72, f"stage {stage}", size=11, anchor="middle", fill="#fff", weight="bold")
        svg.text(x + w / 2, 90, f"{layers} layers", size=10, anchor="middle", fill="#fff")
        svg.text(x + w / 2, 106, layout.replace("t*", "t×"), size=9, anchor="middle", fill="#fff")
        svg.text(x + w / 2, 132, gpu, size=10, anchor="middle")
        if stage < len(partition) - 1:
            svg.line(x + w + 2, 82, x + w + gap - 2, 82, arrow=True)
        x += w + gap
    svg.text(left, 162, "arrows: activations forward (and gradients back) between stages, over the slowest link "
             "between their nodes", size=11)
    svg.text(left, 182, "E = embedding, L = output layer and loss; t×N = N transformer layers", size=11)
    legend_x = left
    for gpu in dict.fromkeys(gpus):
        svg.rect(legend_x, 194, 14, 12, GPU_COLORS.get(gpu, "#bab0ac"))
        svg.text(legend_x + 20, 204, gpu, size=11)
        legend_x += 120
    return svg.render()


# --- the images/ directory --------------------------------------------------------------------------------------------

def diagrams() -> dict[str, str]:
    """File name -> SVG text for every diagram the labs show."""
    hetero = load_spec(example("gpt2-xl-hetero.yaml"))
    return {
        "pipeline_schedules.svg": pipeline_schedules_svg(4, 8, 2),
        "activation_checkpointing.svg": activation_checkpointing_svg(8),
        "zero_stages.svg": zero_stages_svg(4),
        "heterogeneous_pipeline.svg": heterogeneous_pipeline_svg(hetero),
    }


def write_diagrams(out_dir: Path | str = "images") -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in diagrams().items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def show(name_or_svg: str):
    """Display a diagram in a notebook: a file name in images/ ("zero_stages") or SVG text.

    Taught in labs 02, 03, 05, 06 and 07.
    """
    from IPython.display import SVG

    if name_or_svg.lstrip().startswith("<svg"):
        return SVG(data=name_or_svg)
    name = name_or_svg if name_or_svg.endswith(".svg") else f"{name_or_svg}.svg"
    return SVG(filename=str(course_dir("images") / name))


def register(sub) -> None:
    p = sub.add_parser("diagrams", help="regenerate the labs' diagrams (SVG) in images/")
    p.add_argument("--out", default="images", help="output directory (default: images/ under the current directory)")
    p.set_defaults(func=lambda args: _main(args.out))


def _main(out: str) -> int:
    for path in write_diagrams(out):
        print(path)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="regenerate the labs' diagrams")
    parser.add_argument("--out", default="images")
    sys.exit(_main(parser.parse_args().out))
