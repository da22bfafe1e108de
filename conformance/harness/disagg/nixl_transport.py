"""Real NIXL 1.5.1 with the UCX backend: the prefill agent in this process,
the decode agent in a second process (:mod:`.nixl_peer`), on loopback.

Memory registration, metadata exchange (each agent loads the other's
``get_agent_metadata()``), READ (the decode agent pulls, as vLLM's connector
does) or WRITE (the prefill agent pushes; the decode agent learns of it by
notification) of the implementation's descriptor lists, and NIXL's own
errors (``nixlRemoteDisconnectError`` when the peer died, ``nixlNotFoundError``
for a range outside a registration, ``nixlInvalidParamError`` ...).

DRAM only: both buffers are shared-memory files, so the harness's model reads
what NIXL moved.  VRAM would need the decode buffer shared with the peer by
CUDA IPC; not done (no GPU here, and the model runs on the CPU).

UCX picks ``cma`` on loopback, where a post completes synchronously: chunks
are what makes a transfer observable in flight (nixl notes, section 4).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from conformance.disagg.contract import Descriptor

from .nixl_peer import _descs, wait_done
from .transport import TransferError, Transport

SPAWN_TIMEOUT_S = 120.0


def nixl_available() -> str | None:
    """None when NIXL imports; else why not (one line)."""
    try:
        import nixl  # noqa: F401  (picks its CUDA-or-not build on import)
    except Exception as e:  # ImportError, or a broken CUDA wheel probe
        return f"nixl does not import: {type(e).__name__}: {e}"
    return None


class NixlTransport(Transport):
    name = "nixl-ucx (2 processes, DRAM)"
    needs_shared_decode = True

    def _connect(self) -> None:
        from nixl import nixl_agent, nixl_agent_config

        if not self.decode.shared_path:
            raise ValueError("the NIXL transport needs the decode memory in a shared-memory file")
        # No progress thread: it busy-polls a core, which starves the harness's own torch
        # threads on a small machine; this agent progresses when it posts and polls.
        self.agent = nixl_agent("prefill", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent.register_memory(self.prefill.buf)
        self.base = self.prefill.buf.data_ptr()
        self.proc: subprocess.Popen | None = None
        self.spawns = 0
        self.prefill_notifs: list[bytes] = []  # what the prefill agent was told (READs' notifications)
        self._seen: set[bytes] = set()
        self._spawn()

    def _spawn(self) -> None:
        assert self.decode.shared_path is not None
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[3])  # this checkout's conformance package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "conformance.harness.disagg.nixl_peer", str(theirs.fileno()),
             self.decode.shared_path, str(self.decode.geometry.buffer_bytes)],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        if not self.conn.poll(SPAWN_TIMEOUT_S):
            raise RuntimeError("the NIXL decode peer did not start")
        tag, md, self.remote_base = self.conn.recv()
        self.agent.add_remote_agent(md)  # returns b"decode" (bytes); transfers name it as a str
        self.remote = "decode"
        self.conn.send(("peer", self.agent.get_agent_metadata(), self.base))
        self._reply()
        self.spawns += 1

    def _reply(self):
        try:
            # While the peer works (a READ it initiated needs this side's UCX worker too),
            # progress our agent; READ notifications land here, the prefill side.
            while not self.conn.poll(0.0005):
                if self.proc is not None and self.proc.poll() is not None:
                    raise EOFError
                self.prefill_notifs.extend(m for msgs in self.agent.get_new_notifs().values() for m in msgs)
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            raise TransferError("PeerDied", f"decode peer process gone ({type(e).__name__})") from None
        if msg[0] == "err":
            raise TransferError(msg[1], msg[2])
        return msg

    def _call(self, *cmd):
        try:
            self.conn.send(cmd)
        except (BrokenPipeError, OSError) as e:
            raise TransferError("PeerDied", f"decode peer process gone ({type(e).__name__})") from None
        return self._reply()

    def _post(self, op: str, descriptors: tuple[Descriptor, ...], tag: bytes) -> None:
        rows = [(d.src_offset, d.dst_offset, d.length) for d in descriptors]
        if op == "READ":
            self._call("read", rows, tag)
            return
        try:
            local = _descs(self.agent, [(self.base + s, n, 0) for s, _, n in rows])
            far = _descs(self.agent, [(self.remote_base + d, n, 0) for _, d, n in rows])
            h = self.agent.initialize_xfer("WRITE", local, far, self.remote, tag)
            try:
                wait_done(self.agent, h)
            finally:
                self.agent.release_xfer_handle(h)
        except TransferError:
            raise
        except Exception as e:  # nixl._bindings errors: nixlRemoteDisconnectError, nixlNotFoundError, ...
            raise TransferError(type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "") from None

    def _notified(self, tag: bytes) -> bool:
        if tag not in self._seen:
            self._seen.update(self._call("notifs")[1])
        if tag in self._seen:
            self._seen.discard(tag)
            return True
        return False

    def _kill_peer(self) -> str:
        assert self.proc is not None
        pid = self.proc.pid
        os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        return f"SIGKILL to pid {pid}"

    def _recover(self) -> None:
        """A dead peer is replaced: forget its agent, start a new one on the same memory."""
        if self.proc is not None and self.proc.poll() is None:
            return
        try:
            self.agent.remove_remote_agent(self.remote)
        except Exception:
            pass
        self._seen.clear()
        self._spawn()

    def reset(self) -> None:
        """A new scenario on the same agents: a dead peer is replaced, and notifications
        a previous scenario left behind are drained (transfer ids restart with a new
        implementation, so a stale tag could otherwise pass for a new transfer's)."""
        super().reset()
        self._recover()
        self._seen.clear()
        self.prefill_notifs.clear()
        try:
            self._call("notifs")
        except TransferError:
            self._recover()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self._call("stop")
                self.proc.wait(10)
            except (TransferError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
