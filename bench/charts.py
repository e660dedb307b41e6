"""Every benchmark chart, drawn from the results as stored (``bench/results/*.json``).

``python -m bench.charts [FOLDER]`` redraws them all without running a benchmark. Each
workload draws its own here right after saving its JSON (``common.save``), so a chart
never shows what the JSON does not hold. Values that span more than ``LOG_SPAN`` get a
log axis, so that a fast system's bar does not vanish next to a slow one's; every chart
names the machine it was measured on and the date.
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
LOG_SPAN = 10.0  # largest / smallest value shown beyond which the axis is logarithmic
COLORS = {
    "streamq": "tab:blue",
    "kafka": "tab:orange",
    "debezium": "tab:green",
    "nats": "tab:purple",
    "SyncProducer serving": "tab:purple",
    "streamq serve": "tab:cyan",
    "SyncProducer": "tab:blue",
    "publish": "tab:cyan",
    "sqlite3": "tab:gray",
    "floor": "tab:gray",
}
LABELS = {"kafka": "Kafka", "debezium": "Debezium + Kafka", "nats": "NATS JetStream"}
# Workloads whose Kafka side has an outbox (the transfer's floor: its SQL, no framework).
OUTBOX = {**LABELS, "kafka": "Kafka + outbox", "floor": "floor (the same SQL, no framework)"}
MS = 1 / 1000  # microseconds (as stored) to milliseconds (as drawn)

Results = Mapping[str, Any]
# (system, group on the x axis) -> the runs' values
Values = dict[tuple[str, str], list[float]]


def recorded_date(results: Results) -> str:
    if results.get("date"):
        return str(results["date"])
    if results.get("at"):
        return time.strftime("%Y-%m-%d", time.localtime(float(results["at"])))
    return "date not recorded"


def machine_label(results: Results) -> str:
    """``2 cores, Python 3.11.7, 2026-11-22``: where and when the figures were measured."""
    info = results.get("machine") or {}
    cores = f"{info['cores']} cores" if "cores" in info else "cores not recorded"
    python = f"Python {info['python']}" if "python" in info else "Python not recorded"
    return f"{cores}, {python}, {recorded_date(results)}"


def short(value: float) -> str:
    """A bar's label: 369k, 1.8M, 1,286, 7.6."""
    if value >= 1e6:
        return f"{value / 1e6:.3g}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def by_case(series: Sequence[Mapping[str, Any]], unit: str, suffix: str = "") -> Values:
    """The stored series of ``unit`` whose case ends with ``suffix`` (dropped from it)."""
    return {
        (s["system"], s["case"].removesuffix(suffix)): [float(v) for v in s["values"]]
        for s in series
        if s["unit"] == unit and s["case"].endswith(suffix)
    }


def log_y(ax: Any) -> None:
    """A log y axis ticked at 1, 2 and 5 of each decade, labelled as the bars are."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: short(value)))
    ax.yaxis.set_minor_formatter(NullFormatter())


def grouped_bars(
    ax: Any,
    values: Values,
    ylabel: str,
    scale: float = 1.0,
    labels: Mapping[str, str] = LABELS,
) -> None:
    """Groups on the x axis, a bar per system in each (median, whiskers min..max, labelled);
    a log axis when the values span more than ``LOG_SPAN``."""

    groups = list(dict.fromkeys(group for _, group in values))
    systems = list(dict.fromkeys(system for system, _ in values))
    width = 0.8 / len(systems)
    shown: list[float] = []
    for i, system in enumerate(systems):
        xs, medians, low, high = [], [], [], []
        for x, group in enumerate(groups):
            runs = [v * scale for v in values.get((system, group), [])]
            if not runs:
                continue
            median = statistics.median(runs)
            xs.append(x + (i - (len(systems) - 1) / 2) * width)
            medians.append(median)
            low.append(median - min(runs))
            high.append(max(runs) - median)
            shown += runs
        bars = ax.bar(
            xs,
            medians,
            width,
            yerr=[low, high],
            capsize=3,
            color=COLORS.get(system, "tab:gray"),
            label=labels.get(system, system),
        )
        ax.bar_label(bars, [short(m) for m in medians], fontsize=7, padding=2)
    positive = [v for v in shown if v > 0]
    if positive and max(positive) / min(positive) > LOG_SPAN:
        log_y(ax)
        ylabel += " (log scale)"
    ax.margins(y=0.15)
    # Long case names wrap rather than run into their neighbours.
    wrapped = [textwrap.fill(group, 22) for group in groups]
    ax.set_xticks(range(len(groups)), wrapped, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.legend(fontsize=8)


def figure(rows: int, columns: int, width: float, height: float) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, columns, figsize=(width, height), squeeze=False)


def finish(fig: Any, path: Path, title: str, results: Results) -> Path:
    """Title the figure with the machine and the date, and write it."""
    import matplotlib.pyplot as plt

    fig.suptitle(f"{title}\n{machine_label(results)}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bar_chart(
    path: Path,
    results: Results,
    title: str,
    values: Values,
    ylabel: str,
    labels: Mapping[str, str] = LABELS,
) -> Path:
    """One panel of grouped bars."""
    groups = len({group for _, group in values})
    fig, axes = figure(1, 1, max(6.5, 1.3 * groups + 2), 4.2)
    grouped_bars(axes[0][0], values, ylabel, labels=labels)
    return finish(fig, path, title, results)


def percentile_chart(
    path: Path,
    results: Results,
    title: str,
    suffix: str = "",
    labels: Mapping[str, str] = LABELS,
    percentiles: str = "p50 p99",
) -> Path:
    """A panel of grouped bars per percentile of the stored latency series (ms)."""
    series = results["series"]
    rows = percentiles.split()
    groups = len({g for _, g in by_case(series, "us", f"{suffix} {rows[0]}")})
    fig, axes = figure(len(rows), 1, max(5.5, 1.3 * groups + 2), 3.4 * len(rows))
    for ax, percentile in zip(axes[:, 0], rows, strict=True):
        values = by_case(series, "us", f"{suffix} {percentile}")
        grouped_bars(ax, values, f"{percentile}, ms", MS, labels)
    return finish(fig, path, title, results)


# --- one function per results file: what its charts show ---------------------------------


def pipe(results: Results, folder: Path) -> list[Path]:
    return [
        bar_chart(
            folder / "pipe.png",
            results,
            "pipe: records/s end to end, producer process -> consumer DB (higher is better)",
            by_case(results["series"], "rec/s"),
            "records/s",
        )
    ]


def latency(results: Results, folder: Path) -> list[Path]:
    return [
        percentile_chart(
            folder / "latency.png",
            results,
            "latency, due time -> receipt, per rate and durability (lower is better)",
        )
    ]


def transfer(results: Results, folder: Path) -> list[Path]:
    return [
        bar_chart(
            folder / "transfer.png",
            results,
            "transfer: transfers/s, debit + deposit credited exactly once (higher is better)",
            by_case(results["series"], "tr/s"),
            "transfers/s",
            OUTBOX,
        ),
        percentile_chart(
            folder / "transfer_latency.png",
            results,
            "transfer latency, commit -> credit (lower is better)",
            labels=OUTBOX,
        ),
    ]


def spark(results: Results, folder: Path) -> list[Path]:
    return [
        bar_chart(
            folder / "spark.png",
            results,
            "Spark ingest rows/s, noop sink, local[2] (higher is better)",
            by_case(results["series"], "rows/s"),
            "rows/s",
        )
    ]


def spark_sink(results: Results, folder: Path) -> list[Path]:
    return [
        bar_chart(
            folder / "spark_sink.png",
            results,
            "Spark sink: rows/s, Spark -> sink -> consumer DB, local[2] (higher is better)",
            by_case(results["series"], "rows/s"),
            "rows/s",
        ),
        percentile_chart(
            folder / "spark_sink_latency.png",
            results,
            "Spark sink latency, row created -> applied by the consumer (lower is better)",
        ),
    ]


def with_ratios(values: Values, baseline: str = "kafka") -> Values:
    """``values`` with streamq / ``baseline`` (medians) in each case's name."""
    renamed: Values = {}
    for (system, case), runs in values.items():
        mine, theirs = values.get(("streamq", case)), values.get((baseline, case))
        if mine and theirs and statistics.median(theirs):
            case = f"{case}: {statistics.median(mine) / statistics.median(theirs):.2f}x"
        renamed[(system, case)] = runs
    return renamed


def workers(results: Results, folder: Path) -> list[Path]:
    """Top: delivered/s, with streamq / Kafka + outbox in each case's name; bottom:
    commits/s. Results stored before delivered/s have commits/s alone, so titled."""
    series = results["series"]
    paced = f"{results['sizes']['rate']:,}/s"
    delivered = by_case(series, "delivered/s")
    panels: list[tuple[Values, str, str]] = []
    if delivered:
        panels.append(
            (
                with_ratios(delivered),
                "delivered/s",
                "delivered/s: the first commit -> the consumer's last receipt (higher is "
                "better)\nstreamq / Kafka + outbox after each case",
            )
        )
    panels.append(
        (
            by_case(series, "commits/s"),
            "commits/s",
            "commits/s: to the last worker's last COMMIT (higher is better)"
            + ("" if delivered else "\nwhat the consumer received after it not counted"),
        )
    )
    fig, axes = figure(len(panels), 1, 8, 4.2 * len(panels))
    for ax, (values, unit, title) in zip(axes[:, 0], panels, strict=True):
        grouped_bars(ax, values, unit, labels=OUTBOX)
        ax.set_title(title, fontsize=9)
    return [
        finish(fig, folder / "workers.png", "workers: N worker processes on one database", results),
        percentile_chart(
            folder / "workers_latency.png",
            results,
            f"workers: latency at {paced}, due time -> receipt (lower is better)",
            suffix=f", {paced}",
            labels=OUTBOX,
        ),
        bar_chart(
            folder / "workers_sync.png",
            results,
            "sync path alone: orders/s, one process, no server (higher is better)",
            by_case(series, "orders/s"),
            "orders/s",
        ),
    ]


def transfer_pg(results: Results, folder: Path) -> list[Path]:
    """Per writer count, top: transfers/s end to end; bottom: COMMIT -> credit p50 and
    p99 at the paced rate (from the due time if the server did not stamp commits), and
    the p99 from the due time."""
    series = results["series"]
    sizes = results["sizes"]
    paced = f"{sizes['rate']:,}/s"
    columns = len(sizes["writers"])
    fig, axes = figure(2, columns, 4.2 * columns + 1, 7.5)
    throughput = by_case(series, "tr/s")
    for column, writers in enumerate(sizes["writers"]):
        case = f"{writers} writer{'s' if writers > 1 else ''}"
        top, bottom = axes[0][column], axes[1][column]
        grouped_bars(
            top,
            {key: v for key, v in throughput.items() if key[1] == case},
            "transfers/s",
            labels=OUTBOX,
        )
        top.set_title(f"{case}: transfers/s end to end (higher is better)", fontsize=9)
        due = f"{case}, {paced}"
        stamped = by_case(series, "us", f"{due}, from COMMIT p50")
        origin = "COMMIT" if stamped else "due"
        panels = [
            (f"{due}, from COMMIT" if stamped else due, "p50", f"p50 from {origin}"),
            (f"{due}, from COMMIT" if stamped else due, "p99", f"p99 from {origin}"),
        ]
        if stamped:
            panels.append((due, "p99", "p99 from due"))
        latencies: Values = {}
        for measured, percentile, label in panels:
            for (system, group), runs in by_case(series, "us", f" {percentile}").items():
                if group == measured:
                    latencies[(system, label)] = runs
        grouped_bars(bottom, latencies, "ms", MS, OUTBOX)
        bottom.set_title(f"{case}: latency to the credit at {paced} (lower is better)", fontsize=9)
    writer_counts = " or ".join(map(str, sizes["writers"]))
    return [
        finish(
            fig,
            folder / "transfer_pg.png",
            f"transfer on PostgreSQL: payments ({writer_counts} writers) -> ledger",
            results,
        )
    ]


PG_LOAD = {
    "capture": "streamq capture",
    "kafka": "Kafka + outbox",
    "debezium": "Debezium + Kafka",
    "outbox": "outbox alone (nothing reads it)",
}


def pg_load(results: Results, folder: Path) -> list[Path]:
    """Per fsync delay (a row each): delivered/s by writer count (the outbox alone, which
    nothing reads, at its commits/s: a ceiling; runs stored without delivered/s at their
    transactions/s), with streamq / Kafka + outbox; the application's transaction p99;
    COMMIT -> received p50/p99 at the paced rate."""
    runs = results["runs"]
    delays = sorted({r["delay_us"] for r in runs})
    fig, axes = figure(len(delays), 3, 16, 4.2 * len(delays))
    for row, delay in enumerate(delays):
        mine = [r for r in runs if r["delay_us"] == delay]
        unpaced = [r for r in mine if not r["rate"]]
        systems = {r["system"] for r in unpaced}
        paced = [r for r in mine if r["rate"]]
        throughput: Values = {}
        p99: Values = {}
        for r in unpaced:
            case = f"{r['writers']} writer{'s' if r['writers'] > 1 else ''}"
            delivered = r.get("delivered_per_s")
            throughput.setdefault((r["system"], case), []).append(
                r["tx_per_s"] if delivered is None else delivered
            )
            p99.setdefault((r["system"], case), []).append(r["tx_latency_us"][1])
        receipt: Values = {}
        for r in paced:
            if r["receipt_latency_us"]:
                for label, value in zip(("p50", "p99"), r["receipt_latency_us"], strict=True):
                    receipt.setdefault((r["system"], label), []).append(value)
        disk = f"fsync +{delay} µs" if delay else "this VM's disk"
        grouped_bars(axes[row][0], with_ratios(throughput), "delivered/s", labels=PG_LOAD)
        notes = [
            *(["streamq / Kafka + outbox after each case"] if "kafka" in systems else []),
            *(["the outbox alone: its commits, a ceiling"] if "outbox" in systems else []),
        ]
        title = f"{disk}: delivered/s (higher is better)"
        axes[row][0].set_title(
            "\n".join([title, "; ".join(notes)] if notes else [title]), fontsize=9
        )
        grouped_bars(axes[row][1], p99, "ms", MS, PG_LOAD)
        axes[row][1].set_title(f"{disk}: transaction p99 (lower is better)", fontsize=9)
        if receipt:
            rate = paced[0]["rate"]
            grouped_bars(axes[row][2], receipt, "ms", MS, PG_LOAD)
            axes[row][2].set_title(
                f"{disk}: COMMIT -> received at {rate:,}/s (lower is better)", fontsize=9
            )
    return [
        finish(
            fig,
            folder / f"{results['workload']}.png",  # pg_load, or pg_load_capture
            "PostgreSQL at load: writer processes on one database, synchronous_commit=on",
            results,
        )
    ]


def shares(results: Results, folder: Path) -> list[Path]:
    """records/s against workers: measured (min..max), n x one worker, and the apply bound."""
    workers = [int(n) for n in results["runs"]]
    measured = [results["median_rate"][str(n)] for n in workers]
    lows = [min(x["rate"] for x in results["runs"][str(n)]) for n in workers]
    highs = [max(x["rate"] for x in results["runs"][str(n)]) for n in workers]
    fig, axes = figure(1, 1, 5.5, 4.0)
    ax = axes[0][0]
    ax.plot(workers, [measured[0] * n for n in workers], "--", color="gray", label="n x 1 worker")
    ax.plot(
        workers,
        [n * 1000 / results["apply_ms"] for n in workers],
        ":",
        color="black",
        label=f"apply-bound ({results['apply_ms']} ms/record)",
    )
    ax.errorbar(
        workers,
        measured,
        yerr=[[m - lo for m, lo in zip(measured, lows, strict=True)],
              [hi - m for m, hi in zip(measured, highs, strict=True)]],
        marker="o", color="tab:blue", capsize=4, label="streamq shares (median, min..max)",
    )  # fmt: skip
    ax.set_xscale("log", base=2)
    log_y(ax)
    ax.set_xticks(workers, [str(n) for n in workers])
    ax.set_xlabel("worker processes (share=(i, n))")
    ax.set_ylabel("records applied / s (log scale)")
    ax.legend(fontsize=8)
    title = f"per-key shares, {results['count']:,} records"
    return [finish(fig, folder / "shares.png", title, results)]


def groups(results: Results, folder: Path) -> list[Path]:
    """Takeover after kill -9 (every kill, each system side by side), the resharing's
    records applied per 100 ms over time, and records/s against group members."""
    import random

    fig, axes = figure(1, 3, 16, 4.4)
    ax = axes[0][0]
    runs = results["takeover"]
    jitter = random.Random(0)
    for x, r in enumerate(runs):
        values = r["takeover_s"]
        color = COLORS.get(r["system"], "tab:gray")
        ax.boxplot([values], positions=[x], widths=0.5, showfliers=False)
        ax.scatter([x + jitter.uniform(-0.15, 0.15) for _ in values], values, s=12,
                   color=color, alpha=0.7, zorder=3)  # fmt: skip
    labels = [
        f"{LABELS.get(r['system'], r['system'])}\np50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s"
        for r in runs
    ]
    ax.set_xticks(range(len(runs)), labels, fontsize=8)
    values = [v for r in runs for v in r["takeover_s"]]
    if values and max(values) / max(min(values), 1e-9) > LOG_SPAN:
        log_y(ax)
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel("kill -9 -> first apply by another member, s", fontsize=8)
    kafka = next((r for r in runs if r["system"] == "kafka"), None)
    session = f", Kafka session {results['kafka_session_ms']} ms" if kafka else ""
    ax.set_title(f"takeover, {len(runs[0]['kills'])} kills each{session}", fontsize=9)
    reshare = results["reshare"]
    ax = axes[0][1]
    bins = reshare["per_bin"]
    start, width = reshare["bins_from_s"], reshare["bin_s"]
    ax.step([start + i * width for i in range(len(bins))], bins, where="post",
            color=COLORS["streamq"])  # fmt: skip
    ax.axvline(0, color="black", linestyle="--", linewidth=1, label="reshare 4 -> 8")
    ax.axvline(reshare["all_held_s"], color="gray", linestyle=":", linewidth=1,
               label=f"8 shares held (+{reshare['all_held_s']:.2f} s)")  # fmt: skip
    ax.set_xlim(max(start, -3.0), min(start + len(bins) * width, 5.0))  # around the change
    ax.set_xlabel("s from the reshare", fontsize=8)
    ax.set_ylabel(f"records applied per {width * 1000:.0f} ms", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"online resharing at {results['rate']:,}/s: longest gap {reshare['group_gap_s']:.2f} s, "
        f"per key {reshare['key_pause_s']:.2f} s",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    scaling = results["scaling"]
    ax = axes[0][2]
    members = [int(n) for n in scaling["median_rate"]["group"]]
    group = [scaling["median_rate"]["group"][str(n)] for n in members]
    hand = [scaling["median_rate"]["shares"][str(n)] for n in members]
    ax.plot(members, [group[0] * n for n in members], "--", color="gray", label="n x 1 member")
    ax.plot(members, group, "o-", color=COLORS["streamq"],
            label=f"group, shares={scaling['group_shares']}")  # fmt: skip
    ax.plot(members, hand, "s:", color="tab:cyan", label="hand-given shares (n)")
    ax.set_xscale("log", base=2)
    log_y(ax)
    ax.set_xticks(members, [str(n) for n in members])
    ax.set_xlabel("member processes", fontsize=8)
    ax.set_ylabel("records applied / s (log scale)", fontsize=8)
    ax.set_title(f"scaling, apply {scaling['apply_ms']} ms per record", fontsize=9)
    ax.legend(fontsize=7)
    for ax in axes[0]:
        ax.tick_params(labelsize=8)
    title = "consumer groups: streamq GroupConsumer against a Kafka consumer group"
    return [finish(fig, folder / "groups.png", title, results)]


FANOUT = {
    "streamq": "streamq (embedded server)",
    "streamq serve": "streamq serve",
    "kafka": "Kafka",
    "nats": "NATS JetStream",
}
RATE_LINES = ("-", "--", ":", "-.")  # line style per rate, in the order the rates ran


def fanout(results: Results, folder: Path) -> list[Path]:
    """Against N consumers (log axis): the serving process's CPU per record published and
    the p99 from due time to receipt; a line per system and rate (medians of the runs)."""
    runs = results["runs"]
    rates = list(dict.fromkeys(r["rate"] for r in runs))
    fig, axes = figure(1, 2, 12, 4.4)
    panels = (
        ("serving_us_per_record", 1.0, "serving process CPU, µs per record published"),
        ("p99_us", MS, "p99, due time -> receipt, ms"),
    )
    for ax, (name, scale, ylabel) in zip(axes[0], panels, strict=True):
        shown: list[float] = []
        for system in FANOUT:
            for rate, style in zip(rates, RATE_LINES, strict=False):
                mine = [r for r in runs if r["system"] == system and r["rate"] == rate]
                counts = sorted({r["consumers"] for r in mine})
                if not counts:
                    continue
                values = [
                    statistics.median(r[name] * scale for r in mine if r["consumers"] == n)
                    for n in counts
                ]
                shown += values
                ax.plot(counts, values, style, marker="o", color=COLORS.get(system, "tab:gray"),
                        label=f"{FANOUT[system]}, {rate:,}/s")  # fmt: skip
        ax.set_xscale("log")
        positive = [v for v in shown if v > 0]
        if positive and max(positive) / min(positive) > LOG_SPAN:
            log_y(ax)
            ylabel += " (log scale)"
        counts = sorted({r["consumers"] for r in runs})
        ax.set_xticks(counts, [f"{n:,}" for n in counts])
        ax.set_xlabel("consumers (N)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
    axes[0][0].set_title("what serving N consumers costs (lower is better)", fontsize=9)
    axes[0][1].set_title("latency to every consumer (lower is better)", fontsize=9)
    seconds = results["seconds_per_run"]
    title = f"fan-out: one producer, N consumers of 100 B records ({seconds:g} s runs)"
    return [finish(fig, folder / "fanout.png", title, results)]


CHARTS: dict[str, Callable[[Results, Path], list[Path]]] = {
    "pipe": pipe,
    "latency": latency,
    "transfer": transfer,
    "spark": spark,
    "spark_sink": spark_sink,
    "workers": workers,
    "transfer_pg": transfer_pg,
    "pg_load": pg_load,
    "pg_load_capture": pg_load,
    "shares": shares,
    "groups": groups,
    "fanout": fanout,
}


def draw(results: Results, folder: Path) -> list[Path]:
    """The charts of one workload's results (none for a workload without charts)."""
    chart = CHARTS.get(str(results.get("workload")))
    return chart(results, folder) if chart else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.charts", description=__doc__)
    parser.add_argument("folder", nargs="?", type=Path, default=RESULTS, help="JSON results")
    folder = parser.parse_args(argv).folder
    for path in sorted(folder.glob("*.json")):
        for chart in draw(json.loads(path.read_text()), folder):
            print(f"{path.name} -> {chart}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
