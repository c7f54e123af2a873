"""End-to-end HellaSwag scoring speed: Nakta's engines against llama_org and HF transformers.

CLIs: ``run_all`` (every engine), ``nakta_speed`` / ``llama_speed`` / ``hf_speed`` (one family
each), ``lm_eval_speed`` (lm-eval itself, hf vs nakta), ``lm_eval_gsm8k`` (lm-eval's
``generate_until`` on the full GSM8K-shaped task, hf vs nakta), ``scaling`` (multi-GPU runs compared),
``throughput`` (generation of many requests: nakta / hf / llama_org, its engines in
``throughput_engines``).
Public modules, also used by ``model_profile``: ``engines`` (what an engine is, which exist,
``make_engine``), ``weights`` (one set of weights for every engine: random, or a Nakta, Meta or
HF checkpoint) and ``workload`` (the requests they score). Below them: ``engine_api`` and the
engines themselves (``nakta_engine``, ``llama_engine``, ``hf_engine``); the scripts import the
engines, never the reverse.
"""
