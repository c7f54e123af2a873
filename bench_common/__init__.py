"""Measurement helpers shared by kernel_benchmark/, speed_bench/ and model_profile/: timers
(``timing``), device ceilings measured in the same run (``ceilings``) and atomic result files
(``report``). They live outside ``nakta_model``: a user of the model never imports them, and
``nakta_model`` never imports this package."""
