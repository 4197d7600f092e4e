"""``tl capture`` with a sparse dictionary attached: its sites, the top-k features of every
token among them, are stored as run_with_cache returns them, and a store records which
dictionary it was written with."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tl_core import TransformerBridge, UserError
from tl_core.capture import CaptureConfig, CaptureStore, capture
from tl_core.cli import main
from tl_core.sae import load_dictionary, random_dictionary

MODEL = {"model": "gpt2", "driver": "native", "boot_options": {"n_layers": 2, "seed": 3}}
SITE = "blocks.0.hook_out"
HOOKS = (f"{SITE}.hook_sae_top_indices", f"{SITE}.hook_sae_top_values", "blocks.1.hook_out")


def _save(folder: Path, seed: int = 0) -> Path:
    d = random_dictionary(64, 256, seed=seed, scale=0.5)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architecture": "standard",
        "d_in": 64,
        "d_sae": 256,
        "metadata": {"hook_name": "blocks.0.hook_resid_post"},
    }
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file(
        {"W_enc": d.W_enc, "b_enc": d.b_enc, "W_dec": d.W_dec, "b_dec": d.b_dec},
        str(folder / "sae_weights.safetensors"),
    )
    return folder


@pytest.fixture
def source(tmp_path: Path, write_documents: Callable[..., Path]) -> Path:
    return write_documents(tmp_path / "docs.txt")


def _config(source: Path, folder: Path, **changes: Any) -> CaptureConfig:
    fields: dict[str, Any] = {**MODEL, "hooks": HOOKS, "input": str(source), "context_size": 24, "batch_size": 3,
                              "shard_contexts": 6, "dictionaries": ({"path": str(folder), "top_k": 5},)}  # fmt: skip
    return CaptureConfig(**{**fields, **changes})


def test_the_store_holds_each_tokens_top_features(source: Path, tmp_path: Path) -> None:
    folder = _save(tmp_path / "sae")
    capture(_config(source, folder), tmp_path / "store", progress=False)
    store = CaptureStore(tmp_path / "store")
    indices = store.read(HOOKS[0])
    assert indices.dtype == torch.int64 and indices.shape == (len(store), 5)
    native = TransformerBridge.boot_native("gpt2", n_layers=2, seed=3)
    d = load_dictionary(folder)
    tokens, contexts = store.read("tokens"), store.read("contexts")
    first = tokens[contexts == 0]
    _, cache = native.run_with_cache(first[None].long(), names_filter=[SITE, "blocks.1.hook_out"])
    values, chosen = d.encode(cache[SITE][0]).topk(5, dim=-1)
    n = first.numel()
    assert torch.equal(indices[:n], chosen)
    torch.testing.assert_close(store.read(HOOKS[1], 0, n), values)
    # The error term is on by default: the model downstream holds its own values.
    torch.testing.assert_close(
        store.read("blocks.1.hook_out", 0, n), cache["blocks.1.hook_out"][0], atol=1e-5, rtol=1e-5
    )
    assert not native.namespace.dictionaries


def test_a_store_records_its_dictionary_and_refuses_another(source: Path, tmp_path: Path) -> None:
    folder = _save(tmp_path / "sae")
    capture(_config(source, folder), tmp_path / "store", progress=False)
    _save(folder, seed=1)  # new weights in the same folder
    with pytest.raises(UserError, match="dictionaries"):
        capture(_config(source, folder), tmp_path / "store", progress=False)


def test_bad_dictionary_entries_are_refused(source: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"unknown keys \['k'\]"):
        _config(source, tmp_path, dictionaries=({"path": str(tmp_path), "k": 3},))
    # Checked before the model boots: this model would not boot.
    with pytest.raises(UserError, match=r"has no cfg\.json"):
        capture(
            _config(source, tmp_path / "nowhere", model="no-such-preset"),
            tmp_path / "store",
            progress=False,
        )


def test_the_command_line_attaches_a_dictionary(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _save(tmp_path / "sae")
    out = tmp_path / "store"
    args = ["capture", "run", "--model", "gpt2", "--driver", "native", "--option", "n_layers=2", "--option", "seed=3",
            "--sae", f"{folder}@resid_post.0", "--sae-top-k", "4", "--hooks", f"{SITE}.hook_sae_top_indices",
            "--input", str(source), "--output", str(out), "--context-size", "24", "--quiet"]  # fmt: skip
    assert main(args) == 0
    assert main(["capture", "info", str(out)]) == 0
    assert (
        f"{SITE}.hook_sae_top_indices (asked as {SITE}.hook_sae_top_indices): rows of [4] int64"
        in capsys.readouterr().out
    )
