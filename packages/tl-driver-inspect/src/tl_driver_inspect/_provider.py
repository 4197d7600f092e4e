"""The inspect_ai model providers: ``tl_bridge`` (hf driver) and the shared machinery.

A provider boots a tl bridge once per inspect model and serves every sample of the eval
with it. Model work is blocking, so it runs in a worker thread, under ``lock`` (one call at
a time on the model). Each sample's specs come from its ``SampleScope`` (a ``ContextVar``
set by this package's solvers), read on the event loop before the work is dispatched, so
concurrent samples never share specs or activations.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from inspect_ai.model import (
    ChatCompletionChoice,
    ChatMessage,
    ChatMessageAssistant,
    GenerateConfig,
    Logprobs,
    ModelAPI,
    ModelOutput,
    ModelUsage,
)

from tl_core import UserError
from tl_core.driver_api import run_keywords
from tl_driver_inspect._chat import prompt_ids
from tl_driver_inspect._context import GenerationRecord, current_scope
from tl_driver_inspect._generation import (
    DEFAULT_MAX_TOKENS,
    cut_at_stop,
    logprobs_of,
    sampling_options,
)
from tl_driver_inspect._specs import absolute_specs

if TYPE_CHECKING:
    import torch
    from inspect_ai.tool import ToolChoice, ToolInfo

    from tl_core.hooks import HookNamespace

__all__ = ["CACHE_MESSAGE", "TLBridgeAPI", "TLProvider"]

CACHE_MESSAGE = (
    "inspect's response cache is on (cache=True) for a sample that tl captures or steers: a "
    "cached response skips the model provider, so activations would be missing and specs "
    "silently unapplied. Turn the cache off for this eval (drop cache=True / --cache from "
    "generate() or the eval)"
)


class TLProvider(ModelAPI):
    """Base of this package's providers: generation, capture and the tl bridge they share.

    Attributes:
        bridge: The tl bridge under the provider (``TransformerBridge`` for ``tl_bridge``,
            ``RemoteBridge`` for ``tl_bridge_vllm``). ``bridge.driver`` is the tl driver that
            ``InspectDriver`` (``RemoteBridge.boot_inspect``) delegates ``forward`` and the
            namespace to; take ``lock`` around any direct use while an eval runs.
        lock: Re-entrant lock held around every call into ``bridge``.
        driver_name: The tl driver the provider runs (``"hf"`` or ``"vllm"``).
    """

    driver_name: str = ""

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        config: GenerateConfig | None = None,
        **model_args: Any,
    ) -> None:
        super().__init__(
            model_name=model_name,
            base_url=base_url,
            api_key=api_key,
            config=config or GenerateConfig(),
        )
        self.lock = threading.RLock()
        self.bridge: Any = self._boot(model_name, dict(model_args))

    def _boot(self, model: str, options: dict[str, Any]) -> Any:
        import tl_core

        return tl_core.boot(model, driver=self.driver_name, **options)

    # -- facts ----------------------------------------------------------------------

    @property
    def namespace(self) -> HookNamespace:
        """The model's hook names as the provider's driver serves them."""
        return self.bridge.namespace  # type: ignore[no-any-return]

    def max_tokens(self) -> int | None:
        """Default ``max_tokens`` (capped by the model's context at generation)."""
        return DEFAULT_MAX_TOKENS

    def should_retry(self, ex: Exception) -> bool:
        """Local model errors are never transient."""
        return False

    def close(self) -> None:
        """Release the tl bridge (engine processes, memory); safe to call twice."""
        bridge = self.__dict__.get("bridge")
        if bridge is not None:
            with self.lock:
                bridge.close()

    # -- blocking work (run in a worker thread) -------------------------------------

    def _generate_blocking(
        self, prompt: list[int], specs: Any, max_new: int, sampling: dict[str, Any]
    ) -> list[int]:
        """New token ids for one prompt (EOS-padded tail allowed)."""
        import torch

        with self.lock, torch.no_grad():
            result = run_keywords(
                self.bridge.driver,
                [prompt],
                intervene=specs,
                max_new_tokens=max_new,
                return_logits=False,
                **sampling,
            )
        assert result.new_tokens is not None  # max_new >= 1: every driver returns them
        return [int(i) for i in result.new_tokens[0].tolist()]

    def _forward_blocking(
        self, ids: list[int], capture: Sequence[str], specs: Any, want_logits: bool
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """One prefill over ``ids``: logits ``[pos, vocab]`` and captures without batch dim."""
        import torch

        with self.lock, torch.no_grad():
            result = run_keywords(
                self.bridge.driver,
                [ids],
                capture=list(capture),
                intervene=specs,
                max_new_tokens=0,
                return_logits=want_logits,
            )
        return _first_row(result, 0, len(ids), self.namespace, want_logits)

    # -- async entry points ---------------------------------------------------------

    async def forward_ids(
        self,
        ids: Sequence[int],
        *,
        capture: Sequence[str] = (),
        specs: Mapping[str, Any] | None = None,
        want_logits: bool = False,
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Run one sequence with captures and specs off the event loop.

        Args:
            ids: Token ids (prompt plus generated tokens).
            capture: Canonical hook names.
            specs: ``intervene=`` mapping with absolute positions.
            want_logits: Also return the ``[pos, vocab]`` logits.

        Returns:
            ``(logits or None, canonical hook -> tensor without the batch dimension)``.
        """
        return await anyio.to_thread.run_sync(
            self._forward_blocking, list(ids), tuple(capture), specs, want_logits
        )

    async def generate(
        self,
        input: list[ChatMessage],
        tools: list[ToolInfo],
        tool_choice: ToolChoice,
        config: GenerateConfig,
    ) -> ModelOutput:
        """Generate one completion with the sample's specs (see the module docstring)."""
        scope = current_scope()
        specs = scope.driver_specs() if scope is not None else None
        if scope is not None and (scope.capturing or specs) and config.cache:
            raise UserError(CACHE_MESSAGE)
        tokenizer = self.bridge.tokenizer
        prompt = prompt_ids(tokenizer, input)
        max_new, sampling = sampling_options(
            config, prompt_len=len(prompt), n_ctx=self.bridge.cfg.n_ctx
        )
        raw = await anyio.to_thread.run_sync(
            self._generate_blocking, prompt, specs, max_new, sampling
        )
        done = cut_at_stop(
            raw,
            eos=tokenizer.eos_token_id,
            max_new=max_new,
            stop_seqs=config.stop_seqs,
            decode=tokenizer.decode,
        )
        logprobs = None
        if config.logprobs and done.ids:
            logits, _ = await self.forward_ids(
                prompt + done.ids, specs=absolute_specs(specs, len(prompt)), want_logits=True
            )
            assert logits is not None
            start = len(prompt) - 1
            entries = logprobs_of(
                logits[start : start + len(done.ids)],
                done.ids,
                config.top_logprobs,
                tokenizer.token_to_str,
            )
            logprobs = Logprobs.model_validate({"content": entries})
        if scope is not None:
            scope.records.append(GenerationRecord(tuple(prompt), tuple(done.ids), specs))
        message = ChatMessageAssistant(content=done.text, model=self.model_name, source="generate")
        return ModelOutput(
            model=self.model_name,
            choices=[
                ChatCompletionChoice(
                    message=message,
                    stop_reason=done.stop_reason,  # type: ignore[arg-type]
                    logprobs=logprobs,
                )
            ],
            usage=ModelUsage(
                input_tokens=len(prompt),
                output_tokens=len(done.ids),
                total_tokens=len(prompt) + len(done.ids),
            ),
        )


class TLBridgeAPI(TLProvider):
    """``tl_bridge/<model>``: a HuggingFace model through tl's ``hf`` driver.

    ``model_args`` are ``tl_core.boot(model, driver="hf", **model_args)`` options (dtype
    defaults to float32, eager attention, as ``TransformerBridge.boot_transformers``). The
    bridge (a ``TransformerBridge``) is ``self.bridge``.
    """

    driver_name = "hf"


def _first_row(
    result: Any, row: int, length: int, namespace: HookNamespace, want_logits: bool
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Prompt ``row`` of a (right-padded) ``ForwardResult``, cut to its ``length``."""
    logits = result.logits[row, :length] if want_logits and result.logits is not None else None
    captured = {}
    for name, tensor in result.captured.items():
        layout = namespace.layout(name)
        value = tensor[row]
        if layout == "b h q k":
            value = value[:, :length, :length]
        elif layout.split()[1:2] == ["p"]:
            value = value[:length]
        captured[name] = value
    return logits, captured
