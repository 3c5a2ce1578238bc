"""Tiny random causal LMs with a real byte-level BPE tokenizer, built locally for fast tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the key value cache in fixed size blocks.",
    "Continuous batching schedules every iteration and admits new requests at once.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Modelyard serves many named language models from one machine.",
    "你好，世界。今天天气很好。我们一起学习语言模型。",
    "def main():\n    print('hello')\n    return 0\n",
    "1234567890 + - * / = < > ( ) [ ] { } : ; , . ! ?",
]


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on a small fixed corpus (deterministic, no download)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_llama(
    path: Path,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 1024,
) -> Path:
    """A Llama with grouped-query attention, by default 2 layers of 4 query heads on 2 KV
    heads; the keywords make a wider one."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    _scale_up_logits(model)
    return _save(model, tokenizer, path)


def build_tiny_sliding(path: Path, seed: int = 0) -> Path:
    """A 4-layer Gemma2: alternating sliding-window (window 8) and full layers, GQA, soft-capping,
    head_dim 24 (not a power of two)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        sliding_window=8,
        max_position_embeddings=1024,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=24,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Gemma2ForCausalLM(config)
    _scale_up_logits(model)
    return _save(model, tokenizer, path)


def _scale_up_logits(model: PreTrainedModel) -> None:
    """Random init gives near-uniform logits, where fp32 summation order flips greedy ties.
    Sharper output weights make the argmax well separated, so token-for-token comparisons against
    transformers test the engine's arithmetic rather than rounding noise."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)


GEMMA3_SLIDING_WINDOW = 12  # not a multiple of the engine's 16-token blocks


def build_tiny_gemma3(
    path: Path,
    seed: int = 0,
    *,
    attn_logit_softcapping: float | None = None,
    final_logit_softcapping: float | None = None,
) -> Path:
    """A 3-layer Gemma 3 text model shaped like Gemma 3 270M where it matters to the engine:
    sliding-window layers (window 12) before a global one with its own rotary base, one KV head,
    head_dim 256 (4x hidden / heads), tied embeddings scaled by sqrt(hidden), q/k norms, pre/post
    feed-forward norms, gelu_tanh. The soft caps go into the config as given; 270M leaves both
    unset, and transformers' Gemma 3 applies only the final one."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=GEMMA3_SLIDING_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        attn_logit_softcapping=attn_logit_softcapping,
        final_logit_softcapping=final_logit_softcapping,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Gemma3ForCausalLM(config)
    _randomise_norms(model, mean=0.0)  # Gemma's norms scale by (1 + weight), initialised at 0
    # Sharper logits from the final norm: the tied lm_head is the embedding, and scaling it up
    # would scale the inputs too, until the model mostly echoed its last token.
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.copy_(8.0 * (1.0 + norm) - 1.0)
    return _save(model, tokenizer, path)


def _two_layers(tokenizer: PreTrainedTokenizerFast, **overrides: object) -> dict[str, object]:
    """The config the 2-layer tiny models share (GQA: 4 query heads over 2 KV heads, untied
    embeddings), with ``overrides``."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
        **overrides,
    }


def build_tiny_qwen3(path: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3: GQA with per-head q/k RMSNorms (randomised, so that they count) before
    rope, head_dim 32 set apart from hidden / heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3Config(**_two_layers(tokenizer, head_dim=32))
    model = Qwen3ForCausalLM(config)
    _randomise_norms(model, mean=1.0)
    _scale_up_logits(model)
    return _save(model, tokenizer, path)


def build_tiny_qwen2(path: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2: GQA with q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(**_two_layers(tokenizer))
    model = Qwen2ForCausalLM(config)
    # initialised at 0: make them count (at the weights' scale: at 0.5 every prompt gave one token)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, config.initializer_range)
    _scale_up_logits(model)
    return _save(model, tokenizer, path)


SLIDING_WINDOW = 8  # Mistral's and Phi-3's (from the config, every layer): shorter than prompts


def build_tiny_mistral(path: Path, seed: int = 0) -> Path:
    """A 2-layer Mistral, GQA, with a sliding window of 8 on every layer."""
    from transformers import MistralConfig, MistralForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = MistralConfig(**_two_layers(tokenizer, sliding_window=SLIDING_WINDOW))
    model = MistralForCausalLM(config)
    _scale_up_logits(model)
    return _save(model, tokenizer, path)


def build_tiny_phi3(path: Path, seed: int = 0, *, partial_rotary_factor: float = 1.0) -> Path:
    """A 2-layer Phi-3: its own fused qkv_proj and [gate; up] gate_up_proj, GQA, a sliding window
    of 8 on every layer; rotary over ``partial_rotary_factor`` of each head."""
    from transformers import Phi3Config, Phi3ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Phi3Config(
        **_two_layers(
            tokenizer,
            original_max_position_embeddings=1024,
            sliding_window=SLIDING_WINDOW,
            partial_rotary_factor=partial_rotary_factor,
        )
    )
    model = Phi3ForCausalLM(config)
    _scale_up_logits(model)
    return _save(model, tokenizer, path)


def _randomise_norms(model: PreTrainedModel, mean: float) -> None:
    """Norm weights around ``mean`` (they initialise to a constant, which hides a norm applied
    with the wrong weight)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(mean, 0.5)


def tiny_engine_entry(source: Path, max_num_seqs: int = 4) -> dict[str, object]:
    """The models.yaml keys of a local model served from a tiny model at ``source``: on the CPU,
    256 tokens a sequence, 16 MiB of KV cache, one thread (tests and benchmarks that run several
    engines on 2 cores)."""
    return {
        "source": str(source),
        "device": "cpu",
        "max_model_len": 256,
        "max_num_seqs": max_num_seqs,
        "kv_cache_memory": "16MiB",
        "engine_args": ["--num-threads", "1"],
    }
