"""``report.html``: one self-contained page that leads with the verdicts, read in a real headless Chromium.

The browser tests use the distribution's Chromium (``chromium``: Debian's package, which ``.ci/run``
installs): it renders the page, runs its script, prints every console message on stderr
(``--enable-logging=stderr``) and dumps the DOM after the script ran. Where there is no Chromium they skip
with the reason; with ``LIT_ABLATE_REQUIRE_CHROMIUM=1`` (CI) they fail instead, so CI cannot pass by
skipping them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_ablation_first_try import five_variants
from test_ablation_report import make_study

from lit_ablate.ablation.html_report import inline, render_html
from lit_ablate.ablation.report import write_report
from lit_ablate.ablation.summary import study_summary

REQUIRE_ENV = "LIT_ABLATE_REQUIRE_CHROMIUM"
ROOT = Path(__file__).resolve().parents[1]


def chromium() -> str:
    """The Chromium binary, or skip (fail under ``LIT_ABLATE_REQUIRE_CHROMIUM=1``)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but no chromium on PATH (apt-get install chromium)")
        pytest.skip("needs Chromium (apt-get install chromium) to render report.html")
    return found


def browse(page: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """Chromium headless on ``page``: its stdout (the DOM with ``--dump-dom``) and stderr (console lines)."""
    return subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tmp_path / 'profile'}",
            *flags,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def five_variant_page(tmp_path: Path) -> Path:
    records, plan = five_variants()
    return write_report(make_study(tmp_path / "study", records, plan)).parent / "report.html"


def test_the_page_leads_with_the_verdicts_and_needs_no_network(tmp_path: Path):
    """The answer (each variant's speed verdict with its interval, memory, the loss check) comes before how
    it was measured and the full table; nothing is loaded from elsewhere (no src/href to another place, no
    stylesheet link, no script file); each column's legend is folded under its header."""
    html = five_variant_page(tmp_path).read_text()
    assert html.index("The answer") < html.index("How it was measured") < html.index("All measurements")
    answer = html[html.index("The answer") : html.index("How it was measured")]
    assert '<span class="badge faster">faster</span> 1.97× [1.93–2.00]' in answer
    assert '<span class="badge slower">slower</span>' in answer and '<span class="fail">LOSS DIFFERS</span>' in answer
    assert '<span class="badge same">no difference detected</span>' in answer
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", html) and "<link" not in html
    assert html.count("<details><summary>what</summary>") == html.count("<th><button>") >= 17
    assert "Study problems (exit code 1)" in html and "loss check failed: slow_fat" in html


def test_inline_markdown_becomes_html_and_nothing_else_does():
    assert (
        inline("**base** `x` *agrees* <script>")
        == "<strong>base</strong> <code>x</code> <em>agrees</em> &lt;script&gt;"
    )
    assert inline("a\\|b 2*3*4") == "a|b 2*3*4"  # an escaped pipe; products are not emphasis


def test_the_page_renders_in_chromium_without_a_console_message_and_sorts(tmp_path: Path):
    """Rendered and scripted by a real browser: no console message (an error in the sort script or the
    markup would print one: seen with ``rows.sort`` misspelt), the verdicts in the rendered DOM, a
    screenshot taken, and a click on a header sorting the rows by that column's numbers (the first click:
    ascending useful tokens/s puts ``slow_fat`` first, the baseline ``base`` was first before)."""
    page = five_variant_page(tmp_path)
    shot = tmp_path / "report.png"
    shown = browse(page, tmp_path, f"--screenshot={shot}", "--window-size=1300,2000")
    assert shown.returncode == 0 and shot.stat().st_size > 10_000, shown.stderr[-2000:]
    assert console_lines(shown.stderr) == []
    clicking = page.with_name("clicked.html")
    clicking.write_text(page.read_text().replace("</body>", CLICK_USEFUL_TOKENS + "</body>"))
    dom = browse(clicking, tmp_path, "--dump-dom")
    assert console_lines(dom.stderr) == [] and "The answer" in dom.stdout
    assert re.search(r'data-first-row="slow_fat"', dom.stdout), dom.stdout[-3000:]


CLICK_USEFUL_TOKENS = """<script>
var headers = Array.prototype.slice.call(document.querySelectorAll("table.full th button"));
headers.filter(function (b) { return b.textContent === "useful tokens/s"; })[0].click();
var first = document.querySelector("table.full tbody tr td").textContent;
document.body.setAttribute("data-first-row", first);
</script>"""


def test_a_study_summary_renders_without_optional_parts():
    """A study of one run that failed: no speed or memory chart, still a whole page."""
    records, plan = five_variants()
    summary = study_summary({**plan, "variants": [{"name": "oom"}]}, [("runs/oom/seed0/run.json", records[-1])])
    html = render_html(summary)
    assert "Useful tokens/s (median" not in html and "Peak tensor memory per rank" not in html
    assert "Runs that did not finish ok" in html and html.endswith("</html>\n")


def render_all(pages: list[Path], tmp_path: Path) -> tuple[int, list[str]]:
    """Every page in one Chromium (one launch, not one per page): each in a frame of a wrapper page whose
    script, once all have loaded, counts the frames whose rendered document leads with "The answer".
    Returns that count and the console lines of every frame."""
    frames = "".join(f'<iframe src="{page.as_uri()}"></iframe>' for page in pages)
    wrapper = tmp_path / "all_reports.html"
    wrapper.write_text(
        f"<!doctype html><html><body>{frames}<script>"
        'window.addEventListener("load", function () {'
        '  var frames = Array.prototype.slice.call(document.querySelectorAll("iframe"));'
        "  var answered = frames.filter(function (f) {"
        '    var h = f.contentDocument && f.contentDocument.querySelector("h2");'
        '    return h !== null && h.textContent.indexOf("The answer") === 0; });'
        '  document.body.setAttribute("data-answered", String(answered.length)); });'
        "</script></body></html>"
    )
    shown = browse(wrapper, tmp_path, "--dump-dom", "--allow-file-access-from-files", "--virtual-time-budget=20000")
    found = re.search(r'data-answered="(\d+)"', shown.stdout)
    assert found, shown.stderr[-2000:]
    return int(found.group(1)), console_lines(shown.stderr)


def test_every_shipped_report_renders_in_chromium_without_a_console_message(tmp_path: Path):
    """Each study's committed ``benchmarks/results/<study>/report.html`` is what a user opens first: every
    one renders in a real browser, leads with its answer and prints nothing on the console. Seen failing
    with one report's script cut short (a console SyntaxError) and with a page whose first heading was not
    the answer (one frame fewer counted)."""
    studies = sorted(p.stem for p in (ROOT / "configs" / "studies").glob("*.yaml"))
    pages = [ROOT / "benchmarks" / "results" / name / "report.html" for name in studies]
    assert [p.parent.name for p in pages if not p.exists()] == []
    answered, console = render_all(pages, tmp_path)
    assert console == [] and answered == len(pages)
