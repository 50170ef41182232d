"""The tools around the kernels: the ``cake-cute`` command (``cli``), ahead-of-time compilation
(``warmup``) and its per-kernel report (``kernel_report``), the GPU self-check (``selfcheck``), cubin
reports (``cubin``) and the benchmark harness (``bench``). Nothing here is imported by ``import
cake_cute``."""

# argparse's exit status for a bad argument, which every tool's own usage errors share.
EXIT_USAGE = 2
