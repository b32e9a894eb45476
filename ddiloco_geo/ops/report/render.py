"""The report's page: :func:`sections` turns the summary into (heading, table, chart) sections;
:func:`write_markdown` and :func:`write_html` write them as ``report.md`` and ``report.html`` next
to the charts (relative image links)."""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def sections(summary: dict[str, Any]) -> list[tuple[str, list[str] | None, list[list[str]], str | None]]:
    """(heading, table header or None, rows, chart file or None) for the Markdown and HTML pages."""
    b, ms, led = summary["bytes"], summary["merge_stats"], summary["ledger"]
    evals = summary.get("global_evals") or []
    overview = [
        ["run", f"`{summary['run_id']}` at `{summary['url']}`"],
        ["state", f"{summary['state']} (report at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(summary['generated_at']))})"],
        ["model", f"{summary['model'].get('name')} ({summary['num_params']:,} parameters), "
                  f"{summary['num_fragments']} fragments, H={summary['sync_every']}, delta codec {summary['codec']}"],
        ["learners", f"{summary['num_learners']}: " + ", ".join(f"{n} ({l['state']})" for n, l in sorted(summary["learners"].items()))],
        ["wall time", f"{summary['wall_s']:.1f} s"],
        ["tokens", f"{summary['tokens_total']:,} trained, {summary['tokens_merged']:,.0f} merged into the global model"],
        ["global eval loss", f"{_fmt(evals[0]['loss'])} → {_fmt(evals[-1]['loss'])}" if evals else "not evaluated"],
        ["merges", f"{ms['count']}; contributors mean {_fmt(ms['contributors_mean'], 2)}, max {_fmt(ms['contributors_max'])}; "
                   f"staleness mean {_fmt(ms['staleness_mean'], 2)}, max {_fmt(ms['staleness_max'])}"],
        ["deltas", f"{led['deltas_written']} written, {led['deltas_merged']} merged (incl. superseded), "
                   f"{led['deltas_rejected']} rejected {led['rejected_by_reason'] or ''}, {led['deltas_unaccounted']} not yet accounted"],
        ["bytes moved", f"{_mib(b['total'])} (learners ↑{_mib(b['learner_up'])} ↓{_mib(b['learner_down'])}, "
                        f"syncer ↑{_mib(b['syncer_up'])} ↓{_mib(b['syncer_down'])})"],
        ["data-parallel all-reduce", f"{_mib(b['dp_allreduce'])}" + (f" ({b['dp_ratio']:.1f}× more)" if b.get("dp_ratio") else "")],
    ]
    out: list[tuple[str, list[str] | None, list[list[str]], str | None]] = [("Overview", None, overview, None)]
    out.append(("Global eval loss", ["wall time (s)", "tokens merged", "versions", "eval loss"],
                [[f"{e['time']:.1f}", f"{e['tokens']:,.0f}", str(e["versions"]), f"{e['loss']:.4f}"] for e in evals],
                "eval_loss.png"))
    out.append(("Learners", ["learner", "state", "steps", "tokens", "tokens/s", "loss", "deltas", "incarnations",
                             "checkpoints", "exit reason"],
                [[n, l["state"], _fmt(l["steps"]), _fmt(l["tokens"]), _fmt(l["tokens_per_s"], 0), _fmt(l["loss"]),
                  str(l["deltas_written"]), str(len(l["incarnations"])), str(len(l["checkpoints"])), _fmt(l["reason"])]
                 for n, l in sorted(summary["learners"].items())], "throughput.png"))
    out.append(("Merges: contributors and staleness", None, [], "merges.png"))
    out.append(("Bytes against data-parallel", None, [], "bytes.png"))
    out.append(("Timeline: failures, joins, preemptions", ["time (s)", "learner", "event", "detail"],
                [[f"{e['time']:.1f}", _fmt(e["learner"]), e["kind"], e["detail"]] for e in summary["events"]],
                "timeline.png"))
    return out


def write_markdown(summary: dict[str, Any], path: Path) -> Path:
    lines = [f"# ddiloco-geo run `{summary['run_id']}`", ""]
    for heading, header, rows, chart in sections(summary):
        lines += [f"## {heading}", ""]
        if chart:
            lines += [f"![{heading}]({chart})", ""]
        if rows:
            head = header or ["", ""]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
            lines.append("")
    lines += ["Times are seconds since the first global was published. Tokens merged: the `num_tokens` of the deltas "
              "merged into the global model, averaged over fragments. Event times are those the bucket records "
              "(exit records, heartbeats, rejections) or, for joins and checkpoints without one, the publish time of "
              "the merge that accounted the learner's delta. Bytes: the storage counters of the newest exit record "
              "or heartbeat of each process (earlier incarnations' counters are not kept).", ""]
    path.write_text("\n".join(lines))
    return path


def write_html(summary: dict[str, Any], path: Path) -> Path:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>ddiloco-geo run {e(summary['run_id'])}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}img{max-width:100%}</style></head><body>",
             f"<h1>ddiloco-geo run <code>{e(summary['run_id'])}</code></h1>"]
    for heading, header, rows, chart in sections(summary):
        parts.append(f"<h2>{e(heading)}</h2>")
        if chart:
            parts.append(f"<img src='{e(chart)}' alt='{e(heading)}'>")
        if rows:
            parts.append("<table>")
            if header:
                parts.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{e(c.replace('`', ''))}</td>" for c in r) + "</tr>" for r in rows]
            parts.append("</table>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts))
    return path

