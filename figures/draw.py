"""Draw the course's diagrams into figures/ and embed each one in the notebooks that show it.

    python figures/draw.py           # redraw every figure and refresh the notebooks' copies
    python figures/draw.py --check   # exit 1 if a notebook's copy differs from the committed figure

A notebook shows a figure as a markdown image, `![...](attachment:NAME.png)`, with the PNG stored in the cell
(nbformat's cell attachments): it travels with the notebook, so it shows offline in JupyterLab, on GitHub and on
Colab alike. The drawings are matplotlib, fixed in size and free of version metadata, so a redraw with the same
matplotlib gives the same bytes.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DPI = 100
BLUE, ORANGE, GREEN, RED, PURPLE, GREY = "#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#BBBBBB"
HEADS = (BLUE, ORANGE, GREEN)


def _canvas(width: float, height: float, xlim: tuple[float, float], ylim: tuple[float, float]):
    fig, ax = plt.subplots(figsize=(width, height), dpi=DPI)
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def _box(ax, x, y, w, h, text="", color="white", edge="black", fontsize=9, text_color="black", **kwargs):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=color,
                                edgecolor=edge, lw=1.2, **kwargs))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def _arrow(ax, start, end, color="black", style="-|>", **kwargs):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color, lw=1.2,
                                 shrinkA=0, shrinkB=0, **kwargs))


def causal_mask():
    """Scores above the diagonal set to -inf before the softmax: token t attends to tokens <= t only."""
    tokens = ["the", "model", "reads", "one", "token", "ahead"]
    n = len(tokens)
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.4), dpi=DPI)
    for ax, title in zip(axes, ("scores q·k after the mask", "attention weights = softmax(row)"), strict=True):
        for i in range(n):  # row i: the query at position i
            for j in range(n):  # column j: the key at position j
                future = j > i
                ax.add_patch(Rectangle((j, n - 1 - i), 1, 1, facecolor="#EEEEEE" if future else "#CFE0F3",
                                       edgecolor="white", lw=2))
                if ax is axes[0]:
                    text = "−∞" if future else f"s{i + 1}{j + 1}"
                else:
                    text = "0" if future else f"1/{i + 1}"
                ax.text(j + 0.5, n - 0.5 - i, text, ha="center", va="center", fontsize=9,
                        color="#999999" if future else "black")
        ax.set_xlim(0, n)
        ax.set_ylim(0, n)
        ax.set_aspect("equal")
        ax.set_xticks([j + 0.5 for j in range(n)], tokens, rotation=45, fontsize=9)
        ax.set_yticks([n - 0.5 - i for i in range(n)], tokens, fontsize=9)
        ax.tick_params(length=0)
        ax.xaxis.tick_top()
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(title, fontsize=10, pad=42)
    axes[0].set_ylabel("query (the token that looks)", fontsize=9)
    axes[1].set_xlabel("key (the token looked at); equal scores give each row 1/(t+1)", fontsize=9)
    fig.suptitle("Causal mask: each row attends only to its own and earlier tokens", fontsize=11, y=0.98)
    fig.tight_layout()
    return fig


def multi_head_split():
    """One projection, split into heads along the feature axis; each head attends on its own; concatenate, mix."""
    fig, ax = _canvas(11.0, 4.2, (0, 22.4), (-0.8, 7.8))
    T, cell = 4, 0.55
    ax.add_patch(Rectangle((0.3, 1.8), 6 * cell, T * cell, facecolor=GREY, edgecolor="black"))
    ax.text(0.3 + 3 * cell, 1.8 + T * cell + 0.3, "x  (T × d_model)", ha="center", fontsize=9)
    _arrow(ax, (3.8, 2.9), (5.0, 2.9))
    ax.text(4.4, 3.25, "W_q", ha="center", fontsize=8)
    for h, color in enumerate(HEADS):  # q: the same shape, its columns coloured by the head that owns them
        ax.add_patch(Rectangle((5.1 + 2 * h * cell, 1.8), 2 * cell, T * cell, facecolor=color, edgecolor="black"))
    ax.text(5.1 + 3 * cell, 1.8 + T * cell + 0.3, "q  (T × d_model)", ha="center", fontsize=9)
    ax.text(5.1 + 3 * cell, 1.5, "its columns split\ninto h heads", ha="center", va="top", fontsize=8)
    for h, color in enumerate(HEADS):  # per head: (T x d_head) -> attention -> (T x d_head)
        y = 5.7 - h * 2.3
        _arrow(ax, (8.6, 2.9), (9.6, y + 0.65), color=color)
        ax.add_patch(Rectangle((9.7, y), 2 * cell, 1.3, facecolor=color, edgecolor="black"))
        _box(ax, 11.2, y, 4.0, 1.3, f"head {h + 1}, causal:\nsoftmax(qkᵀ/√d_head)·v", color="white", fontsize=8)
        _arrow(ax, (15.3, y + 0.65), (16.1, 2.9), color=color)
    ax.text(10.25, 7.25, "T × d_head", ha="center", fontsize=8)
    for h, color in enumerate(HEADS):
        ax.add_patch(Rectangle((16.2 + 2 * h * cell, 1.8), 2 * cell, T * cell, facecolor=color, edgecolor="black",
                               alpha=0.75))
    ax.text(16.2 + 3 * cell, 1.8 + T * cell + 0.3, "heads concatenated", ha="center", fontsize=9)
    _arrow(ax, (19.6, 2.9), (20.4, 2.9))
    ax.text(20.0, 3.25, "W_o", ha="center", fontsize=8)
    ax.add_patch(Rectangle((20.5, 1.8), 1.6, T * cell, facecolor=PURPLE, edgecolor="black"))
    ax.text(21.3, 1.8 + T * cell + 0.3, "out", ha="center", fontsize=9)
    ax.text(11.2, -0.6, "k and v are split the same way; the heads differ only in which columns of the projections "
            "they own. In code: view (B, T, h, d_head), then transpose to (B, h, T, d_head).", ha="center",
            fontsize=8)
    return fig


def transformer_block():
    """GPT-2's pre-LayerNorm block: two sub-layers, each added back onto the residual stream."""
    fig, ax = _canvas(5.6, 7.4, (0, 8), (0, 10.6))
    x0, w = 1.6, 4.2
    mid = x0 + w / 2
    rows = [  # (y, label, colour)
        (0.2, "x  (batch, T, d_model)", "white"),
        (1.5, "LayerNorm", "#E8E8E8"),
        (2.7, "causal multi-head attention", "#CFE0F3"),
        (3.9, "dropout", "#F3F3F3"),
        (5.8, "LayerNorm", "#E8E8E8"),
        (7.0, "MLP: d→4d, GELU, 4d→d", "#F6D9C4"),
        (8.2, "dropout", "#F3F3F3"),
        (9.8, "out  (batch, T, d_model)", "white"),
    ]
    for y, label, color in rows:
        _box(ax, x0, y, w, 0.7, label, color=color, fontsize=9)
    for (y, _, _), (y_next, _, _) in zip(rows, rows[1:], strict=False):
        if (y, y_next) not in ((3.9, 5.8), (8.2, 9.8)):  # those two pass through an addition
            _arrow(ax, (mid, y + 0.7), (mid, y_next))
    # each addition: (y of the +, top of the dropout below it, the box above it, the side its residual runs on)
    for y_add, below, above, side in ((5.15, 4.6, 5.8, 1), (9.25, 8.9, 9.8, -1)):
        ax.add_patch(plt.Circle((mid, y_add), 0.25, facecolor="white", edgecolor="black", lw=1.2))
        ax.text(mid, y_add, "+", ha="center", va="center", fontsize=11)
        _arrow(ax, (mid, below), (mid, y_add - 0.25))
        _arrow(ax, (mid, y_add + 0.25), (mid, above))
        lane = mid + side * (w / 2 + 0.8)
        leaves = 0.55 if side == 1 else 5.55  # from the input, or from the stream after the first addition
        ax.plot([mid + side * (w / 2 if side == 1 else 0), lane, lane], [leaves, leaves, y_add], color=GREEN, lw=1.6)
        _arrow(ax, (lane, y_add), (mid + side * 0.25, y_add), color=GREEN)
        ax.text(lane + side * 0.15, (leaves + y_add) / 2, "residual", rotation=90, va="center", fontsize=8,
                color=GREEN, ha="left" if side == 1 else "right")
    ax.set_title("A GPT-2 transformer block (pre-LayerNorm),\nstacked n_layers times", fontsize=11)
    return fig


def gradient_accumulation():
    """N micro-batches add their gradients into .grad; one optimizer step follows, then zero_grad."""
    fig, ax = _canvas(10.5, 3.1, (0, 21), (0.4, 6.8))
    ax.text(0.1, 6.2, "one batch of B sequences:", fontsize=9, va="center")
    _box(ax, 5.2, 5.7, 8.0, 0.9, "forward + backward on all B at once: peak memory ∝ B", color="#CFE0F3",
         fontsize=8)
    _arrow(ax, (13.3, 6.15), (14.1, 6.15))
    _box(ax, 14.2, 5.7, 3.0, 0.9, "optimizer.step()", color="#D5ECD9", fontsize=9)
    _arrow(ax, (17.3, 6.15), (18.1, 6.15))
    _box(ax, 18.2, 5.7, 2.6, 0.9, "zero_grad()", color="#EEEEEE", fontsize=9)
    ax.text(0.1, 4.1, "N = 4 micro-batches\nof B / 4 each:", fontsize=9, va="center")
    for i in range(4):
        x = 5.2 + i * 2.0
        _box(ax, x, 3.6, 1.8, 0.9, f"fwd + bwd\n{i + 1}/4", color="#CFE0F3", fontsize=8)
        ax.add_patch(Rectangle((x + 0.3, 1.2), 1.2, 0.35 * (i + 1), facecolor=ORANGE, edgecolor="black"))
        _arrow(ax, (x + 0.9, 3.55), (x + 0.9, 1.3 + 0.35 * (i + 1)), color=ORANGE)
    ax.text(9.2, 0.7, ".grad after each micro-batch: the sums grow, nothing is stepped", ha="center", fontsize=8)
    _arrow(ax, (13.3, 4.05), (14.1, 4.05))
    _box(ax, 14.2, 3.6, 3.0, 0.9, "optimizer.step()", color="#D5ECD9", fontsize=9)
    _arrow(ax, (17.3, 4.05), (18.1, 4.05))
    _box(ax, 18.2, 3.6, 2.6, 0.9, "zero_grad()", color="#EEEEEE", fontsize=9)
    ax.text(17.3, 2.2, "each micro-batch's loss is divided by\nthe step's total number of targets, so the\n"
            "summed gradient equals the full batch's;\npeak memory ∝ B / 4", ha="center", va="center", fontsize=8)
    return fig


def kv_cache():
    """Decoding step t: without a cache all t positions run again; with one, only the new token does."""
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.0), dpi=DPI)
    t = 6
    for ax, cached in zip(axes, (False, True), strict=True):
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 8)
        ax.set_aspect("equal")
        ax.axis("off")
        for i in range(t):  # the model's input rows this step
            y = 6.6 - i * 0.9
            new = i == t - 1
            runs = new or not cached
            ax.add_patch(Rectangle((0.3, y), 1.6, 0.7, facecolor=ORANGE if new else ("#CFE0F3" if runs else "white"),
                                   edgecolor="black" if runs else GREY, ls="-" if runs else ":"))
            ax.text(1.1, y + 0.35, f"token {i + 1}", ha="center", va="center", fontsize=8,
                    color="black" if runs else "#999999")
            for col, name in ((4.6, "k"), (6.6, "v")):
                ax.add_patch(Rectangle((col, y), 1.6, 0.7,
                                       facecolor=ORANGE if new else (GREEN if cached else "#CFE0F3"),
                                       edgecolor="black", alpha=1.0 if new or cached else 0.9))
                ax.text(col + 0.8, y + 0.35, f"{name}{i + 1}" + (" (cached)" if cached and not new else ""),
                        ha="center", va="center", fontsize=7)
        ax.text(1.1, 7.55, "model input", ha="center", fontsize=9)
        ax.text(6.4, 7.55, "keys and values", ha="center", fontsize=9)
        _arrow(ax, (2.0, 6.6 - (t - 1) * 0.9 + 0.35), (4.5, 6.6 - (t - 1) * 0.9 + 0.35), color=ORANGE)
        if cached:
            ax.text(5.0, 0.35, "step t runs 1 token: its q attends to the cached k, v\nand its own (appended); work "
                    "per step ∝ 1 (attention ∝ t)", ha="center", fontsize=8)
            ax.set_title("with a KV cache", fontsize=10)
        else:
            ax.text(5.0, 0.35, "step t runs all t tokens again and keeps only the last\nlogits: work per step ∝ t, "
                    "for n tokens ∝ n²", ha="center", fontsize=8)
            ax.set_title("without a cache", fontsize=10)
    fig.suptitle("Generating the next token at step t = 6: orange is computed for the new token, blue computed "
                 "again, green read from the cache", fontsize=10)
    fig.tight_layout()
    return fig


def paged_blocks():
    """Each sequence's tokens live in fixed-size blocks anywhere in one pool; a block table maps them."""
    fig, ax = _canvas(10.5, 4.2, (0, 21), (0, 8.4))
    size = 4  # tokens per block
    sequences = {"A": (BLUE, 10, [6, 1, 3]), "B": (ORANGE, 6, [0, 8])}  # colour, tokens, physical blocks
    ax.text(2.6, 7.9, "tokens of each sequence\n(logical blocks of 4)", ha="center", va="center", fontsize=9)
    ax.text(9.3, 7.9, "block tables", ha="center", va="center", fontsize=9)
    ax.text(16.2, 7.9, "one pool of physical blocks", ha="center", va="center", fontsize=9)
    pool_y = {b: 6.6 - b * 0.62 for b in range(10)}
    for b, y in pool_y.items():
        ax.add_patch(Rectangle((14.4, y), 3.6, 0.5, facecolor="white", edgecolor=GREY))
        ax.text(14.1, y + 0.25, str(b), ha="right", va="center", fontsize=8)
    row_y = {"A": 5.6, "B": 2.8}
    for name, (color, n_tokens, table) in sequences.items():
        y0 = row_y[name]
        ax.text(0.2, y0 + 0.3, name, fontsize=11, weight="bold", va="center", color=color)
        for logical, physical in enumerate(table):
            used = min(size, n_tokens - logical * size)
            for s in range(size):
                ax.add_patch(Rectangle((0.8 + logical * 1.9 + s * 0.45, y0), 0.45, 0.6,
                                       facecolor=color if s < used else "white", edgecolor="black", lw=0.8))
            ax.add_patch(Rectangle((14.4, pool_y[physical]), 3.6 * used / size, 0.5, facecolor=color,
                                   edgecolor="black"))
            ax.text(18.1, pool_y[physical] + 0.25, f"{name} block {logical}", fontsize=7, va="center")
        ax.text(9.3, y0 + 0.3, f"{name}: [{', '.join(map(str, table))}]", ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round", facecolor="white", edgecolor=color))
        _arrow(ax, (0.8 + len(table) * 1.9 + 0.2, y0 + 0.3), (7.9, y0 + 0.3), color=color)
        for physical in table:
            _arrow(ax, (10.8, y0 + 0.3), (14.35, pool_y[physical] + 0.25), color=color, alpha=0.6)
    free = [b for b in pool_y if all(b not in t for _, _, t in sequences.values())]
    ax.text(16.2, 0.1, f"free list: {free}", ha="center", fontsize=8)
    ax.text(5.0, 0.9, "a sequence wastes at most its last block's empty slots;\nfinished sequences return "
            "their blocks to the free list", ha="center", fontsize=8)
    return fig


def next_token_windows():
    """A window's target is its input shifted by one token; the stride sets where the next window starts."""
    fig, ax = _canvas(10.5, 3.6, (0, 21), (0, 7.2))
    n, t, w = 12, 4, 1.35  # tokens shown, context T, box width
    x0 = 2.9
    ax.text(0.1, 6.35, "token ids", fontsize=9, va="center")
    for i in range(n):
        _box(ax, x0 + i * w, 6.0, w - 0.15, 0.7, f"t{i}", color="#EEEEEE", fontsize=8)
    ax.text(0.1, 5.0, "window 0, T = 4", fontsize=9, va="center")
    for i in range(t):
        _box(ax, x0 + i * w, 4.75, w - 0.15, 0.55, f"x: t{i}", color="#CFE0F3", fontsize=7)
        _box(ax, x0 + (i + 1) * w, 3.95, w - 0.15, 0.55, f"y: t{i + 1}", color="#F6D5BE", fontsize=7)
        _arrow(ax, (x0 + i * w + 0.6, 4.72), (x0 + (i + 1) * w + 0.35, 4.53), color=ORANGE)
    ax.text(x0 + (t + 1) * w + 0.3, 4.55, "input x = t0..t3, target y = t1..t4: position i predicts token i + 1,\n"
            "so one window holds T predictions", fontsize=8, va="center")
    for stride, color, label, top in ((t, BLUE, "stride T = 4", 2.75), (t // 2, GREEN, "stride T/2 = 2", 2.0)):
        ax.text(0.1, top + 0.17, label, fontsize=9, va="center")
        for k, start in enumerate(range(0, n - t, stride)):
            level = top - 0.45 * k * (stride < t)  # overlapping windows one row each, window 0 on top
            ax.add_patch(Rectangle((x0 + start * w, level), t * w - 0.15, 0.35, facecolor=color, alpha=0.55,
                                   edgecolor="black"))
            ax.text(x0 + start * w + 0.1, level + 0.17, f"window {k}", fontsize=7, va="center")
    ax.text(x0 + n * w + 0.3, 1.55, "T/2: twice the windows,\neach token read at two\npositions", fontsize=8,
            va="center")
    return fig


def training_loop():
    """One optimizer, a learning rate that depends on the step, batches in a seeded order: the loop around a step."""
    fig, ax = _canvas(10.5, 3.7, (0, 21), (0, 7.4))
    steps = [("next batch (x, y)\nShuffledBatches", "#EEEEEE"), ("forward\nlogits = model(x)", "#CFE0F3"),
             ("loss\nF.cross_entropy", "#CFE0F3"), ("backward\nloss.backward()", "#F6D5BE"),
             ("clip the gradients'\nglobal norm to 1", "#F6D5BE"), ("AdamW step\nat lr(step)", "#D5ECD9"),
             ("zero_grad()", "#EEEEEE")]
    w, h, gap = 2.7, 1.2, 0.25
    for i, (text, color) in enumerate(steps):
        x = 0.2 + i * (w + gap)
        _box(ax, x, 5.6, w, h, text, color=color, fontsize=7)
        if i < len(steps) - 1:
            _arrow(ax, (x + w + 0.02, 6.2), (x + w + gap - 0.02, 6.2))
    right = 0.2 + (len(steps) - 1) * (w + gap) + w / 2
    ax.add_patch(FancyArrowPatch((right, 5.55), (1.55, 5.55), connectionstyle="arc3,rad=-0.12", arrowstyle="-|>",
                                 mutation_scale=12, color="black", lw=1.2))
    ax.text(10.5, 3.75, "step += 1, repeat for STEPS steps; AdamW's moments carry over from step to step",
            ha="center", fontsize=8)
    sx, sy, sw, sh = 13.4, 0.3, 6.5, 2.3  # the schedule: linear warm-up, then a cosine down to max_lr / 10
    ax.add_patch(Rectangle((sx, sy), sw, sh, facecolor="white", edgecolor=GREY))
    points = []
    for k in range(101):
        u = k / 100
        lr = u / 0.1 if u < 0.1 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (u - 0.1) / 0.9))
        points.append((sx + 0.2 + u * (sw - 0.4), sy + 0.2 + lr * (sh - 0.6)))
    ax.plot(*zip(*points, strict=True), color=GREEN, lw=1.8)
    ax.text(sx + sw / 2, sy + sh + 0.25, "lr(step): warm-up, then cosine to lr / 10", ha="center", fontsize=8)
    ax.text(0.3, 1.4, "The Trainer runs this loop and adds what a real run needs:\n"
            "micro-batches, mixed precision, evaluation, samples, checkpoints.", fontsize=8, va="center")
    return fig


def utf8_bytes():
    """Characters are code points; UTF-8 writes each as one to four bytes, so 256 byte values spell any text."""
    fig, ax = _canvas(10.5, 3.4, (0, 21), (0, 6.8))
    characters = [("A", "U+0041", [65]), ("é", "U+00E9", [195, 169]), ("—", "U+2014", [226, 128, 148]),
                  ("🙂", "U+1F642", [240, 159, 153, 130])]
    ax.text(0.1, 5.6, "character", fontsize=9, va="center")
    ax.text(0.1, 4.1, "code point", fontsize=9, va="center")
    ax.text(0.1, 2.2, "UTF-8 bytes", fontsize=9, va="center")
    x = 3.2
    for char, point, encoded in characters:
        width = len(encoded) * 1.05
        middle = x + width / 2
        _box(ax, middle - 0.6, 5.15, 1.2, 0.9, "" if char == "🙂" else char, color="#EEEEEE", fontsize=14)
        if char == "🙂":  # the default font has no emoji: draw a face
            ax.add_patch(plt.Circle((middle, 5.6), 0.32, facecolor="#F6D26B", edgecolor="black", lw=1))
            ax.add_patch(FancyArrowPatch((middle - 0.15, 5.5), (middle + 0.15, 5.5), arrowstyle="-",
                                         connectionstyle="arc3,rad=0.6", color="black", lw=1))
            for dx in (-0.11, 0.11):
                ax.add_patch(plt.Circle((middle + dx, 5.7), 0.04, color="black"))
        ax.text(middle, 4.1, point, ha="center", va="center", fontsize=9)
        _arrow(ax, (middle, 5.1), (middle, 4.45))
        _arrow(ax, (middle, 3.75), (middle, 2.75))
        for i, byte in enumerate(encoded):
            _box(ax, x + i * 1.05, 1.8, 0.95, 0.8, str(byte), color="#CFE0F3", fontsize=9)
        ax.text(middle, 1.35, f"{len(encoded)} byte{'s' if len(encoded) > 1 else ''}", ha="center", va="center",
                fontsize=8)
        x += width + 0.9
    ax.text(10.5, 0.45, "every byte is one of 256 values (0–255): a tokenizer that starts from bytes never meets "
            "an unknown character", ha="center", fontsize=9)
    return fig


def token_granularity():
    """One text cut three ways: bytes (tiny vocabulary, long sequences), subwords, words (huge vocabulary)."""
    fig, ax = _canvas(10.5, 3.6, (0, 21), (0, 7.2))
    rows = [("bytes", list("tokenization of text"), "#CFE0F3",
             "256 ids, nothing unknown,\n20 tokens: one per byte"),
            ("subwords (BPE)", ["token", "ization", " of", " text"], "#D5ECD9",
             "GPT-2: 50,257 ids; a rare word\nis spelled from smaller pieces"),
            ("words", ["tokenization", " of", " text"], "#F6D5BE",
             "an id per word seen in training;\nan unseen word has none")]
    for r, (label, pieces, color, note) in enumerate(rows):
        y = 5.6 - r * 2.2
        ax.text(0.1, y + 0.35, label, fontsize=9, va="center")
        x = 3.4
        for piece in pieces:
            w = 0.42 + 0.3 * len(piece) if len(pieces) < 20 else 0.5
            _box(ax, x, y, w, 0.7, piece.replace(" ", "␣"), color=color, fontsize=8 if len(pieces) < 20 else 7)
            x += w + 0.08
        ax.text(15.3, y + 0.35, note, fontsize=8, va="center")
    ax.text(10.5, 0.35, "␣ marks a space: GPT-2's pieces keep the space with the word after it", ha="center",
            fontsize=8)
    return fig


def bpe_merge_step():
    """One BPE step: count adjacent pairs over the chunks, weighted by how often each chunk occurs; merge the top."""
    fig, ax = _canvas(10.5, 3.9, (0, 21), (0, 7.8))
    chunks = [("hug", 10), ("pug", 5), ("hugs", 5)]
    ax.text(2.6, 7.3, "chunks (byte ids, × count)", ha="center", fontsize=9)
    ax.text(10.2, 7.3, "1. count adjacent pairs", ha="center", fontsize=9)
    ax.text(17.6, 7.3, "2. merge the top pair into id 256", ha="center", fontsize=9)
    for r, (word, count) in enumerate(chunks):
        y = 5.8 - r * 1.5
        for i, char in enumerate(word):
            top = word[i:i + 2] == "ug" or (i > 0 and word[i - 1:i + 1] == "ug")  # the pair about to merge
            _box(ax, 0.3 + i * 1.0, y, 0.9, 0.8, f"{char}\n{ord(char)}", color=ORANGE if top else "#EEEEEE",
                 fontsize=8)
        ax.text(0.3 + len(word) * 1.0 + 0.2, y + 0.4, f"× {count}", fontsize=9, va="center")
        x = 14.8
        i = 0
        while i < len(word):  # the same chunk after the merge: "ug" is one token
            merged = word[i:i + 2] == "ug"
            _box(ax, x, y, 1.6 if merged else 0.9, 0.8, "ug\n256" if merged else f"{word[i]}\n{ord(word[i])}",
                 color=ORANGE if merged else "#EEEEEE", fontsize=8)
            x += (1.6 if merged else 0.9) + 0.1
            i += 2 if merged else 1
        ax.text(x + 0.1, y + 0.4, f"× {count}", fontsize=9, va="center")
    pairs = [("u g", "10 + 5 + 5 = 20"), ("h u", "10 + 5 = 15"), ("p u", "5"), ("g s", "5")]
    for r, (pair, total) in enumerate(pairs):
        y = 6.1 - r * 1.0
        _box(ax, 7.0, y, 6.2, 0.75, f"({pair}):  {total}", color=ORANGE if r == 0 else "white", fontsize=9)
    _arrow(ax, (5.4, 4.6), (6.9, 4.6))
    _arrow(ax, (13.3, 4.6), (14.6, 4.6))
    ax.text(10.5, 0.7, "repeat with the new counts until the vocabulary has its size; the list of merges, in order, "
            "is the tokenizer", ha="center", fontsize=9)
    return fig


def batch_stacking():
    """A seeded shuffle of the windows, cut into batches of B; each batch stacks B windows into (B, T) tensors."""
    fig, ax = _canvas(10.5, 3.6, (0, 21), (0, 7.2))
    n, batch = 10, 4
    order = [7, 2, 9, 4, 0, 5, 8, 1, 3, 6]  # one seeded permutation
    ax.text(0.1, 6.4, "windows", fontsize=9, va="center")
    for i in range(n):
        _box(ax, 2.6 + i * 1.0, 6.0, 0.9, 0.8, str(i), color="#CFE0F3", fontsize=9)
    _arrow(ax, (7.5, 5.9), (7.5, 5.1))
    ax.text(7.8, 5.5, "shuffle (a seeded generator: the same order every run)", fontsize=8, va="center")
    ax.text(0.1, 4.4, "order", fontsize=9, va="center")
    for i, w in enumerate(order):
        group = i // batch
        color = (BLUE, GREEN, GREY)[group]
        _box(ax, 2.6 + i * 1.0 + 0.3 * group, 4.0, 0.9, 0.8, str(w), color=color, fontsize=9,
             alpha=0.5 if group < 2 else 0.4)
    ax.text(13.4, 4.4, "dropped (drop_last): fewer than B = 4 left", fontsize=8, va="center")
    for b, (color, x0) in enumerate(((BLUE, 2.6), (GREEN, 10.6))):
        ax.text(x0 + 2.7, 3.0, f"batch {b}: x of shape (B = {batch}, T)", ha="center", fontsize=8)
        for r in range(batch):
            ax.add_patch(Rectangle((x0, 2.3 - r * 0.55), 5.4, 0.45, facecolor=color, alpha=0.5, edgecolor="black"))
            ax.text(x0 + 0.15, 2.52 - r * 0.55, f"window {order[b * batch + r]}: T token ids", fontsize=7,
                    va="center")
        _arrow(ax, (2.6 + b * (batch + 0.3) + batch / 2 - 0.05, 3.95), (x0 + 2.7, 3.2), color=color)
    ax.text(18.5, 1.6, "y: the same windows'\ntargets, (B, T)", ha="center", va="center", fontsize=8)
    return fig


def embedding_lookup():
    """Each id selects a row of the token table; each position a row of the position table; the sum enters block 1."""
    fig, ax = _canvas(10.5, 4.2, (0, 21), (0, 8.4))
    ids = [5, 2, 5, 0]
    ax.text(1.4, 7.8, "token ids (T = 4)", ha="center", fontsize=9)
    for t, i in enumerate(ids):
        _box(ax, 0.3 + t * 0.6, 6.9, 0.5, 0.6, str(i), color="#EEEEEE", fontsize=8)
    rows, tx, ty, h = 7, 4.6, 2.2, 0.6  # the token table: V = 7 rows shown
    ax.text(tx + 1.2, 7.8, "token table (V × d)", ha="center", fontsize=9)
    for r in range(rows):
        picked = r in ids
        ax.add_patch(Rectangle((tx, ty + (rows - 1 - r) * h), 2.4, h, facecolor=BLUE if picked else "white",
                               alpha=0.6 if picked else 1, edgecolor="black", lw=0.8))
        ax.text(tx - 0.15, ty + (rows - 1 - r) * h + h / 2, f"row {r}", fontsize=7, ha="right", va="center")
    _arrow(ax, (2.8, 7.2), (tx - 0.9, 7.2 - 0.3))
    ax.text(4.3, 1.6, "a lookup = one-hot(id) · table,\nwithout the one-hot vectors", ha="center", va="top",
            fontsize=8)
    out_x = 9.8
    blocks = [("token vectors", BLUE, [f"row {i}" for i in ids]), ("position vectors", GREEN,
                                                                  [f"pos {t}" for t in range(4)]),
              ("sum: block 1's input", PURPLE, ["" for _ in ids])]
    for b, (title, color, labels) in enumerate(blocks):
        x = out_x + b * 3.9
        ax.text(x + 1.3, 7.8, title, ha="center", fontsize=9)
        for t, label in enumerate(labels):
            ax.add_patch(Rectangle((x, 6.2 - t * 0.8), 2.6, 0.6, facecolor=color, alpha=0.6, edgecolor="black"))
            ax.text(x + 1.3, 6.5 - t * 0.8, label, ha="center", va="center", fontsize=8)
        ax.text(x + 1.3, 3.1, "(T × d)", ha="center", fontsize=8)
    _arrow(ax, (tx + 2.5, 5.0), (out_x - 0.1, 5.0), color=BLUE)
    ax.text(out_x + 3.25, 4.6, "+", ha="center", va="center", fontsize=16)
    ax.text(out_x + 7.15, 4.6, "=", ha="center", va="center", fontsize=16)
    ax.text(out_x + 5.2, 2.2, "the position table is (context × d): row t is added at position t,\nthe same for "
            "every sequence of the batch", ha="center", fontsize=8)
    ax.text(10.5, 0.5, "a batch of ids (B, T) becomes vectors (B, T, d)", ha="center", fontsize=9)
    return fig


def qkv_one_head():
    """One attention head: three projections of the same X, scores QKᵀ/√d, a softmax per row, a weighted sum of V."""
    fig, ax = _canvas(10.5, 4.6, (0, 21), (0, 9.2))
    ax.add_patch(Rectangle((0.3, 3.2), 1.2, 2.8, facecolor=GREY, edgecolor="black"))
    ax.text(0.9, 6.3, "X\n(T × d_in)", ha="center", va="bottom", fontsize=9)
    roles = [("Q = X·W_q", "query: what am I looking for?", BLUE, 7.2),
             ("K = X·W_k", "key: what do I contain?", ORANGE, 4.3),
             ("V = X·W_v", "value: what do I pass on?", GREEN, 1.4)]
    for name, role, color, y in roles:
        _arrow(ax, (1.6, 4.6), (3.0, y + 0.6), color=color)
        ax.add_patch(Rectangle((3.1, y - 0.6), 0.8, 1.9, facecolor=color, alpha=0.7, edgecolor="black"))
        ax.text(4.1, y + 0.55, name, fontsize=9, va="center")
        ax.text(4.1, y - 0.05, role, fontsize=7, va="center", color="#444444")
    ax.text(3.5, 0.2, "each (T × d_out)", ha="center", fontsize=8)
    _arrow(ax, (7.4, 7.7), (9.0, 6.4), color=BLUE)
    _arrow(ax, (7.4, 4.9), (9.0, 5.8), color=ORANGE)
    cell = 0.38
    x0, y0 = 9.2, 4.3
    for i in range(5):  # the T × T scores, one row per query
        for j in range(5):
            ax.add_patch(Rectangle((x0 + j * cell, y0 + (4 - i) * cell), cell, cell, facecolor="#CFE0F3",
                                   edgecolor="white"))
    ax.text(x0 + 2.5 * cell, y0 + 5 * cell + 0.2, "scores\nQ·Kᵀ / √d_out\n(T × T)", ha="center", va="bottom",
            fontsize=8)
    _arrow(ax, (x0 + 5 * cell + 0.1, y0 + 2.5 * cell), (12.4, y0 + 2.5 * cell))
    ax.text(12.0, y0 + 2.5 * cell + 0.55, "softmax\nper row", ha="center", fontsize=8)
    x1 = 12.6
    shades = [0.15, 0.35, 0.9, 0.25, 0.5]
    for i in range(5):
        for j in range(5):
            ax.add_patch(Rectangle((x1 + j * cell, y0 + (4 - i) * cell), cell, cell, facecolor=PURPLE,
                                   alpha=shades[(i + 2 * j) % 5], edgecolor="white"))
    ax.text(x1 + 2.5 * cell, y0 + 5 * cell + 0.2, "weights A\n(T × T),\nrows sum to 1", ha="center", va="bottom",
            fontsize=8)
    _arrow(ax, (x1 + 5 * cell + 0.1, y0 + 2.5 * cell), (16.4, y0 + 2.5 * cell))
    ax.text(15.95, y0 + 2.5 * cell + 0.35, "A·V", ha="center", fontsize=8)
    _arrow(ax, (7.4, 2.0), (16.3, y0 + 0.5), color=GREEN)
    ax.add_patch(Rectangle((16.6, y0), 0.8, 5 * cell, facecolor=GREEN, alpha=0.9, edgecolor="black"))
    ax.text(17.0, y0 + 5 * cell + 0.2, "context Z\n(T × d_out)", ha="center", va="bottom", fontsize=8)
    ax.text(13.7, 1.3, "row t of Z: the values of all tokens,\nweighted by how well their keys\nmatch query t",
            ha="center", va="center", fontsize=8)
    return fig


def gpt_shapes():
    """The whole GPT as a stack of shapes: ids in, an embedding sum, n_layers blocks, a LayerNorm, logits out."""
    fig, ax = _canvas(8.4, 7.4, (0, 16.8), (0, 14.8))
    x0, w = 3.0, 8.6
    mid = x0 + w / 2
    rows = [  # (y, label, colour, the shape that leaves the box)
        (0.4, "token ids", "white", "(B, T) integers"),
        (2.2, "token embedding: row id of a (V × d) table", "#CFE0F3", "(B, T, d)"),
        (4.0, "+ position embedding: row t of (context × d)", "#D5ECD9", "(B, T, d)"),
        (5.8, "dropout", "#F3F3F3", "(B, T, d)"),
        (7.6, "transformer block × n_layers", "#F6D9C4", "(B, T, d)"),
        (9.4, "final LayerNorm", "#E8E8E8", "(B, T, d)"),
        (11.2, "LM head: Linear d → V (no bias)", "#CFE0F3", "(B, T, V)"),
        (13.0, "logits: a score for every vocabulary token", "white", "at each position"),
    ]
    for i, (y, label, color, shape) in enumerate(rows):
        _box(ax, x0, y, w, 1.0, label, color=color, fontsize=9)
        ax.text(x0 + w + 0.4, y + 0.5, shape, fontsize=9, va="center", color="#333333")
        if i < len(rows) - 1:
            _arrow(ax, (mid, y + 1.0), (mid, rows[i + 1][0]))
    lane = x0 - 0.9  # weight tying: the head's weight is the token table
    ax.plot([x0, lane, lane, x0], [2.7, 2.7, 11.7, 11.7], color=PURPLE, lw=1.4, ls="--")
    ax.text(lane - 0.15, 7.2, "tied: the head's\nweight is the\n(V × d) table", fontsize=8, ha="right",
            va="center", color=PURPLE)
    ax.text(8.4, 14.3, "B batch, T tokens (≤ context), d = d_model, V vocabulary", ha="center", fontsize=9)
    return fig


def feed_forward_gelu_swiglu():
    """GPT-2's MLP (d→4d, GELU, 4d→d) beside the gated SwiGLU one (gate and up d→h, SiLU(gate)·up, h→d)."""
    fig, ax = _canvas(10.5, 4.4, (0, 21), (0, 8.8))
    ax.text(4.8, 8.3, "GPT-2: two matrices, 2 · d · 4d = 8d² weights", ha="center", fontsize=9)
    _box(ax, 3.0, 0.6, 3.6, 0.8, "x  (d)", fontsize=9)
    _box(ax, 3.0, 2.2, 3.6, 0.9, "fc: d → 4d", color="#CFE0F3", fontsize=9)
    _box(ax, 3.0, 3.9, 3.6, 0.9, "GELU", color="#F6D9C4", fontsize=9)
    _box(ax, 3.0, 5.6, 3.6, 0.9, "proj: 4d → d", color="#CFE0F3", fontsize=9)
    for y0, y1 in ((1.4, 2.2), (3.1, 3.9), (4.8, 5.6), (6.5, 7.3)):
        _arrow(ax, (4.8, y0), (4.8, y1))
    ax.text(4.8, 7.45, "out  (d)", ha="center", fontsize=9)
    ax.plot([10.5, 10.5], [0.3, 8.0], color=GREY, lw=1)
    ax.text(15.9, 8.3, "SwiGLU: three matrices, 3 · d · h ≈ 8d² for h ≈ 8d/3", ha="center", fontsize=9)
    _box(ax, 14.1, 0.6, 3.6, 0.8, "x  (d)", fontsize=9)
    _box(ax, 11.6, 2.2, 3.4, 0.9, "gate: d → h", color="#CFE0F3", fontsize=9)
    _box(ax, 16.8, 2.2, 3.4, 0.9, "up: d → h", color="#CFE0F3", fontsize=9)
    _box(ax, 11.6, 3.9, 3.4, 0.9, "SiLU", color="#F6D9C4", fontsize=9)
    ax.add_patch(plt.Circle((15.9, 4.35), 0.35, facecolor="white", edgecolor="black", lw=1.2))
    ax.text(15.9, 4.35, "×", ha="center", va="center", fontsize=12)
    _box(ax, 14.1, 5.6, 3.6, 0.9, "proj: h → d", color="#CFE0F3", fontsize=9)
    _arrow(ax, (15.4, 1.4), (13.3, 2.2))
    _arrow(ax, (16.4, 1.4), (18.5, 2.2))
    _arrow(ax, (13.3, 3.1), (13.3, 3.9))
    _arrow(ax, (15.05, 4.35), (15.55, 4.35))
    ax.plot([18.5, 18.5], [3.1, 4.35], color="black", lw=1.2)
    _arrow(ax, (18.5, 4.35), (16.25, 4.35))
    _arrow(ax, (15.9, 4.7), (15.9, 5.6))
    _arrow(ax, (15.9, 6.5), (15.9, 7.3))
    ax.text(15.9, 7.45, "out  (d)", ha="center", fontsize=9)
    ax.text(19.0, 5.2, "the gate scales\nthe up path,\nelement by element", fontsize=7, va="center")
    ax.text(10.5, 0.05, "helpers stores gate and up as one Linear d → 2h (`fc`) and splits its output in two",
            ha="center", fontsize=8)
    return fig


def simplified_attention():
    """No weights yet: one query scores every token by a dot product, softmax turns the scores into weights."""
    fig, ax = _canvas(10.5, 3.9, (0, 21), (0, 7.8))
    tokens = ["Att", "ention", " lets", " each", " token", " look", " back"]
    weights = [0.05, 0.55, 0.2, 0.05, 0.03, 0.06, 0.06]  # a shape to show, not the notebook's numbers
    query = 1
    ax.text(0.1, 6.9, "inputs x_j", fontsize=9, va="center")
    ax.text(0.1, 5.2, "scores\nω_j = x_2 · x_j", fontsize=9, va="center")
    ax.text(0.1, 3.0, "weights\nα_j = softmax(ω)_j", fontsize=9, va="center")
    for j, (token, weight) in enumerate(zip(tokens, weights, strict=True)):
        x = 4.0 + j * 1.75
        _box(ax, x, 6.5, 1.5, 0.8, token.replace(" ", "␣"), color=ORANGE if j == query else "#CFE0F3", fontsize=8)
        _arrow(ax, (x + 0.75, 6.45), (x + 0.75, 5.75))
        _box(ax, x + 0.25, 4.9, 1.0, 0.8, f"ω_{j + 1}", color="white", fontsize=8)
        _arrow(ax, (x + 0.75, 4.85), (x + 0.75, 4.25))
        ax.add_patch(Rectangle((x + 0.35, 2.0), 0.8, 2.1 * weight / max(weights), facecolor=PURPLE, alpha=0.7,
                               edgecolor="black"))
        ax.text(x + 0.75, 1.65, f"α_{j + 1}", ha="center", va="center", fontsize=8)
    ax.text(4.0 + query * 1.75 + 0.75, 7.55, "the query", ha="center", fontsize=8, color=ORANGE)
    ax.plot([3.9, 16.3], [2.0, 2.0], color="black", lw=0.8)
    ax.text(10.1, 0.6, "context z_2 = Σ_j α_j · x_j : the inputs averaged with these weights, which sum to 1",
            ha="center", fontsize=9)
    ax.text(16.6, 3.0, "softmax over\nthe row", fontsize=8, va="center")
    return fig


def layer_norm():
    """LayerNorm acts on each token's vector alone: centre it, divide by its spread, then a learned scale and shift."""
    fig, ax = _canvas(10.5, 3.4, (0, 21), (0, 6.8))
    values = [2.5, -0.5, 1.5, 4.0, 0.5, 3.5]  # one token's features, before
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    scale, shift = [1.3, 0.7, 1.0, 1.2, 0.8, 1.1], [0.3, -0.2, 0.4, 0.0, 0.2, -0.3]  # learned per feature
    stages = [("one token's d features", values, GREY),
              ("− mean", [v - mean for v in values], BLUE),
              ("÷ √(variance + eps)", [(v - mean) / std for v in values], BLUE),
              ("× weight + bias\n(learned, per feature)",
               [w * (v - mean) / std + b for v, w, b in zip(values, scale, shift, strict=True)], GREEN)]
    for s, (title, vals, color) in enumerate(stages):
        x0 = 0.6 + s * 5.2
        base = 3.0
        ax.plot([x0 - 0.1, x0 + 3.7], [base, base], color="black", lw=0.8)
        for i, v in enumerate(vals):
            ax.add_patch(Rectangle((x0 + i * 0.6, base), 0.45, 0.55 * v, facecolor=color, alpha=0.75,
                                   edgecolor="black", lw=0.6))
        ax.text(x0 + 1.8, 0.35, title, ha="center", va="bottom", fontsize=9)
        if s < len(stages) - 1:
            _arrow(ax, (x0 + 3.9, base + 1.0), (x0 + 4.9, base + 1.0))
    ax.text(10.5, 6.35, "after the division: mean 0 and variance 1 across the features of each token; the batch "
            "and the other tokens play no part", ha="center", fontsize=9)
    return fig


FIGURES: dict[str, Callable[[], plt.Figure]] = {
    "next_token_windows": next_token_windows,
    "training_loop": training_loop,
    "causal_mask": causal_mask,
    "multi_head_split": multi_head_split,
    "transformer_block": transformer_block,
    "gradient_accumulation": gradient_accumulation,
    "kv_cache": kv_cache,
    "paged_blocks": paged_blocks,
    "utf8_bytes": utf8_bytes,
    "token_granularity": token_granularity,
    "bpe_merge_step": bpe_merge_step,
    "batch_stacking": batch_stacking,
    "embedding_lookup": embedding_lookup,
    "qkv_one_head": qkv_one_head,
    "gpt_shapes": gpt_shapes,
    "feed_forward_gelu_swiglu": feed_forward_gelu_swiglu,
    "simplified_attention": simplified_attention,
    "layer_norm": layer_norm,
}
ATTACHMENT = re.compile(r"!\[[^\]]*\]\(attachment:([\w-]+)\.png\)")


def render(name: str) -> bytes:
    """The PNG bytes of figure `name` (no version metadata: the same matplotlib draws the same bytes)."""
    fig = FIGURES[name]()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None}, facecolor="white")
    plt.close(fig)
    return buffer.getvalue()


def notebooks() -> list[Path]:
    return sorted(ROOT.glob("ch*/*.ipynb"))


def shown_figures(path: Path) -> dict[int, list[str]]:
    """{markdown cell index: the figures it shows as attachments} of one notebook."""
    cells = json.loads(path.read_text())["cells"]
    return {i: ATTACHMENT.findall("".join(c["source"])) for i, c in enumerate(cells)
            if c["cell_type"] == "markdown" and ATTACHMENT.search("".join(c["source"]))}


def embed(path: Path, figures_dir: Path | None = None) -> bool:
    """Store each figure a markdown cell of `path` shows as that cell's attachment; True when the file changed."""
    figures_dir = figures_dir or HERE
    text = path.read_text()
    nb = json.loads(text)
    for index, names in shown_figures(path).items():
        unknown = [n for n in names if not (figures_dir / f"{n}.png").is_file()]
        if unknown:
            raise SystemExit(f"{path.name}, cell {index}: no figure {unknown} in {figures_dir.name}/; "
                             f"draw it first (known: {', '.join(FIGURES)})")
        attachments = {f"{n}.png": {"image/png": base64.b64encode((figures_dir / f"{n}.png").read_bytes()).decode()}
                       for n in names}
        # keys in nbformat's (sorted) order, as a recording writes them
        nb["cells"][index] = dict(sorted({**nb["cells"][index], "attachments": attachments}.items()))
    indent = 1 if text.startswith('{\n "') else 2
    new = json.dumps(nb, indent=indent, ensure_ascii=False) + "\n"
    if new != text:
        tmp = path.with_suffix(".ipynb.tmp")
        tmp.write_text(new)
        tmp.replace(path)
    return new != text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the notebooks' copies are current")
    args = parser.parse_args(argv)
    if not args.check:
        for name in FIGURES:
            (HERE / f"{name}.png").write_bytes(render(name))
            print(f"drew figures/{name}.png")
    stale = []
    for path in notebooks():
        if not shown_figures(path):
            continue
        if args.check:
            nb = json.loads(path.read_text())
            for index, names in shown_figures(path).items():
                held = nb["cells"][index].get("attachments", {})
                for n in names:
                    committed = base64.b64encode((HERE / f"{n}.png").read_bytes()).decode()
                    if held.get(f"{n}.png", {}).get("image/png") != committed:
                        stale.append(f"{path.relative_to(ROOT)}: {n}.png")
        elif embed(path):
            print(f"embedded figures in {path.relative_to(ROOT)}")
    if stale:
        print("stale or missing figures (run python figures/draw.py):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
