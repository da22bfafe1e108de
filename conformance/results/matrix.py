"""Several runs as one matrix: one row per run (an implementation, its
version, its options), one column per check family, each cell the worst
status of that family's checks.  The HTML report and ``hybrid-conformance
matrix`` show the same thing; the runs may come from several invocations
(the reference, vLLM at both levels and SGLang live in different
environments), each a results.json."""

from __future__ import annotations

_ORDER = {"error": 0, "failed": 1, "skipped": 2, "passed": 3, None: 4}
_SYMBOL = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip", "none": "-"}


def run_label(r: dict) -> str:
    label = f"{r.get('implementation', '?')} {r.get('implementation_version', '')}".strip()
    options = (r.get("impl_config") or {}).get("options") or {}
    if options:
        label += " [" + ",".join(f"{k}={v}" for k, v in sorted(options.items())) + "]"
    if r.get("mutant"):
        label += f" + {r['mutant']}"
    if r.get("fault_names"):
        label += f" + faults {','.join(r['fault_names'])}"
    return label


def families(results: list[dict]) -> list[str]:
    """Every family any run has, in first-seen order."""
    seen: list[str] = []
    for r in results:
        for c in r.get("checks", []):
            if c.get("family") not in seen:
                seen.append(c.get("family"))
    return seen


def family_cell(checks: list[dict]) -> tuple[str, str]:
    """Worst status of a family's checks (one failing check fails the family),
    and a line naming each check's status (and a skip's reason)."""
    if not checks:
        return "none", "not run"
    worst = min((c["status"] for c in checks), key=lambda s: _ORDER.get(s, 4))
    title = "; ".join(f"{c['id']}: {c['status']}" + (f" ({c['reason']})" if c.get("reason") else "")
                      for c in checks)
    return worst, title


def format_matrix(results: list[dict]) -> str:
    """The matrix as text: a row per run, a column per family."""
    fams = families(results)
    labels = [run_label(r) for r in results]
    width = max([len(x) for x in labels] + [14])
    cols = [max(len(f), 5) for f in fams]
    lines = [" " * width + "  " + "  ".join(f.ljust(w) for f, w in zip(fams, cols))]
    for r, label in zip(results, labels):
        cells = [_SYMBOL.get(family_cell([c for c in r.get("checks", []) if c.get("family") == f])[0], "?")
                 for f in fams]
        lines.append(label.ljust(width) + "  " + "  ".join(c.ljust(w) for c, w in zip(cells, cols)))
    return "\n".join(lines)
