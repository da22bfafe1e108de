"""``hybrid-conformance economics``: what a retention policy stores and reuses
on a workload, measured by replaying it through a real cache (see
:mod:`conformance.analysis.economics`), and the design note's cost model (crossover
length, optimal interval) for a model's sizes and one's own prices."""

from __future__ import annotations

import sys
from pathlib import Path

from conformance.adapters import resolve
from conformance.cli.common import nonnegative_int, path_arg, positive_int, positive_number
from conformance.errors import UsageError
from conformance.model import ModelConfig
from conformance.results.files import strict_json


def add_parser(sub) -> None:
    p = sub.add_parser("economics", help="measure cache economics of a retention policy on a workload; cost model")
    p.add_argument("--workload", default=None,
                   help="bundled workload name (heavy-tail, flat-k2, agent-sessions) or a JSONL file")
    p.add_argument("--impl", default="reference", help="reference, vllm or module:Class (default: reference)")
    p.add_argument("--admission", choices=("always", "second-hit"), default=None,
                   help="admission policy option passed to the implementation (default: its own)")
    p.add_argument("--interval", type=nonnegative_int, default=None,
                   help="retention interval I (a multiple of the block size; 0 = prompt ends only; "
                        "default: every block boundary)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="another implementation option (JSON value; repeatable)")
    p.add_argument("--block-size", type=positive_int, default=4, help="block size of the replay (default 4)")
    p.add_argument("--spec-tokens", type=nonnegative_int, default=0, metavar="K",
                   help="replay under speculative decoding: K drafts verified at every decode step (the "
                        "implementation's spec_option; default 0: off)")
    p.add_argument("--spec-agree", type=nonnegative_int, default=None, metavar="A",
                   help="with --spec-tokens: how many of the K drafts agree with the reference (default K)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--plot", type=path_arg, default=None, help="write a PNG of hit rates and occupancies (matplotlib)")
    p.add_argument("--report-dir", type=path_arg, default=None,
                   help="also write economics-<workload>-<policy>.json and .png there (where HTML reports look)")
    cost = p.add_argument_group("cost model (design note, sections 1-2)")
    cost.add_argument("--state-bytes", type=positive_number, default=None, help="bytes of one recurrent state")
    cost.add_argument("--kv-bytes-per-token", type=positive_number, default=None,
                      help="attention KV bytes per token")
    cost.add_argument("--model-config", type=path_arg, default=None,
                      help="a model TOML (fixtures/models/*.toml): state and KV sizes from its shapes")
    cost.add_argument("--dtype-bytes", type=positive_int, default=2,
                      help="bytes per element with --model-config (default 2)")
    cost.add_argument("--context", type=positive_int, default=None, help="context length T (default 1,000,000)")
    cost.add_argument("--alpha", type=positive_number, default=None, help="cost per byte held (default 1e-9)")
    cost.add_argument("--beta", type=positive_number, default=None, help="cost per token recomputed (default 1e-3)")
    p.set_defaults(func=main)


def main(args) -> int:
    from conformance.cli.common import parse_options
    from conformance.suite.prepare import check_output_file, check_report_dir

    # Where it will write, checked before the replay (minutes on a large workload), not after it.
    if args.report_dir is not None:
        check_report_dir(args.report_dir)
    if args.plot is not None:
        check_output_file(args.plot, "--plot")
    cost = _cost_model(args)
    if args.workload is None and cost is None:
        raise UsageError("economics: give --workload, or cost-model sizes (--state-bytes and --kv-bytes-per-token, "
                         "or --model-config)")
    out: dict = {}
    replayed = None
    if args.workload is not None:
        from conformance.analysis.economics import replay_workload
        from conformance.generate import workload as wl

        try:
            requests = wl.load(args.workload)
        except ValueError as exc:
            raise UsageError(f"--workload: {exc}") from None
        options = parse_options(args.option)
        for key, flag in (("admission", args.admission), ("interval", args.interval)):
            if flag is None:
                continue
            if key in options and options[key] != flag:  # which one was meant?
                raise UsageError(f"--{key} {flag} and --option {key}={options[key]}: two values for one option")
            options[key] = flag
        factory = resolve(args.impl)
        if args.spec_tokens < 0 or (args.spec_agree is not None and args.spec_agree < 0):
            raise UsageError("--spec-tokens and --spec-agree must be >= 0")
        if args.spec_agree is not None and not args.spec_tokens:
            raise UsageError("--spec-agree needs --spec-tokens")
        if args.spec_tokens and not getattr(factory, "spec_option", None):
            raise UsageError(f"--spec-tokens: --impl {args.impl} has no speculative decoding (no spec_option)")
        spec = (args.spec_tokens, args.spec_tokens if args.spec_agree is None else args.spec_agree) \
            if args.spec_tokens else None
        validate = getattr(factory, "validate_options", None)
        if callable(validate):  # an interval the implementation refuses is the user's, as in `run`
            from conformance.contract import ImplConfig

            try:
                validate(ImplConfig(block_size=args.block_size, options=options))
            except ValueError as exc:
                raise UsageError(f"the options {options}: {exc}") from None
        from conformance.analysis.economics import capacity
        from conformance.errors import ConformanceFailure, ImplementationError
        from conformance.suite.limits import memory_problem

        why = memory_problem(ModelConfig(), args.block_size, *capacity(requests, args.block_size, options))
        if why:
            raise UsageError(f"--block-size {args.block_size}: {why}")
        try:
            replayed = replay_workload(requests, factory, options, name=Path(args.workload).stem,
                                       impl_name=args.impl, block_size=args.block_size,
                                       keep_series=args.plot is not None or args.report_dir is not None, spec=spec)
        except (ConformanceFailure, ImplementationError) as exc:  # the implementation failed: exit 1, said once
            first = str(exc).splitlines()[0]
            print(f"hybrid-conformance: economics: {args.impl} failed the replay of {args.workload} "
                  f"({exc.kind}): {first}", file=sys.stderr)
            return 1
        out = dict(replayed.result)
    if cost is not None:
        out["cost_model"] = cost.report()
    if args.report_dir is not None and replayed is not None:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        r = replayed.result
        stem = f"economics-{r['workload']}-i{'block' if r['interval'] is None else r['interval']}-{r['admission']}"
        args.plot = args.plot or args.report_dir / f"{stem}.png"
        (args.report_dir / f"{stem}.json").write_text(strict_json(out, indent=2) + "\n")
    if args.plot is not None and replayed is not None:
        from conformance.analysis.economics import plot

        why = plot(replayed, args.plot)
        out["plot"] = None if why else str(args.plot)
        if why:
            print(f"hybrid-conformance: {why}", file=sys.stderr)
    if args.format == "json":
        print(strict_json(out, indent=2))
    else:
        from conformance.analysis.cost_model import format_report
        from conformance.analysis.economics import format_text

        if replayed is not None:
            print(format_text(out))
        if cost is not None:
            print(format_report(out["cost_model"]))
        if out.get("plot"):
            print(f"plot: {out['plot']}")
    return 0


def _cost_model(args):
    from conformance.analysis.cost_model import NOTE_ALPHA, NOTE_BETA, NOTE_CONTEXT, CostModel, sizes_of

    state, kv = args.state_bytes, args.kv_bytes_per_token
    if args.model_config is not None:
        try:
            m_state, m_kv = sizes_of(ModelConfig.load(args.model_config), args.dtype_bytes)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--model-config {args.model_config}: {exc}") from None
        state = m_state if state is None else state
        kv = m_kv if kv is None else kv
    prices = (args.context, args.alpha, args.beta)
    if state is None and kv is None:
        if any(v is not None for v in prices):
            raise UsageError("--context/--alpha/--beta need --state-bytes and --kv-bytes-per-token (or --model-config)")
        return None
    if state is None or kv is None:
        raise UsageError("the cost model needs both --state-bytes and --kv-bytes-per-token (or --model-config)")
    try:
        return CostModel(state, kv, args.context or NOTE_CONTEXT, args.alpha or NOTE_ALPHA, args.beta or NOTE_BETA)
    except ValueError as exc:
        raise UsageError(f"cost model: {exc}") from None
