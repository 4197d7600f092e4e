"""A small byte-level BPE tokenizer trained locally, for tiny test checkpoints."""

from __future__ import annotations

import functools
from typing import Final

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS_TOKEN",
    "BOS_TOKEN_ID",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "MIN_VOCAB_SIZE",
    "PAD_TOKEN",
    "PAD_TOKEN_ID",
    "SPECIAL_TOKENS",
    "UNK_TOKEN",
    "UNK_TOKEN_ID",
    "train_tiny_tokenizer",
]

PAD_TOKEN: Final = "<|pad|>"
BOS_TOKEN: Final = "<|bos|>"
EOS_TOKEN: Final = "<|eos|>"
UNK_TOKEN: Final = "<|unk|>"
# The trainer gives special tokens the first ids, in this order; configs rely on it.
SPECIAL_TOKENS: Final = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_TOKEN_ID: Final = 0
BOS_TOKEN_ID: Final = 1
EOS_TOKEN_ID: Final = 2
UNK_TOKEN_ID: Final = 3
# Every byte must be in the vocabulary, otherwise byte-level BPE cannot encode all text.
MIN_VOCAB_SIZE: Final = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '>\\n' + message['content'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>\\n' }}{% endif %}"
)
"""A plain chat template, so chat-style callers (inspect, vLLM chat) work on the tiny model."""

_CORPUS: Final = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small
brass lamp, a notebook with a cracked green cover, and a thermos of strong black tea. From
the gallery at the top he could see the whole bay: the fishing boats coming home, the gulls
circling over the harbour wall, and the long grey line of the breakwater.

On Tuesdays the supply boat arrived with flour, paraffin, letters and newspapers that were
already three days old. The keeper read them slowly, one page at a time, and wrote down the
weather in his notebook: wind from the north-west, force 4; visibility good; sea moderate.
He had kept these records for twenty-seven years, and he had never missed a single night.

A model of language learns which words tend to follow which. Given the words "the cat sat
on the", it should guess that "mat" or "floor" is more likely than "seventeen". Researchers
who study these models open them up and look inside: they record the activations of every
layer, patch values from one run into another, and ask which heads and neurons matter.

Mathematics has its own small poems. One plus one is two; two times three is six; the
square root of sixteen is four. In 1969 people walked on the Moon, and in 2024 a kettle
could be controlled by a telephone. Prices rose by 3.5% in March, then fell by 0.8% in May.

"Where are you going?" asked the girl. "To the market," said her grandfather, "to buy
apples, onions, cheese and a loaf of bread. Would you like to come along?" She nodded,
pulled on her boots, and ran ahead down the muddy lane, splashing through every puddle.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

The river was wide and slow near the town, but in the hills it ran quickly over stones
and fallen branches. Children built dams in summer; in winter the water froze at the edges
and the herons stood very still, waiting for fish. Nobody remembered who had planted the
willows along the bank, but everybody agreed that the town would not be the same without them.

Questions, answers, reasons and results: a good experiment states what it expects before it
runs, measures what happened, and reports both honestly. If the numbers disagree with the
theory, the theory must change, or the measurement must be checked again more carefully.

The baker opened her shop before sunrise. She weighed the flour, warmed the water, and
kneaded the dough until it was smooth and elastic. While the loaves were rising she swept
the floor, counted the coins in the drawer, and wrote the prices on a small blackboard:
white bread, brown bread, rye bread, and on Fridays a sweet plaited loaf with raisins.

Trains left the station every twenty minutes. The first one, at 05:40, was nearly always
empty; the one at 08:00 was so crowded that people stood in the corridors reading over each
other's shoulders. Conductors checked tickets, announced the stations, and helped travellers
with heavy suitcases. At night the last train rattled slowly home through the dark fields.
"""


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    # The trained backend is cached as JSON so every caller gets a fresh, unshared object.
    backend = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    # A small corpus runs out of merges before a large vocabulary is full; reserved tokens
    # fill the rest so the tokenizer and the model's embedding have the same size.
    missing = vocab_size - backend.get_vocab_size()
    if missing > 0:
        start = backend.get_vocab_size()
        backend.add_special_tokens([f"<|reserved_{start + i}|>" for i in range(missing)])
    if backend.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"trained tokenizer has {backend.get_vocab_size()} tokens, expected {vocab_size}"
        )
    return backend.to_str()


def train_tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on a small built-in English corpus.

    Training is deterministic and runs offline; the result is cached per process, and each
    call returns a new tokenizer object, so callers may modify theirs. Ids ``0..3`` are
    ``<|pad|>``, ``<|bos|>``, ``<|eos|>`` and ``<|unk|>``; then the 256 byte symbols and
    the learned merges. If the corpus yields fewer merges than needed, reserved special
    tokens fill the vocabulary up to exactly ``vocab_size``. No special tokens are added
    when encoding (as GPT-2 does), so ``decode(encode(text)) == text``. A simple chat
    template is set.

    Args:
        vocab_size: Exact number of tokens, at least ``MIN_VOCAB_SIZE`` (260).

    Returns:
        A fast tokenizer with ``bos``, ``eos``, ``pad`` and ``unk`` tokens set.

    Raises:
        ValueError: If ``vocab_size`` is not an int of at least ``MIN_VOCAB_SIZE``.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs the 256 "
            f"bytes and {len(SPECIAL_TOKENS)} special tokens; use at least {MIN_VOCAB_SIZE}"
        )
    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
