"""index.html: the human view of one run or of several (a comparison).

Rendered from results.json dicts only, so any set of result files (shards,
engine versions, mutants) gives a matrix.  Self-contained: inline CSS, plots
embedded as base64, no script and no network, so it opens from a CI artifact
zip as it is."""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import os
from pathlib import Path

from conformance.results.files import atomic_write
from conformance.results.matrix import families as families_of
from conformance.results.matrix import family_cell, run_label

# A family with a skipped check is not green: what was skipped was not checked.

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d2430;background:#fff}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde2ea;padding-bottom:4px}
.meta{color:#5a6474;margin-bottom:12px}
table{border-collapse:collapse;margin:6px 0 12px}
th,td{border:1px solid #d5dbe4;padding:5px 9px;text-align:left;vertical-align:top}
th{background:#f2f5f9;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
td.passed{background:#d9f2df;color:#10561f} td.failed{background:#fbd9d7;color:#8a1710;font-weight:600}
td.error{background:#fde6c8;color:#7a4300;font-weight:600} td.skipped{background:#eceff3;color:#5a6474}
td.none{background:#fafbfc;color:#a0a8b4}
td.zero{color:#b0463c} .badge{display:inline-block;padding:1px 7px;border-radius:9px;font-size:12px}
.ok{background:#d9f2df;color:#10561f} .bad{background:#fbd9d7;color:#8a1710} .warn{background:#fde6c8;color:#7a4300}
code,pre{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{background:#f5f7fa;border:1px solid #e1e6ed;padding:8px;overflow-x:auto;white-space:pre-wrap}
.failure{border-left:4px solid #d2443a;padding:4px 12px;margin:12px 0}
img{max-width:100%;border:1px solid #e1e6ed;margin:6px 0}
.scroll{overflow-x:auto}
"""


def replay_command(repro: str, impl_spec: str | None) -> str:
    """The command that replays a repro file.  A ``module:Class`` named by the
    file is never imported from it (replay trusts only the command line), so
    the command carries ``--impl`` for such a run."""
    impl = f" --impl {impl_spec}" if impl_spec and ":" in impl_spec else ""
    return f"hybrid-conformance replay {repro}{impl}"


def _rel(path: str, base: Path | None) -> str:
    if base is None:
        return path
    try:
        return os.path.relpath(Path(path).resolve(), base.resolve())
    except ValueError:  # another drive on Windows
        return path


_e = html.escape


def render(results: list[dict], base: Path | None = None, title: str = "hybrid-cache-conformance",
           plots: list[Path] | tuple[Path, ...] = ()) -> str:
    """``base``: where relative links start; ``plots``: the PNG files to embed
    (a run's own plots: a comparison written next to other files embeds none
    of theirs)."""
    e = _e
    out = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
           f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{e(title)}</h1>",
           f"<div class='meta'>{len(results)} run{'s' if len(results) != 1 else ''}; generated "
           f"{_dt.datetime.now(_dt.UTC).isoformat(timespec='seconds')}</div>"]
    out += _matrix(results)
    out += _coverage(results)
    out += _triage(results, base)
    out += _checks(results)
    out += _failures(results, base)
    out += _faults_and_plots(results, plots)
    out.append("</body></html>\n")
    return "".join(out)


def _matrix(results: list[dict]) -> list[str]:
    """One row per run, one column per family."""
    e = _e
    families = families_of(results)
    out = ["<h2>Matrix</h2><table id='matrix'><thead><tr><th>implementation</th>"]
    out += [f"<th>{e(str(f))}</th>" for f in families]
    out.append("<th>passed</th><th>failed</th><th>errors</th><th>skipped</th><th>run</th></tr></thead><tbody>")
    for r in results:
        s = r.get("summary") or {}
        verdict = _verdict(r)
        state = ("crashed" if r.get("crashed") else "interrupted") if r.get("interrupted") else \
            "not finished" if "finished" in r and not r["finished"] else _LABEL[verdict.status]
        badge = "ok" if verdict.ok else "warn" if verdict.status == "incomplete" and not r.get("crashed") else "bad"
        out.append(f"<tr><th>{e(run_label(r))}</th>")
        for f in families:
            status, tip = family_cell([c for c in r.get("checks", []) if c.get("family") == f])
            out.append(f"<td class='{status}' title='{e(tip)}'>{e(status)}</td>")
        out.append(f"<td class='num'>{s.get('passed', 0)}</td><td class='num'>{s.get('failed', 0)}</td>"
                   f"<td class='num'>{s.get('error', 0)}</td><td class='num'>{s.get('skipped', 0)}</td>"
                   f"<td><span class='badge {badge}' title='{e(verdict.headline())}'>{e(state)}</span> "
                   f"seed {e(str(r.get('seed', '')))}, "
                   f"{e(str(r.get('profile', '')))}</td></tr>")
    out.append("</tbody></table>")
    return out


_LABEL = {"new": "NEW", "incomplete": "incomplete", "fixed": "FIXED", "known": "as expected",
          "expected": "as expected", "passed": "passed"}


def _verdict(r: dict):
    from conformance.results.verdict import verdict_of

    return verdict_of(r)


def _coverage(results: list[dict]) -> list[str]:
    """How often each situation occurred."""
    e = _e
    counters: list[str] = []
    for r in results:
        counters += [k for k in (r.get("coverage") or {}) if k not in counters]
    if not counters:
        return []
    out = ["<h2>Coverage</h2><p class='meta'>Times each situation occurred over all examples; "
           "a 0 means the run could not have caught bugs that need it.</p>",
           "<div class='scroll'><table id='coverage'><thead><tr><th>implementation</th>"]
    out += [f"<th>{e(k)}</th>" for k in counters]
    out.append("</tr></thead><tbody>")
    for r in results:
        cov = r.get("coverage") or {}
        out.append(f"<tr><th>{e(run_label(r))}</th>")
        out += [f"<td class='num{' zero' if not cov.get(k) else ''}'>{int(cov.get(k, 0))}</td>" for k in counters]
        out.append("</tr>")
    out.append("</tbody></table></div>")
    return out


def _checks(results: list[dict]) -> list[str]:
    """Every check of every run."""
    e = _e
    out = ["<h2>Checks</h2><table id='checks'><thead><tr><th>implementation</th><th>check</th><th>family</th>"
           "<th>status</th><th>examples</th><th>operations</th><th>seconds</th><th>first failure after</th>"
           "<th>notes</th></tr></thead><tbody>"]
    for r in results:
        for c in r.get("checks", []):
            f = c.get("failure") or {}
            first = (f"{f.get('examples_to_failure')} examples, {f.get('seconds_to_failure')} s"
                     if f.get("examples_to_failure") is not None else "")
            status = c["status"] + (f": {c['reason']}" if c["status"] == "skipped" and c.get("reason") else "")
            out.append(f"<tr><td>{e(run_label(r))}</td><td title='{e(c.get('description', ''))}'>{e(c['id'])}</td>"
                       f"<td>{e(str(c.get('family', '')))}</td><td class='{e(c['status'])}'>{e(status)}</td>"
                       f"<td class='num'>{c.get('examples', 0)}</td><td class='num'>{c.get('operations', 0)}</td>"
                       f"<td class='num'>{c.get('seconds', 0):.1f}</td><td>{e(first)}</td>"
                       f"<td>{'<br>'.join(e(n) for n in c.get('notes') or [])}</td></tr>")
        for cv in _verdict(r).checks:
            if cv.status == "not-run":
                out.append(f"<tr><td>{e(run_label(r))}</td><td>{e(cv.id)}</td><td></td>"
                           f"<td class='error'>not run: {e(cv.why)}</td><td></td><td></td><td></td><td></td>"
                           f"<td></td></tr>")
    out.append("</tbody></table>")
    return out


def _triage(results: list[dict], base: Path | None) -> list[str]:
    """Failures grouped by signature (one row per known defect, one per NEW
    title), FIXED defects and the ones no check met, per run with a triage."""
    e = _e
    out: list[str] = []
    for r in results:
        t = r.get("triage")
        if not t:
            continue
        exp = r.get("expectations") or {}
        run_verdict = _verdict(r)
        verdict = "as expected" if run_verdict.ok else \
            "INCOMPLETE" if run_verdict.status == "incomplete" else "NOT as expected"
        out.append(f"<h2>Triage: {e(run_label(r))}</h2><p class='meta'>against "
                   f"<code>{e(str(exp.get('path', '')))}</code> ({e(str(exp.get('engine', '')))} "
                   f"{e(str(exp.get('version', '')))}): <span class='badge {'ok' if run_verdict.ok else 'bad'}'>"
                   f"{verdict}</span> {e(run_verdict.headline())}</p>")
        out.append("<table id='triage'><thead><tr><th>verdict</th><th>signature</th><th>checks</th>"
                   "<th>examples</th><th>first repro</th></tr></thead><tbody>")
        for g in t.get("new", []) + t.get("known", []):
            new = g["status"] == "new"
            label = "NEW" if new else f"known {g.get('category', 'defect')}"
            repro = g.get("first_repro")
            link = f"<a href='{e(_rel(repro, base))}'><code>{e(_rel(repro, base))}</code></a>" if repro else ""
            title = g["title"] if new else f"{g['key']}: {g['title']} ({g.get('upstream', '')})"
            out.append(f"<tr><td class='{'failed' if new else 'skipped'}'>{e(label)}</td><td>{e(title)}</td>"
                       f"<td>{len(g['checks'])}: {e(', '.join(g['checks']))}</td>"
                       f"<td class='num'>{g.get('examples', 0)}</td><td>{link}</td></tr>")
        for rec in t.get("fixed", []):
            out.append(f"<tr><td class='failed'>FIXED</td><td>{e(rec['defect'])}: its pinned repro no longer "
                       f"reproduces (update the expectations file)</td><td></td><td></td>"
                       f"<td><code>{e(str(rec.get('repro', '')))}</code></td></tr>")
        for did in t.get("not_seen", []):
            out.append(f"<tr><td class='none'>not seen</td><td>{e(did)} (no check met it; informational)</td>"
                       f"<td></td><td></td><td></td></tr>")
        out.append("</tbody></table>")
    return out


def _failures(results: list[dict], base: Path | None) -> list[str]:
    """Failures, with their repro files and the command that replays them."""
    e = _e
    failures = [(r, c) for r in results for c in r.get("checks", []) if c["status"] in ("failed", "error")]
    out = [f"<h2>Failures ({len(failures)})</h2>"]
    if not failures:
        incomplete = any(_verdict(r).status == "incomplete" for r in results)
        out.append("<p><span class='badge warn'>none so far: the run is incomplete</span></p>" if incomplete
                   else "<p><span class='badge ok'>none</span></p>")
    for r, c in failures:
        f = c.get("failure") or {}
        label = ((r.get("triage") or {}).get("by_check") or {}).get(c["id"], "")
        tag = (f"<span class='badge {'bad' if label == 'NEW' else 'warn'}'>{e(label)}</span> " if label else "")
        out.append(f"<div class='failure' id='failure-{e(c['id'])}'><h3>{e(c['id'])} "
                   f"<span class='badge bad'>{e(str(f.get('kind', c['status'])))}</span> {tag}"
                   f"<small>{e(run_label(r))}</small></h3><pre>{e(str(f.get('message', '')))}</pre>")
        if f.get("repro"):
            rel = _rel(f["repro"], base)
            out.append(f"<p>repro: <a href='{e(rel)}'><code>{e(rel)}</code></a><br>replay: "
                       f"<code>{e(replay_command(f['repro'], r.get('impl_spec')))}</code></p>")
        steps = f.get("operations") or []
        if steps:
            body = "\n".join(f"{i + 1:>3}. {json.dumps(s)}" for i, s in enumerate(steps))
            out.append(f"<details><summary>minimized sequence ({len(steps)} operations)</summary>"
                       f"<pre>{e(body)}</pre></details>")
        out.append("</div>")
    return out


def _faults_and_plots(results: list[dict], plots) -> list[str]:
    e = _e
    out = []
    faults = [(r, name, info) for r in results for name, info in (r.get("faults") or {}).items()]
    if faults:
        out.append("<h2>Faults</h2><table><tr><th>implementation</th><th>fault</th><th>report</th></tr>")
        out += [f"<tr><td>{e(run_label(r))}</td><td>{e(name)}</td><td><code>{e(json.dumps(info))}</code></td></tr>"
                for r, name, info in faults]
        out.append("</table>")
    why = [str((r.get("metrics") or {}).get("plots_missing")) for r in results
           if (r.get("metrics") or {}).get("plots_missing")]
    if why and not plots:
        out.append(f"<h2>Plots</h2><p class='meta'>no plots: {e(why[0])}</p>")
    if plots:
        out.append("<h2>Plots</h2>")
        for p in plots:
            data = base64.b64encode(p.read_bytes()).decode("ascii")
            out.append(f"<figure><img alt='{e(p.name)}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{e(p.name)}</figcaption></figure>")
    return out


def write_index(out: Path, results: list[dict], title: str = "hybrid-cache-conformance") -> Path:

    out = Path(out)
    path = out / "index.html"
    atomic_write(path, render(results, base=out, title=title, plots=sorted(out.glob("*.png"))))
    return path
