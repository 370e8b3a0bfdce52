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
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Polygon, Rectangle  # noqa: E402

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
    _loop_of_boxes(ax, steps, y=5.6, w=2.7, h=1.2, gap=0.25, fontsize=7, bend=-0.12)
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


def _loop_of_boxes(ax, steps, y, w, h, gap, fontsize, bend):
    """A row of (text, colour) boxes joined by arrows, and an arc from the last one back to the first: a loop."""
    for i, (text, color) in enumerate(steps):
        x = 0.2 + i * (w + gap)
        _box(ax, x, y, w, h, text, color=color, fontsize=fontsize)
        if i < len(steps) - 1:
            _arrow(ax, (x + w + 0.02, y + h / 2), (x + w + gap - 0.02, y + h / 2))
    last = 0.2 + (len(steps) - 1) * (w + gap) + w / 2
    ax.add_patch(FancyArrowPatch((last, y - 0.05), (0.2 + w / 2, y - 0.05), connectionstyle=f"arc3,rad={bend}",
                                 arrowstyle="-|>", mutation_scale=12, color="black", lw=1.2))


def document_split():
    """Two ways to hold out 10% of the corpus: its alphabetical tail, or whole documents drawn from all over it."""
    fig, ax = _canvas(9.6, 2.6, (0, 19.2), (0, 5.2))
    widths = [0.9, 0.5, 0.7, 1.1, 0.4, 0.8, 0.6, 1.0, 0.5, 0.7, 0.9, 0.4, 0.6, 0.8, 0.5, 1.0, 0.7, 0.5, 0.6, 0.8]
    held_out = {2, 9, 15}  # document_split's draw: anywhere in the corpus
    x0 = 5.2
    tail = x0 + 0.9 * sum(widths)  # where the last 10% of the characters begins
    for row, (label, y) in enumerate((("hold out the last 10%", 3.6), ("document_split", 1.4))):
        ax.text(0.2, y + 0.35, label, fontsize=9, va="center")
        x = x0
        for i, w in enumerate(widths):
            validation = x >= tail - 1e-9 if row == 0 else i in held_out
            ax.add_patch(Rectangle((x, y), w, 0.7, facecolor=ORANGE if validation else "#CFE0F3", edgecolor="black",
                                   lw=0.8))
            x += w
    ax.plot([tail, tail], [3.4, 4.5], color=RED, lw=1.5, ls="--")
    ax.text(x0, 4.85, "the corpus: one document per topic, in alphabetical order", fontsize=9, va="center")
    ax.text(tail + 0.3, 3.15, "the last topics: tables and\nindentation, unlike the rest", fontsize=8, va="top",
            ha="right")
    ax.text(x0, 0.9, "whole documents drawn at random while they fit in 10% of the characters; no document in both "
            "parts", fontsize=8, va="center")
    ax.add_patch(Rectangle((0.2, 0.05), 0.5, 0.4, facecolor="#CFE0F3", edgecolor="black", lw=0.8))
    ax.text(0.85, 0.25, "training", fontsize=8, va="center")
    ax.add_patch(Rectangle((2.6, 0.05), 0.5, 0.4, facecolor=ORANGE, edgecolor="black", lw=0.8))
    ax.text(3.25, 0.25, "validation", fontsize=8, va="center")
    return fig


def next_token_loss():
    """The loss of one window: at each position, minus the log of the probability the model gave the next token."""
    fig, ax = _canvas(10.5, 4.0, (0, 21), (0.2, 8.2))
    inputs, targets = ["The", "return", "statement", "is"], ["return", "statement", "is", "used"]
    probs = [[0.05, 0.3, 0.1, 0.2, 0.05, 0.15, 0.1, 0.05], [0.1, 0.05, 0.5, 0.1, 0.05, 0.1, 0.05, 0.05],
             [0.05, 0.1, 0.05, 0.15, 0.35, 0.1, 0.1, 0.1], [0.2, 0.1, 0.05, 0.1, 0.05, 0.1, 0.3, 0.1]]
    hit = [1, 2, 4, 0]  # the bar of the target token in each distribution
    _box(ax, 0.4, 2.2, 13.2, 0.9, "the GPT (causal: position i sees tokens 0..i only)", color="#E8E8E8")
    for i, (x_tok, y_tok) in enumerate(zip(inputs, targets, strict=True)):
        x = 0.6 + i * 3.3
        _box(ax, x, 0.4, 2.9, 0.8, f"x{i} = {x_tok}", color="#CFE0F3", fontsize=8)
        _arrow(ax, (x + 1.45, 1.25), (x + 1.45, 2.15))
        _arrow(ax, (x + 1.45, 3.15), (x + 1.45, 3.75))
        for j, p in enumerate(probs[i]):  # the softmax over the vocabulary, a few of its tokens shown
            ax.add_patch(Rectangle((x + 0.1 + j * 0.34, 3.8), 0.28, p * 5, facecolor=ORANGE if j == hit[i] else GREY,
                                   edgecolor="black", lw=0.5))
        ax.text(x + 1.45, 6.65, f"target y{i} = {y_tok}", ha="center", fontsize=8)
        ax.text(x + 1.45, 7.4, f"−ln p(y{i}) = {-math.log(probs[i][hit[i]]):.1f}", ha="center", fontsize=9,
                color=ORANGE)
    ax.text(13.9, 5.0, "softmax over the V tokens:\na distribution per position;\norange = the target's "
            "probability", fontsize=8, va="center")
    ax.text(13.9, 7.4, "loss = mean over all positions\n= cross-entropy (nats per token)", fontsize=9, va="center")
    ax.text(13.9, 2.0, "untrained: p ≈ 1/V everywhere,\nso loss ≈ ln V;\nperplexity = e^loss", fontsize=8,
            va="center")
    ax.text(13.9, 0.8, "(the probabilities shown are made up)", fontsize=8, va="center", color="#777777")
    return fig


def generation_loop():
    """Autoregressive decoding: the model scores the next token, a rule picks one, it is appended, and again."""
    fig, ax = _canvas(10.5, 2.7, (0, 21), (0.5, 5.9))
    steps = [("token ids\n(1, t)", "#EEEEEE"), ("model on the last\nCONTEXT ids", "#CFE0F3"),
             ("logits of the\nlast position (V,)", "#CFE0F3"), ("penalties, then /T,\ntop-k, top-p", "#F6D5BE"),
             ("pick one token:\nargmax or sample", "#F6D5BE"), ("append the token:\nids (1, t + 1)", "#D5ECD9")]
    _loop_of_boxes(ax, steps, y=3.5, w=3.0, h=1.3, gap=0.45, fontsize=8, bend=-0.1)
    ax.text(10.5, 1.75, "repeat until n new tokens: each step runs the model once and adds one token", ha="center",
            fontsize=9)
    ax.text(10.5, 0.8, "the decoding rule (orange) is the only part that differs between greedy, temperature, "
            "top-k and top-p", ha="center", fontsize=8)
    ax.text(10.5, 5.3, "one step = one new token", ha="center", fontsize=9)
    return fig


def top_k_top_p():
    """Top-k keeps a fixed number of tokens; top-p as many as reach probability p: few when sure, many when not."""
    peaked = [0.62, 0.3, 0.02, 0.015, 0.012, 0.01, 0.008, 0.006, 0.004, 0.003, 0.001, 0.001]
    flat = [0.16, 0.14, 0.12, 0.11, 0.1, 0.09, 0.08, 0.07, 0.05, 0.04, 0.03, 0.01]
    k, p = 4, 0.9
    fig, axes = plt.subplots(2, 2, figsize=(10.5, 4.6), dpi=DPI, sharey=True)
    for col, (probs, title) in enumerate(((peaked, "the model is sure"), (flat, "the model is unsure"))):
        above = [sum(probs[:i]) for i in range(len(probs))]  # the probability ranked above each token
        rules = ((f"top-k, k = {k}", [i < k for i in range(len(probs))]),
                 (f"top-p, p = {p}", [a < p for a in above]))
        for row, (rule, keep) in enumerate(rules):
            ax = axes[row, col]
            ax.bar(range(len(probs)), probs, color=[BLUE if kept else GREY for kept in keep], edgecolor="black",
                   lw=0.6)
            ax.set_xticks(range(len(probs)), [str(i + 1) for i in range(len(probs))], fontsize=8)
            ax.tick_params(axis="y", labelsize=8)
            ax.text(0.97, 0.85, f"{rule}: keeps {sum(keep)}", transform=ax.transAxes, ha="right", fontsize=9)
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
        axes[0, col].set_title(title, fontsize=10)
        axes[1, col].set_xlabel("tokens ranked by probability", fontsize=8)
    for row in range(2):
        axes[row, 0].set_ylabel("probability", fontsize=8)
    fig.suptitle("Blue tokens are kept and renormalised; grey ones get probability 0", fontsize=10)
    fig.tight_layout()
    return fig


def decoding_penalties():
    """The three penalties on the logits of tokens the context already holds (count = how often)."""
    tokens, counts, logits = ["A", "B", "C", "D"], [0, 1, 3, 2], [3.0, 2.5, 2.0, -1.0]
    r, alpha, beta = 1.5, 0.5, 1.0
    rules = {f"repetition penalty r = {r}\n(seen: positive / r, negative × r)":
             [z if n == 0 else (z / r if z > 0 else z * r) for z, n in zip(logits, counts, strict=True)],
             f"frequency penalty α = {alpha}\n(z − α · count)": [z - alpha * n for z, n in zip(logits, counts,
                                                                                                   strict=True)],
             f"presence penalty β = {beta}\n(z − β, once, if seen)": [z - beta * (n > 0) for z, n in
                                                                        zip(logits, counts, strict=True)]}
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.4), dpi=DPI, sharey=True)
    labels = [f"{t}\ncount {n}" for t, n in zip(tokens, counts, strict=True)]
    for ax, (title, after) in zip(axes, rules.items(), strict=True):
        ax.bar([i - 0.2 for i in range(4)], logits, width=0.4, color=GREY, edgecolor="black", lw=0.6, label="before")
        ax.bar([i + 0.2 for i in range(4)], after, width=0.4, color=ORANGE, edgecolor="black", lw=0.6, label="after")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(4), labels, fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.set_title(title, fontsize=9)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].set_ylabel("logit", fontsize=9)
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle("Penalties lower the logits of tokens already in the context (A is unseen: unchanged)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def prefill_decode():
    """A cached generation: one prefill pass writes the prompt's keys and values, then each decode step adds one."""
    fig, ax = _canvas(10.5, 3.9, (0, 21), (0, 7.8))
    prompt, new = 4, 4  # P prompt tokens, N new ones: the cache holds P + N - 1 positions
    slots = prompt + new - 1
    cx, cw = 9.0, 1.0
    ax.text(cx + slots * cw / 2, 7.3, f"the KV cache: room for P + N − 1 = {slots} positions (every layer)",
            ha="center", fontsize=9)
    for step in range(new):
        y = 5.9 - step * 1.45
        fed = [f"t{i}" for i in range(prompt)] if step == 0 else [f"t{prompt + step - 1}"]
        label = f"prefill: {prompt} prompt tokens, one pass" if step == 0 else f"decode step {step}: one token"
        ax.text(0.2, y + 0.35, label, fontsize=9, va="center")
        ax.text(6.2, y + 0.35, " ".join(fed), fontsize=9, va="center", color=ORANGE if step else BLUE)
        _arrow(ax, (8.0, y + 0.35), (cx - 0.1, y + 0.35))
        written = range(prompt) if step == 0 else [prompt + step - 1]
        for s in range(slots):
            color = (BLUE if step == 0 else ORANGE) if s in written else (GREEN if s < prompt + step - 1 else "white")
            ax.add_patch(Rectangle((cx + s * cw, y), cw, 0.7, facecolor=color, edgecolor="black", lw=0.8))
            if step == 0:
                ax.text(cx + (s + 0.5) * cw, y + 1.0, str(s), ha="center", fontsize=8)
        _arrow(ax, (cx + slots * cw + 0.2, y + 0.35), (cx + slots * cw + 1.2, y + 0.35))
        ax.text(cx + slots * cw + 1.4, y + 0.35, f"predicts t{prompt + step}", fontsize=9, va="center")
    ax.text(10.5, 0.2, f"t{prompt + new - 1}, the last new token, is returned and never fed back. Blue: written by the "
            "prefill; orange: written this step; green: read from the cache", ha="center", fontsize=8)
    return fig


def kv_cache_memory():
    """What the cache stores: a key and a value of d_model numbers per token, in every layer."""
    fig, ax = _canvas(10.5, 3.1, (0, 21), (0.4, 6.6))
    layers, tokens = 4, 7
    x0, y0, cw, ch = 1.8, 1.2, 1.2, 1.2
    for layer in range(layers):
        y = y0 + layer * ch
        ax.text(x0 - 0.2, y + ch / 2, f"layer {layer + 1}", ha="right", va="center", fontsize=9)
        for t in range(tokens):
            new = t == tokens - 1
            for half, name in enumerate(("k", "v")):
                ax.add_patch(Rectangle((x0 + t * cw + half * cw / 2, y + 0.1), cw / 2, ch - 0.2,
                                       facecolor=ORANGE if new else ("#CFE0F3" if half == 0 else "#D5ECD9"),
                                       edgecolor="black", lw=0.6))
                ax.text(x0 + t * cw + (half + 0.5) * cw / 2, y + ch / 2, name, ha="center", va="center", fontsize=8)
    for t in range(tokens):
        ax.text(x0 + (t + 0.5) * cw, y0 - 0.4, f"token {t + 1}" if t < tokens - 1 else "new", ha="center",
                fontsize=8)
    ax.text(x0 + tokens * cw / 2, y0 + layers * ch + 0.4, "positions so far →", ha="center", fontsize=9)
    tx = x0 + tokens * cw + 0.6
    ax.text(tx, 5.4, "each token adds, in every layer,\na key and a value of d_model numbers (orange):",
            fontsize=9, va="center")
    ax.text(tx, 4.3, "bytes per token = 2 · n_layers · d_model · bytes per element", fontsize=9, va="center",
            bbox=dict(boxstyle="round", facecolor="white", edgecolor=ORANGE))
    ax.text(tx, 2.5, "the whole cache = bytes per token × tokens × batch:\nit grows with the length and the batch;\n"
            "the weights stay the same size", fontsize=9, va="center")
    return fig


def gpt2_and_llama_blocks():
    """GPT-2's block beside a LLaMA-style block: the same residual stack, each part swapped for a newer one."""
    fig, ax = _canvas(10.5, 6.7, (0, 16.4), (-0.5, 10.0))
    columns = {"GPT-2": (0.9, ["token embedding + learned position table", "LayerNorm",
                               "multi-head attention (biases)", "LayerNorm", "MLP: d→4d, GELU, 4d→d",
                               "LayerNorm → LM head (tied)"]),
               "LLaMA-style": (9.5, ["token embedding (no position table)", "RMSNorm",
                                     "attention: RoPE on q, k; GQA; no biases", "RMSNorm",
                                     "SwiGLU: gate and up, 8d/3 wide", "RMSNorm → LM head (untied)"])}
    ys = [0.3, 2.0, 3.2, 5.3, 6.5, 8.6]
    colors = ["white", "#E8E8E8", "#CFE0F3", "#E8E8E8", "#F6D9C4", "white"]  # by role: norms, attention, MLP
    w, h = 6.0, 0.8
    for name, (x0, labels) in columns.items():
        mid = x0 + w / 2
        ax.add_patch(Rectangle((x0 - 0.75, 1.35), w + 0.95, 6.95, facecolor="none", edgecolor=GREY, ls="--"))
        ax.text(x0 + w + 0.1, 8.05, "× n_layers", ha="right", fontsize=8)
        for y, label, color in zip(ys, labels, colors, strict=True):
            _box(ax, x0, y, w, h, label, color=color, fontsize=8)
        for y_add in (4.55, 7.85):  # the two residual additions
            ax.add_patch(plt.Circle((mid, y_add), 0.25, facecolor="white", edgecolor="black", lw=1.2))
            ax.text(mid, y_add, "+", ha="center", va="center", fontsize=11)
        for start, end in ((0.3 + h, 2.0), (2.0 + h, 3.2), (3.2 + h, 4.3), (4.8, 5.3), (5.3 + h, 6.5),
                           (6.5 + h, 7.6), (8.1, 8.6)):
            _arrow(ax, (mid, start), (mid, end))
        for leave, y_add in ((1.55, 4.55), (4.95, 7.85)):  # residual: around each sub-layer, onto the +
            lane = x0 - 0.45
            ax.plot([mid, lane, lane], [leave, leave, y_add], color=GREEN, lw=1.4)
            _arrow(ax, (lane, y_add), (mid - 0.25, y_add), color=GREEN)
        ax.text(mid, 9.65, name, ha="center", fontsize=11, weight="bold")
    ax.text(8.2, 9.65, "vs", ha="center", fontsize=10)
    ax.text(8.2, -0.3, "green: the residual stream, added back after each sub-layer", ha="center", fontsize=8,
            color=GREEN)
    return fig


def rope_rotation():
    """RoPE turns each pair of a head's dimensions by position × frequency: a query-key score sees only m − n."""
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 5.0), dpi=DPI)
    theta, start = 0.35, 0.3  # the pair's frequency (radians per position); q and k start in one direction
    for ax, (m, n, title) in zip(axes, ((3, 1, "q at position m = 3, k at position n = 1"),
                                        (6, 4, "both 3 positions later: m = 6, n = 4")), strict=True):
        ax.set_xlim(-1.5, 1.5)
        ax.set_ylim(-1.4, 1.5)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.add_patch(plt.Circle((0, 0), 1.0, fill=False, color=GREY, ls=":"))
        ax.plot([0, 1.1 * math.cos(start)], [0, 1.1 * math.sin(start)], color=GREY, lw=1.2, ls="--")
        ax.text(1.15 * math.cos(start), 1.15 * math.sin(start) - 0.12, "q, k before\nthe rotation", fontsize=8,
                color="#777777", va="top")
        for pos, length, color, name in ((m, 1.0, BLUE, "q"), (n, 0.75, ORANGE, "k")):
            turned = start + pos * theta
            _arrow(ax, (0, 0), (length * math.cos(turned), length * math.sin(turned)), color=color)
            ax.text((length + 0.3) * math.cos(turned), (length + 0.2) * math.sin(turned),
                    rf"{name}: turned by ${pos}\theta_i$", ha="center", va="center", fontsize=9, color=color)
        a0, a1 = start + n * theta, start + m * theta
        arc = [(0.35 * math.cos(a0 + (a1 - a0) * s / 20), 0.35 * math.sin(a0 + (a1 - a0) * s / 20))
               for s in range(21)]
        ax.plot(*zip(*arc, strict=True), color=PURPLE, lw=1.6)
        ax.text(0, -1.3, rf"angle between q and k: $(m - n)\theta_i = {m - n}\theta_i$", ha="center", fontsize=9,
                color=PURPLE)
        ax.set_title(title, fontsize=10)
    fig.suptitle(r"One pair $(x_i, x_{i+d/2})$ of a head's query and key, drawn as a point in the plane. The score "
                 "depends on the angle between them,\n" r"so only on the distance $m - n$. Each pair turns at its "
                 r"own speed $\theta_i = \theta^{-2i/d}$: fast for the first pairs, slow for the last.", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def gqa_heads():
    """Which key/value head each query head reads: one each (MHA), one per group (GQA), one for all (MQA)."""
    fig, ax = _canvas(10.5, 3.0, (0, 21), (0.3, 6.3))
    n_heads = 8
    for col, (name, kv) in enumerate((("multi-head (MHA)", 8), ("grouped-query (GQA)", 2), ("multi-query (MQA)", 1))):
        x0 = 0.4 + col * 7.0
        group = n_heads // kv
        ax.text(x0 + 3.0, 5.9, f"{name}: {kv} key/value head{'s' if kv > 1 else ''}", ha="center", fontsize=9)
        kv_w = 6.0 / kv
        for h in range(n_heads):
            color = HEADS[(h // group) % len(HEADS)] if kv < n_heads else BLUE
            ax.add_patch(Rectangle((x0 + h * 0.75, 4.6), 0.6, 0.8, facecolor=color, edgecolor="black", lw=0.6))
            ax.text(x0 + h * 0.75 + 0.3, 5.0, f"q{h}", ha="center", va="center", fontsize=7, color="white")
            kv_head = h // group
            _arrow(ax, (x0 + h * 0.75 + 0.3, 4.55), (x0 + (kv_head + 0.5) * kv_w, 2.85), color=GREY)
        for j in range(kv):
            color = HEADS[j % len(HEADS)] if kv < n_heads else BLUE
            ax.add_patch(Rectangle((x0 + j * kv_w + 0.05, 1.9), kv_w - 0.1, 0.9, facecolor=color, edgecolor="black",
                                   lw=0.6, alpha=0.6))
            ax.text(x0 + (j + 0.5) * kv_w, 2.35, f"k{j}, v{j}" if kv < n_heads else f"k{j}\nv{j}", ha="center",
                    va="center", fontsize=8 if kv < n_heads else 7)
        ax.text(x0 + 3.0, 1.2, f"query head h reads key/value head h // {group}", ha="center", fontsize=8)
        ax.text(x0 + 3.0, 0.6, f"KV cache: {kv}/{n_heads} of multi-head's" if kv < n_heads else "the full KV cache",
                ha="center", fontsize=8)
    return fig


def _caption(ax, y, text, x=10.5):
    """A centred note of one or two lines under a diagram, at the size its labels use."""
    ax.text(x, y, text, ha="center", va="center", fontsize=8)


def _steps_by_rank(ax, titles, x0, dx, width, title_y, rank_ys, arrow_y):
    """The frame of a step-by-step picture of ranks: a title over each column of width `width`, "rank r" left of
    the first column at each of `rank_ys`, an arrow from each column to the next; returns the columns' left edges."""
    xs = [x0 + k * dx for k in range(len(titles))]
    for x, title in zip(xs, titles, strict=True):
        ax.text(x + width / 2, title_y, title, ha="center", va="center", fontsize=8)
    for r, y in enumerate(rank_ys):
        ax.text(x0 - 0.2, y, f"rank {r}", ha="right", va="center", fontsize=8)
    for x in xs[1:]:
        _arrow(ax, (x - dx + width + 0.1, arrow_y), (x - 0.1, arrow_y))
    return xs


def _cell_row(ax, x, y, labels, colors, w=0.9, h=0.7, fontsize=8, text_color="black"):
    """A row of square-cornered cells, one label and one colour each, left to right from (x, y)."""
    for i, (label, color) in enumerate(zip(labels, colors, strict=True)):
        ax.add_patch(Rectangle((x + i * w, y), w, h, facecolor=color, edgecolor="black", lw=0.8))
        ax.text(x + (i + 0.5) * w, y + h / 2, label, ha="center", va="center", fontsize=fontsize, color=text_color)


def online_softmax():
    """The notebook's ten scores in chunks of 3: a running max m and a running sum ℓ, rescaled when m grows."""
    x = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0]
    fig, ax = _canvas(10.5, 3.6, (0, 21), (0, 7.2))
    ax.text(0.2, 6.6, "scores x, walked in chunks of 3: one pass, keeping only m and ℓ", fontsize=9, va="center")
    m, ell = -math.inf, 0.0
    for c, start in enumerate(range(0, len(x), 3)):
        chunk = x[start:start + 3]
        x0 = 0.4 + c * 5.2
        _cell_row(ax, x0, 5.0, [f"{v:g}" for v in chunk], ["#CFE0F3"] * len(chunk), w=1.0, h=0.8, fontsize=9)
        m_new = max(m, max(chunk))
        rescale = "" if m == -math.inf else (f"ℓ·e^({m:g}−{m_new:g}) + " if m_new > m else "ℓ·1 + ")
        ell = ell * math.exp(m - m_new) + sum(math.exp(v - m_new) for v in chunk)
        grew = m_new > m
        _box(ax, x0 - 0.2, 1.9, 4.6, 2.4, "", color="#F6D9C4" if grew else "#EEEEEE", fontsize=8)
        ax.text(x0 + 2.1, 3.8, f"m = {m_new:g}" + ("  (grew)" if grew and c else ""), ha="center", fontsize=9)
        ax.text(x0 + 2.1, 3.0, f"ℓ = {rescale}Σ e^(x − {m_new:g})", ha="center", fontsize=8)
        ax.text(x0 + 2.1, 2.3, f"= {ell:.5f}", ha="center", fontsize=8)
        _arrow(ax, (x0 + 0.5 * len(chunk), 4.95), (x0 + 0.5 * len(chunk), 4.35))
        if c:
            _arrow(ax, (x0 - 0.75, 3.1), (x0 - 0.25, 3.1), color=PURPLE)
        m = m_new
    _caption(ax, 0.9, f"then softmax(x)ᵢ = e^(xᵢ − {m:g}) / ℓ: the same as the two-pass formula. When a chunk "
             "raises the max, the\nold sum was taken against the old max, so it is multiplied by e^(m − m′) "
             "before the new terms are added.")
    return fig


def flash_attention_tiles():
    """Causal tiled attention: query block i walks key blocks 0..i; one tile of scores at a time, in fast memory."""
    fig, ax = _canvas(10.5, 4.8, (0, 21), (0, 9.6))
    n, t = 4, 1.5  # 4 query blocks x 4 key blocks, each tile t wide
    gx, gy = 2.6, 1.2  # the score grid's lower-left corner
    for j in range(n):
        _box(ax, gx + j * t + 0.1, gy + n * t + 0.25, t - 0.2, 0.7, f"K{j}, V{j}", color="#D5ECD9", fontsize=8)
    ax.text(gx + n * t / 2, gy + n * t + 1.3, "key blocks (block_k keys each)", ha="center", fontsize=8)
    for i in range(n):
        y = gy + (n - 1 - i) * t
        _box(ax, gx - 1.2, y + 0.1, 0.9, t - 0.2, f"Q{i}", color="#CFE0F3", fontsize=8)
        for j in range(n):
            skipped, current = j > i, (i, j) == (2, 1)
            color = "#F3F3F3" if skipped else (ORANGE if current else "#FBE9DC")
            ax.add_patch(Rectangle((gx + j * t, y), t, t, facecolor=color, edgecolor="black", lw=0.8))
            if j == i:  # the diagonal tile: its keys after each query are masked inside it
                ax.add_patch(Polygon([(gx + j * t, y + t), (gx + (j + 1) * t, y + t), (gx + (j + 1) * t, y)],
                                     facecolor="#F3F3F3", edgecolor="black", lw=0.8))
            label = "skipped" if skipped else ("in SRAM\nnow" if current else f"S{i}{j}")
            at = (gx + (j + 0.3) * t, y + 0.3 * t) if j == i else (gx + (j + 0.5) * t, y + t / 2)
            ax.text(*at, label, ha="center", va="center", fontsize=8,
                    color="#999999" if skipped else "black")
    ax.text(gx - 0.75, gy + n * t + 0.6, "query\nblocks", ha="center", fontsize=8)
    y2 = gy + t  # query block 2's row: the walk over its key blocks
    _arrow(ax, (gx + 0.2, y2 + 0.2), (gx + 2.8 * t, y2 + 0.2), color=PURPLE)
    ax.text(gx + n * t / 2, gy - 0.5, "diagonal tiles: masked inside (grey half); tiles above them: never computed",
            ha="center", fontsize=8)
    x1 = 10.4
    _box(ax, x1, 5.2, 10.2, 2.6, "", color="#FBE9DC")
    ax.text(x1 + 5.1, 7.4, "for query block i (here i = 2), for key blocks j = 0 … i:", ha="center", fontsize=9)
    ax.text(x1 + 0.3, 6.0, "S = Qᵢ Kⱼᵀ / √d                        (block_q × block_k: the only scores)\n"
            "m′ = max(m, row max S),  P = e^(S − m′)\n"
            "ℓ = ℓ·e^(m − m′) + row sum P,   o = o·e^(m − m′) + P Vⱼ", fontsize=8, va="center")
    _box(ax, x1, 2.9, 10.2, 1.6, "after the last key block: Oᵢ = o / ℓ, written to HBM once", color="#CFE0F3",
         fontsize=9)
    _arrow(ax, (x1 + 5.1, 5.15), (x1 + 5.1, 4.55))
    ax.text(x1 + 5.1, 1.6, "m, ℓ (one per row) and o (block_q × d) stay in fast memory.\n"
            "Kⱼ, Vⱼ are read once per query block; no T × T array is ever written.", ha="center", va="center",
            fontsize=8)
    return fig


def int8_per_channel():
    """Symmetric int8 with one scale per tensor or one per output channel (row): the step each row gets."""
    import numpy as np

    w = np.array([[0.12, -0.05, 0.31, -0.22, 0.08], [2.40, -0.30, 0.45, 0.10, -0.60],
                  [-0.04, 0.02, -0.01, 0.03, 0.05], [0.50, -0.75, 0.20, 0.66, -0.18]])
    fig, ax = _canvas(10.5, 4.0, (0, 21), (0, 8.0))
    rows, cols = w.shape
    cw, ch = 0.9, 0.75

    def matrix(x0, values, fmt, title, highlight=None):
        ax.text(x0 + cols * cw / 2, 6.4, title, ha="center", va="center", fontsize=9)
        for r in range(rows):
            colors = [("#F6D9C4" if highlight is not None and highlight[r] else "#EEEEEE")] * cols
            _cell_row(ax, x0, 5.6 - (r + 1) * ch, [fmt(v) for v in values[r]], colors, w=cw, h=ch, fontsize=8)

    matrix(0.2, w, lambda v: f"{v:g}", "weights W (out × in)")
    s_tensor = np.abs(w).max() / 127
    q_tensor = np.clip(np.round(w / s_tensor), -127, 127).astype(int)
    s_rows = np.abs(w).max(axis=1) / 127
    q_rows = np.clip(np.round(w / s_rows[:, None]), -127, 127).astype(int)
    coarse = np.abs(q_tensor).max(axis=1) < 32
    matrix(5.5, q_tensor, str, f"q, per tensor:\none s = {np.abs(w).max():g} / 127", highlight=coarse)
    matrix(10.9, q_rows, str, "q, per output channel:\nsᵢ = max |row i| / 127")
    ax.text(16.3, 6.4, "sᵢ", ha="center", va="center", fontsize=9)
    for r in range(rows):
        ax.text(16.3, 5.6 - (r + 0.5) * ch, f"{s_rows[r]:.5f}", ha="center", va="center", fontsize=8)
    _arrow(ax, (4.75, 4.1), (5.4, 4.1))
    _arrow(ax, (10.15, 4.1), (10.8, 4.1))
    ax.text(17.4, 4.1, "q = round(w / s),\nclamped to ±127;\nw ≈ s·q, off by\nat most s/2", fontsize=8, va="center")
    _caption(ax, 1.2, "One large weight (2.4) sets the per-tensor step for every row: the shaded rows use only a few "
             "of the 255 levels.\nPer-channel scales give each row a step for its own range: every row reaches ±127.")
    return fig


def _continuous_schedule(requests, slots):
    """Each request's (slot, first iteration, last iteration) when a finished request's slot is refilled next
    iteration; a request runs 1 prefill iteration and max_tokens - 1 decode iterations."""
    waiting, free_at, placed = list(requests), [0] * slots, {}
    while waiting:
        slot = min(range(slots), key=lambda s: free_at[s])
        name, _, out = waiting.pop(0)
        placed[name] = (slot, free_at[slot], free_at[slot] + out - 1)
        free_at[slot] += out
    return placed


def static_continuous_batching():
    """Notebook 6.3's six requests on 3 slots: static batches wait for their longest row, continuous refills."""
    requests = [("r0", 6, 3), ("r1", 4, 8), ("r2", 9, 2), ("r3", 3, 5), ("r4", 5, 2), ("r5", 7, 4)]  # prompt, out
    fig, axes = plt.subplots(2, 1, figsize=(10.5, 4.6), dpi=DPI)
    static = {}
    for b in range(0, len(requests), 3):
        batch = requests[b:b + 3]
        start = max((v[2] for v in static.values()), default=-1) + 1
        longest = max(out for _, _, out in batch)
        for slot, (name, _, out) in enumerate(batch):
            static[name] = (slot, start, start + out - 1, start + longest - 1)
    continuous = {k: (*v, v[2]) for k, v in _continuous_schedule(requests, 3).items()}
    for ax, (title, plan) in zip(axes, (("static batching", static), ("continuous batching", continuous)),
                                 strict=True):
        span = max(v[3] for v in plan.values()) + 1
        for name, (slot, first, last, held) in plan.items():
            for it in range(first, held + 1):
                kind = "P" if it == first else ("d" if it <= last else "pad")
                color = BLUE if kind == "P" else (GREEN if kind == "d" else "#F4C7C8")
                ax.add_patch(Rectangle((it, 2 - slot), 1, 1, facecolor=color, edgecolor="white", lw=1.5))
                ax.text(it + 0.5, 2.5 - slot, f"{name}\n{kind}" if it == first else kind, ha="center",
                        va="center", fontsize=7 if it == first else 8, color="white" if kind != "pad" else RED)
        ax.set_xlim(0, 13)
        ax.set_ylim(0, 3)
        ax.set_yticks([2.5, 1.5, 0.5], ["slot 0", "slot 1", "slot 2"], fontsize=8)
        ax.set_xticks([i + 0.5 for i in range(13)], [str(i) for i in range(13)], fontsize=8)
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(f"{title}: {span} iterations", fontsize=10, loc="left")
    axes[1].set_xlabel("iteration (P = prefill of the prompt, d = one decode step, pad = a finished row computed as "
                       "padding)", fontsize=8)
    fig.suptitle("Six requests (prompt, new tokens): r0 (6, 3), r1 (4, 8), r2 (9, 2), r3 (3, 5), r4 (5, 2), "
                 "r5 (7, 4); 3 batch slots", fontsize=9)
    fig.tight_layout()
    return fig


def speculative_verify():
    """One greedy round, k = 4: the draft proposes, one target pass scores k + 1 prefixes, the matching run is kept."""
    context = ["for", " i", " in"]
    drafted = [" range", "(", "n", ")"]
    chosen = [" range", "(", "len", "(", ":"]
    fig, ax = _canvas(10.5, 4.4, (0, 21), (0, 8.8))
    w = 2.0
    ax.text(0.2, 8.2, "1. the draft proposes k = 4 tokens, one (cheap) pass each", fontsize=9)
    _cell_row(ax, 0.4, 6.9, context, ["#EEEEEE"] * 3, w=w, h=0.8, fontsize=9)
    _cell_row(ax, 0.4 + 3 * w, 6.9, [repr(t) for t in drafted], [ORANGE] * 4, w=w, h=0.8, fontsize=9)
    ax.text(0.2, 5.9, "2. the target runs once over the last accepted token and the k proposals: its own choice "
            "after each of the k + 1 prefixes", fontsize=9)
    _box(ax, 0.4 + 2 * w, 4.75, 5 * w, 0.6, "one target forward pass", color="#CFE0F3", fontsize=8)
    for j in range(5):
        _arrow(ax, (0.4 + (2.5 + j) * w, 6.85), (0.4 + (2.5 + j) * w, 5.4), color=GREY)
        _arrow(ax, (0.4 + (2.5 + j) * w, 4.7), (0.4 + (3.5 + j) * w - 0.3, 3.75), color=GREY)
    ok = [d == c for d, c in zip(drafted, chosen, strict=False)]
    kept = ok.index(False) if False in ok else len(drafted)
    colors = [GREEN if j < kept else (BLUE if j == kept else "#F3F3F3") for j in range(5)]
    _cell_row(ax, 0.4 + 3 * w, 2.9, [repr(t) for t in chosen], colors, w=w, h=0.8, fontsize=9)
    ax.text(0.4 + 3 * w - 0.2, 3.3, "target's choice", ha="right", va="center", fontsize=8)
    for j in range(4):
        ax.text(0.4 + (3.5 + j) * w, 2.6, "= draft ✓" if ok[j] else ("≠ draft ✗" if j == kept else "not used"),
                ha="center", va="top", fontsize=8, color=GREEN if ok[j] else (RED if j == kept else "#999999"))
    ax.text(0.4 + 7.5 * w, 2.6, "used if all\n4 match", ha="center", va="top", fontsize=8, color="#999999")
    ax.text(0.2, 1.2, f"3. keep the {kept} proposals before the first mismatch, then the target's own token there: "
            f"{kept + 1} tokens for one target pass\n    (between 1 and k + 1). The text is the target's own greedy "
            "output, token for token; the draft only changes the speed.", fontsize=9, va="center")
    return fig


def prefix_tree():
    """Chain digests make the cached blocks a tree: a request follows its prompt's blocks from the root."""
    fig, ax = _canvas(10.5, 4.4, (0, 21), (0, 8.8))
    bw, bh = 3.3, 1.1
    node = {}

    def block(key, x, y, tokens, color, owners):
        _box(ax, x, y, bw, bh, "", color=color)
        ax.text(x + bw / 2, y + bh * 0.68, tokens, ha="center", va="center", fontsize=8)
        ax.text(x + bw / 2, y + bh * 0.25, f"d{key} · held by {owners}", ha="center", va="center", fontsize=7,
                color="#444444")
        node[key] = (x, y)

    _box(ax, 0.2, 3.9, 1.4, 1.1, "root", color="#EEEEEE", fontsize=9)
    block("1", 2.3, 5.8, "You are a helpful", "#D5ECD9", "A, B")
    block("2", 6.3, 5.8, "assistant. Answer in", "#D5ECD9", "A, B")
    block("3a", 10.3, 7.2, "one line. What is", "#CFE0F3", "A")
    block("4a", 14.3, 7.2, "a list comprehension", "#CFE0F3", "A")
    block("3b", 10.3, 4.4, "one line. How do", "#F6D9C4", "B")
    block("4b", 14.3, 4.4, "I sort a dict", "#F6D9C4", "B")
    block("1c", 2.3, 2.0, "Translate to French:", "#EEEEEE", "C")
    block("2c", 6.3, 2.0, "the cat sat on", "#EEEEEE", "C")
    for a, b in (("1", "2"), ("2", "3a"), ("3a", "4a"), ("2", "3b"), ("3b", "4b"), ("1c", "2c")):
        (xa, ya), (xb, yb) = node[a], node[b]
        _arrow(ax, (xa + bw, ya + bh / 2), (xb, yb + bh / 2), color="#555555")
    for key in ("1", "1c"):
        _arrow(ax, (1.6, 4.45), (node[key][0], node[key][1] + bh / 2), color="#555555")
    _caption(ax, 0.9, "dᵢ = sha256(dᵢ₋₁ + the tokens of block i): a block's name covers every token up to its end "
             "(blocks of 4 tokens here).\nA and B share the system prompt's full blocks; the block where B's question "
             "begins differs, and so does every digest after it.")
    ax.text(18.0, 2.6, "a new prompt hashes its blocks\nand follows them from the root;\nthe first miss ends "
            "the\nshared part", ha="center", va="center", fontsize=8)
    return fig


def ring_all_reduce():
    """Three ranks, three chunks each: p-1 reduce-scatter steps, then p-1 all-gather steps around the ring."""
    p = 3
    names = "abc"
    held = [[{r} for _ in range(p)] for r in range(p)]  # held[rank][chunk]: whose values it has summed
    states = [("start: rank r holds\nits own gradient", [[set(c) for c in row] for row in held], set())]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(p - 1):
            sends = []
            for r in range(p):
                idx = (r - step) % p if phase == "reduce-scatter" else (r + 1 - step) % p
                sends.append(((r + 1) % p, idx, set(held[r][idx])))
            for dest, idx, payload in sends:
                held[dest][idx] = held[dest][idx] | payload if phase == "reduce-scatter" else payload
            states.append((f"{phase}\nstep {step + 1}", [[set(c) for c in row] for row in held],
                           {(dest, idx) for dest, idx, _ in sends}))
    fig, ax = _canvas(10.5, 3.5, (0, 21), (0, 7.0))
    cw, ch = 1.15, 0.85
    shade = {1: "#EEEEEE", 2: "#F6D9C4", 3: GREEN}
    xs = _steps_by_rank(ax, [title for title, _, _ in states], 1.5, 3.95, p * cw, 5.6,
                        [3.9 - r * ch + ch / 2 for r in range(p)], 3.5)
    for x0, (_, grid, changed) in zip(xs, states, strict=True):
        for r in range(p):
            labels = ["Σ" + str(c) if len(grid[r][c]) == p else "+".join(f"{names[q]}{c}" for q in sorted(grid[r][c]))
                      for c in range(p)]
            y = 3.9 - r * ch
            _cell_row(ax, x0, y, labels, [shade[len(grid[r][c])] for c in range(p)], w=cw, h=ch, fontsize=8)
            for c in range(p):
                if (r, c) in changed:
                    ax.add_patch(Rectangle((x0 + c * cw, y), cw, ch, fill=False, edgecolor=RED, lw=2.0))
    _caption(ax, 0.8, "Chunk j of the gradient: aj, bj, cj on ranks 0, 1, 2; Σj = aj + bj + cj, the sum over all "
             "ranks. Each step every rank sends one chunk\nto its right neighbour (0 → 1 → 2 → 0); "
             "red: the chunk each rank received. Reduce-scatter adds it, all-gather copies it.")
    return fig


def tensor_parallel_qkv():
    """The fused QKV weight on 2 ranks: each rank takes its heads' rows of Q, of K and of V (d_model = 8)."""
    d, ranks = 8, 2
    fig, ax = _canvas(10.5, 4.4, (0, 21), (0, 8.8))
    rh = 0.26  # one weight row
    y_top = 7.6
    shard = d // ranks

    def column(x, owner, title):
        ax.text(x + 0.9, y_top + 0.35, title, ha="center", fontsize=9)
        for row in range(3 * d):
            rank = owner(row)
            ax.add_patch(Rectangle((x, y_top - (row + 1) * rh), 1.8, rh, facecolor=HEADS[rank], edgecolor="white",
                                   lw=0.6, alpha=0.9))
        for part, name in enumerate("QKV"):
            y = y_top - (part + 0.5) * d * rh
            ax.text(x - 0.2, y, name, ha="right", va="center", fontsize=9)
            ax.plot([x - 0.1, x + 1.9], [y_top - part * d * rh] * 2, color="black", lw=1.2)
        ax.plot([x - 0.1, x + 1.9], [y_top - 3 * d * rh] * 2, color="black", lw=1.2)

    column(1.5, lambda row: row % d // shard, "shard_rows: each rank\nits heads of Q, K and V")
    column(8.0, lambda row: row // (3 * d // ranks), "a contiguous cut\n(wrong)")
    for r in range(ranks):
        rows = [row for row in range(3 * d) if row % d // shard == r]
        ax.add_patch(Rectangle((13.4, 6.3 - r * 1.7), 0.5, 0.5, facecolor=HEADS[r], edgecolor="white"))
        runs = ", ".join(f"{rows[i]}–{rows[i + shard - 1]}" for i in range(0, len(rows), shard))
        ax.text(14.1, 6.55 - r * 1.7, f"rank {r}: rows {runs}\n{('the first', 'the second')[r]} half of the heads: "
                "their q, k and v",
                va="center", fontsize=8)
    ax.text(14.1, 3.0, "The contiguous cut gives rank 0 all\nof Q, half of K and none of V: no\nhead has its q, k "
            "and v on one rank.\nWith shard_rows each rank computes\nwhole heads and never needs\n"
            "another rank's q, k or v.",
            va="center", fontsize=8)
    ax.text(1.5 + 0.9, 0.6, "W_qkv: 3·d_model rows × d_model (d_model = 8, 2 ranks)", ha="center", fontsize=8)
    return fig


def pipeline_bubble():
    """p = 4 stages, F = 1 and B = 2 time units: one batch keeps one stage busy at a time; GPipe's m = 4
    micro-batches leave the bubble (p - 1)/(m + p - 1) of the step idle."""
    p = 4
    fig, axes = plt.subplots(2, 1, figsize=(10.5, 4.6), dpi=DPI, gridspec_kw={"height_ratios": [1, 1]})
    for ax, m in zip(axes, (1, 4), strict=True):
        forward_end = p - 1 + m  # the last stage finishes the last forward here
        span = 3 * (m + p - 1)
        for s in range(p):
            y = p - 1 - s
            ax.add_patch(Rectangle((0, y + 0.1), span, 0.8, facecolor="#F4F4F4", edgecolor="none"))
            for i in range(m):  # forward of micro-batch i on stage s: starts at s + i
                ax.add_patch(Rectangle((s + i, y + 0.1), 1, 0.8, facecolor=BLUE, edgecolor="white"))
                ax.text(s + i + 0.5, y + 0.5, f"F{i}", ha="center", va="center", fontsize=8, color="white")
            for k, i in enumerate(reversed(range(m))):  # backwards in reverse order, each 2 units
                start = forward_end + 2 * (p - 1 - s) + 2 * k
                ax.add_patch(Rectangle((start, y + 0.1), 2, 0.8, facecolor=ORANGE, edgecolor="white"))
                ax.text(start + 1, y + 0.5, f"B{i}", ha="center", va="center", fontsize=8, color="white")
        ax.set_xlim(0, 21)
        ax.set_ylim(0, p)
        ax.set_yticks([p - 0.5 - s for s in range(p)], [f"stage {s}" for s in range(p)], fontsize=8)
        ax.set_xticks(range(0, 22, 3))
        ax.tick_params(labelsize=8, length=2)
        for spine in ("top", "right", "left"):
            ax.spines[spine].set_visible(False)
        idle = (p - 1) / (m + p - 1)
        title = ("one batch (m = 1): a single stage works at a time" if m == 1
                 else f"GPipe, m = {m} micro-batches: all forwards, then all backwards")
        ax.set_title(f"{title}; grey = idle, (p−1)/(m+p−1) = {p - 1}/{m + p - 1} = {idle:.0%} of the step",
                     fontsize=9, loc="left")
    axes[1].set_xlabel("time (F = 1 unit, B = 2 units); the step takes 3(m + p − 1) units", fontsize=8)
    fig.tight_layout()
    return fig


def fsdp_shard_gather():
    """One FSDP unit on 2 ranks: shards at rest, all-gathered for forward and again for backward, the gradient
    reduce-scattered so each rank keeps the summed gradient of its own shard."""
    fig, ax = _canvas(10.5, 3.6, (0, 21), (0.4, 7.6))
    steps = [("at rest:\nits shard", "shard", None),
             ("forward:\nall-gather,\ncompute", "full", None),
             ("after forward:\nfull copy freed", "shard", None),
             ("backward:\nall-gather, full\ngradient (own data)", "full", "full"),
             ("reduce-scatter:\nsummed gradient\nof its own shard", "shard", "shard"),
             ("AdamW updates\nits shard, with\nits own moments", "step", "shard")]
    xs = _steps_by_rank(ax, [title for title, _, _ in steps], 0.9, 3.4, 2.3, 6.8, [4.5, 2.1], 3.3)
    for x0, (_, weights, grads) in zip(xs, steps, strict=True):
        for r in range(2):
            y = 3.7 - r * 2.4
            for half in range(2):  # the parameter's two halves along dim 0
                own, top = half == r, y + (1 - half) * 0.8
                if weights == "full" or own:
                    color = GREEN if weights == "step" else BLUE
                    ax.add_patch(Rectangle((x0, top), 1.0, 0.8, facecolor=color, alpha=1.0 if own else 0.4,
                                           edgecolor="black", lw=0.8))
                    ax.text(x0 + 0.5, top + 0.4, f"W{half}" + ("′" if weights == "step" else ""), ha="center",
                            va="center", fontsize=8, color="white")
                if grads == "full" or (grads == "shard" and own):
                    ax.add_patch(Rectangle((x0 + 1.3, top), 1.0, 0.8, facecolor=ORANGE, edgecolor="black", lw=0.8))
                    ax.text(x0 + 1.8, top + 0.4, f"g{half}" if grads == "full" else f"Σg{half}", ha="center",
                            va="center", fontsize=8, color="white")
    _caption(ax, 0.75, "W0, W1: a parameter cut along its first dimension; light: the half gathered from the other "
             "rank, freed after use.\ng: this rank's gradient (from its own part of the batch); Σg: summed over the "
             "ranks.")
    return fig


def moe_routing():
    """A router picks each token's top-2 of 4 experts, weighted by its probabilities; the slots then reach the
    experts by a loop over experts or sorted by expert for one grouped matrix product."""
    fig, ax = _canvas(11.0, 4.2, (0, 22.6), (0.7, 9.3))
    experts = (BLUE, ORANGE, GREEN, PURPLE)
    probs = ((0.41, 0.08, 0.29, 0.22), (0.12, 0.47, 0.10, 0.31), (0.36, 0.05, 0.15, 0.44), (0.09, 0.52, 0.12, 0.27))
    chosen = [sorted(range(4), key=lambda e, p=p: -p[e])[:2] for p in probs]
    ax.text(5.6, 8.9, "routing: softmax over E = 4 experts, keep the top k = 2", ha="center", fontsize=9)
    _box(ax, 1.5, 2.1, 1.3, 5.4, "router\n(linear\nd → E)\nsoftmax", color="#E8E8E8", fontsize=8)
    for e, color in enumerate(experts):
        ax.text(3.75 + e * 0.9, 7.95, f"E{e}", ha="center", fontsize=8, color=color, fontweight="bold")
    for t, (p, top) in enumerate(zip(probs, chosen, strict=True)):
        y = 6.8 - t * 1.35
        _box(ax, 0.2, y, 0.9, 0.7, f"t{t}", color="#F2F2F2", fontsize=8)
        _arrow(ax, (1.1, y + 0.35), (1.5, y + 0.35))
        _arrow(ax, (2.8, y + 0.35), (3.25, y + 0.35))
        _cell_row(ax, 3.3, y, [f"{v:.2f}" for v in p],
                  [experts[e] if e in top else "white" for e in range(4)], text_color="black", fontsize=7)
        terms = " + ".join(f"{p[e]:.2f}·E{e}(t{t})" for e in top)
        ax.text(7.1, y + 0.35, f"y{t} = {terms}", va="center", fontsize=8)
    _caption(ax, 1.2, "a token runs through its k experts only: FLOPs of k, weights of E", x=5.6)
    ax.plot([12.0, 12.0], [0.4, 9.0], color=GREY, lw=0.8)
    slots = sorted((e, t) for t, top in enumerate(chosen) for e in top)
    ax.text(17.3, 8.9, "dispatch: the same slots, two ways", ha="center", fontsize=9)
    ax.text(12.5, 8.05, "loop over experts: each gathers its tokens, one matmul each", fontsize=8)
    for e, color in enumerate(experts):
        mine = [f"t{t}" for f, t in slots if f == e]
        _box(ax, 12.5 + e * 2.5, 6.4, 2.2, 1.1, f"E{e}: " + ", ".join(mine), color=color, fontsize=8,
             text_color="white")
    ax.text(12.5, 5.2, "sorted: slots ordered by expert, one grouped matmul over the segments", fontsize=8)
    _cell_row(ax, 12.9, 3.9, [f"t{t}" for _, t in slots], [experts[e] for e, _ in slots], w=1.1, h=0.8,
              text_color="white")
    start = 0
    for e in range(4):
        n = sum(f == e for f, _ in slots)
        x0, x1 = 12.9 + start * 1.1, 12.9 + (start + n) * 1.1
        ax.plot([x0 + 0.05, x0 + 0.05, x1 - 0.05, x1 - 0.05], [3.75, 3.6, 3.6, 3.75], color=experts[e], lw=1.2)
        ax.text((x0 + x1) / 2, 3.2, f"E{e}", ha="center", va="center", fontsize=8, color=experts[e])
        start += n
    _caption(ax, 2.1, "segments of uneven length: the load the router gave each expert", x=17.3)
    _caption(ax, 1.2, "then each output slot is scaled by its weight and added back to its token", x=17.3)
    return fig


def masked_chat_loss():
    """One chat exchange as a training row: the targets inside the prompt are ignored, the answer's are scored."""
    fig, ax = _canvas(10.5, 3.4, (0, 21.5), (-0.3, 6.5))
    tokens = ["<|user|>", "What", "does", "dedent", "do?", "<|end|>", "<|assistant|>", "Remove", "common",
              "whitespace", "<|end|>"]
    start = 7  # the answer's first token
    w, gap = 1.75, 0.08
    ax.text(0.1, 5.85, "inputs", fontsize=8, va="center")
    ax.text(0.1, 1.15, "targets", fontsize=8, va="center")
    for i, token in enumerate(tokens):
        x = 1.4 + i * (w + gap)
        marker = token.startswith("<|")
        color = PURPLE if marker else ("#CFE0F3" if i < start else "#D5EBD9")
        _box(ax, x, 5.4, w, 0.9, token, color=color, fontsize=6.5, text_color="white" if marker else "black")
        if i == 0:
            continue
        scored = i >= start
        _box(ax, x - w - gap, 0.7, w, 0.9, token if scored else "ignored", color=ORANGE if scored else "#E8E8E8",
             fontsize=6.5, text_color="black" if scored else "#777777")
        _arrow(ax, (x + w / 2, 5.35), (x - gap - w / 2, 1.65), color=ORANGE if scored else GREY)
    ax.text(1.4 + 2.5 * (w + gap) + w / 2, 0.2, "the prompt: IGNORE_INDEX, no loss, no gradient", ha="center",
            va="center", fontsize=8, color="#555555")
    ax.text(1.4 + 7.5 * (w + gap) + w / 2, 0.2, "the answer and its <|end|>: the loss", ha="center", va="center",
            fontsize=8, color=ORANGE)
    return fig


def lora_update():
    """Full fine-tuning updates every number of W; LoRA keeps W frozen and adds (alpha / r) B A, B at zero at first."""
    fig, ax = _canvas(10.5, 3.6, (0, 21), (0, 7.2))
    _box(ax, 0.6, 1.4, 3.6, 3.6, "W\n(out × in)\ntrained", color="#CFE0F3", fontsize=9)
    ax.text(4.45, 3.2, "+", fontsize=16, va="center")
    _box(ax, 5.2, 1.4, 3.6, 3.6, "ΔW\n(out × in):\na gradient and\ntwo AdamW\nmoments for\nevery number",
         color=ORANGE, fontsize=8)
    ax.text(4.7, 6.3, "full fine-tuning", ha="center", fontsize=10)
    _box(ax, 10.6, 1.4, 3.6, 3.6, "W\n(out × in)\nfrozen", color="#E8E8E8", fontsize=9)
    ax.text(14.45, 3.2, "+ α/r ·", fontsize=12, va="center")
    _box(ax, 16.4, 1.4, 0.9, 3.6, "B", color=GREEN, fontsize=9)
    _box(ax, 17.6, 4.1, 3.2, 0.9, "A (r × in)", color=GREEN, fontsize=8)
    ax.text(16.85, 1.1, "B: out × r,\nzero at first", ha="center", va="top", fontsize=7)
    ax.text(19.2, 3.6, "A: random\nat first", ha="center", va="top", fontsize=7)
    ax.text(15.7, 6.3, "LoRA: r · (in + out) numbers train", ha="center", fontsize=10)
    return fig


def http_serving():
    """Clients, the HTTP front on an event loop, and the engine in a process of its own, with what passes between
    them through two pipes: a request checked and sent, its tokens sent back after every iteration and streamed as
    events."""
    fig, ax = _canvas(11.0, 4.6, (0, 22.6), (0, 9.4))
    ax.text(1.9, 8.9, "clients", ha="center", fontsize=10)
    for i, name in enumerate(("openai client", "curl", "chat page")):
        _box(ax, 0.3, 6.6 - i * 2.1, 3.2, 1.2, name, color="#F2F2F2", fontsize=8)
    ax.text(9.0, 8.9, "server process: FastAPI on uvicorn's event loop", ha="center", fontsize=10)
    _box(ax, 5.6, 6.3, 6.8, 1.5, "check the request whole\n(a bad field: 4xx, named; queue full: 429)",
         color="#CFE0F3", fontsize=8)
    _box(ax, 5.6, 3.9, 6.8, 1.5, "stream each request's new text\nas server-sent events: data: {...}",
         color="#D5EBD9", fontsize=8)
    _box(ax, 5.6, 1.5, 6.8, 1.5, "/metrics, /health, /v1/models\na client gone: abort its sequence",
         color="#F2F2F2", fontsize=8)
    ax.text(18.3, 8.9, "engine process: its own interpreter", ha="center", fontsize=10)
    _box(ax, 14.8, 1.5, 7.0, 6.3, "", color="white")
    for i, step in enumerate(("1. take new requests and\naborts from the pipe", "2. one iteration: prefill and\n"
                              "decode, continuous batching,\npaged KV, prefix cache",
                              "3. send back each request's\nnew tokens")):
        _box(ax, 15.3, 6.2 - i * 2.0, 6.0, 1.4 if i != 1 else 1.7, step, color=[BLUE, ORANGE, GREEN][i],
             fontsize=8, text_color="white")
    _arrow(ax, (3.5, 7.2), (5.6, 7.05))
    ax.text(4.55, 7.45, "POST", ha="center", fontsize=7)
    _arrow(ax, (5.6, 4.65), (3.5, 5.1), color=GREEN)
    ax.text(4.55, 4.2, "events", ha="center", fontsize=7, color=GREEN)
    _arrow(ax, (12.4, 7.05), (15.3, 6.9), color=BLUE)
    ax.text(13.85, 7.35, "pipe", ha="center", fontsize=7, color=BLUE)
    _arrow(ax, (15.3, 2.9), (12.4, 4.3), color=GREEN)
    ax.text(13.6, 2.6, "tokens, per\nrequest; stats", ha="center", fontsize=7, color=GREEN)
    _arrow(ax, (21.55, 2.6), (21.55, 6.9), connectionstyle="arc3,rad=0.3", color=GREY)
    ax.text(22.05, 4.75, "repeat", rotation=90, ha="center", va="center", fontsize=7, color="#777777")
    _caption(ax, 0.6, "two interpreters on their own cores: the front never runs the model and the engine never "
             "waits for a client; requests join the running batch at the next iteration", x=11.2)
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
    "document_split": document_split,
    "next_token_loss": next_token_loss,
    "generation_loop": generation_loop,
    "top_k_top_p": top_k_top_p,
    "decoding_penalties": decoding_penalties,
    "prefill_decode": prefill_decode,
    "kv_cache_memory": kv_cache_memory,
    "gpt2_and_llama_blocks": gpt2_and_llama_blocks,
    "rope_rotation": rope_rotation,
    "gqa_heads": gqa_heads,
    "online_softmax": online_softmax,
    "flash_attention_tiles": flash_attention_tiles,
    "int8_per_channel": int8_per_channel,
    "static_continuous_batching": static_continuous_batching,
    "speculative_verify": speculative_verify,
    "prefix_tree": prefix_tree,
    "ring_all_reduce": ring_all_reduce,
    "tensor_parallel_qkv": tensor_parallel_qkv,
    "pipeline_bubble": pipeline_bubble,
    "fsdp_shard_gather": fsdp_shard_gather,
    "moe_routing": moe_routing,
    "masked_chat_loss": masked_chat_loss,
    "lora_update": lora_update,
    "http_serving": http_serving,
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
