"""A known defect as an issue body in vLLM's bug-report form
(``.github/ISSUE_TEMPLATE/400-bug-report.yml``): "Your current environment",
"🐛 Describe the bug" with the minimal repro, expected vs actual, and the
before-submitting checklist.  ``hybrid-conformance defects --report ID`` prints it.

Everything in it comes from files a reviewer reads anyway, so that the body
and the write-up cannot drift apart: the defect's record (its title, the
versions whose expectations file holds it, its upstream references), its
write-up ``docs/findings/<id>.md`` (the sections below, by heading) and its
standalone script ``docs/findings/<id>_repro.py`` (pasted whole: vLLM's
template asks for code one can copy and run).  Pure text in, text out."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from conformance.errors import UsageError
from conformance.results.defects import Defect

FINDINGS = Path(__file__).resolve().parents[2] / "docs" / "findings"
# The write-up's sections the body is made of, by the start of their "## " heading.
SECTIONS = {"what": "What fails", "expected": "Expected and actual", "where": "Where it reproduces",
            "code": "Code path"}
CHECKLIST = ("- [x] Make sure you already searched for relevant issues, and asked the chatbot living at the bottom "
             "right corner of the [documentation page](https://docs.vllm.ai/en/latest/), which can answer lots of "
             "frequently asked questions.")


@dataclass(frozen=True)
class Writeup:
    title: str
    sections: dict[str, str]
    script: str
    script_name: str
    path: Path


def writeup_paths(defect_id: str, root: Path = FINDINGS) -> tuple[Path, Path]:
    return root / f"{defect_id}.md", root / f"{defect_id}_repro.py"


def load_writeup(defect_id: str, root: Path = FINDINGS) -> Writeup:
    """The write-up and the standalone script of a defect; a missing file or
    section is a usage error naming it (a defect is upstream-ready only with both)."""
    md, script = writeup_paths(defect_id, root)
    if not md.is_file() or not script.is_file():
        missing = md if not md.is_file() else script
        raise UsageError(f"--report {defect_id}: no write-up for it ({missing} is missing): a defect is "
                         f"upstream-ready once docs/findings/ holds {md.name} and {script.name}")
    text = md.read_text()
    first = text.splitlines()[0] if text else ""
    title = re.sub(r"^#\s*(\[Bug\]:?\s*)?", "", first).strip()
    sections: dict[str, str] = {}
    for key, heading in SECTIONS.items():
        found = re.search(rf"^## {re.escape(heading)}[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        if found is None:
            raise UsageError(f"--report {defect_id}: {md} has no '## {heading}' section")
        sections[key] = found.group(1).strip()
    code = re.search(r"^## (Code path[^\n]*)", text, re.M)
    sections["code_heading"] = code.group(1).strip() if code else "Code path"
    return Writeup(title, sections, script.read_text(), script.name, md)


def compose(defect: Defect, versions: list[str], writeup: Writeup, environment: str, environment_note: str) -> str:
    """The issue: a title line, then the body as vLLM's template lays it out."""
    w = writeup.sections
    related = [u for u in defect.upstream if u.relation != "reports"]
    lines = [f"[Bug]: {writeup.title}", "", "### Your current environment", "",
             "<details>", "<summary>The output of <code>python collect_env.py</code></summary>", "",
             "```text", environment.rstrip(), "```", "", "</details>", ""]
    if environment_note:
        lines += [environment_note, ""]
    lines += ["### 🐛 Describe the bug", "",
              f"Found by a conformance suite for hybrid (attention + Mamba/GDN) caches and verified with the "
              f"standalone script below on {', '.join(versions)}.", "",
              w["what"], "",
              "#### Minimal reproduction", "",
              f"`{writeup.script_name}` imports only vLLM and torch (and what vLLM itself brings), needs no GPU and "
              f"no model download, and prints one `FAIL: ...` line (exit 1) while the bug is there, `PASS` (exit 0) "
              f"once it is fixed; its docstring names the control configurations that pass.", "",
              "<details>", f"<summary>{writeup.script_name}</summary>", "", "```python", writeup.script.rstrip(), "```",
              "", "</details>", "",
              "#### Expected vs actual", "", w["expected"], "",
              "#### Where it reproduces and where it does not", "", w["where"], "",
              f"#### {w['code_heading']}", "", w["code"], ""]
    if related:
        lines += ["#### Related upstream", ""]
        lines += [f"- {u.describe()}: {u.relation}" for u in related]
        lines.append("")
    if defect.searched:
        lines += [f"Searched before filing: {defect.searched}", ""]
    lines += ["### Before submitting a new issue...", "", CHECKLIST, ""]
    return "\n".join(lines)
