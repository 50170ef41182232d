"""The results document the model-step and host-bound scripts write: what ran where (script, device,
commit, versions of torch and the peers) and one row per line (the JSON layout of
``cake_cute.tools.bench.results``)."""

from __future__ import annotations

import json
from pathlib import Path


def kept_rows(path: Path, append: bool) -> list[dict]:
    """The rows already in ``path`` when appending (a run split over several commands), else none."""
    return json.loads(path.read_text())["rows"] if append and path.exists() else []


def write_results(path: Path, script: str, device: str, rows: list[dict], **extra) -> None:
    """Write ``rows`` with the run's facts (and ``extra`` fields) to ``path`` atomically."""
    import torch

    from cake_cute.tools.bench import peers, results

    doc = {
        "script": script,
        "device": device,
        "commit": results.git_commit(),
        "torch": torch.__version__,
        "versions": peers.versions(),
        **extra,
        "rows": rows,
    }
    results.write_json(path, doc)
    print(f"wrote {len(rows)} rows to {path}")
