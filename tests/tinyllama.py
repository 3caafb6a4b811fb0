"""The tiny random Llama that kvtier's transformers tests and guest
benchmark decode with: built from a config only (nothing is downloaded),
fixed seed, 4 layers, hidden 128, 4 KV heads of 32, fp32 (1 KiB of K+V per
token per layer), and an init range wide enough that greedy decoding does
not settle on one token. Imports torch and transformers: callers that may
run without them import this module only after checking."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(prompt_len: int, max_positions: int = 256):
    """(model in eval mode, a (1, prompt_len) prompt of token ids)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_positions,
                      initializer_range=0.3)
    model = LlamaForCausalLM(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    return model, prompt
