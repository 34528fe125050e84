"""A tiny Hugging Face GPT-2 (built from a config: no download), its LM head tied to the token
embedding, trained pipelined by pipeir:

    pipeirc run --schedule 1f1b --ranks 2 --microbatches 4 --model examples/hf_gpt2.py

The tie is found from the module (one Parameter under two names) and kept: the copies on the
first and last stage get one gradient and stay equal. `--model examples/hf_gpt2.py:untied`
trains the untied variant. `HF_GPT2_WEIGHTS=gpt2.pt` starts from an unsplit state_dict. Needs
`pip install 'pipeir[hf]'`.
"""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from pipeir.models import ModuleSpec


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def spec(tied: bool = True) -> ModuleSpec:
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0,
                        tie_word_embeddings=tied)
    return ModuleSpec(module=lambda: GPT2LMHeadModel(config), batch=batch, loss=loss,
                      example=batch(0)[0][:2], weights=os.environ.get("HF_GPT2_WEIGHTS"))


def untied() -> ModuleSpec:
    return spec(tied=False)
