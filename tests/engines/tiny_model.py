"""Make the tiny random-weights Llama that the real-engine tests serve (no hub, no download).

Run with the engine environment's interpreter (it has torch, transformers and tokenizers):

    ENGINE_PYTHON -m tests.engines.tiny_model OUT_DIR

A 2-layer Llama, hidden 128, 2 attention heads (head_dim 64: vLLM's CPU attention kernels
refuse head_dim 16), 512-token byte-level BPE tokenizer trained on this repository's own
text, saved with `save_pretrained` (~300 KB after safetensors). The weights are random
(seeded): the model's output is nonsense, but every token of it goes through vLLM's real
scheduler, KV cache, EngineCore and Worker - which is what a supervisor test needs.

The directory is complete only when its marker file exists; a half-written one is redone.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# Bump when the model's shape or tokenizer changes: the cache directory name carries it.
MODEL_VERSION = "tiny-llama-v1"
MARKER = ".omnid-complete"
REPO = Path(__file__).resolve().parents[2]
VOCAB = 512
CONTEXT = 1024


def corpus() -> list[str]:
    """Local text to train the tokenizer on: the repository's own docs and sources, in a
    fixed order (a byte-level BPE covers any input, so the corpus only shapes the merges)."""
    files = sorted(REPO.glob("*.md")) + sorted((REPO / "man").glob("*")) + sorted((REPO / "omnid").rglob("*.py"))
    return [p.read_text(errors="replace") for p in files if p.is_file()]


def make(out: Path) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (out / MARKER).exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                  model_max_length=CONTEXT)
    # A chat template, so /v1/chat/completions works as well as /v1/completions.
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(tmp)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=True, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / MARKER).write_text(MODEL_VERSION + "\n")
    # Another maker may have finished first: keep its copy.
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (out / MARKER).exists():
        raise RuntimeError(f"{out}: model directory incomplete after making it")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    if out.exists() and not (out / MARKER).exists():
        shutil.rmtree(out)  # a half-made one from an interrupted run
    print(make(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
