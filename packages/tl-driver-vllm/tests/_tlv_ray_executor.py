"""The vllm driver with vLLM's Ray executor (TP=2) against the same engine with its
multiprocess executor, run as a script in a fresh interpreter by ``test_ray_executor.py``.

vLLM's CPU build refuses its Ray executor ("current platform cpu does not support ray":
the CPU platform names no Ray device resource; see ``QUARANTINES.md``). ``allow_ray_on_cpu``
is a test-only shim for that refusal, applied here and, through Ray's worker setup hook, in
every Ray worker: it names a custom Ray resource as the CPU platform's device, and reads
each worker's rank as its device id. Everything else (the Ray workers, tl's worker
extension in them, the transport of edit tables and results) is vLLM's and tl's own code.

Usage: python _tlv_ray_executor.py CHECKPOINT OUTPUT_JSON
"""

from __future__ import annotations

import os

# Before Ray or vLLM is imported: Ray's and vLLM's node addresses on the loopback interface,
# the engine in this process, and two workers on a one-NUMA-node machine.
os.environ.update(
    {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
)

import json
import sys
from pathlib import Path
from typing import Any

#: The Ray resource that stands for one CPU rank of the engine.
RANK = "tl_test_cpu_rank"


def allow_ray_on_cpu() -> None:
    """The test-only shim (see the module docstring)."""
    import ray
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor_v2

    CpuPlatform.ray_device_key = RANK

    def node_and_rank(self: Any) -> tuple[str, list[int]]:
        return ray.get_runtime_context().get_node_id(), [self._init_kwargs["rank"]]

    ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids = node_and_rank


def _run(bridge: Any, specs: Any) -> dict[str, Any]:
    driver = bridge.driver
    prompts = [[5, 6, 7, 8, 9], list(range(10, 50)), [60, 61], list(range(100, 112))]
    capture = sorted(driver.supported_hook_points)
    out: dict[str, Any] = {"workers": driver.workers}
    for label, intervene in (("plain", None), ("specs", specs)):
        result = driver.forward(prompts, capture=capture, intervene=intervene, max_new_tokens=0)
        out[label] = {**result.captured, "logits": result.logits}
    steered = driver.forward(prompts, intervene=specs, max_new_tokens=4, stop_at_eos=False)
    out["tokens"] = steered.new_tokens.tolist()
    return out


def _difference(a: Any, b: Any) -> float:
    """The largest absolute difference; equal values count 0 (masked scores are -inf in both)."""
    if a.shape != b.shape:
        return float("inf")
    gap = (a - b).abs()
    gap[a == b] = 0.0
    return float(gap.max()) if gap.numel() else 0.0


def main(folder: str, output: str) -> None:
    import ray
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from _tlv_support import ENGINE_OPTIONS
    from test_lifecycle import _sharded_specs

    from tl_core import RemoteBridge

    allow_ray_on_cpu()
    ray.init(
        num_cpus=4,
        resources={RANK: 2},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": "_tlv_ray_executor.allow_ray_on_cpu"},
    )
    options = {"dtype": "float32", "tensor_parallel_size": 2, "use_attn_result": True}
    try:
        over_ray = RemoteBridge.boot_vllm(
            folder, distributed_executor_backend="ray", **options, **ENGINE_OPTIONS
        )
        try:
            specs = _sharded_specs(over_ray.driver)
            got = _run(over_ray, specs)
            nodes = [n["NodeManagerAddress"] for n in ray.nodes()]
        finally:
            over_ray.close()
    finally:
        ray.shutdown()
    one_node = RemoteBridge.boot_vllm(
        folder, distributed_executor_backend="mp", **options, **ENGINE_OPTIONS
    )
    try:
        want = _run(one_node, specs)
    finally:
        one_node.close()
    report: dict[str, Any] = {
        "ray_workers": [{k: w[k] for k in ("tp_rank", "pid")} for w in got["workers"]],
        "ray_nodes": nodes,
        "driver_pid": os.getpid(),
        "tokens_equal": got["tokens"] == want["tokens"],
        "differences": {
            f"{label}:{name}": _difference(got[label][name], want[label][name])
            for label in ("plain", "specs")
            for name in want[label]
        },
        "hooks": len(want["plain"]) - 1,
    }
    assert all(isinstance(t, torch.Tensor) for t in got["plain"].values())
    Path(output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
