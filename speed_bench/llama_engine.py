"""``llama_org`` engine: Meta's LLaMA code as Meta runs it, scored like every other engine.

Meta's ``Transformer.forward(tokens, start_pos=0)`` on right-padded batches, logits for every
position in fp32, scored through ``nakta_model.scoring.score_with_forward`` (same requests,
batching, token budget and log-prob gather as Nakta's plain path).

One adaptation, memory only: Meta preallocates a KV cache of ``max_batch_size x max_seq_len``
per layer. Under a token budget the batches have many short rows or few long ones, and a cache
rectangle covering both (~1,000 rows x ~180 tokens for HellaSwag) would not fit on a GPU
beside a 7B model. So each layer's cache is one flat buffer of ``token_budget`` tokens, viewed
as exactly ``[rows, width]`` for each batch. Meta's forward still writes K/V into the cache and
reads them back from it, so the work is Meta's; only the unused rectangle is gone.

Under ``torchrun`` llama_org runs as Meta runs it: fairscale model parallel over the whole world
(MP = world size), each rank holding its fairscale shard of the same weights (the unsplit Meta
tensors cut on ``meta_split_dim``, one tensor at a time), every rank scoring every request.

The engine only; ``llama_speed.py`` is the command that times it (``run_all`` with these
engines).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speed_bench.engine_api import Engine, EngineConfig
from speed_bench.weights import WeightSource
from speed_bench.workload import Request


class LlamaOrgEngine(Engine):
    name = "llama_org"

    def __init__(self, weights: WeightSource, cfg: EngineConfig):
        import fairscale.nn.model_parallel.initialize as fs_init

        from llama_org.distributed import init_distributed, init_model_parallel
        from llama_org.generation import Llama

        self.cfg = cfg
        self._own_mp = not fs_init.model_parallel_is_initialized()  # ours to tear down
        init_model_parallel(init_distributed(cfg.device))  # Meta: MP = world size
        meta = weights.meta_shard_state_dict(
            cfg.device,
            cfg.dtype,
            fs_init.get_model_parallel_rank(),
            fs_init.get_model_parallel_world_size(),
        )
        llama = Llama.from_state_dict(
            weights.args.to_meta_params(),
            meta,
            max_seq_len=cfg.max_length,
            max_batch_size=1,  # real cache set below
            device=cfg.device,
            dtype=cfg.dtype,
        )
        del meta
        self.model = llama.model
        slots = max(cfg.token_budget, cfg.max_length)
        self.model.params.max_batch_size = slots  # rows are bounded by the token budget
        self._caches = []
        for layer in self.model.layers:
            a = layer.attention
            shape = (slots, a.n_local_kv_heads, a.head_dim)
            k = torch.empty(shape, device=cfg.device, dtype=cfg.dtype)
            v = torch.empty(shape, device=cfg.device, dtype=cfg.dtype)
            self._caches.append((a, k, v))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        for a, k, v in self._caches:
            a.cache_k = k[: b * s].view(b, s, *k.shape[1:])
            a.cache_v = v[: b * s].view(b, s, *v.shape[1:])
        return self.model(tokens, 0)

    def score(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        return self.score_plain(self.forward, requests, self.cfg, self.model.params.vocab_size)

    def close(self) -> None:
        self.model = None
        self._caches = []
        if self._own_mp:  # the model-parallel groups, and the process group if llama_org made it
            from llama_org.distributed import shutdown

            shutdown()
