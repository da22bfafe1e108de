"""Reading a file the user named (a repro, a results.json, an expectations
file, a workload): its text, or one line naming the file and what is wrong
with it, raised as the caller's error class (a usage error: exit 2).  Every
front door reads its inputs here, so that no input file is a traceback:
missing, a directory, unreadable, endless (``/dev/zero``), or not UTF-8
text.  At the bottom of the house (beside ``errors``): the generator's
workloads and the results readers both use it."""

from __future__ import annotations

from pathlib import Path

# The most an input file (a repro, a results.json, an expectations file, a workload) may hold: the
# suite writes them in kilobytes to a few megabytes; past this it is not one (``/dev/zero`` would
# otherwise be read until memory runs out).
MAX_INPUT_BYTES = 256 << 20


def read_input(path: str | Path, error: type[Exception] = ValueError) -> str:
    """The text of an input file the user named, or ``error`` with one line
    naming the file and the problem: it cannot be read (missing, a directory,
    no permission), it is larger than any file the suite writes, or it is not
    UTF-8 text (JSON and TOML are)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_INPUT_BYTES + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_INPUT_BYTES:
        raise error(f"{path}: larger than {MAX_INPUT_BYTES >> 20} MiB: not a file this suite reads")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x})") from None
