"""Tables and plots of bench/controller_sweep.py results: throughput and latency against concurrency.

    python bench/plot_sweep.py OUT/controller_sweep_pair.json OUT/controller_sweep_ngram8b.json --out-dir docs/img

For each JSON: <out-dir>/controller_sweep_<mode>_throughput.png (output tokens/s per policy, and each
policy's ratio to no speculation with the 5% band of the target) and ..._latency.png (p50 and p99 of
TTFT, TPOT and end-to-end latency). Prints the markdown tables docs/tuning.md takes (also with
--md FILE). matplotlib (Agg) is imported only to draw; the tables need nothing but the standard library.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

TARGET = 0.95  # the adaptive controller within 5% of the best fixed choice and of no speculation
ADAPTIVE = ("adaptive", "adaptive-uncalibrated", "adaptive+graphs")


def _levels(result: dict[str, Any]) -> list[int]:
    return [c for c in result["concurrency"] if any(str(c) in rows for rows in result["points"].values())]


def closed_loop_tps(row: dict[str, Any], c: int) -> float | None:
    """Output tokens/s of c clients that each send their next request when the last one finished, by
    Little's law: c x mean output tokens / mean end-to-end latency, over the point's requests. No window
    edge enters it: neither a drain where few requests run nor a replacement's prompt in the last steps."""
    reqs = row.get("requests") or []
    e2e = sum(r[2] for r in reqs)
    return c * sum(r[3] for r in reqs) / (e2e / 1e3) if reqs and e2e > 0 else None


def _tps(result: dict[str, Any], policy: str, c: int, metric: str = "tokens_per_s") -> float | None:
    """A point's throughput: as measured ("tokens_per_s"), or "closed_loop" (closed_loop_tps)."""
    row = result["points"].get(policy, {}).get(str(c))
    if row is None:
        return None
    return closed_loop_tps(row, c) if metric == "closed_loop" else row["tokens_per_s"]


def best_fixed(result: dict[str, Any], c: int, metric: str = "tokens_per_s") -> tuple[str, float] | None:
    """The best of no speculation and every fixed k at this concurrency (all of them measured)."""
    fixed = [p for p in result["policies"] if p == "off" or p.startswith("k=")]
    values = [(p, _tps(result, p, c, metric)) for p in fixed]
    if not values or any(v is None for _, v in values):
        return None
    return max(values, key=lambda pv: pv[1])


def verdicts(result: dict[str, Any], policy: str = "adaptive",
             metric: str = "tokens_per_s") -> list[tuple[int, float | None, float | None]]:
    """(c, policy / best fixed, policy / off) at every measured level."""
    out = []
    for c in _levels(result):
        mine, off = _tps(result, policy, c, metric), _tps(result, "off", c, metric)
        best = best_fixed(result, c, metric)
        out.append((c, mine / best[1] if mine and best else None, mine / off if mine and off else None))
    return out


def paired_ratios(result: dict[str, Any], policy: str, other: str, c: int) -> list[float]:
    """Per round of a point run in parts (--interleave), `policy`'s part throughput over `other`'s part
    of the same round (the parts of a round run back to back): a slow spell of the machine that lasts a
    round hits both, so the ratios spread less than the pooled totals. Empty without parts."""
    mine = (result["points"].get(policy, {}).get(str(c)) or {}).get("runs") or []
    theirs = (result["points"].get(other, {}).get(str(c)) or {}).get("runs") or []
    return [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mine, theirs) if b.get("tokens_per_s")]


def _paired_table(result: dict[str, Any]) -> list[str]:
    """Each adaptive policy against the best fixed choice (by pooled throughput) and no speculation, paired
    by round: the median of the rounds' ratios and their range."""
    pols = result["policies"]
    adaptive = [p for p in ADAPTIVE if p in pols]
    if not adaptive or "off" not in pols:
        return []
    lines = ["", ("Paired by round (median of the rounds' part throughput ratios, range in brackets; the "
                  "best fixed choice as above)"), ""]
    head = ["concurrency", "rounds"]
    for p in adaptive:
        head += [f"{p} / best", f"{p} / off"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in _levels(result):
        best = best_fixed(result, c)
        cells, rounds = [str(c)], 0
        for p in adaptive:
            for other in (best[0] if best else None, "off"):
                r = paired_ratios(result, p, other, c) if other else []
                rounds = max(rounds, len(r))
                cells.append("-" if not r else f"{_ratio(_median(r))} [{min(r):.2f}-{max(r):.2f}]")
        lines.append("| " + " | ".join(cells[:1] + [str(rounds)] + cells[1:]) + " |")
    return lines


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" + ("" if x >= TARGET else " ✗")


def _cell(row: dict[str, Any] | None, metric: str) -> str:
    if row is None:
        return "-"
    lat = row["latency_ms"][metric]
    if lat["p50"] is None:
        return "-"
    digits = 2 if metric in ("tpot", "itl") else 0
    return f"{lat['p50']:.{digits}f} / {lat['p99']:.{digits}f}"


def markdown_tables(result: dict[str, Any]) -> str:
    """Throughput (with the target's ratios) and p50 / p99 latency tables, markdown."""
    pols = result["policies"]
    mode = result["mode"]
    lines = [f"#### {mode}: {result['what']}",
             "",
             (f"{result['device']}, commit {result.get('commit')}, {result.get('date')}; "
              f"{result.get('prompt_tokens_mean', 0):.0f} prompt tokens on average; output "
              f"{result['config']['output_len']} tokens per request below concurrency "
              f"{result['config']['high_from']}, {result['config']['output_len_high']} from it on"
              + (f" (each request's within ±{result['config']['output_len_spread']:.0%} of that)"
                 if result['config'].get('output_len_spread') else "") + "; at least "
              f"{result['min_requests']} requests per point; greedy; K = {result['max_k']}."),
             "",
             "Output tokens/s (✗: below the target, 0.95)",
             ""]
    if not _levels(result):
        return "\n".join(lines[:3] + ["No point was measured."])
    lines += _throughput_table(result, "tokens_per_s")
    lines += ["", ("Closed-loop output tokens/s by Little's law (c x mean output tokens / mean end-to-end latency; "
                   "✗: below the target)"), ""]
    lines += _throughput_table(result, "closed_loop")
    lines += _paired_table(result)
    for metric, title in (("tpot", "TPOT"), ("ttft", "TTFT"), ("e2el", "end-to-end latency")):
        lines += ["", f"{title}, ms, p50 / p99", "", "| concurrency | " + " | ".join(pols) + " |",
                  "|" + " --- |" * (len(pols) + 1)]
        for c in _levels(result):
            cells = [str(c)] + [_cell(result["points"].get(p, {}).get(str(c)), metric) for p in pols]
            lines.append("| " + " | ".join(cells) + " |")
    accept = [p for p in pols if p != "off"]
    if accept:
        lines += ["", "Acceptance rate (accepted / drafted tokens)", "", "| concurrency | " + " | ".join(accept) + " |",
                  "|" + " --- |" * (len(accept) + 1)]
        for c in _levels(result):
            cells = [str(c)]
            for p in accept:
                row = result["points"].get(p, {}).get(str(c))
                a = None if row is None else row.get("acceptance_rate")
                cells.append("-" if a is None else f"{a:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    if result.get("error"):
        lines += ["", f"The run stopped with an error: {result['error']}"]
    if result.get("skipped"):
        lines += ["", "Not run (time budget): " + ", ".join(f"{p} c={c}" for p, c in result["skipped"])]
    return "\n".join(lines)


def _throughput_table(result: dict[str, Any], metric: str) -> list[str]:
    """The throughput table's lines (each policy, the best fixed choice, the adaptive policies' ratios
    and mean k) and the verdict line, by `metric` (see _tps)."""
    pols = result["policies"]
    adaptive = [p for p in ADAPTIVE if p in pols]
    head = ["concurrency"] + pols + ["best fixed"]
    for p in adaptive:
        head += [f"{p} / best", f"{p} / off", f"{p} mean k"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in _levels(result):
        best = best_fixed(result, c, metric)
        cells = [str(c)] + [_fmt_tps(_tps(result, p, c, metric)) for p in pols]
        cells.append("-" if best is None else f"{best[0]} ({best[1]:.0f})")
        for p in adaptive:
            v = {cc: (a, b) for cc, a, b in verdicts(result, p, metric)}[c]
            row = result["points"].get(p, {}).get(str(c)) or {}
            k = row.get("mean_chosen_k")
            cells += [_ratio(v[0]), _ratio(v[1]), "-" if k is None else f"{k:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for p in adaptive:
        v = [x for x in verdicts(result, p, metric) if x[1] is not None and x[2] is not None]
        if v:
            met = sum(1 for _, a, b in v if a >= TARGET and b >= TARGET)
            worst = min(v, key=lambda x: min(x[1], x[2]))
            lines += ["", (f"{p}: target met at {met} of {len(v)} concurrency levels; worst at {worst[0]}: "
                           f"{worst[1]:.3f} of the best fixed choice, {worst[2]:.3f} of no speculation.")]
    return lines


def _fmt_tps(x: float | None) -> str:
    return "-" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


# -- plots -----------------------------------------------------------------------------------------
def _style(policy: str) -> dict[str, Any]:
    if policy == "off":
        return {"color": "black", "linestyle": "--", "marker": "s", "linewidth": 1.5}
    if policy == "adaptive":
        return {"color": "tab:red", "linestyle": "-", "marker": "o", "linewidth": 2.5}
    if policy == "adaptive+graphs":
        return {"color": "tab:red", "linestyle": ":", "marker": "o", "linewidth": 2.0}
    palette = ["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:cyan", "tab:olive"]
    k = int(policy.split("=")[1]) if policy.startswith("k=") else 0
    return {"color": palette[(k - 1) % len(palette)], "linestyle": "-", "marker": "^", "linewidth": 1.2,
            "alpha": 0.85}


def _axis(ax: Any, xs: list[int]) -> None:
    if xs and max(xs) / max(min(xs), 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.grid(True, alpha=0.3)


def _series(result: dict[str, Any], policy: str, value) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for c in _levels(result):
        row = result["points"].get(policy, {}).get(str(c))
        v = None if row is None else value(row)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            xs.append(c)
            ys.append(v)
    return xs, ys


def _plain_log_labels(ax: Any) -> None:
    import matplotlib.ticker

    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def plot_result(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    mode, levels, pols = result["mode"], _levels(result), result["policies"]
    title = f"{result['what']} ({result['device']}, {result.get('date')})"
    paths = []

    fig, (ax_tps, ax_rel) = plt.subplots(1, 2, figsize=(14, 5.5))
    off = {c: _tps(result, "off", c) for c in levels}
    for p in pols:
        ax_tps.plot(*_series(result, p, lambda r: r["tokens_per_s"]), label=p, **_style(p))
        ax_rel.plot(*_series(result, p, lambda r, off=off: r["tokens_per_s"] / off[r["concurrency"]]
                             if off.get(r["concurrency"]) else None), label=p, **_style(p))
    ax_tps.set_yscale("log")
    _plain_log_labels(ax_tps)
    ax_tps.set_ylabel("output tokens/s")
    ax_tps.set_title("throughput")
    ax_rel.axhline(1.0, color="black", linewidth=0.8)
    ax_rel.axhspan(TARGET, 1.0, color="tab:red", alpha=0.08, label="within 5% of no speculation")
    ax_rel.set_ylabel("throughput / no speculation")
    ax_rel.set_title("speedup over no speculation")
    for ax in (ax_tps, ax_rel):
        _axis(ax, levels)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out_dir / f"controller_sweep_{mode}_throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for col, (metric, name) in enumerate((("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "end-to-end latency"))):
        for row, stat in enumerate(("p50", "p99")):
            ax = axes[row][col]
            for p in pols:
                ax.plot(*_series(result, p, lambda r, m=metric, st=stat: r["latency_ms"][m][st]), label=p, **_style(p))
            ax.set_yscale("log")
            _plain_log_labels(ax)
            ax.set_ylabel(f"{name} {stat} (ms)")
            _axis(ax, levels)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out_dir / f"controller_sweep_{mode}_latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="controller_sweep_<mode>.json files")
    p.add_argument("--out-dir", default=None,
                   help="where the PNGs go (default: beside each JSON; docs/img only when asked, so a look at "
                        "an old run does not overwrite the plots the docs show)")
    p.add_argument("--md", default=None, help="also write the tables to this file")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    args = p.parse_args(argv)
    tables = []
    for path in args.results:
        result = json.loads(Path(path).read_text())
        tables.append(markdown_tables(result))
        if not args.no_plots:
            for png in plot_result(result, Path(args.out_dir) if args.out_dir else Path(path).parent):
                print(f"wrote {png}")
    text = "\n\n".join(tables)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
