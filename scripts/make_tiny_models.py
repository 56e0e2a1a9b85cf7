"""Build the tiny models the end-to-end tests serve, offline and reproducibly.

Each model gets a byte-level BPE tokenizer trained on fixed, generated text and random
weights from a fixed seed, and is saved as a Hugging Face folder that ``vllm serve`` and
``AutoTokenizer`` load without network access. A folder is reused when its stamp (a hash of
the recipe) matches, so a second call takes milliseconds.

    .venv/bin/python scripts/make_tiny_models.py [--out .cache/models] [NAME ...]

Names: ``llama`` (GQA), ``llama-hd16`` (same but another head size, for the mismatch test),
``llama-swa`` (full + sliding-window layers), ``deepseek-v2`` (MLA). Settings (see
docs/vllm.md): the CPU MLA kernel takes only a latent of 512+64, and float32 with weights
from N(0, 0.2) keeps greedy decoding free of near-ties.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "ModelRecipe", "build_model", "default_out_dir", "main"]

_RECIPE_VERSION = 1
_VOCAB_SIZE = 2048
_WEIGHT_STD = 0.2


@dataclass(frozen=True, kw_only=True)
class ModelRecipe:
    """What one tiny model is: its architecture, its config and its weight seed."""

    name: str
    architecture: str
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


_LLAMA = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

MODELS: dict[str, ModelRecipe] = {
    "llama": ModelRecipe(name="llama", architecture="LlamaForCausalLM", config=_LLAMA, seed=1234),
    # Same hidden size and layer count, another KV head size: a decode server of this model
    # paired with a prefill server of "llama" must be refused at the handshake.
    "llama-hd16": ModelRecipe(
        name="llama-hd16",
        architecture="LlamaForCausalLM",
        config={**_LLAMA, "num_attention_heads": 8, "head_dim": 16},
        seed=1234,
    ),
    # One KV head (MQA): at TP 2 each rank holds a replica of it (issue 47's pairs of
    # other TP sizes on real servers).
    "llama-kv1": ModelRecipe(
        name="llama-kv1",
        architecture="LlamaForCausalLM",
        config={**_LLAMA, "num_key_value_heads": 1},
        seed=1234,
    ),
    # Hybrid: layer 0 full attention, layer 1 a 64-token sliding window (vLLM's Llama
    # reads `layer_types`), so vLLM builds a full and a sliding-window cache group.
    "llama-swa": ModelRecipe(
        name="llama-swa",
        architecture="LlamaForCausalLM",
        config={
            **_LLAMA,
            "layer_types": ["full_attention", "sliding_attention"],
            "sliding_window": 64,
        },
        seed=1234,
    ),
    # Hybrid state model (Mamba2 + attention + MLP, NemotronH's "M*-"): one Mamba2 layer
    # (8 heads of 32, state 16, one group), one GQA attention layer, one dense MLP layer.
    # vLLM gives it a Mamba state cache group beside the attention group.
    "nemotron-h": ModelRecipe(
        name="nemotron-h",
        architecture="NemotronHForCausalLM",
        config={
            "hidden_size": 128,
            "intermediate_size": 256,
            "layers_block_type": ["linear_attention", "full_attention", "mlp"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "mlp_hidden_act": "relu2",
            "ssm_state_size": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 32,
            "n_groups": 1,
            "conv_kernel": 4,
            "expand": 2,
            "chunk_size": 128,
            "max_position_embeddings": 1024,
            "layer_norm_epsilon": 1e-6,
            "tie_word_embeddings": False,
        },
        seed=2424,
    ),
    "deepseek-v2": ModelRecipe(
        name="deepseek-v2",
        architecture="DeepseekV2ForCausalLM",
        config={
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            # Dense layers only: no MoE kernels on the CPU path.
            "first_k_dense_replace": 2,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
        seed=4321,
    ),
}


def default_out_dir() -> Path:
    """``<repo>/.cache/models`` (git-ignored)."""
    return Path(__file__).resolve().parent.parent / ".cache" / "models"


_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have "
    "not they which one you had but all their there can has more were been when will "
    "data model cache block token layer head value key prefill decode server request "
    "transfer memory page state window ring latent attention tensor vector python code "
    "def return class import if else for while yield lambda none true false self list "
    "dict set tuple string number zero one two three four five six seven eight nine ten "
    "quick brown fox jumps over lazy dog hello world once upon a time story river city"
)


def _corpus(seed: int = 7, lines: int = 6000) -> Iterator[str]:
    """Deterministic English-like text: tokenizer training must not depend on the host."""
    rng = random.Random(seed)
    words = _WORDS.split()
    punct = [".", ",", "!", "?", ":", ";", " -", " (", ")", "\n"]
    for _ in range(lines):
        n = rng.randint(4, 18)
        parts = []
        for _ in range(n):
            w = rng.choice(words)
            if rng.random() < 0.1:
                w = w.capitalize()
            if rng.random() < 0.05:
                w = str(rng.randint(0, 9999))
            parts.append(w)
            if rng.random() < 0.08:
                parts.append(rng.choice(punct))
        yield " ".join(parts) + rng.choice([".", "!", "?", ""])


def _stamp(recipe: ModelRecipe) -> str:
    payload = json.dumps(
        {"v": _RECIPE_VERSION, "vocab": _VOCAB_SIZE, "std": _WEIGHT_STD, **asdict(recipe)},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _train_tokenizer(folder: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1024,
    )
    fast.save_pretrained(folder)
    return int(tok.get_vocab_size())


def build_model(recipe: ModelRecipe, out_dir: Path) -> Path:
    """Build ``recipe`` into ``out_dir/<name>`` unless an identical build is there."""
    target = out_dir / recipe.name
    stamp = _stamp(recipe)
    stamp_file = target / ".recipe"
    if stamp_file.is_file() and stamp_file.read_text() == stamp:
        return target

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{recipe.name}.", dir=out_dir))
    try:
        vocab = _train_tokenizer(tmp)
        config_cls: Callable[..., Any] = getattr(
            transformers, recipe.architecture.replace("ForCausalLM", "Config")
        )
        config = config_cls(
            vocab_size=vocab,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
            dtype="float32",
            **recipe.config,
        )
        model_cls = getattr(transformers, recipe.architecture)
        torch.manual_seed(recipe.seed)
        model = model_cls(config)
        gen = torch.Generator().manual_seed(recipe.seed)
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                # Matrices N(0, std) so greedy outputs depend on the prompt with clear
                # margins; norms stay at 1 (random norm weights only add noise).
                if param.dim() >= 2:
                    param.copy_(torch.randn(param.shape, generator=gen) * _WEIGHT_STD)
                elif "norm" in name:
                    param.fill_(1.0)
        model.to(torch.float32).save_pretrained(tmp, safe_serialization=True)
        (tmp / ".recipe").write_text(stamp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=default_out_dir())
    parser.add_argument("names", nargs="*", default=sorted(MODELS))
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    for name in args.names:
        print(build_model(MODELS[name], args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
