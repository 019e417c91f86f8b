"""report.html's tables sort on a header click, every table (issue 30: a click in any table after the first
threw a TypeError, the column index counted every <th> of the page)."""
import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from attnzoo.analysis.report import _JS, build_report

# a stand-in for the browser DOM, just what report.html's script touches: querySelectorAll('th' | 'input.filter'
# | ...), closest, querySelector('tbody'), rows, children, cellIndex, dataset, textContent, appendChild
DOM_STUB = r"""
class El {
  constructor(tag, parent) { this.tag = tag; this.parent = null; this.children = []; this.dataset = {};
    this.textContent = ''; this.style = {}; this.listeners = {}; if (parent) parent.appendChild(this); }
  appendChild(c) { if (c.parent) c.parent.children.splice(c.parent.children.indexOf(c), 1);
    c.parent = this; this.children.push(c); return c; }
  addEventListener(type, f) { this.listeners[type] = f; }
  closest(tag) { let e = this; while (e && e.tag !== tag) e = e.parent; return e; }
  querySelector(tag) { return this.children.find(c => c.tag === tag) || null; }
  get rows() { return this.children.filter(c => c.tag === 'tr'); }
  get cellIndex() { return this.parent.children.indexOf(this); }
}
const tables = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const ths = [];
const built = tables.map(t => {
  const table = new El('table'), head = new El('tr', new El('thead', table)), body = new El('tbody', table);
  t.head.forEach(h => { const th = new El('th', head); th.textContent = h; ths.push(th); });
  t.rows.forEach(r => { const tr = new El('tr', body);
    r.forEach(([text, v]) => { const td = new El('td', tr); td.textContent = text; if (v !== null) td.dataset.v = v; }); });
  return body;
});
global.document = { querySelectorAll: sel => sel === 'th' ? ths : [] };
eval(SCRIPT);
// click every header of every table once (ascending); after each click, record that column top to bottom
const out = tables.map((t, ti) => t.head.map((h, ci) => {
  const th = ths.filter(x => x.closest('table') === built[ti].parent)[ci];
  th.listeners.click();
  return built[ti].rows.map(tr => { const td = tr.children[ci]; return td.dataset.v !== undefined ? Number(td.dataset.v) : td.textContent; });
}));
console.log(JSON.stringify(out));
"""


class Tables(HTMLParser):
    """The <table>s of a page: head texts and, per row, (text, data-v or None) per cell."""

    def __init__(self):
        super().__init__()
        self.tables, self.cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append({"id": dict(attrs).get("id"), "head": [], "rows": []})
        elif tag == "tr" and self.tables:
            self.row = []
        elif tag in ("th", "td") and self.tables:
            self.cell = [tag, "", dict(attrs).get("data-v")]

    def handle_data(self, data):
        if self.cell is not None:
            self.cell[1] += data

    def handle_endtag(self, tag):
        if tag in ("th", "td") and self.cell is not None:
            kind, text, v = self.cell
            (self.tables[-1]["head"].append(text) if kind == "th" else self.row.append((text, v)))
            self.cell = None
        elif tag == "tr" and self.tables and self.row:
            self.tables[-1]["rows"].append(self.row)
            self.row = []


@pytest.fixture(scope="module")
def report_html(tmp_path_factory):
    """A sweep of 4 finished jobs (2 mixers x 2 learning rates) evaluated at two extra lengths: the report
    then has three tables (best per variant, length extrapolation, all jobs)."""
    d = tmp_path_factory.mktemp("report") / "sweep"
    losses = {("gqa", "1e-3"): 2.5, ("gqa", "3e-3"): 2.1, ("gated_deltanet", "1e-3"): 2.9, ("gated_deltanet", "3e-3"): 1.7}
    for n, ((mixer, lr), loss) in enumerate(losses.items()):
        job = d / str(n)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- model/mixer={mixer}\n- optim.lr={lr}\n")
        metrics = {"val/loss": loss, "val/loss@64": loss + 0.5 + n / 10, "val/loss@128": loss + 1 - n / 10,
                   "cache/bytes_per_token": 100.0 * (n + 1), "params/total": 1000.0 - n}
        (job / "summary.json").write_text(json.dumps({"status": "ok", "metrics": metrics, "context_len": 32,
                                                      "config": {"model": {"mixer": {"name": mixer}}}}))
    build_report(d)
    page = Tables()
    page.feed((d / "report.html").read_text())
    assert len(page.tables) == 3, [t["id"] for t in page.tables]
    return page.tables


def test_every_header_addresses_a_column_of_its_own_table(report_html):
    """Structural: every row of every table has a cell under each of its headers, and the script takes the
    column from the clicked header's position in its own row (th.cellIndex), not from its index among all the
    page's headers (which is past the end of every table after the first)."""
    for t in report_html:
        assert t["rows"] and all(len(r) == len(t["head"]) for r in t["rows"]), t["head"]
    assert "th.cellIndex" in _JS and "forEach((th, i)" not in _JS


@pytest.mark.skipif(shutil.which("node") is None, reason="the sort script is run in node where it is installed")
def test_header_click_sorts_every_table(report_html):
    """The page's real script, run in node on a DOM stub holding the report's real tables: a click on any
    header of any table sorts that table by that column (numbers by value) and does not throw."""
    script = DOM_STUB.replace("eval(SCRIPT);", f"eval({json.dumps(_JS)});")
    r = subprocess.run(["node", "-e", script], input=json.dumps(report_html), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    columns = json.loads(r.stdout)
    for t, cols in zip(report_html, columns):
        assert len(cols) == len(t["head"])
        for head, col in zip(t["head"], cols):
            assert len(col) == len(t["rows"])
            numbers = [v for v in col if isinstance(v, (int, float))]
            if len(numbers) == len(col):
                assert numbers == sorted(numbers), (t["id"], head, col)
    # the sort moved rows in the tables after the first too: their numeric columns were not in order before
    assert any(isinstance(v, (int, float)) for cols in columns[1:] for col in cols for v in col)
