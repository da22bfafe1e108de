"""The README's "Writing an adapter" example runs, as written, under the harness."""

import re
from pathlib import Path

from conformance.contract import ImplConfig
from conformance.harness.ops import Drain, Submit
from conformance.judge import judged_session

README = Path(__file__).resolve().parent.parent / "README.md"


def _example_namespace():
    text = README.read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class NoCache" in b)
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)  # our own README, not user input
    return ns


def test_readme_adapter_is_correct(model, oracle):
    NoCache = _example_namespace()["NoCache"]
    s = judged_session(NoCache, ImplConfig(block_size=4, num_kv_blocks=32, num_state_slots=8), model, oracle)
    s.apply(Submit("a", tuple(range(1, 11)), 2))
    s.apply(Submit("b", tuple(range(1, 7)), 3))
    s.apply(Drain(5))
    s.apply(Submit("c", tuple(range(1, 11)), 1))
    s.apply(Drain(1024))
    assert s.coverage["prefix_hits"] == 0 and s.coverage["decode_steps"] > 0
    assert not s.active()
