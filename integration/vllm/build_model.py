"""Builds the tiny model the real-vLLM suite and bench serve: a
Llama-architecture model with random weights, a byte-level BPE tokenizer
and a Llama-3-style chat template with special tokens, as real models
have. Deterministic: fixed seeds, and a tokenizer corpus generated here
from a seeded generator, so every machine builds the same files (the
suite checks the tokenizer's digest). Nothing is downloaded.

    python build_model.py OUT_DIR [--hidden 128 --layers 2 --heads 4]

Beside the model, OUT_DIR/lora-0 ... lora-9: ten LoRA adapters of rank 8
on the attention's q and v projections (PEFT's layout, random weights),
for adapter routing on real vLLM (`--enable-lora --lora-modules`): the
bench's LoRA workload asks for all ten, the suite for two.

vLLM's CPU attention needs a head size of 32, 64, 80, ...: hidden /
heads = 32 here.
"""

import argparse
import hashlib
import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's template, as its tokenizer_config.json ships it (whitespace
# control and `| trim` included): what the filter must render as vLLM does.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
VOCAB_SIZE = 4096


def corpus(seed=0, lines=20000):
    """Text like the bench's prompts (random lowercase words, numbered
    headers) and a little prose, code and JSON, from a seeded generator."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    prose = (
        "The router sends each request to the pod that holds its prefix. "
        "You are a careful assistant working inside a code repository. "
        "def main():\n    return {\"status\": 200, \"tokens\": [1, 2, 3]}\n"
        "Summarise the conversation so far, then answer the last question.\n"
    )
    for i in range(lines):
        if i % 10 == 0:
            yield prose
        words = [
            "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
            for _ in range(rng.randint(8, 40))
        ]
        yield f"user {rng.randint(0, 999)} turn {rng.randint(0, 99)}: " + " ".join(words)


def build_tokenizer(out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    bos = tokenizer.token_to_id(BOS)
    # As Llama 3's tokenizer: a completions prompt starts with BOS.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": "<|eot_id|>",
        "model_max_length": 16384,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": "<|eot_id|>"}, f, indent=1)
    return tokenizer


def build_model(out, tokenizer, hidden, layers, heads):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=16384,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id("<|eot_id|>"),
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


ADAPTERS = tuple(f"lora-{k}" for k in range(10))
LORA_RANK = 8


def build_lora(out, name, seed, hidden, layers):
    """One adapter in PEFT's layout: what `vllm serve --lora-modules`
    loads (adapter_config.json and adapter_model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for part, shape in (("lora_A", (LORA_RANK, hidden)), ("lora_B", (hidden, LORA_RANK))):
                weight = torch.randn(shape, generator=generator) * 0.02
                tensors[f"{prefix}.{part}.weight"] = weight.to(torch.bfloat16)
    path = os.path.join(out, name)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": out,
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tokenizer = build_tokenizer(args.out)
    build_model(args.out, tokenizer, args.hidden, args.layers, args.heads)
    for seed, name in enumerate(ADAPTERS, start=1):
        build_lora(args.out, name, seed, args.hidden, args.layers)
    with open(os.path.join(args.out, "tokenizer.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    print(f"built {args.out}: vocab {tokenizer.get_vocab_size()}, tokenizer.json sha256 {digest}")


if __name__ == "__main__":
    sys.exit(main())
