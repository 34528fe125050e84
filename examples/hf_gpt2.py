"""A tiny Hugging Face GPT-2 (built from a config: no download), its LM head tied to the token
embedding, trained pipelined by pipeir:

    pipeirc run --schedule 1f1b --ranks 2 --microbatches 4 --model examples/hf_gpt2.py

`causal_lm` trains the unsplit `GPT2LMHeadModel` on random tokens with next-token
cross-entropy, cut by torch's tracer for one of 4 micro-batches of batch(0). The tie is found
from the module (one Parameter under two names) and kept: the copies on the first and last
stage get one gradient and stay equal. `--model examples/hf_gpt2.py:untied` trains the untied
variant. `HF_GPT2_WEIGHTS=gpt2.pt` starts from an unsplit state_dict. Needs
`pip install 'pipeir[hf]'`.

The optimizer is `ModuleSpec`'s default, SGD: the key slice of GPT-2's fused qkv bias has a
zero gradient in exact arithmetic (softmax ignores a shift of all scores), so its gradient is
rounding noise of the summation order, which AdamW divides by its own root mean square into
steps of the learning rate; SGD keeps the noise at its own size, and the run matches
single-process training within 1e-5.
"""

import os

from transformers import GPT2Config, GPT2LMHeadModel

from pipeir.models import ModuleSpec, causal_lm


def spec(tied: bool = True) -> ModuleSpec:
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    return causal_lm(lambda: GPT2LMHeadModel(config), vocab=config.vocab_size,
                     weights=os.environ.get("HF_GPT2_WEIGHTS"))


def untied() -> ModuleSpec:
    return spec(tied=False)
