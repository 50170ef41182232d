"""The benchmark harness (``cake-cute bench``, ``benchmarks/sweep.py``, ``benchmarks/plot.py``), split by
concern:

* ``cases``: the shape grids and the byte model (dtype sizes from ``cake_cute.vocab``);
* ``results``: result rows, the table, the JSON file (standard library only);
* ``plot``: the PNG (matplotlib; with ``results``, loadable without torch by ``benchmarks/plot.py``);
* ``timing``: device time with the L2 defeated, and the device-copy ceiling (torch, GPU);
* ``peers``: the implementations under test (cake_cute, torch, torch.compile, Liger, quack);
* ``runner``: one row, and the sweep over a grid;
* ``cli``: the arguments and ``main``.

The method is described in ``benchmarks/README.md``.
"""
