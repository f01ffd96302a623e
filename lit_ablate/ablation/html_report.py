"""``report.html``: the study report as one self-contained page that leads with the answer.

A reader came for which variant is faster, by how much and beyond noise or not, at what memory, and
whether the checks passed: the page opens with that, one line per variant, before the details. Then how
it was measured, the charts (inline SVG, each value on hover), the full table (sortable by clicking a
header, each column's legend folded under it), the loss differences by step, the runs that did not
finish and the environment. No network: the CSS, the few lines of script and the charts are in the
file, so it opens from a laptop, an e-mail or a CI artifact. ``report.md`` says the same for reading in
a repository; both are drawn from ``report.json``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from lit_ablate.ablation.loss_divergence import loss_divergence_section
from lit_ablate.ablation.report_table import Column, format_bytes, format_rate, numbered_fallbacks, table_columns
from lit_ablate.ablation.report_text import ceiling_line, environment_line, speed_design_line, study_line
from lit_ablate.ablation.speed_verdict import FASTER, INCONCLUSIVE, SAME, SLOWER, speed_figure
from lit_ablate.ablation.svg_charts import COLORS, bar_chart, line_chart
from lit_ablate.ablation.terminal_summary import verdict

VERDICT_CLASSES = {FASTER: "faster", SLOWER: "slower", SAME: "same", INCONCLUSIVE: "inconclusive"}
STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #ddd}
.answer{border-collapse:collapse;margin:1em 0} .answer td,.answer th{padding:.35em .8em;text-align:left}
.answer tr:nth-child(even){background:#f6f6f6}
.badge{padding:.1em .5em;border-radius:.3em;font-weight:600;white-space:nowrap}
.faster{background:#d7f5dd;color:#14532d} .slower{background:#fde2e1;color:#7f1d1d}
.same{background:#e8eaed;color:#333} .inconclusive{background:#fdf3d0;color:#6b4e00}
.fail{color:#b91c1c;font-weight:600} .pass{color:#15803d} .problems{background:#fde2e1;padding:.6em 1em}
.note{color:#555;font-size:.92em}
table.full{border-collapse:collapse;font-size:.85em;display:block;overflow-x:auto}
table.full th,table.full td{border:1px solid #ddd;padding:.3em .5em;vertical-align:top}
table.full th{background:#f3f4f6} table.full th button{all:unset;cursor:pointer;font-weight:600}
table.full details{font-weight:400;max-width:22em} table.full summary{cursor:pointer;color:#555}
.chart{max-width:720px;width:100%;height:auto;font-size:11px} .chart .grid{stroke:#e5e5e5}
.chart .whisker{stroke:#222;stroke-width:1.5} .chart-title{font-weight:600;font-size:13px}
ul.legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:.3em 1.2em;font-size:.9em}
ul.legend span{display:inline-block;width:.9em;height:.9em;margin-right:.3em;vertical-align:-.1em}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:.85em}
"""
SORT_SCRIPT = """
document.querySelectorAll("table.full th button").forEach(function (button, column) {
  button.addEventListener("click", function () {
    var table = button.closest("table"), body = table.tBodies[0];
    var down = button.dataset.order !== "down";
    button.dataset.order = down ? "down" : "up";
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = a.cells[column].dataset.sort, y = b.cells[column].dataset.sort;
      var p = parseFloat(x), q = parseFloat(y);
      if (isNaN(p) !== isNaN(q)) { return isNaN(p) ? 1 : -1; }  /* rows without a number last */
      var order = isNaN(p) ? String(x).localeCompare(String(y)) : p - q;
      return down ? order : -order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  });
});
"""


def inline(markdown: str) -> str:
    """The Markdown the table's cells and the report's lines use (``**bold**``, ``*emphasis*``,
    ``code``), as HTML, everything else escaped."""
    text = escape(markdown.replace("\\|", "|"))
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])", r"<em>\1</em>", text)


def render_html(summary: Mapping[str, Any]) -> str:
    """The whole page."""
    study, variants = summary["study"], summary["variants"]
    name = study.get("name") or "runs"
    body = [f"<h1>Study <code>{escape(name)}</code></h1>", f'<p class="note">{inline(study_line(study))}</p>']
    body += _answer(summary)
    body += ["<h2>How it was measured</h2>"]
    measured = (speed_design_line(summary.get("speed")), ceiling_line(summary))
    body += [f"<p>{inline(line)}</p>" for line in measured if line]
    body += _charts(variants)
    body += _full_table(summary)
    body += _markdown_table_section(loss_divergence_section(summary))
    body += _failures(variants)
    body += ["<h2>Environment</h2>", f"<p>{inline(environment_line(summary))}</p>"]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Study {escape(name)}</title><style>{STYLE}</style></head><body>\n"
        + "\n".join(body)
        + f"\n<script>{SORT_SCRIPT}</script>\n</body></html>\n"
    )


def _answer(summary: Mapping[str, Any]) -> list[str]:
    """The verdicts: per variant its status, speed (ratio, interval, verdict), memory and the checks."""
    study, variants = summary["study"], summary["variants"]
    baseline = study["baseline"]
    lines = ["<h2>The answer</h2>"]
    if summary.get("problems"):
        lines.append('<div class="problems"><strong>Study problems (exit code 1):</strong><ul>')
        lines += [f"<li>{inline(problem)}</li>" for problem in summary["problems"]]
        lines.append("</ul></div>")
    lines.append(
        '<table class="answer"><thead><tr><th>variant</th><th>speed vs baseline</th><th>memory ×</th>'
        "<th>in words</th></tr></thead><tbody>"
    )
    for variant in variants:
        speed = variant.get("speed")
        if variant["name"] == baseline:
            badge = '<span class="badge same">baseline</span>'
        elif speed and variant["status"] == "ok":
            figure = speed_figure(speed) or ""
            badge = (
                f'<span class="badge {VERDICT_CLASSES[speed["verdict"]]}">{escape(speed["verdict"])}</span> {figure}'
            )
        else:
            badge = "—"
        memory = "—" if variant.get("memory_ratio") is None else f"{variant['memory_ratio']:.2f}×"
        words = verdict(variant, baseline, with_figures=False)
        words = re.sub(r"(LOSS DIFFERS|GRADIENTS DIFFER)", r'<span class="fail">\1</span>', escape(words))
        lines.append(
            f"<tr><td><strong>{escape(variant['name'])}</strong></td><td>{badge}</td><td>{memory}</td>"
            f"<td>{words}</td></tr>"
        )
    lines.append("</tbody></table>")
    return lines


def _charts(variants: Sequence[Mapping[str, Any]]) -> list[str]:
    """Loss curves, useful tokens/s and peak tensor memory, with a legend of the lines' colours."""
    curves = [
        (v["name"], v["loss_curve"]["step"], v["loss_curve"]["median"]) for v in variants if v["loss_curve"]["step"]
    ]
    speed = [_bar(v, "useful_tokens_per_sec") for v in variants if v.get("useful_tokens_per_sec")]
    memory = [_bar(v, "peak_tensor_bytes") for v in variants if v.get("peak_tensor_bytes")]
    charts = [
        line_chart("Loss (median over seeds)", "loss", curves, lambda x: f"{x:.4g}"),
        bar_chart("Useful tokens/s (median, min–max)", "tokens/s", speed, format_rate),
        bar_chart("Peak tensor memory per rank", "bytes", memory, format_bytes),
    ]
    if not any(charts):
        return []
    legend = "".join(
        f'<li><span style="background:{COLORS[i % len(COLORS)]}"></span>{escape(name)}</li>'
        for i, (name, _, _) in enumerate(curves)
    )
    loss = [charts[0], f'<ul class="legend">{legend}</ul>'] if charts[0] else []
    return ["<h2>Charts</h2>", *loss, *(chart for chart in charts[1:] if chart)]


def _bar(variant: Mapping[str, Any], key: str) -> tuple[str, float, float, float]:
    stats = variant[key]
    return variant["name"], stats["median"], stats["min"], stats["max"]


def _full_table(summary: Mapping[str, Any]) -> list[str]:
    """Every column, sortable; each header's legend folded under it; the fallbacks' notes below."""
    columns = table_columns(summary)
    head = "".join(
        f"<th><button>{escape(c.header)}</button><details><summary>what</summary>{inline(c.legend)}</details></th>"
        for c in columns
    )
    rows = [f"<tr>{''.join(_cell(c, v) for c in columns)}</tr>" for v in summary["variants"]]
    lines = [
        "<h2>All measurements</h2>",
        '<p class="note">Click a header to sort by it.</p>',
        f'<table class="full"><thead><tr>{head}</tr></thead><tbody>',
        *rows,
        "</tbody></table>",
    ]
    fallbacks = numbered_fallbacks(summary)
    if fallbacks:
        lines.append("<p>Fallbacks: what ran instead of what the row's config names, as its runs recorded.</p><ol>")
        lines += [f"<li>{inline(line)}</li>" for line in fallbacks]
        lines.append("</ol>")
    return lines


def _cell(column: Column, variant: Mapping[str, Any]) -> str:
    key = column.sort_key(variant) if column.sort_key else None
    text = column.cell(variant)
    sort = key if key is not None else re.sub(r"[*`]", "", text)
    return f'<td data-sort="{escape(str(sort))}">{inline(text)}</td>'


def _markdown_table_section(lines: Sequence[str]) -> list[str]:
    """A Markdown section of the report (a heading, a line, a pipe table) as HTML."""
    html, rows = [], []
    for line in lines:
        if line.startswith("|"):
            if not set(line) <= set("|-"):
                rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
        elif line.startswith("## "):
            html.append(f"<h2>{inline(line[3:])}</h2>")
        elif line:
            html.append(f"<p>{inline(line)}</p>")
    if rows:
        head, *body = rows
        html.append(
            '<table class="full"><thead><tr>' + "".join(f"<th>{inline(c)}</th>" for c in head) + "</tr></thead>"
        )
        html += ["<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>" for row in body]
        html.append("</table>")
    return html


def _failures(variants: Sequence[Mapping[str, Any]]) -> list[str]:
    failed = [(v["name"], run) for v in variants for run in v["runs"] if run["status"] != "ok"]
    if not failed:
        return []
    lines = ["<h2>Runs that did not finish ok</h2><ul>"]
    for name, run in failed:
        tail = run.get("stderr_tail") or ""
        folded = f"<details><summary>stderr</summary><pre>{escape(tail)}</pre></details>" if tail else ""
        lines.append(
            f"<li><code>{escape(name)}</code> seed {run['seed']}: <strong>{escape(run['status'])}</strong> — "
            f"{escape(run['message'] or 'no message')} (<code>{escape(run['path'])}</code>){folded}</li>"
        )
    return [*lines, "</ul>"]
