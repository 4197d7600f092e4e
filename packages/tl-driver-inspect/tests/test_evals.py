"""Real offline evals on a tiny local checkpoint: files, parity with the hf driver, specs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _tli_tasks import HOOKS, STEER, make_task, samples
from inspect_ai import eval as inspect_eval
from inspect_ai.log import read_eval_log
from inspect_ai.solver import generate
from safetensors import safe_open

from tl_driver_inspect import capture_activations, intervene
from tl_driver_inspect._chat import prompt_ids

pytestmark = pytest.mark.slow


def run(task: Any, model: str, tmp_path: Path, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 6)
    logs = inspect_eval(
        task, model=model, max_connections=4, log_dir=str(tmp_path / "logs"), display="none", **kw
    )
    return logs[0]


def prompt_of(reference: Any, text: str) -> list[int]:
    from inspect_ai.model import ChatMessageUser

    return prompt_ids(reference.tokenizer, [ChatMessageUser(content=text)])


def hf_generate(reference: Any, prompt: list[int], n: int, specs: Any = None) -> list[int]:
    out = reference.driver.forward([prompt], intervene=specs, max_new_tokens=n, return_logits=False)
    ids = out.new_tokens[0].tolist()
    eos = reference.tokenizer.eos_token_id
    return ids[: ids.index(eos)] if eos in ids else ids


def read(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, "pt") as f:
        # safe_open has no __iter__
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118


def test_capture_python_api(
    checkpoint: Path, provider: str, reference: Any, tmp_path: Path
) -> None:
    out = tmp_path / "acts"
    task = make_task([intervene(STEER), capture_activations(HOOKS, output_dir=str(out))], epochs=2)
    log = run(task, f"{provider}/{checkpoint}", tmp_path)
    assert log.status == "success", log.error
    files = sorted(os.listdir(out))
    assert files == sorted(f"s{i}_epoch{e}.safetensors" for i in range(8) for e in (1, 2))
    canonical = [reference.namespace.lookup(h) for h in HOOKS]
    by_id = {s.id: s.input for s in samples()}
    assert len(log.samples) == 16
    for sample in log.samples:
        summary = sample.store["tl_activations"]
        tensors, meta = read(summary["path"])
        assert Path(summary["path"]).name == f"{sample.id}_epoch{sample.epoch}.safetensors"
        tokens = tensors.pop("tokens").tolist()
        prompt = prompt_of(reference, by_id[sample.id])
        # the file holds this sample's own tokens: its prompt, then its completion
        assert tokens[: len(prompt)] == prompt and int(meta["n_prompt_tokens"]) == len(prompt)
        assert summary["n_tokens"] == len(tokens) and sorted(summary["hooks"]) == sorted(canonical)
        assert tokens[len(prompt) :] == hf_generate(reference, prompt, 6, STEER)
        ref = reference.driver.forward(
            [tokens], capture=canonical, intervene=STEER, max_new_tokens=0
        )
        for name in canonical:
            assert torch.allclose(tensors[name], ref.captured[name][0], atol=1e-5, rtol=0), name
            assert summary["shapes"][name] == list(tensors[name].shape)


def test_greedy_without_specs_equals_hf_generate(
    checkpoint: Path, provider: str, reference: Any, tmp_path: Path
) -> None:
    log = run(make_task(generate(), n=4), f"{provider}/{checkpoint}", tmp_path, max_tokens=8)
    assert log.status == "success", log.error
    for sample in log.samples:
        prompt = prompt_of(reference, sample.input)
        expected = reference.tokenizer.decode(hf_generate(reference, prompt, 8))
        assert sample.output.completion == expected


def test_intervene_changes_outputs_like_hf(
    checkpoint: Path, provider: str, reference: Any, tmp_path: Path
) -> None:
    log = run(make_task([intervene(STEER), generate()], n=4), f"{provider}/{checkpoint}", tmp_path)
    assert log.status == "success", log.error
    changed = 0
    for sample in log.samples:
        prompt = prompt_of(reference, sample.input)
        steered = reference.tokenizer.decode(hf_generate(reference, prompt, 6, STEER))
        assert sample.output.completion == steered
        changed += steered != reference.tokenizer.decode(hf_generate(reference, prompt, 6))
    assert changed > 0, "the spec changed no output: pick a stronger one"


def test_logprobs_and_stop(checkpoint: Path, provider: str, reference: Any, tmp_path: Path) -> None:
    log = run(
        make_task(generate(), n=2),
        f"{provider}/{checkpoint}",
        tmp_path,
        logprobs=True,
        top_logprobs=3,
    )
    assert log.status == "success", log.error
    for sample in log.samples:
        choice = sample.output.choices[0]
        assert choice.logprobs is not None
        content = choice.logprobs.content
        assert content and all(len(c.top_logprobs or []) == 3 for c in content)
        assert all(c.logprob <= 0 for c in content)
        assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # type: ignore[index]


def test_cli_eval(checkpoint: Path, provider: str, reference: Any, tmp_path: Path) -> None:
    task_file = Path(__file__).with_name("_tli_tasks.py")
    out = tmp_path / "cli-acts"
    cmd = [
        sys.executable, "-m", "inspect_ai", "eval", f"{task_file}@capture_task",
        "--model", f"{provider}/{checkpoint}", "-T", f"output_dir={out}",
        "--max-connections", "4", "--max-tokens", "6", "--log-dir", str(tmp_path / "logs"),
        "--display", "none",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(task_file.parent)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(os.listdir(out)) == 16
    (log_file,) = (tmp_path / "logs").glob("*.eval")
    log = read_eval_log(str(log_file))
    assert log.status == "success"
    canonical = [reference.namespace.lookup(h) for h in HOOKS]
    sample = log.samples[3]
    tensors, _ = read(sample.store["tl_activations"]["path"])
    tokens = tensors.pop("tokens").tolist()
    ref = reference.driver.forward([tokens], capture=canonical, intervene=STEER, max_new_tokens=0)
    for name in canonical:
        assert torch.allclose(tensors[name], ref.captured[name][0], atol=1e-5, rtol=0), name


def test_reduce_positions_and_samples_df(
    checkpoint: Path, provider: str, reference: Any, tmp_path: Path
) -> None:
    out = tmp_path / "acts"
    solver = capture_activations(
        "blocks.1.hook_out", output_dir=str(out), reduce="mean", positions="generated"
    )
    log = run(make_task(solver, n=2), f"{provider}/{checkpoint}", tmp_path)
    assert log.status == "success", log.error
    summary = log.samples[0].store["tl_activations"]
    tensors, _ = read(summary["path"])
    tokens = tensors["tokens"].tolist()
    n_prompt = summary["n_prompt_tokens"]
    ref = reference.driver.forward([tokens], capture=["blocks.1.hook_out"], max_new_tokens=0)
    expected = ref.captured["blocks.1.hook_out"][0][n_prompt:].mean(0)
    assert torch.allclose(tensors["blocks.1.hook_out"], expected, atol=1e-5)
    assert summary["shapes"]["blocks.1.hook_out"] == [expected.shape[0]]
    pytest.importorskip("pandas")
    from inspect_ai.analysis import SampleColumn, SampleSummary, samples_df

    df = samples_df(
        str(tmp_path / "logs"),
        columns=[*SampleSummary, SampleColumn("acts", path="store.tl_activations", full=True)],
    )
    assert len(df) == 2 and df["acts"].str.contains("blocks.1.hook_out").all()
