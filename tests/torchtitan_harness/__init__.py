"""What torchtitan's trainer needs to run on a CPU-only machine, kept out of the package: a CPU launcher
(``launch``), a llama3 debug config with dense attention and a local token dataset
(``config_registry``) and a driver that runs it and compares loss curves (``runs``)."""
