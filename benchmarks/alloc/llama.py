"""The Llama-style model both model benchmarks run (bench_llama.py, bench_decode_graphs.py):
transformers' LlamaForCausalLM from a config (hidden 2048, 16 heads, 8 KV heads), random bf16
weights, and the flags that shape it and its input."""

from __future__ import annotations

import argparse


def model_flags(parser: argparse.ArgumentParser, layers: int) -> None:
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)


def llama_config(layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                       max_position_embeddings=4096)


def llama_model(config):
    """The model on the GPU, its weights drawn from torch's generator as seeded by the caller."""
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()
