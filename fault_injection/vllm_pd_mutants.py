"""Seeded bugs on vLLM's prefill/decode path at the scheduler level
(:class:`conformance.adapters.vllm.disagg.VllmDisagg`, reached through
``VllmCache.disagg_factory``).  Runtime wrappers of one instance each: no vLLM
code is copied and no vLLM class is modified.  The disagg family must catch
them through its general checks (decode logits against the no-cache
reference, the byte audit of every decode read).

- ``vllm-pd-failed-recv-as-finished``: the worker's report reaches vLLM's
  decode ``Scheduler.update_from_output`` with ``failed_recving`` emptied, so a
  failed, partial or corrupt load is reported as a finished one (the NIXL
  worker's ``get_finished`` forgetting its failures): vLLM decodes on what
  landed.
- ``vllm-pd-last-state-sent``: the prefill side's NixlConnector scheduler does
  not truncate the prompt (``_truncate_request_for_prefill`` a no-op on that
  instance), so the prefill computes all N tokens and sends the state at N
  while the decode side, which claims N-1 (``_get_remote_prefill_token_count``),
  recomputes token N-1 on top of it.

Not planted here: a receive tail left unzeroed.  vLLM zeroes untransferred
regions only in the worker's heterogeneous-block-size post-processing
(``region_blocks_to_zero``); at this level the harness executes the worker
side, so the zeroing is the harness's stand-in for vLLM's masked attention
loads, and a mutant of it would test the harness's code, not vLLM's.
"""

from __future__ import annotations

from fault_injection.registry import register

TARGET = "vllm-disagg"


def _with_mode(factory, name: str, patch):
    """``factory`` (VllmCache or a subclass) whose disaggregated mode builds a
    VllmDisagg and then applies ``patch`` to that one instance."""
    from conformance.adapters.vllm.disagg import VllmDisagg

    inner = getattr(factory, "disagg_factory", None)
    if not (isinstance(inner, type) and issubclass(inner, VllmDisagg)):
        raise TypeError(f"mutant {name} applies to the vLLM adapter's disaggregated mode only")

    def build(config=None):
        impl = inner(config)
        patch(impl)
        return impl

    build.__name__ = f"{inner.__name__}[{name}]"
    return type(f"{factory.__name__}[{name}]", (factory,), {"disagg_factory": staticmethod(build)})


@register("vllm-pd-failed-recv-as-finished", "PD", target=TARGET)
def failed_recv_as_finished(factory):
    """PD: a failed receive is reported to vLLM's decode scheduler as finished
    (``failed_recving`` emptied on its way into ``update_from_output``)."""

    def patch(impl):
        sched = impl.decode.scheduler
        original = sched.update_from_output

        def update_from_output(so, out):
            kvo = out.kv_connector_output
            if kvo is not None and kvo.failed_recving:
                kvo.failed_recving = set()
            return original(so, out)

        sched.update_from_output = update_from_output

    return _with_mode(factory, "vllm-pd-failed-recv-as-finished", patch)


@register("vllm-pd-last-state-sent", "PD", target=TARGET)
def last_state_sent(factory):
    """PD: the prefill computes all N prompt tokens and sends the state at N,
    although the decode side recomputes token N-1 (no Mamba back-off on the
    prefill side's NixlConnector scheduler)."""

    def patch(impl):
        from conformance.adapters.vllm import compat

        conn = impl.prefill.scheduler.connector.connector_scheduler
        name = compat.nixl_prefill_truncation()  # the method's name moved in 0.31.0
        assert callable(getattr(conn, name, None)), f"{name}: not on {type(conn).__name__}"
        setattr(conn, name, lambda request: None)

    return _with_mode(factory, "vllm-pd-last-state-sent", patch)
