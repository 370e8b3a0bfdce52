"""The training-speed ladder's report as a table (`format_report`) and a plot (`plot_ladder`)."""

from __future__ import annotations

from .train_ladder import rung_tokens_per_s


def format_report(report: dict) -> str:
    """The ladder as a table, then the comparison with transformers."""
    lines = [f"{report['model']}: batch {report['batch']} x ctx {report['ctx']} on {report['device_name']}; "
             f"MFU against {report['peak_flops'] / 1e12:.2f} TFLOP/s, {report['peak_source']}",
             f"{'rung':<26} {'status':<8} {'ms/step':>9} {'tokens/s':>10} {'IQR':>15} {'MFU':>7} {'x base':>7} "
             f"{'loss 1st':>9}"]
    base = next((r for r in report["rungs"] if r["status"] == "ok"), None)
    for r in report["rungs"]:
        if r["status"] != "ok":
            lines.append(f"{r['label']:<26} {r['status']:<8} {r['note']}")
            continue
        # "~": within the noise of the first measured rung (their IQRs overlap)
        same = r is not base and rung_tokens_per_s(r).overlaps(rung_tokens_per_s(base))
        gain = f"{'~' if same else ''}{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
        iqr = "{:,.0f}–{:,.0f}".format(*r["tokens_per_s_iqr"])
        lines.append(f"{r['label']:<26} {'ok':<8} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10,.0f} {iqr:>15} "
                     f"{r['mfu']:>7.2%} {gain:>7} {r['first_loss']:>9.4f}")
    c = report["transformers"]
    if c is None or c["status"] != "ok":
        lines.append(f"transformers: {c['note'] if c else 'not compared'}")
        return "\n".join(lines)
    lines.append(f"transformers' GPT2LMHeadModel with the settings of '{c['best_rung']}' ({c['attn_implementation']}):")
    lines.append(f"  ours {c['ours_tokens_per_s']:,.0f} tokens/s, transformers eager "
                 f"{c['transformers_eager_tokens_per_s']:,.0f} (x{report['ratio_vs_transformers_eager']:.2f})")
    if report["ratio_vs_transformers_compiled"] is not None:
        lines[-1] += (f", compiled {c['transformers_compiled_tokens_per_s']:,.0f} "
                      f"(x{report['ratio_vs_transformers_compiled']:.2f})")
    lines.append(f"  same settings: {c['verdict']}")
    return "\n".join(lines)


def plot_ladder(report: dict):
    """Tokens/s and MFU per rung with their interquartile ranges (skipped rungs marked), with transformers' GPT-2
    for reference; a Figure."""
    import matplotlib.pyplot as plt

    rungs = report["rungs"]
    labels = [r["label"] for r in rungs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, unit in ((ax1, "tokens_per_s", "training tokens/s"), (ax2, "mfu", "MFU (%)")):
        scale = 100 if key == "mfu" else 1
        values = [scale * r[key] if r["status"] == "ok" else 0 for r in rungs]
        # MFU is tokens/s times a constant (FLOPs per token over the peak): the same quartiles, rescaled
        quartiles = [[v * q / r["tokens_per_s"] for q in r["tokens_per_s_iqr"]] if r["status"] == "ok" else [0, 0]
                     for v, r in zip(values, rungs, strict=True)]
        below_above = [[v - q1 for v, (q1, _) in zip(values, quartiles, strict=True)],
                       [q3 - v for v, (_, q3) in zip(values, quartiles, strict=True)]]
        bars = ax.bar(range(len(rungs)), values, yerr=below_above, capsize=3,
                      color=["C0" if r["status"] == "ok" else "0.8" for r in rungs])
        for bar, r in zip(bars, rungs, strict=True):
            if r["status"] != "ok":
                ax.annotate(r["status"], (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom",
                            rotation=90, fontsize=8, xytext=(0, 3), textcoords="offset points")
        ax.set_xticks(range(len(rungs)), labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(unit)
    c = report["transformers"]
    legend = False
    if c and c["status"] == "ok":
        for name, style in (("transformers_eager_tokens_per_s", "--"), ("transformers_compiled_tokens_per_s", ":")):
            if c[name]:
                ax1.axhline(c[name], color="C3", linestyle=style,
                            label=f"transformers GPT-2, {name.split('_')[1]} ({c['best_rung']} settings)")
        ax1.axhline(c["ours_tokens_per_s"], color="C2", linestyle="-", linewidth=0.8,
                    label="ours, best rung, timed with transformers")
        fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)  # below the axes, clear of the lines
        legend = True
    ax1.set_title(f"{report['model']}: batch {report['batch']} x {report['ctx']} tokens, median and IQR", fontsize=10)
    ax2.set_title(f"MFU against {report['peak_flops'] / 1e12:.3g} TFLOP/s, {report['peak_source']}", fontsize=9)
    fig.suptitle(report["device_name"])
    fig.tight_layout(rect=(0, 0.07 if legend else 0, 1, 1))
    return fig
