"""One self-contained HTML report (inline CSS and SVG, no network) of check, verify, parity and
trajectory results. `lockstep report RUN_DIR` builds it from the JSON files a run wrote;
`--html PATH` on check, verify and parity writes it directly."""

from __future__ import annotations

import html
import json
import math
import os
import re

from ..parity.compare import outcomes

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


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, log: bool = False,
               width: int = 520, height: int = 280) -> str:
    """An SVG line chart with ticks on both axes and the legend above the plot area.

    With log=True the y axis is log10 with a tick at every power of ten; zeros (exact agreement)
    are drawn on their own line below the lowest decade, labelled 0."""
    colors = ["#1f6feb", "#d1242f", "#1a7f37", "#9a6700", "#8250df"]
    pts = [(x, y) for s in series.values() for x, y in s if y is not None and math.isfinite(y)]
    if not pts:
        return f"<p class=note>{html.escape(title)}: no data</p>"
    left, right, top, bottom = 52, 12, 30 + 16 * ((len(series) + 2) // 3), 34
    x0, x1 = min(x for x, _ in pts), max(x for x, _ in pts)
    if x1 == x0:
        x1 = x0 + 1
    if log:
        logs = [math.log10(y) for _, y in pts if y > 0]
        lo, hi = (math.floor(min(logs)), math.ceil(max(logs))) if logs else (-1, 0)
        if hi == lo:
            hi = lo + 1
        zero_row = lo - 0.6                               # the line where zeros are drawn

        def y_of(y):
            return math.log10(y) if y > 0 else zero_row
        y0, y1 = zero_row - 0.2, hi
        y_ticks = [(float(e), f"1e{e}") for e in range(lo, hi + 1)] + [(zero_row, "0")]
    else:
        ys = [y for _, y in pts]
        y0, y1 = min(ys), max(ys)
        if y1 == y0:
            y0, y1 = y0 - 1, y1 + 1
        pad = 0.05 * (y1 - y0)
        y0, y1 = y0 - pad, y1 + pad

        def y_of(y):
            return y
        y_ticks = [(v, f"{v:.3g}") for v in _ticks(y0, y1)]

    def px(x):
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def py(y):
        return height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' class='plot'>",
             f"<text x='{width / 2}' y='16' text-anchor='middle' font-weight='600'>{html.escape(title)}</text>",
             f"<line x1='{left}' y1='{height - bottom}' x2='{width - right}' y2='{height - bottom}' stroke='#888'/>",
             f"<line x1='{left}' y1='{top}' x2='{left}' y2='{height - bottom}' stroke='#888'/>"]
    for yv, label in y_ticks:
        parts.append(f"<line x1='{left - 3}' y1='{py(yv):.1f}' x2='{width - right}' y2='{py(yv):.1f}' stroke='#eee'/>")
        parts.append(f"<text x='{left - 5}' y='{py(yv) + 3.5:.1f}' text-anchor='end' font-size='10'>{label}</text>")
    for xv in _ticks(x0, x1):
        label = f"{xv:g}"
        parts.append(f"<line x1='{px(xv):.1f}' y1='{height - bottom}' x2='{px(xv):.1f}' y2='{height - bottom + 4}' "
                     "stroke='#888'/>")
        parts.append(f"<text x='{px(xv):.1f}' y='{height - bottom + 15}' text-anchor='middle' font-size='10' "
                     f"class='xtick'>{label}</text>")
    parts.append(f"<text x='{(left + width - right) / 2}' y='{height - 4}' text-anchor='middle' font-size='11'>step</text>")
    for i, (name, s) in enumerate(series.items()):
        coords = [f"{px(x):.1f},{py(y_of(y)):.1f}" for x, y in s if y is not None and math.isfinite(y)]
        color = colors[i % len(colors)]
        dash = " stroke-dasharray='6 3'" if i % 2 else ""
        parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='2'{dash} points='{' '.join(coords)}'/>")
        lx, ly = left + 165 * (i % 3), 30 + 16 * (i // 3)
        parts.append(f"<line x1='{lx}' y1='{ly - 4}' x2='{lx + 18}' y2='{ly - 4}' stroke='{color}' stroke-width='2'{dash}/>"
                     f"<text x='{lx + 22}' y='{ly}' font-size='11' class='legend'>{html.escape(name)}</text>")
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


def _native_bits_note(native_bits: dict | None) -> str:
    """Whether the native kernels, and then the whole native backend, gave the recorded bits (lockstep
    check's comparison): one paragraph each."""
    if not native_bits:
        return ""
    on = native_bits["recorded_on"]
    recorded = f"recorded on {html.escape(on['machine'])}, {html.escape(on['isa'])}"
    if native_bits["differ"]:
        # Joined here: importing lockstep.backends.native would build the kernels to draw a page.
        where = "; ".join(f"{isa}: {', '.join(names)}" for isa, names in native_bits["differ"].items())
        out = (f"<p class=fail>Native bits: not the recorded ones ({recorded}), in {html.escape(where)} "
               "(docs/adr/0026).</p>")
    else:
        out = (f"<p class=pass>Native bits: the recorded ones on "
               f"{html.escape(', '.join(native_bits['instruction_sets']))} ({recorded}).</p>")
    backend = native_bits.get("backend")  # absent from a check.json written before it was compared
    if backend is None:
        return out
    torch_release = html.escape(backend["torch"])
    if not backend["differ"]:
        return out + (f"<p class=pass>Native backend bits: the recorded ones in all {backend['sections']} sections "
                      f"under torch {torch_release}.</p>")
    sections = html.escape(", ".join(backend["differ"]))
    if backend.get("counted", backend["listed"]):
        return out + (f"<p class=fail>Native backend bits: not the recorded ones ({recorded}), in {sections}, under "
                      f"torch {torch_release} (docs/adr/0026).</p>")
    return out + (f"<p class=note>Native backend bits: other than the recorded ones in {sections} under torch "
                  f"{torch_release}, where the inputs may differ from the recording's (not counted as a "
                  "failure).</p>")


def _check_section(reports: list[dict], native_bits: dict | None = None) -> str:
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
            f"eager PyTorch's.</p>{_native_bits_note(native_bits)}{contract}<h2>Invariance matrix</h2><p class=note>pass = bitwise identical; "
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
    css = {"not compared": "na", "identical": "pass", "diverged": "fail"}
    for o in outcomes(p):
        later = f"; {o.first.contaminated_count} later records contaminated." if o.status == "diverged" else ""
        out.append(f"<p class={css[o.status]}>{o.phase}: {html.escape(o.headline(_fmt))}{later}</p>")
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
    error = (f", each plus {t['pytorch_error_factor']} x PyTorch's own error (plain vs lockstep's trainer in float64)"
             if t.get("pytorch_error_factor") else "")
    head = (f"<p>Tolerances: loss {t['loss_tol']}, parameters {t['param_tol']}{error}. First step outside: "
            f"<b>{first if first is not None else 'none'}</b></p>")
    op = t.get("first_diverging_op")
    extra = _parity_section({**op, "a": a, "b": b}) if op else ""
    table = _table(["step", f"loss {a}", f"loss {b}", "|dloss|", f"grad norm {a}", f"grad norm {b}", "max |dparam|"],
                   [[r["step"], r["loss_a"], r["loss_b"], r["loss_diff"], r["grad_norm_a"], r["grad_norm_b"],
                     r["max_param_diff"]] for r in rows])
    return f"<h2>Training trajectories: {html.escape(a)} vs {html.escape(b)}</h2>{head}<div class=charts>{''.join(charts)}</div>{table}{extra}"


def _training_section(t: dict) -> str:
    """A `lockstep train` or `lockstep rl` run: the curves its log holds (loss, gradient norm, learning
    rate; reward and the sampler-trainer mismatch), and its starts and resumes."""
    steps = t["steps"]

    def series(key):
        return [(r["step"], r[key]) for r in steps if r.get(key) is not None]

    charts = []
    if any("reward" in r for r in steps):
        charts.append(line_chart({"mean reward": series("reward")}, "reward"))
        charts.append(line_chart({"max |dlogp|": series("max_abs_dlogp"), "approx KL": series("approx_kl0")},
                                 "sampler vs trainer (log10; 0 = the same bits)", log=True))
        charts.append(line_chart({"mean ratio - 1": [(s_, abs(v - 1)) for s_, v in series("mean_ratio")]},
                                 "|mean importance ratio - 1| (log10)", log=True))
    for key, title in (("loss", "loss"), ("grad_norm", "gradient norm"), ("lr", "learning rate")):
        if any(key in r for r in steps):
            charts.append(line_chart({key.replace("_", " "): series(key)}, title))
    events = _table(["event", "at step", "ranks", "accum", "global batch tokens", "changes"],
                    [[e.get("event"), e.get("step"), e.get("ranks"), e.get("accum"), e.get("global_batch_tokens"),
                      ", ".join(f"{k} {a} -> {b}" for k, (a, b) in (e.get("changes") or {}).items()) or "-"]
                     for e in t["events"]])
    last = steps[-1] if steps else {}
    facts = ", ".join(f"last {k.replace('_', ' ')} {_fmt(last.get(k))}" for k in ("reward", "loss", "grad_norm",
                                                                                   "max_abs_dlogp") if k in last)
    return (f"<h2>Training run</h2><p>{len(steps)} steps; {facts}.</p><div class=charts>{''.join(charts)}</div>"
            f"{events}")


def build_html(data: dict, title: str = "lockstep report") -> str:
    """data may hold "check" (list of op reports) with "native_bits" (lockstep check's comparison
    of the native kernels' bits with the recorded ones), "verify", "parity", "trajectory" and "training"
    ({"steps": [...], "events": [...]}, a `lockstep train` log)."""
    sections = []
    if data.get("check"):
        sections.append(_check_section(data["check"], data.get("native_bits")))
    if data.get("verify"):
        sections.append(_verify_section(data["verify"]))
    if data.get("parity"):
        sections.append(_parity_section(data["parity"]))
    if data.get("trajectory"):
        sections.append(_trajectory_section(data["trajectory"]))
    if data.get("training"):
        sections.append(_training_section(data["training"]))
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
    """Read RUN_DIR/{check,verify,parity,trajectory}.json and a `lockstep train` log.jsonl (whichever
    exist) and write RUN_DIR/report.html (or `out`)."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run_dir: {run_dir!r} is not a folder")
    data = {}
    for key, name in FILES.items():
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                try:
                    loaded = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"run_dir: {path} is not valid JSON ({e})") from None
            if key == "check":
                if not isinstance(loaded, dict) or not isinstance(loaded.get("reports"), list):
                    raise ValueError(f"run_dir: {path} is not lockstep check's JSON (expected an object with a "
                                     "\"reports\" list)")
                data[key], data["native_bits"] = loaded["reports"], loaded.get("native_bits")
            else:
                data[key] = loaded.get(key, loaded)    # parity.json and trajectory.json wrap their payload
    if os.path.exists(os.path.join(run_dir, "log.jsonl")):
        from ..train import read_log

        steps, events = read_log(run_dir)
        data["training"] = {"steps": steps, "events": events}
    if not data:
        raise FileNotFoundError(f"run_dir: none of {sorted(FILES.values()) + ['log.jsonl']} in {run_dir}")
    return write_html(data, out or os.path.join(run_dir, "report.html"),
                      f"lockstep report: {os.path.basename(os.path.abspath(run_dir))}")
