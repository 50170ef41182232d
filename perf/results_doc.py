"""The results document the model-step and host-bound scripts write: what ran where (script, device,
commit, versions of torch and the peers) and one row per line (``cake_cute.bench``'s JSON layout)."""

from __future__ import annotations

from pathlib import Path


def write_results(path: Path, script: str, device: str, rows: list[dict], **extra) -> None:
    """Write ``rows`` with the run's facts (and ``extra`` fields) to ``path`` atomically."""
    import torch

    from cake_cute import bench

    doc = {
        "script": script,
        "device": device,
        "commit": bench.git_commit(),
        "torch": torch.__version__,
        "versions": bench._versions(),
        **extra,
        "rows": rows,
    }
    bench.write_json(path, doc)
    print(f"wrote {len(rows)} rows to {path}")
