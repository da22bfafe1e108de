"""No path of one machine in the code or the docs: a user's checkout has no
work folder or home folder of ours, so such a default silently finds nothing."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATTERNS = tuple("/" + p + "/" for p in ("work", "home", "Users"))  # spelled so this file does not match itself


def test_tracked_files_name_no_machine_paths():
    # the project's own folders (not .venvs, reports or other untracked output)
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("conformance", "fault_injection", "docs", "scripts", "tests", "fixtures", "bench", ".ci"):
        files += sorted((ROOT / folder).rglob("*")) if (ROOT / folder).is_dir() else []
    hits = []
    for path in files:
        name = path.relative_to(ROOT)
        if path.suffix not in (".py", ".md", ".toml", ".sh", ".json", ".yml", ".yaml", ".txt", ".cfg") \
                or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(p in line for p in PATTERNS):
                hits.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not hits, "machine paths:\n" + "\n".join(hits)
