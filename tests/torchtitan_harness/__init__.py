"""What torchtitan's trainer needs to run on a CPU-only machine, kept out of the package: a CPU launcher
(``launch``), the llama3 and Qwen3.5 debug configs with dense attention and a local token dataset
(``config_registry``), the CPU settings (``cpu``) and a driver that runs them and compares loss curves
(``runs``)."""
