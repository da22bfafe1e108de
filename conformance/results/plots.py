"""The run's plot: per check, the KV hit rate beside the recurrent-state hit
rate (the signature of a bad retention policy is a healthy first and a
collapsed second) and the peak occupancies of the two pools, from the cache
metrics results.json holds.  ``index.html`` embeds every PNG of the report
directory; without matplotlib (a test extra and the ``plot`` extra) no plot
is written and the report says why."""

from __future__ import annotations

from pathlib import Path

from conformance.results.records import RunResult

PLOT = "cache-metrics.png"


def write_run_plot(out: Path, result: RunResult) -> str | None:
    """Write ``out/cache-metrics.png``; None, or why no plot was written."""
    checks = [c for c in result.checks if c.metrics and c.metrics.get("prompt_tokens")]
    if not checks:
        return "no check measured cache metrics"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'hybrid-cache-conformance[plot]')"
    ids = [c.id for c in checks]
    x = range(len(ids))
    width = 0.4
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.0, 0.6 * len(ids)), 7), sharex=True)
    top.bar([i - width / 2 for i in x], [c.metrics.get("kv_hit_rate", 0) for c in checks], width, label="KV hit rate")
    top.bar([i + width / 2 for i in x], [c.metrics.get("state_hit_rate", 0) for c in checks], width,
            label="state hit rate (tokens reused)")
    top.set_ylabel("share of prompt tokens")
    top.set_ylim(0, 1)
    top.legend(loc="upper right", fontsize=8, framealpha=0.8)
    bottom.bar([i - width / 2 for i in x], [c.metrics.get("kv_occupancy_peak", 0) for c in checks], width,
               label="KV blocks, peak")
    bottom.bar([i + width / 2 for i in x], [c.metrics.get("state_occupancy_peak", 0) for c in checks], width,
               label="state slots, peak")
    bottom.set_ylabel("pool occupancy")
    bottom.set_ylim(0, 1)
    bottom.legend(loc="upper right", fontsize=8, framealpha=0.8)
    bottom.set_xticks(list(x))
    bottom.set_xticklabels(ids, rotation=45, ha="right", fontsize=8)
    fig.suptitle(f"{result.implementation} {result.implementation_version}: cache metrics per check "
                 f"(seed {result.seed}, {result.profile})")
    fig.tight_layout()
    tmp = out / (PLOT + ".tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    tmp.replace(out / PLOT)
    return None
