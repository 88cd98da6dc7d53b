"""Batch-job summaries: totals over output records, a printable digest and a PNG plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxspec.jobs.durable import WriteError

UNVERSIONED = "unversioned"  # the by_prompt_version key of records without a prompt_version


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _add_positions(total: list[int], values) -> None:
    for j, v in enumerate(values or ()):
        if j == len(total):
            total.append(0)
        total[j] += v


def totals(records: list[dict]) -> dict:
    """Counts and rates over output records (ok ones carry "stats", failed ones "error").

    Acceptance pools draft tokens over records (accepted / drafted), so long completions weigh
    more than short ones, as they do in throughput.
    """
    ok = [r for r in records if "error" not in r]
    keys = ("new_tokens", "target_steps", "drafted", "accepted", "prompt_tokens")
    sums = {k: sum(r["stats"][k] for r in ok) for k in keys}
    sums["cached_tokens"] = sum(r["stats"].get("cached_tokens", 0) for r in ok)  # records before prefix sharing: 0
    accepted_pos: list[int] = []
    drafted_pos: list[int] = []
    for r in ok:
        _add_positions(accepted_pos, r["stats"].get("accepted_per_position"))
        _add_positions(drafted_pos, r["stats"].get("drafted_per_position"))
    return {
        "records": len(records), "ok": len(ok), "failed": len(records) - len(ok), **sums,
        "acceptance_rate": _ratio(sums["accepted"], sums["drafted"]),
        "tokens_per_step": _ratio(sums["new_tokens"], sums["target_steps"]),
        "prefill_tokens": sums["prompt_tokens"] - sums["cached_tokens"],  # shared prefixes counted once
        "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(accepted_pos, drafted_pos)],
        "finish_reasons": _count(o["finish_reason"] for r in ok for o in r.get("outputs", [r])),  # per sample
        "rounds_per_k": _rounds_per_k(sums["target_steps"] - sum(len(r.get("outputs", [r])) for r in ok), drafted_pos),
    }


def _rounds_per_k(rounds: int, drafted_pos: list[int]) -> dict:
    """{K: verify rounds that drafted K tokens (K = 0: paused, adaptive K)} from the rounds (each
    sample's prefill step left out) and the rounds that drafted each position; {} for plain decoding."""
    if not drafted_pos:
        return {}
    offered = [rounds, *drafted_pos, 0]
    counts = {k: offered[k] - offered[k + 1] for k in range(len(drafted_pos) + 1)}
    return {str(k): c for k, c in counts.items() if c}


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def by_prompt_version(records: list[dict]) -> dict:
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(str(r.get("prompt_version", UNVERSIONED)), []).append(r)
    return {v: totals(rs) for v, rs in sorted(groups.items())}


def write_json(path: Path, obj) -> None:
    """Written to a temporary file then renamed, so a crash never leaves half a summary; a failed
    write (a full disk) removes the temporary file and raises WriteError."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(path, e) from e


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_summary(s: dict) -> str:
    """The summary as a few human-readable lines."""
    t, run, st = s["totals"], s["this_run"], s["settings"]
    lines = [
        f"batch job {s['input']} -> {s['output']}",
        f"  records: {t['records']} ({t['ok']} ok, {t['failed']} failed); "
        f"{s['skipped_existing']} already in the output were skipped",
        f"  settings: {st['method']}, batch size {st['batch_size']}, target {st['target']}, "
        f"draft {st['draft']}, max_tokens {st['max_tokens']}, temperature {st['temperature']}",
        f"  this run: {run['records']} records, {run['new_tokens']} new tokens in {run['wall_s']:.1f} s: "
        f"{run['records_per_s']:.2f} records/s, {run['tokens_per_s']:.1f} tokens/s "
        f"({run['decode_tokens_per_s']:.1f} tokens/s decoding; compile {run['compile_s']:.1f} s, "
        f"canary {run['canary_s']:.1f} s; graphs compiled {run['graph_cache']['misses']}, of which "
        f"{run['graph_cache']['disk_hits']} read back from the compile cache)"
        + (f"; models loaded in {run['load_s']:.1f} s" if "load_s" in run else ""),
        f"  all records: {t['new_tokens']} new tokens, acceptance {_fmt(t['acceptance_rate'])}, "
        f"{_fmt(t['tokens_per_step'], '.2f')} tokens per target step",
        f"  prefill: {t['prefill_tokens']} of {t['prompt_tokens']} prompt tokens computed, "
        f"{t['cached_tokens']} reused from shared prefixes",
    ]
    if t["per_position_acceptance"]:
        lines.append("  per-position acceptance: " + " ".join(f"{a:.2f}" for a in t["per_position_acceptance"]))
    if len(s["by_prompt_version"]) > 1 or UNVERSIONED not in s["by_prompt_version"]:
        for v, vt in s["by_prompt_version"].items():
            lines.append(
                f"  prompt_version {v}: {vt['ok']} ok, {vt['failed']} failed, acceptance "
                f"{_fmt(vt['acceptance_rate'])}, {_fmt(vt['tokens_per_step'], '.2f')} tokens/step"
            )
    if s.get("canary"):
        lines.append(f"  canary: {s['canary']['reason']}")
    lines.append(f"  summary {s['summary_path']}" + (f", plot {s['plot_path']}" if s.get("plot_path") else ""))
    return "\n".join(lines)


def plot(summary: dict, batches: list[dict], path: Path) -> Path:
    """Per-position acceptance, throughput per batch over the run, and the canary's candidates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    canary = summary.get("canary")
    panels = 3 if canary else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4), dpi=90)
    ax = axes[0]
    pos = summary["totals"]["per_position_acceptance"]
    if pos:
        ax.bar(range(1, len(pos) + 1), pos, color="tab:blue")
        ax.set_xticks(range(1, len(pos) + 1))
        ax.axhline(summary["totals"]["acceptance_rate"], color="black", lw=1,
                   label=f"overall {summary['totals']['acceptance_rate']:.2f}")
        ax.axhline(summary["settings"]["warn_below_acceptance"], color="tab:red", ls="--", lw=1,
                   label="warning threshold")
        ax.legend(loc="upper right", fontsize=8)
    elif canary:  # the job ran plain: show what the canary's candidates achieved
        for c in canary["candidates"]:
            if c["per_position_acceptance"]:
                p = c["per_position_acceptance"]
                ax.plot(range(1, len(p) + 1), p, "o-", ms=3, label=f"canary {c['method'].replace('speculative ', '')}")
        ax.axhline(summary["settings"]["warn_below_acceptance"], color="tab:red", ls="--", lw=1)
        ax.legend(loc="upper right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "plain decoding:\nno draft tokens", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1.05), title="Per-position acceptance")

    ax = axes[1]
    if batches:
        t = [b["elapsed_s"] for b in batches]
        ax.plot(t, [b["tokens_per_s"] for b in batches], ".", ms=4, color="tab:gray", label="batch (decode)")
        ax.plot(t, [b["running_tokens_per_s"] for b in batches], "-", color="tab:green",
                label="running (wall clock, all included)")
        ax.legend(loc="lower right", fontsize=8)
    st = summary["settings"]
    ax.set(xlabel="seconds into the run", ylabel="tokens/s", ylim=(0, None),
           title=f"Throughput: {st['method']}, batch {st['batch_size']}")

    if canary:
        ax = axes[2]
        cands = canary["candidates"]
        names = [c["method"].replace("speculative ", "") for c in cands]
        colors = ["tab:orange" if c["method"] == canary["chosen"] else "tab:gray" for c in cands]
        bars = ax.bar(names, [c["tokens_per_s"] for c in cands], color=colors)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.set(ylabel=f"tokens/s on {canary['sample_records']} sample records", title=f"Canary: {canary['chosen']}")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:  # a full disk: no half-written image left behind
        Path(path).unlink(missing_ok=True)
        raise WriteError(path, e) from e
    finally:
        plt.close(fig)
    return path
