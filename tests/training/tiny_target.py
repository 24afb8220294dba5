"""A tiny random Llama saved as a Hugging Face directory, with a character-level chat tokenizer.

Everything the training pipeline does to SmolLM2 (load_model, chat template, datagen, cache, train) runs on it
in milliseconds per forward.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

import torch

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,!?+-=:'\n")
VOCAB = 96


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS[:2])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>",
                                   pad_token="<|im_end|>", chat_template=TEMPLATE)


FAMILY_EXTRAS = {  # what each family needs beyond the shared shape
    "llama": {},
    "qwen2": {},  # q/k/v biases
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=30.0),
}


def make_target_dir(path: Path, seed: int = 0, layers: int = 3, family: str = "llama") -> Path:
    """Write config.json + model.safetensors + tokenizer files; `load_model(str(path))` then works."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(model_type=family, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                  rope_theta=10000.0, eos_token_id=1, bos_token_id=0, **FAMILY_EXTRAS[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger logits: a peaked, less uniform random target
        model.model.embed_tokens.weight.mul_(4)
    model.save_pretrained(str(path))
    make_tokenizer().save_pretrained(str(path))
    return path


def write_prompts(path: Path, n: int, bad_lines: dict[int, str] | None = None) -> Path:
    lines = []
    for i in range(n):
        turns = [f"say {i} please", f"and now {i + 1}?"] if i % 3 == 0 else [f"count to {i}"]
        lines.append(json.dumps({"turns": turns, "source": "test"}))
    for number, text in (bad_lines or {}).items():
        lines.insert(number - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def random_dataset(path: Path, n: int, seed: int = 0, vocab: int = VOCAB, lengths=(20, 60)) -> Path:
    """Pre-tokenised sequences: a prompt part (mask 0) then one or two assistant spans (mask 1)."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = int(torch.randint(*lengths, (1,), generator=g))
            ids = torch.randint(2, vocab - 1, (length,), generator=g).tolist()
            start = int(torch.randint(2, length // 2, (1,), generator=g))
            mask = [0] * start + [1] * (length - start)
            if length > 40:  # a second user turn inside: a masked gap
                mask[start + 10: start + 14] = [0] * 4
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return path
