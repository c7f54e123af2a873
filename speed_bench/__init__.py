"""End-to-end HellaSwag scoring speed: Nakta's engines against llama_org and HF transformers.

CLIs: ``run_all`` (every engine), ``nakta_speed`` / ``llama_speed`` / ``hf_speed`` (one family
each), ``lm_eval_speed`` (lm-eval itself, hf vs nakta), ``scaling`` (multi-GPU runs compared).
Public modules, also used by ``model_profile``: ``engines`` (what an engine is, which exist,
``make_engine``), ``weights`` (one set of weights for every engine) and ``workload`` (the
requests they score).
"""
