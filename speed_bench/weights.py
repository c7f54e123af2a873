"""One set of weights for every engine: a checkpoint folder (Nakta, Meta or HF) or seeded
random weights.

Every engine is built from the SAME unsplit Meta-format state dict (Meta's key names), so the
engines differ only in how they compute. To bound GPU memory, the benchmark builds one engine
at a time and asks for a fresh state dict each time: random weights are regenerated on the
device from per-tensor seeds (bit-identical every time, ~13.5 GB for 7B in bf16 made in well
under a second), a checkpoint is opened once on the host and copied to the device.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from nakta_model.config import ModelArgs, preset
from nakta_model.layout import meta_shapes, meta_split_dim
from nakta_model.sources import Source, open_checkpoint

StateDict = dict[str, torch.Tensor]


def matmul_params(args: ModelArgs) -> tuple[int, int]:
    """(block matmul parameters, LM-head parameters): the weights every token multiplies.

    Embedding lookups and norms are not matmuls and are left out, as is attention's
    ``q @ k^T`` / ``p @ v`` work (small at HellaSwag lengths; kernel_benchmark counts it).
    """
    d, f = args.dim, args.hidden_dim
    attn = d * args.qkv_dim + args.n_heads * args.head_dim * d
    return args.n_layers * (attn + 3 * d * f), args.vocab_size * d


class WeightSource:
    """Hands out a fresh unsplit Meta state dict on a device, as often as engines need one."""

    def __init__(self, args: ModelArgs, name: str):
        self.args, self.name = args, name

    def state_dict(self, device: torch.device, dtype: torch.dtype) -> StateDict:
        raise NotImplementedError

    def tensor(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """One unsplit Meta tensor, equal to ``state_dict(...)[name]``: lets a tensor-parallel
        rank build its shard one tensor at a time instead of holding the whole model first."""
        raise NotImplementedError

    def source(self, device: torch.device, dtype: torch.dtype) -> Source:
        """These weights as a ``nakta_model.sources.Source``: what ``nakta_model.load`` builds a
        rank's Nakta shard from, one Meta tensor at a time (made on ``device`` in ``dtype``)."""
        return Source(
            args=self.args,
            get=lambda name: self.tensor(name, device, dtype),
            dtype=dtype,
            description=f"speed_bench weights {self.name}",
        )

    def meta_shard(
        self, name: str, device: torch.device, dtype: torch.dtype, rank: int, size: int
    ) -> torch.Tensor:
        """Model-parallel rank ``rank`` of ``size``'s piece of Meta tensor ``name``, split as
        Meta's fairscale layers split it (``meta_split_dim``; norms whole). A copy of its own,
        so the unsplit tensor is freed: an MP rank holds its shard plus one unsplit tensor."""
        t = self.tensor(name, device, dtype)
        dim = meta_split_dim(name)
        if size == 1 or dim is None:
            return t
        if t.shape[dim] % size:
            raise ValueError(
                f"{name}: dim {dim} of shape {tuple(t.shape)} does not split into {size} shards"
            )
        return t.chunk(size, dim)[rank].clone(memory_format=torch.contiguous_format)

    def meta_shard_state_dict(
        self, device: torch.device, dtype: torch.dtype, rank: int, size: int
    ) -> StateDict:
        """Every tensor's :meth:`meta_shard`: what ``consolidated.0<rank>.pth`` of an MP=``size``
        checkpoint of these weights holds."""
        return {n: self.meta_shard(n, device, dtype, rank, size) for n in meta_shapes(self.args)}


class RandomWeights(WeightSource):
    """Seeded random weights drawn directly on the device (never on the host).

    Scale as ``nakta_model.random_model``: matrices ~ N(0, 1/fan_in), residual projections
    (``wo``, ``w2``) further scaled by 1/sqrt(2 n_layers), embeddings ~ N(0, 1), norms 1, so
    activations stay finite through 80 layers in bf16. Each tensor has its own generator seed,
    so the result does not depend on the order tensors are drawn in.
    """

    def __init__(self, args: ModelArgs, name: str, seed: int = 0):
        super().__init__(args, name)
        self.seed = seed
        self._shapes = meta_shapes(args)
        self._index = {n: i for i, n in enumerate(self._shapes)}

    def state_dict(self, device: torch.device, dtype: torch.dtype) -> StateDict:
        return {name: self.tensor(name, device, dtype) for name in self._shapes}

    def tensor(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(f"{name!r} is not a Meta tensor name of this model")
        if name == "output.weight" and self.args.tie_word_embeddings:
            return self.tensor("tok_embeddings.weight", device, dtype)  # a tied head
        shape = self._shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=dtype, device=device)
        kind = name.split(".")[-2]
        std = 1.0 if kind == "tok_embeddings" else shape[1] ** -0.5
        if kind in ("wo", "w2"):
            std *= 1.0 / math.sqrt(2 * self.args.n_layers)
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed * 1_000_003 + self._index[name])
        t = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        return t.mul_(std)


class CheckpointWeights(WeightSource):
    """A Nakta, Meta or HF checkpoint folder (``nakta_model.sources.open_checkpoint``), handed
    to every engine as the same unsplit Meta tensors: Meta and HF files memory-mapped (HF's q/k
    rows un-permuted), a Nakta checkpoint's shards read once, checked against its manifest, and
    each Meta tensor cut back out of the fused ones. Each engine gets its own device copy, in
    the layout it needs (``hf_engine`` permutes back to HF's). ``tokenizer``: the checkpoint's
    own sentencepiece model, or None."""

    def __init__(self, ckpt_dir: str | Path, verify: str | bool = "fast"):
        source = open_checkpoint(ckpt_dir, verify)
        super().__init__(source.args, Path(ckpt_dir).name)
        self._source = source
        self.tokenizer = source.tokenizer
        self.description = source.description

    def state_dict(self, device: torch.device, dtype: torch.dtype) -> StateDict:
        return {k: self.tensor(k, device, dtype) for k in meta_shapes(self.args)}

    def tensor(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self._source.get(name).to(device=device, dtype=dtype, non_blocking=True)


def weight_source(
    preset_name: str | None, checkpoint: str | Path | None, seed: int = 0
) -> WeightSource:
    if checkpoint is not None:
        return CheckpointWeights(checkpoint)
    if preset_name is None:
        raise ValueError("give --preset or --checkpoint")
    return RandomWeights(preset(preset_name), f"random-{preset_name}", seed)
