"""One rank of a torchtitan training run on CPU:
``torchrun ... -m tests.torchtitan_harness.launch <torchtitan.train arguments>``. It makes the CPU
settings of ``tests.torchtitan_harness.cpu`` and hands over to ``torchtitan.train.main``. With
``CAKE_TT_LOSS_FILE`` set, rank 0 writes the loss of every logged step there as JSON (full FP32
precision, which torchtitan's log lines round)."""

import json
import os
import sys

from .cpu import patch_trainer, prepare

prepare()

from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.train import main  # noqa: E402

_losses: dict[int, float] = {}
_log = MetricsProcessor.log


def _recording_log(self, step, global_avg_loss, *args, **kwargs):
    _losses[int(step)] = float(global_avg_loss)
    path = os.environ.get("CAKE_TT_LOSS_FILE")
    if path and int(os.environ.get("RANK", "0")) == 0:
        with open(path, "w") as f:
            json.dump({"loss": [_losses[s] for s in sorted(_losses)]}, f)
    return _log(self, step, global_avg_loss, *args, **kwargs)


if __name__ == "__main__":
    patch_trainer()
    MetricsProcessor.log = _recording_log
    main()
    # main() has trained, logged and destroyed the process groups. A gloo rank can still abort while
    # the interpreter finalizes ("terminate called without an active exception" with no Python frame
    # left: a native thread torn down at exit), which CI saw once in a stock two-process run on a
    # 2-core machine. The run is over and its losses written: leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
