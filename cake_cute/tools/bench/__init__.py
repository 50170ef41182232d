"""The benchmark harness (``cake-cute bench``, ``benchmarks/sweep.py``, ``benchmarks/plot.py``): shape
grids and the byte model (``cases``), result rows and files (``results``, standard library only), the
PNG (``plot``), device timing (``timing``), the implementations under test (``peers``), the sweep
(``runner``) and the arguments (``cli``). The method is in ``benchmarks/README.md``.
"""
