"""Write tiny randomly initialised HuggingFace checkpoints to a folder, offline."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, cast

import torch
import transformers
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from tl_driver_hf.testing._families import FAMILIES, VLLM_CPU_HEAD_SIZES, Family, TinyDims
from tl_driver_hf.testing._tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    MIN_VOCAB_SIZE,
    PAD_TOKEN_ID,
    train_tiny_tokenizer,
)

__all__ = ["TINY_FAMILIES", "tiny_config", "write_tiny_checkpoint"]

TINY_FAMILIES: Final[tuple[str, ...]] = tuple(FAMILIES)
"""The families :func:`write_tiny_checkpoint` can build, as ``transformers`` model types."""

_DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEFAULT_N_HEADS: Final = 4
# Norm weights/biases and biases start constant; noise makes "before vs after the norm's
# weight" and "with vs without bias" differ, which parity tests must be able to see.
_CONSTANT_INIT_NOISE: Final = 0.1


def _match_key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _family(family: str) -> Family:
    spec = FAMILIES.get(family) if isinstance(family, str) else None
    if spec is not None:
        return spec
    hint = ""
    if isinstance(family, str):
        by_key = {_match_key(name): name for name in TINY_FAMILIES}
        close = difflib.get_close_matches(_match_key(family), by_key, n=1, cutoff=0.5)
        if close:
            hint = f"; did you mean {by_key[close[0]]!r}?"
    raise ValueError(
        f"unknown tiny model family {family!r}; expected one of {', '.join(TINY_FAMILIES)}{hint}"
    )


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    for name, value in _DTYPES.items():
        if dtype in (name, value):
            return value
    raise ValueError(
        f"unsupported dtype {dtype!r} for a tiny checkpoint; use 'float32' or 'bfloat16'"
    )


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _dims(
    family: str,
    spec: Family,
    *,
    n_layers: int,
    d_model: int | None,
    n_heads: int | None,
    head_dim: int,
    vocab_size: int,
    n_ctx: int,
) -> TinyDims:
    _positive_int("n_layers", n_layers)
    _positive_int("n_ctx", n_ctx)
    _positive_int("vocab_size", vocab_size, MIN_VOCAB_SIZE)
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"head_dim={head_dim!r} is not a head size vLLM's CPU attention supports; use one "
            f"of {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}"
        )
    if n_heads is None:
        if d_model is None:
            n_heads = _DEFAULT_N_HEADS
        elif d_model % head_dim == 0:
            n_heads = d_model // head_dim
        else:
            raise ValueError(
                f"d_model={d_model!r} is not a multiple of head_dim={head_dim}; pass n_heads "
                f"as well, or a d_model that head_dim divides"
            )
    _positive_int("n_heads", n_heads)
    if d_model is None:
        d_model = n_heads * head_dim
    _positive_int("d_model", d_model)
    if not spec.own_head_dim and d_model != n_heads * head_dim:
        raise ValueError(
            f"family {family!r} derives head_dim from d_model / n_heads, so d_model must be "
            f"n_heads * head_dim = {n_heads * head_dim}, got d_model={d_model}"
        )
    if spec.kv == "mqa":
        n_kv_heads = 1
    elif spec.kv == "gqa" and n_heads % 2 == 0:
        n_kv_heads = n_heads // 2
    else:
        n_kv_heads = n_heads
    return TinyDims(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_mlp=2 * d_model,
        vocab_size=vocab_size,
        n_ctx=n_ctx,
    )


def tiny_config(
    family: str,
    *,
    dtype: torch.dtype | str = "float32",
    n_layers: int = 2,
    d_model: int | None = None,
    n_heads: int | None = None,
    head_dim: int = 32,
    vocab_size: int = 512,
    n_ctx: int = 256,
    overrides: Mapping[str, Any] | None = None,
) -> PretrainedConfig:
    """Build the config of a tiny model of ``family``, without weights.

    Sizes not given follow ``n_heads=4`` and ``head_dim=32``; ``d_model`` defaults to
    ``n_heads * head_dim`` and the MLP is ``2 * d_model`` wide (``4 * d_model`` on BLOOM and
    Falcon, whose vLLM implementations fix that width). Families with grouped-query
    attention get ``n_heads // 2`` key/value heads (when ``n_heads`` is even), multi-query
    families one. Rotary families use ``rope_theta=10000``; sliding windows are ``n_ctx``
    wide so they never cut anything off. Token ids match :func:`train_tiny_tokenizer`.

    Args:
        family: One of :data:`TINY_FAMILIES`.
        dtype: ``"float32"`` or ``"bfloat16"`` (or the torch dtype), recorded in the config.
        n_layers: Number of transformer blocks.
        d_model: Residual stream width; must be ``n_heads * head_dim`` unless the family has
            its own ``head_dim`` field.
        n_heads: Number of query heads.
        head_dim: Size of each attention head; one of the sizes vLLM's CPU attention
            supports (32, 64, 80, 96, 112, 128, ...).
        vocab_size: Vocabulary size, equal to the tiny tokenizer's (at least 260).
        n_ctx: Maximum sequence length.
        overrides: Config fields set last, by their ``transformers`` names.

    Returns:
        The family's ``transformers`` config.

    Raises:
        ValueError: If the family is unknown (the message suggests the nearest one), the
            sizes are inconsistent or unsupported, or the dtype is not supported.
    """
    spec = _family(family)
    torch_dtype = _dtype(dtype)
    dims = _dims(
        family,
        spec,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        n_ctx=n_ctx,
    )
    fields = spec.fields(dims)
    fields.update(
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )
    # Std 1/sqrt(d_model) keeps activations O(1); with the usual 0.02 a 128-wide model has
    # near-uniform attention, so position and masking bugs would not show.
    fields[spec.init_std_field] = dims.d_model**-0.5
    fields.update(overrides or {})
    config_class: type[PretrainedConfig] = getattr(transformers, spec.config_class)
    config = config_class(**fields)
    config.dtype = torch_dtype
    return config


@contextmanager
def _seeded_float32(seed: int) -> Iterator[None]:
    # Leave the caller's RNG and default dtype as they were: a fixture must not perturb tests.
    previous_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


def _perturb_constant_parameters(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            flat = param.detach().reshape(-1)
            if flat.numel() > 0 and bool((flat == flat[0]).all()):
                param.add_(torch.randn_like(param), alpha=_CONSTANT_INIT_NOISE)


def _build_model(
    family: str, config: PretrainedConfig, dtype: torch.dtype, seed: int
) -> PreTrainedModel:
    model_class: type[PreTrainedModel] = getattr(transformers, FAMILIES[family].model_class)
    # Initialised in float32 whatever the target dtype, so a bfloat16 checkpoint holds the
    # float32 one's weights rounded.
    with _seeded_float32(seed):
        model = model_class(config)
        _perturb_constant_parameters(model)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        do_sample=False,
    )
    if dtype != torch.float32:
        # Typed as a Module: transformers' decorated `to` confuses type checkers.
        cast(torch.nn.Module, model).to(dtype=dtype)
    return model


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def _check_target(path: Path) -> None:
    if (path.exists() or path.is_symlink()) and not _is_empty_dir(path):
        raise FileExistsError(
            f"cannot write a tiny checkpoint to {str(path)!r}: it already exists and is not an "
            f"empty folder; remove it or choose another path"
        )


def _use_portable_tokenizer_class(folder: Path) -> None:
    # transformers 5 records its new backend class name, which transformers 4 (possibly the
    # one next to vLLM) cannot load; the old generic name loads the same files in both.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tiny_checkpoint(
    family: str,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = "float32",
    seed: int = 0,
    n_layers: int = 2,
    d_model: int | None = None,
    n_heads: int | None = None,
    head_dim: int = 32,
    vocab_size: int = 512,
    n_ctx: int = 256,
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Write a tiny randomly initialised checkpoint of ``family`` with a local tokenizer.

    The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` and
    the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``), and loads with
    ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` offline
    (and with vLLM). Weights come from the model's own initialisation in float32 under
    ``torch.manual_seed(seed)`` (the caller's RNG state is restored) with std
    ``1/sqrt(d_model)``, so activations and logits are O(1) and attention is not uniform;
    parameters the model initialises to a constant (norm weights, biases) get Gaussian
    noise of std 0.1, so a norm's weight and every bias visibly matter. The weights are
    then cast to ``dtype``: the same arguments give the same bytes. The folder is written next to
    ``path`` under a temporary name and renamed into place, so an interrupted write never
    leaves a partial folder at ``path``.

    Args:
        family: One of :data:`TINY_FAMILIES`.
        path: The folder to create; it must not exist, or be an empty folder.
        dtype: ``"float32"`` or ``"bfloat16"`` (or the torch dtype).
        seed: Seed of the weight initialisation.
        n_layers: Number of transformer blocks.
        d_model: Residual stream width (see :func:`tiny_config`).
        n_heads: Number of query heads.
        head_dim: Size of each attention head.
        vocab_size: Vocabulary size of both the model and the tokenizer.
        n_ctx: Maximum sequence length of the model and the tokenizer.
        overrides: Config fields set last, by their ``transformers`` names.

    Returns:
        The absolute path of the written folder.

    Raises:
        ValueError: If an argument is invalid (see :func:`tiny_config`).
        FileExistsError: If ``path`` exists and is not an empty folder.
    """
    config = tiny_config(
        family,
        dtype=dtype,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        n_ctx=n_ctx,
        overrides=overrides,
    )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    _check_target(Path(path).absolute())  # before building anything
    model = _build_model(family, config, _dtype(dtype), seed)
    return save_with_tokenizer(model, path, vocab_size=vocab_size, n_ctx=n_ctx)


def save_with_tokenizer(
    model: PreTrainedModel, path: str | os.PathLike[str], *, vocab_size: int | None, n_ctx: int
) -> Path:
    """Write ``model`` and a tiny tokenizer of ``vocab_size`` ids (none for ``None``: a
    model that reads pixels or audio) into the folder ``path``, atomically: the folder is
    written next to ``path`` under a temporary name and renamed into place (``path`` must
    not exist, or be an empty folder).

    Returns:
        The absolute path of the written folder.
    """
    target = Path(path).absolute()
    _check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would stay on the renamed folder.
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    staging.mkdir()
    try:
        model.save_pretrained(staging)
        if vocab_size is not None:
            tokenizer = train_tiny_tokenizer(vocab_size)
            tokenizer.model_max_length = n_ctx
            tokenizer.save_pretrained(staging)
            _use_portable_tokenizer_class(staging)
        if _is_empty_dir(target):
            # An empty folder (such as pytest's tmp_path) is taken over.
            target.rmdir()
        os.rename(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
