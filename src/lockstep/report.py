"""One self-contained HTML report (inline CSS and SVG, no network) of check, verify, parity and
trajectory results. `lockstep report RUN_DIR` builds it from the JSON files a run wrote;
`--html PATH` on check, verify and parity writes it directly."""

from __future__ import annotations

import html
import json
import math
import os
import re

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1180px;color:#1d232a;padding:0 16px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #dde;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #d5d9e0;padding:3px 7px;text-align:right;font-variant-numeric:tabular-nums}
th{background:#f3f5f8}td.l,th.l{text-align:left}.pass{background:#d9f2dd}.fail{background:#f8d3d0}.na{background:#f1f1f1;color:#888}
.note{color:#555;font-size:13px}.scroll{overflow-x:auto;max-width:100%}.charts{display:flex;flex-wrap:wrap;gap:18px}.heat td{min-width:34px;font-size:11px}
"""


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        if x == 0:
            return "0"
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return f"{x:.3g}" if abs(x) >= 1e-3 else f"{x:.2e}"
    return html.escape(str(x))


def _table(header: list[str], rows: list[list], classes: list[list[str]] | None = None) -> str:
    out = ["<div class=scroll><table><tr>" + "".join(f"<th class=l>{html.escape(h)}</th>" if i == 0 else f"<th>{html.escape(h)}</th>"
                                  for i, h in enumerate(header)) + "</tr>"]
    for r, row in enumerate(rows):
        cells = []
        for c, v in enumerate(row):
            cls = (classes[r][c] if classes else "") + (" l" if c == 0 else "")
            cells.append(f"<td class='{cls.strip()}'>{_fmt(v)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table></div>"


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, log: bool = False,
               width: int = 520, height: int = 260) -> str:
    """An SVG line chart; with log=True the y axis is log10 (zeros are drawn at the bottom)."""
    colors = ["#1f6feb", "#d1242f", "#1a7f37", "#9a6700", "#8250df"]
    pts = [(x, y) for s in series.values() for x, y in s if y is not None and math.isfinite(y)]
    if not pts:
        return f"<p class=note>{html.escape(title)}: no data</p>"
    tf = (lambda y: math.log10(y) if y > 0 else None) if log else (lambda y: y)
    ys = [tf(y) for _, y in pts if tf(y) is not None] or [0.0]
    x0, x1 = min(x for x, _ in pts), max(x for x, _ in pts)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    if x1 == x0:
        x1 = x0 + 1
    m = 44

    def px(x):
        return m + (x - x0) / (x1 - x0) * (width - m - 10)

    def py(y):
        return height - 28 - (y - y0) / (y1 - y0) * (height - 58)

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' class='plot'>",
             f"<text x='{width / 2}' y='16' text-anchor='middle' font-weight='600'>{html.escape(title)}</text>",
             f"<line x1='{m}' y1='{height - 28}' x2='{width - 10}' y2='{height - 28}' stroke='#888'/>",
             f"<line x1='{m}' y1='30' x2='{m}' y2='{height - 28}' stroke='#888'/>"]
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        label = f"1e{yv:.1f}" if log else f"{yv:.3g}"
        parts.append(f"<text x='{m - 4}' y='{py(yv) + 4:.1f}' text-anchor='end' font-size='10'>{label}</text>")
    parts.append(f"<text x='{width / 2}' y='{height - 6}' text-anchor='middle' font-size='11'>step</text>")
    for i, (name, s) in enumerate(series.items()):
        coords = []
        for x, y in s:
            t = tf(y) if y is not None and math.isfinite(y) else None
            coords.append(f"{px(x):.1f},{py(t if t is not None else y0):.1f}")
        color = colors[i % len(colors)]
        dash = " stroke-dasharray='6 3'" if i % 2 else ""
        parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='2'{dash} points='{' '.join(coords)}'/>")
        parts.append(f"<text x='{m + 8 + 150 * i}' y='{height - 36 - 0}' fill='{color}' font-size='11'>{html.escape(name)}</text>")
    parts.append("</svg>")
    return "".join(parts)


def _heat_color(v: float | None) -> str:
    if v is None:
        return "#f1f1f1"
    if v == 0:
        return "#d9f2dd"
    level = min(1.0, max(0.0, (math.log10(v) + 9) / 8))      # 1e-9 .. 1e-1
    r, g, b = 255, int(225 - 170 * level), int(200 - 170 * level)
    return f"rgb({r},{g},{b})"


def heat_map(per_op: list[dict], phase: str) -> str:
    """Per-layer divergence heat map: layers down, op kinds across, max |a - b| in each cell."""
    cells: dict[tuple[str, str], float] = {}
    layers, kinds = [], []
    for rec in per_op:
        if rec["phase"] != phase:
            continue
        m = re.search(r"layers\.(\d+)\.(.*)", rec["module"])
        layer = f"layer {m.group(1)}" if m else (rec["module"] or "top")
        kind = (m.group(2) + ":" if m else "") + rec["op"] + ("" if rec["slot"] == "out" else f"[{rec['slot']}]")
        if layer not in layers:
            layers.append(layer)
        if kind not in kinds:
            kinds.append(kind)
        key = (layer, kind)
        cells[key] = max(cells.get(key, 0.0), rec["max_abs_diff"])
    if not cells:
        return f"<p class=note>{phase}: nothing compared</p>"
    out = [f"<div class=scroll><table class=heat><tr><th class=l>{phase}</th>" + "".join(f"<th>{html.escape(k)}</th>" for k in kinds) + "</tr>"]
    for layer in layers:
        row = [f"<td class=l>{html.escape(layer)}</td>"]
        for k in kinds:
            v = cells.get((layer, k))
            row.append(f"<td style='background:{_heat_color(v)}' title='{_fmt(v)}'>{_fmt(v) if v else ('0' if v == 0 else '')}</td>")
        out.append("<tr>" + "".join(row) + "</tr>")
    return "\n".join(out) + "</table></div>"


def _check_section(reports: list[dict]) -> str:
    rows, classes, sweeps = [], [], []
    for r in reports:
        for s in r["sweeps"]:
            if s["sweep"] not in sweeps:
                sweeps.append(s["sweep"])
    for r in reports:
        a = r.get("accuracy") or {}
        rows.append([r["op"], r["dtype"], a.get("forward_max_abs"), a.get("gradient_max_abs"), a.get("ratio_vs_eager"),
                     "pass" if a.get("passed", True) else "FAIL", "pass" if r["invariant"] else "FAIL"])
        classes.append(["", "", "", "", "", "pass" if a.get("passed", True) else "fail",
                        "pass" if r["invariant"] else "fail"])
    contract = _table(["op", "dtype", "fwd max abs", "grad max abs", "err / eager", "accuracy", "invariance"], rows, classes)
    mrows, mcls = [], []
    for r in reports:
        by = {s["sweep"]: s for s in r["sweeps"]}
        mrows.append([f"{r['op']} {r['dtype']}"] + [("pass" if by[s]["passed"] else f"{by[s]['max_diff']:.1e}") if s in by else "-"
                                                    for s in sweeps])
        mcls.append([""] + [("pass" if by[s]["passed"] else "fail") if s in by else "na" for s in sweeps])
    matrix = _table(["op x sweep"] + sweeps, mrows, mcls)
    return ("<h2>Operator contract</h2><p class=note>Errors against float64; err / eager is lockstep's error over "
            f"eager PyTorch's.</p>{contract}<h2>Invariance matrix</h2><p class=note>pass = bitwise identical; "
            f"otherwise the max difference.</p>{matrix}")


def _verify_section(v: dict) -> str:
    rows = [[r["dtype"], r["sampling"], r["path"], r["settings"], r["tokens"], 100 * r["token_agreement"], r["max_abs_dlogp"],
             r["approx_kl0"], r["clipfrac0"]] for r in v["rows"]]
    cls = [[""] * 8 + ["pass" if r["exact"] else ("fail" if r["path"] == "lockstep" else "na")] for r in v["rows"]]
    chain = ", ".join(f"{k}: {'identical' if ok else 'DIFFERENT'}" for k, ok in v.get("backward_chain", {}).items())
    return ("<h2>Train-inference gate</h2>" + _table(["dtype", "sampling", "path", "settings", "tokens", "agreement %",
                                                    "max |dlogp|", "approx_kl0", "clipfrac0"], rows, cls)
            + f"<p>Backward chain (input-embedding gradients alone vs batched): {html.escape(chain)}</p>")


def _parity_section(p: dict) -> str:
    out = [f"<h2>First divergence: {html.escape(p.get('a', 'A'))} vs {html.escape(p.get('b', 'B'))}</h2>"]
    for phase in ("forward", "backward"):
        d = p["first"].get(phase)
        if d is None:
            out.append(f"<p class=pass>{phase}: identical ({p['compared'][phase]} op records compared)</p>")
        else:
            out.append(f"<p class=fail>{phase}: first divergence at record #{d['index']} <b>{html.escape(d['module'] or '<top>')}"
                       f" {html.escape(d['op'])}</b> [{html.escape(d['slot'])}]: max abs diff {_fmt(d['max_abs_diff'])}, "
                       f"max ulp diff {d['max_ulp_diff']}, {d['differing']}/{d['elements']} elements differ; "
                       f"{d['contaminated_count']} later records contaminated.</p>")
    out.append("<h2>Per-layer divergence heat map</h2><p class=note>max |a - b| of each op's output (forward) and "
               "input gradients (backward); green is bitwise equal.</p>")
    out.append(heat_map(p["per_op"], "forward"))
    out.append(heat_map(p["per_op"], "backward"))
    return "\n".join(out)


def _trajectory_section(t: dict) -> str:
    rows = t["rows"]
    a, b = t["side_a"], t["side_b"]
    charts = [
        line_chart({f"loss {a}": [(r["step"], r["loss_a"]) for r in rows], f"loss {b}": [(r["step"], r["loss_b"]) for r in rows]},
                   "loss"),
        line_chart({f"grad norm {a}": [(r["step"], r["grad_norm_a"]) for r in rows],
                    f"grad norm {b}": [(r["step"], r["grad_norm_b"]) for r in rows]}, "gradient norm"),
        line_chart({"|loss diff|": [(r["step"], r["loss_diff"]) for r in rows],
                    "max |param diff|": [(r["step"], r["max_param_diff"]) for r in rows]}, "differences (log10)", log=True),
    ]
    first = t.get("first_step_outside_contract")
    head = (f"<p>Tolerances: loss {t['loss_tol']}, parameters {t['param_tol']}. First step outside: "
            f"<b>{first if first is not None else 'none'}</b></p>")
    op = t.get("first_diverging_op")
    extra = _parity_section({**op, "a": a, "b": b}) if op else ""
    table = _table(["step", f"loss {a}", f"loss {b}", "|dloss|", f"grad norm {a}", f"grad norm {b}", "max |dparam|"],
                   [[r["step"], r["loss_a"], r["loss_b"], r["loss_diff"], r["grad_norm_a"], r["grad_norm_b"],
                     r["max_param_diff"]] for r in rows])
    return f"<h2>Training trajectories: {html.escape(a)} vs {html.escape(b)}</h2>{head}<div class=charts>{''.join(charts)}</div>{table}{extra}"


def build_html(data: dict, title: str = "lockstep report") -> str:
    """data may hold "check" (list of op reports), "verify", "parity" and "trajectory" dicts."""
    sections = []
    if data.get("check"):
        sections.append(_check_section(data["check"]))
    if data.get("verify"):
        sections.append(_verify_section(data["verify"]))
    if data.get("parity"):
        sections.append(_parity_section(data["parity"]))
    if data.get("trajectory"):
        sections.append(_trajectory_section(data["trajectory"]))
    if not sections:
        sections.append("<p>No results found.</p>")
    body = "\n".join(sections)
    script = ("document.body.dataset.plots=document.querySelectorAll('svg.plot').length;"
              "document.body.dataset.tables=document.querySelectorAll('table').length;"
              "document.body.dataset.ready='1';")
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{body}<script>{script}</script></body></html>")


def write_html(data: dict, path: str, title: str = "lockstep report") -> str:
    with open(path, "w") as f:
        f.write(build_html(data, title))
    return path


FILES = {"check": "check.json", "verify": "verify.json", "parity": "parity.json", "trajectory": "trajectory.json"}


def from_run_dir(run_dir: str, out: str | None = None) -> str:
    """Read RUN_DIR/{check,verify,parity,trajectory}.json (whichever exist) and write report.html."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run_dir: {run_dir!r} is not a folder")
    data = {}
    for key, name in FILES.items():
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                loaded = json.load(f)
            if key == "check":
                data[key] = loaded.get("reports", loaded)
            else:
                data[key] = loaded.get(key, loaded)    # parity.json and trajectory.json wrap their payload
    if not data:
        raise FileNotFoundError(f"run_dir: none of {sorted(FILES.values())} in {run_dir}")
    return write_html(data, out or os.path.join(run_dir, "report.html"), f"lockstep report: {os.path.basename(os.path.abspath(run_dir))}")
