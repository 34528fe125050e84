"""A tiny Hugging Face Llama (built from a config: no download) trained pipelined by pipeir:

    pipeirc run --schedule 1f1b --ranks 2 --microbatches 4 --model examples/hf_llama.py

pipeir cuts the unsplit `LlamaForCausalLM` evenly over its decoder layers for the schedule's
stage count (torch's tracer, as `torch.distributed.pipelining.pipeline` does), with the
parameter names of the unsplit model. `HF_LLAMA_WEIGHTS=llama.pt` (or `.safetensors`) starts from an
unsplit state_dict; `pipeirc export-weights` writes a `--save` checkpoint back as one.
Needs `pip install 'pipeir[hf]'`.
"""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeir.models import ModuleSpec

CONFIG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def spec() -> ModuleSpec:
    return ModuleSpec(module=lambda: LlamaForCausalLM(CONFIG), batch=batch, loss=loss,
                      example=batch(0)[0][:2], weights=os.environ.get("HF_LLAMA_WEIGHTS"))
