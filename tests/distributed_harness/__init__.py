"""The distributed matrix the tests and the two-GPU runs share, kept out of the package: a Llama-style
model with the parallel plans (``model``), the cases (``matrix``, one process per rank under torchrun),
the same cases with two ranks on one device (``one_gpu``) and the process-group and results plumbing
(``launch``). Run from the repository root as modules, e.g.
``torchrun --nproc_per_node=2 -m tests.distributed_harness.matrix --device cpu --small --out DIR``."""
