"""``ModelInfo``: the shape facts about a model that every driver reports."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = ["ModelInfo"]


@dataclass(frozen=True)
class ModelInfo:
    """Sizes and structure of the model behind a driver.

    Attributes:
        n_layers: Number of transformer blocks.
        d_model: Residual-stream width.
        n_heads: Query heads per block.
        d_head: Width of one head.
        d_mlp: MLP hidden width (per expert for mixture-of-experts models).
        d_vocab: Vocabulary size (rows of the unembedding).
        n_ctx: Longest sequence the model takes.
        n_key_value_heads: Key/value heads (``n_heads`` unless grouped-query attention).
        normalization_type: ``"LN"`` (LayerNorm), ``"RMS"`` (RMSNorm), ``None`` (no norms),
            or ``"unknown"``: tl did not establish it (a block it reads from outside only).
            No norm site (``ln1.*``, ``ln_final.*``, ...) is served on an unknown norm.
        positional_embedding_type: ``"standard"`` (learned), ``"rotary"``, ``"none"``, or
            ``"unknown"`` (not established): then neither ``pos_embed.*`` nor the rotary
            sites are served, and no alias claims the model has no rotary embedding.
        gated_mlp: Whether the MLP has a gate projection (``hook_pre_linear`` fires).
        parallel_attn_mlp: Whether attention and MLP read the same block input (GPT-J,
            NeoX): then ``ln2.hook_in`` / ``hook_resid_mid`` does not exist.
        sandwich_norm: Whether each sublayer is followed by its own norm (Gemma 2/3, OLMo 2).
        post_residual_norm: Whether each sublayer's output is added to its input and the sum
            normalised, the original Transformer's post-LN (BERT): ``h = ln1(x + attn(x));
            out = ln2(h + mlp(h))``. Then ``ln1`` and ``ln2`` name those two norms:
            ``ln1.hook_in`` is ``hook_in + attn.hook_out``, ``ln1.hook_out`` the MLP's
            input, ``ln2.hook_in`` is ``ln1.hook_out + mlp.hook_out`` and ``ln2.hook_out``
            the block's output. The residual stream is renormalised in every block, so
            analyses that decompose it into a sum of components refuse such models.
        n_experts: Experts per mixture-of-experts layer (``None``: a dense MLP).
        experts_per_token: Experts each position is routed to (mixture of experts).
        d_shared_expert: Hidden width of the shared expert that a mixture of experts runs
            on every position beside the routed ones (Qwen2-MoE), or ``None`` when it has
            none: then ``mlp.shared_expert.*`` and ``mlp.experts.hook_out`` exist.
        d_q_latent: Width of the compressed query latent of multi-head latent attention
            (DeepSeek-V2/V3's ``q_lora_rank``), or ``None``: then ``attn.hook_q_latent``
            exists.
        d_kv_latent: Width of the compressed key/value latent of multi-head latent attention
            (``kv_lora_rank``), or ``None``: then ``attn.hook_kv_latent`` exists.
        mixer: Whether every block is ``x + mixer(norm(x))``, one mixer module in place of
            attention and an MLP (Mamba, Mamba-2; Nemotron-H, whose mixer is a state-space
            layer, attention or an MLP by layer): then ``mixer.hook_in``/``hook_out`` exist.
        embed_norm: Whether a norm sits between the embedding and the first block (BLOOM):
            then ``embed_ln.*`` exist.
        head_transform: Whether the unembedding reads a transform of the last block's
            output (a masked LM's head: dense, activation, norm): then ``mlm_head.*`` exist
            and ``ln_final`` is the transform's norm, whose input is the activation of
            ``mlm_head.hook_out``.
        token_type_embed: Whether a token-type (segment) embedding adds a row per segment id
            to the token embedding (BERT's sentence A and B): then ``token_type_embed.*``
            exist.
        reads_images: Whether image features replace the embeddings at an image token's
            positions (a vision-language model): then the tensor the rotary module reads
            (TransformerLens's ``rotary_emb.hook_in``) is the stream entering block 0, not the
            token embedding.
        encoder_layers: Blocks in the encoder stack of an encoder-decoder model (T5, BART),
            ``None`` for a model with one stack. Then ``n_layers`` counts the decoder's blocks,
            the two stacks' sites are named ``encoder_blocks.{i}.*`` and
            ``decoder_blocks.{i}.*`` (TransformerLens 4.3's prefixes; ``blocks.{i}.*`` names
            nothing), and the other facts hold for both stacks. ``stacks`` gives each stack's
            own view.
        cross_attention: Whether the blocks attend to another stack's output besides their
            own stream (an encoder-decoder's decoder blocks): then ``cross_attn.*`` and ``ln3.*``
            exist, and, as in TransformerLens, ``ln2`` is the norm before cross-attention and
            ``ln3`` the MLP's.
        qk_norm: Whether queries and keys are normalised before the rotary embedding
            (Qwen3, Gemma 3, OLMo 2): then ``attn.q_norm.*`` and ``attn.k_norm.*`` exist.
        rotary_dim: Width of the rotated part of each head (``None``: the whole head);
            smaller where only part of a head is rotated (GPT-NeoX's ``rotary_pct``).
        act_fn: The MLP activation as the model's config names it (``"gelu"``,
            ``"gelu_new"``, ``"silu"``, ``"relu"``; transformers names such as
            ``"gelu_pytorch_tanh"`` are kept as given), or ``None`` when the driver does not
            know it. Gradient rules that depend on the activation read it (see
            ``tl_core.analysis.use_relevance_rules``).
        architecture: A free-form family name (``"native-llama"``, ``"LlamaForCausalLM"``).
        device: Where the bridge takes token ids and returns tensors (a ``torch.device`` on
            a bridge's ``cfg``; ``"cpu"`` for engines in another process). It describes a placement, not the model's structure, so it
            takes no part in equality or hashing.
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    n_key_value_heads: int | None = None
    normalization_type: Literal["LN", "RMS", "unknown"] | None = "LN"
    positional_embedding_type: Literal["standard", "rotary", "none", "unknown"] = "standard"
    gated_mlp: bool = False
    parallel_attn_mlp: bool = False
    sandwich_norm: bool = False
    post_residual_norm: bool = False
    n_experts: int | None = None
    experts_per_token: int | None = None
    d_shared_expert: int | None = None
    d_q_latent: int | None = None
    d_kv_latent: int | None = None
    mixer: bool = False
    embed_norm: bool = False
    token_type_embed: bool = False
    head_transform: bool = False
    reads_images: bool = False
    encoder_layers: int | None = None
    cross_attention: bool = False
    qk_norm: bool = False
    rotary_dim: int | None = None
    act_fn: str | None = None
    architecture: str = ""
    device: str | torch.device = field(default="cpu", compare=False)

    @property
    def stacks(self) -> tuple[tuple[str, ModelInfo], ...]:
        """Each stack's name prefix and its own view of the model, in forward order.

        ``(("blocks", self),)`` for a one-stack model; for an encoder-decoder
        ``(("encoder_blocks", encoder), ("decoder_blocks", decoder))``, where the encoder's
        view has ``encoder_layers`` blocks and no cross-attention, and the decoder's has
        ``n_layers`` blocks and cross-attention.
        """
        if self.encoder_layers is None:
            return (("blocks", self),)
        encoder = replace(
            self,
            n_layers=self.encoder_layers,
            encoder_layers=None,
            cross_attention=False,
        )
        decoder = replace(self, encoder_layers=None, cross_attention=True)
        return (("encoder_blocks", encoder), ("decoder_blocks", decoder))

    def stack(self, prefix: str) -> ModelInfo:
        """The view of the stack named ``prefix`` (``"encoder_blocks"``; see ``stacks``).

        Raises:
            KeyError: The model has no such stack.
        """
        for name, info in self.stacks:
            if name == prefix:
                return info
        raise KeyError(prefix)

    @property
    def kv_heads(self) -> int:
        """Key/value heads, resolving the ``None`` default to ``n_heads``."""
        return self.n_key_value_heads or self.n_heads

    @property
    def rotary_width(self) -> int:
        """Width of the rotary table per position (``rotary_dim``, else ``d_head``)."""
        return self.rotary_dim or self.d_head
