"""Build a small random-weight causal LM (Llama, or another architecture with ``--arch``) and a real fast
tokenizer, entirely offline.

Why: tests, benchmarks and local runs need a genuine Hugging Face checkpoint (config, safetensors weights,
``tokenizer.json``, generation config) that loads with the Auto classes, yet nothing may be downloaded. The
weights are random but deterministic for a seed, so runs are reproducible byte for byte. ``lm_head`` is
re-initialised with a large std so the top logits are well separated: greedy outputs compared token for token
against ``model.generate`` then rarely hit a near-tie. The tokenizer is a byte-level BPE trained on a corpus
generated in code, so it encodes any Unicode text losslessly and does not depend on files of the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
# A Zephyr-style chat template over the tokenizer's own special tokens: ``<s>``, then each message as
# ``<|role|>`` (plain text to this tokenizer), a newline, its content and ``</s>``, so a reply ends
# on EOS. Reusing the tokens keeps the vocabulary, and so every existing id, unchanged.
# Tools, when a request brings them, are listed in a system turn of their own, and an assistant
# turn's tool calls follow its text, each as <tool_call>{"name", "arguments"}</tool_call> (the
# layout of Hermes-style templates); ``enable_thinking: false`` closes an empty thinking in the
# generation prompt, as Qwen3's template does. A conversation without either renders as before.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>\\nTools:\\n' }}"
    "{% for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}{{ eos_token + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% for call in message.get('tool_calls', []) %}"
    "{{ '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
_MASK64 = (1 << 64) - 1
_CORPUS_SEED = 20240607  # the tokenizer is the same whatever the model seed
_CORPUS_SENTENCES = 6000


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """Architecture of one size; the field names are ``LlamaConfig`` arguments."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = 8192
    max_position_embeddings: int = 4096


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=688
    ),
    "small": ModelSize(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12, intermediate_size=3072
    ),
    # ~1.03 B parameters (TinyLlama's shape with 8 KV heads and this tokenizer's vocabulary): for GPU runs.
    "1b": ModelSize(
        hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=8, intermediate_size=5632
    ),
}
DTYPES = ("float32", "bfloat16", "float16")

# Architectures ``--arch`` builds at every size: a transformers model type, and what its config
# needs beyond the shared shape. Each exercises a feature the executor must serve exactly, or
# refuse: Qwen2's q/k/v biases, Qwen3's QK-norm and a head_dim other than hidden / heads, Mistral's
# sliding window (each layer reads only its window), Phi-3's fused projections, Gemma 2's
# soft-capped attention logits and final logits, and gpt-oss's learned attention sinks, mixture of
# experts and alternating windowed and full layers (with YaRN RoPE, its original context a 32nd).
ARCHS: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral": ("mistral", {"sliding_window": 512}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {"head_dim": 32}),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64}),
}

_GPT_OSS_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "rope_theta": 150000.0,
}

_PARAGRAPHS = """\
The river ran quietly past the old mill, where the wheel had not turned for many years. In the morning the fog
lay low over the water, and the first birds called from the reeds along the bank. A small boat was tied to a post
near the bridge; its paint was faded, but it still floated well. Children from the village came down each summer
to fish, to swim, and to tell stories about the miller who, they said, had hidden a box of silver under the floor.
Nobody ever found it. "Maybe there was never any silver," said the teacher. Science asks simple questions and
answers them with care: how fast does light travel, why is the sky blue, what makes a seed grow into a tree? In 1905
a young clerk wrote four short papers that changed physics. Numbers such as 3.14159 and 6.022e23 appear again and
again. Good code, like good writing, is clear, short and honest about what it does not know.
"""

_WORD_TEXT = """\
the a an and or but if then when while because so of to in on at by for with from into over under about after
before between through during without within against among time year day week month hour minute people person man
woman child friend family city country world house home room door window table chair book page word letter story
water fire earth air light dark sun moon star sky cloud rain snow wind tree flower river lake sea mountain road
street car train ship plane bird fish horse dog cat money market price work job company school teacher student
question answer problem idea reason example number system program computer data model network language music song
picture color red blue green yellow black white small large big little long short new old young good bad great
high low early late first last next other same different important possible real true simple hard easy quick slow
is are was were be been has have had do does did can could will would should may might must go goes went come came
make made take took see saw know knew think thought say said tell told give gave find found use used want need
look feel try leave call ask turn keep begin show hear play run move live believe bring happen write read learn
change follow stop open close walk grow carry build send fall cut reach kill remain suggest raise pass sell decide
very really also just only even still already never always often sometimes here there now today tomorrow together
"""
_SYLLABLE_TEXT = """\
ka lo mi ra ven tor sel qua bri dan eth fu gor hal ix jun kel mor nix op pra rin sto tul ur vex wyn yol zar ce
ab an ar as en er es in is on or un al el il ol am em im om um ath oth ith ung ing ang ast est ist ost
"""
_WORDS, _SYLLABLES = _WORD_TEXT.split(), _SYLLABLE_TEXT.split()


class _Rng:
    """SplitMix64: tiny, and identical on every platform and Python version (unlike ``random``'s helpers)."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def choice(self, items: list[str]) -> str:
        return items[self.below(len(items))]


def _corpus() -> list[str]:
    """Plain English paragraphs plus seeded pseudo-random sentences of real and invented words and numbers."""
    rng = _Rng(_CORPUS_SEED)
    lines = _PARAGRAPHS.splitlines()
    for _ in range(_CORPUS_SENTENCES):
        words: list[str] = []
        for _ in range(5 + rng.below(10)):
            roll = rng.below(100)
            if roll < 72:
                word = rng.choice(_WORDS)
            elif roll < 92:
                word = "".join(rng.choice(_SYLLABLES) for _ in range(1 + rng.below(4)))
                if rng.below(3) == 0:
                    word = word.capitalize()
            else:
                word = str(rng.below(10 ** (1 + rng.below(5))))
            if words and rng.below(12) == 0:
                words[-1] += rng.choice([",", ";", ":"])
            words.append(word)
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ".", ".", "!", "?"]))
    return lines


def _build_tokenizer(vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    unk, bos, eos, pad = SPECIAL_TOKENS
    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _corpus()
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, wanted {vocab_size}: corpus too small")
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )


def _build_model(
    spec: ModelSize, seed: int, bos_id: int, eos_id: int, pad_id: int, dtype: str, arch: str = "llama"
) -> PreTrainedModel:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_type, extra = ARCHS[arch]
    if model_type == "gpt_oss":  # YaRN as gpt-oss's own config sets it, scaled to this context
        original = spec.max_position_embeddings // 32
        extra = {**extra, "rope_parameters": {**_GPT_OSS_YARN, "original_max_position_embeddings": original}}
    config = AutoConfig.for_model(
        model_type,
        **dataclasses.asdict(spec),
        **extra,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype=dtype,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        model.float()
        with torch.no_grad():
            # Large logit gaps: greedy comparisons against model.generate then almost never meet a near-tie.
            model.lm_head.weight.normal_(0.0, 3.0 / math.sqrt(spec.hidden_size))
            for name, parameter in model.named_parameters():
                if name.endswith(".sinks"):  # near zero as initialised: sinks of weight, which a wrong softmax shows
                    parameter.normal_(0.0, 1.0)
    # Initialised in float32 whatever the dtype, so a bf16 model is the float32 one rounded.
    model.to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False
    )
    return model


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """``save_pretrained`` draws a tqdm bar; library code should print nothing."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def make_model(
    out: Path | str,
    size: str = "tiny",
    seed: int = 0,
    progress: bool = False,
    dtype: str = "float32",
    arch: str = "llama",
    chat_template: bool = True,
) -> Path:
    """Write a deterministic random-weight causal LM (``arch``, Llama by default) and its byte-level
    BPE tokenizer into ``out``; the tokenizer carries ``CHAT_TEMPLATE`` unless ``chat_template`` is
    off (a model that cannot take conversations)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    spec = SIZES[size]
    out = Path(out)

    def step(message: str) -> None:
        logger.info("make_model(%s): %s", size, message)
        if progress:
            sys.stderr.write(f"[make-model] {message}\n")
            sys.stderr.flush()

    step("training tokenizer…")
    tokenizer = _build_tokenizer(spec.vocab_size, spec.max_position_embeddings)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    vocab = tokenizer.get_vocab()
    bos, eos, pad = (vocab[t] for t in ("<s>", "</s>", "<pad>"))
    step(f"initialising {size} {arch} model (seed {seed}, {dtype})…")
    model = _build_model(spec, seed, bos, eos, pad, dtype, arch)
    step(f"saving to {out}…")
    out.mkdir(parents=True, exist_ok=True)
    with _quiet_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    # transformers 5 records its internal "TokenizersBackend"; the public alias also loads with transformers 4.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    step(f"done: {sum(p.numel() for p in model.parameters()):,} parameters")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="directory to write the model and tokenizer into")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model size (default: tiny)")
    parser.add_argument("--seed", default=0, type=int, help="seed for the random weights (default: 0)")
    parser.add_argument(
        "--arch", default="llama", choices=list(ARCHS), help="model architecture (default: llama); see ARCHS"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="dtype of the saved weights (default: float32)"
    )
    parser.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="give the tokenizer no chat template (default: a Zephyr-style one), for a model that takes no chats",
    )


def run(args: argparse.Namespace) -> int:
    path = make_model(
        args.out,
        size=args.size,
        seed=args.seed,
        progress=True,
        dtype=args.dtype,
        arch=args.arch,
        chat_template=args.chat_template,
    )
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton make-model", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
