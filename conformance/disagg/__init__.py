"""The contract of prefill/decode disaggregation: each worker's layout, the
geometry of its pages and state shards, and the transfer descriptors an
implementation plans (as NIXL takes them).  It extends the single-worker
contract (:mod:`conformance.contract`) without changing it."""
