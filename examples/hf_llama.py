"""A tiny Hugging Face Llama (built from a config: no download) trained pipelined by pipeir:

    pipeirc run --schedule 1f1b --ranks 2 --microbatches 4 --model examples/hf_llama.py

`causal_lm` trains the unsplit `LlamaForCausalLM` on random tokens with next-token
cross-entropy; pipeir cuts it evenly over its decoder layers for the schedule's stage count
(torch's tracer, as `torch.distributed.pipelining.pipeline` does), with the parameter names of
the unsplit model. The trace keeps one micro-batch's shapes: batch(0) cut into 4 (a run with
other micro-batch counts is refused before it starts). `HF_LLAMA_WEIGHTS=llama.pt` (or
`.safetensors`) starts from an unsplit state_dict; `pipeirc export-weights` writes a `--save`
checkpoint back as one. Needs `pip install 'pipeir[hf]'`.

The optimizer is `ModuleSpec`'s default, SGD: with AdamW, a gradient that is zero in exact
arithmetic is all rounding noise of the summation order, and AdamW divides it by its own
root mean square, so that noise becomes steps of the learning rate (1.7e-4 apart after two
steps); runs would no longer match single-process training within 1e-5. SGD keeps the
noise at its own size.
"""

import os

from transformers import LlamaConfig, LlamaForCausalLM

from pipeir.models import ModuleSpec, causal_lm

CONFIG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)


def spec() -> ModuleSpec:
    return causal_lm(lambda: LlamaForCausalLM(CONFIG), vocab=CONFIG.vocab_size,
                     weights=os.environ.get("HF_LLAMA_WEIGHTS"))
