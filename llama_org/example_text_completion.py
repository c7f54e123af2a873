"""Complete prompts with the reference model, like Meta's ``example_text_completion.py``.

    torchrun --nproc_per_node <n shards> -m llama_org.example_text_completion \
        --ckpt_dir CKPT --tokenizer_path tokenizer.model [--prompt "Once upon a time"]...

A 1-shard checkpoint also runs with plain ``python -m``. Greedy with ``--temperature 0``.
"""

from __future__ import annotations

import argparse

import fairscale.nn.model_parallel.initialize as fs_init
import torch

from llama_org.distributed import shutdown
from llama_org.generation import Llama

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt_dir", required=True, help="folder with consolidated.*.pth + params.json")
    p.add_argument("--tokenizer_path", required=True, help="sentencepiece tokenizer.model")
    p.add_argument("--prompt", action="append", help="repeat for a batch (default: 2 examples)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top_p", type=float, default=0.9)
    p.add_argument("--max_seq_len", type=int, default=128)
    p.add_argument("--max_gen_len", type=int, default=64)
    p.add_argument("--max_batch_size", type=int, default=4)
    p.add_argument("--device", default=None, help="default: this rank's GPU if any, else cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: fp16 on GPU")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    prompts = args.prompt or ["Once upon a time", "The little dog"]
    generator = Llama.build(
        ckpt_dir=args.ckpt_dir,
        tokenizer_path=args.tokenizer_path,
        max_seq_len=args.max_seq_len,
        max_batch_size=max(args.max_batch_size, len(prompts)),
        device=args.device,
        dtype=_DTYPES[args.dtype] if args.dtype else None,
        seed=args.seed,
    )
    results = generator.text_completion(
        prompts,
        max_gen_len=args.max_gen_len,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    if fs_init.get_model_parallel_rank() == 0:
        for prompt, result in zip(prompts, results):
            print(prompt)
            print(f"> {result['generation']}")
            print("\n==================================\n")
    return [r["generation"] for r in results]


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
