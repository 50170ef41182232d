"""The tools around the kernels: the ``cake-cute`` command (``cli``), ahead-of-time compilation
(``warmup``), the GPU self-check (``selfcheck``), cubin reports (``cubin``) and the benchmark harness
(``bench``). Nothing here is imported by ``import cake_cute``."""
