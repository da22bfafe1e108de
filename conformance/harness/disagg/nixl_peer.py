"""The decode worker's NIXL agent, in its own process.

It maps the decode memory (a shared-memory file the harness also maps, so
the harness's model reads exactly what NIXL wrote), registers it with a UCX
agent named ``decode`` and serves commands over a pipe: load the prefill
agent's metadata, READ a descriptor list from the prefill side (vLLM's
direction), report the notifications it received (WRITEs from the prefill
side announce themselves there).  Errors go back as (kind, message) pairs.
"""

from __future__ import annotations

import time

POLL_DEADLINE_S = 30.0


def _descs(agent, rows):
    import numpy as np

    return agent.get_xfer_descs(np.array(rows, dtype=np.uint64).reshape(-1, 3), "DRAM")


def wait_done(agent, handle, deadline_s: float = POLL_DEADLINE_S) -> None:
    """Post ``handle`` and poll until DONE; NIXL raises on every failure it detects."""
    state = agent.transfer(handle)
    stop = time.monotonic() + deadline_s
    while state == "PROC":
        if time.monotonic() > stop:
            raise TimeoutError(f"transfer still in progress after {deadline_s:.0f} s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer state {state}")


def serve(conn, shared_path: str, nbytes: int) -> None:
    # No torch here: the mapping is plain mmap and NIXL gets (address, length, device, meta)
    # tuples, so the peer starts in well under a second (torch's import alone takes seconds).
    import mmap
    import os

    import numpy as np
    from nixl import nixl_agent, nixl_agent_config

    fd = os.open(shared_path, os.O_RDWR)
    mapping = mmap.mmap(fd, nbytes)
    os.close(fd)
    buf = np.frombuffer(mapping, dtype=np.uint8)
    base = buf.ctypes.data
    agent = nixl_agent("decode", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent.register_memory([(base, nbytes, 0, "")], "DRAM")
    conn.send(("ready", agent.get_agent_metadata(), base))
    remote, remote_base = None, 0
    inbox: list[bytes] = []
    while True:
        # No progress thread (its busy polling starves the harness's torch threads on a small
        # machine): between commands this loop progresses UCX itself, every millisecond.
        try:
            while not conn.poll(0.001):
                if remote is not None:
                    inbox.extend(m for msgs in agent.get_new_notifs().values() for m in msgs)
            cmd, *args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if cmd == "peer":
                md, remote_base = args
                agent.add_remote_agent(md)
                remote = "prefill"
                conn.send(("ok",))
            elif cmd == "read":
                descs, tag = args  # (src_offset on prefill, dst_offset here, length)
                local = _descs(agent, [(base + d, n, 0) for _, d, n in descs])
                far = _descs(agent, [(remote_base + s, n, 0) for s, _, n in descs])
                h = agent.initialize_xfer("READ", local, far, remote, tag)
                try:
                    wait_done(agent, h)
                finally:
                    agent.release_xfer_handle(h)
                conn.send(("ok",))
            elif cmd == "notifs":
                inbox.extend(m for msgs in agent.get_new_notifs().values() for m in msgs)
                conn.send(("ok", inbox))
                inbox = []
            elif cmd == "stop":
                conn.send(("ok",))
                return
            else:
                conn.send(("err", "UsageError", f"unknown command {cmd!r}"))
        except Exception as e:  # NIXL's errors are exceptions; report them, stay alive
            conn.send(("err", type(e).__name__, str(e)))


def main(argv: list[str]) -> None:
    """``python -m conformance.harness.disagg.nixl_peer FD SHARED_PATH NBYTES``: a
    subprocess, not multiprocessing's spawn (which re-imports the parent's
    ``__main__``: a CLI, pytest)."""
    from multiprocessing.connection import Connection

    fd, path, nbytes = argv
    serve(Connection(int(fd)), path, int(nbytes))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
