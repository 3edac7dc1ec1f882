"""Qwen3.5-VL (dense and MoE) for context-parallel SFT: transformers' vision tower, cp_models' text model.

One readable file in the manner of transformers' modeling files. Parameter names are transformers' own
(``model.visual.*``, ``model.language_model.*``, ``lm_head.weight``), so a checkpoint saved by
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` loads directly and
:meth:`Qwen35VLForConditionalGeneration.save_pretrained` writes one that transformers loads back.

Forward over one packed row, root-level sharding: every CP rank receives the whole row (token ids, labels, the
row's images), and the model itself

1. checks the row on the host (image runs vs grids, document boundaries, pixel rows, divisibility), before any
   collective, so bad input raises the same error on every rank;
2. builds the 3-D MRoPE positions of the whole row (:func:`cp_vlm.packed_mrope_positions`) and keeps its shard;
3. encodes images with the vision tower, never through the CP attention path: ``vision_cp="shard"`` gives each
   rank a balanced subset of the row's images (by patch count) and all-gathers the merged embeddings with autograd
   (backward sums every rank's gradient); ``"replicate"`` encodes every image on every rank (the reference
   system's behaviour). Both compute the same thing;
4. embeds its own tokens and puts the image embeddings that fall in its shard into their placeholder slots, which
   equals merging into the full row and then sharding;
5. runs the text model (Ulysses attention, GDN state passing) on its shard.

A rank that encodes no image (a text-only row, or fewer images than ranks under ``"shard"``) runs no vision
forward and pays for no dummy image; its vision parameters still get a (zero) gradient, so every rank of an
FSDP group reduces the same set of gradients and nothing waits on a rank that skipped the tower.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn

from cp_core import (
    AttentionBackend,
    ContextParallelError,
    CPTopology,
    RecurrentBackend,
    build_packed_metadata,
    check_divisible,
    check_same_row_on_every_rank,
    gather_variable,
)
from cp_models.hf_checkpoint import (
    load_hf_checkpoint,
    strip_prefixes,
    unwrapped_names,
    write_safetensors,
    written_dtype,
)
from cp_models.loss import CausalLMOutput, causal_lm_output
from cp_models.loss_tiles import TileKernels
from cp_models.qwen3_5 import (
    VL_MODEL_TYPES,
    Qwen35Rotary,
    Qwen35TextModel,
    cp_to_hf_state,
    hf_to_cp_state,
    init_qwen35_weights,
    load_text_config,
)
from cp_models.row_inputs import check_token_values, tensor_shapes
from cp_vlm.positions import packed_mrope_positions

VisionCP = Literal["shard", "replicate"]
VISION_CP_MODES: tuple[str, ...] = ("shard", "replicate")


def load_vl_config(path_or_config):
    """The VL config (``Qwen3_5Config`` / ``Qwen3_5MoeConfig``) of a checkpoint folder or config object."""
    from transformers import AutoConfig, PretrainedConfig

    config = (
        path_or_config if isinstance(path_or_config, PretrainedConfig) else AutoConfig.from_pretrained(path_or_config)
    )
    if config.model_type not in VL_MODEL_TYPES or getattr(config, "vision_config", None) is None:
        raise ContextParallelError(
            f"not a Qwen3.5-VL config: model_type={config.model_type!r}; a text-only Qwen3.5 checkpoint loads with "
            "cp_models.Qwen35ForCausalLM"
        )
    return config


def balance_images(patch_counts: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Image indices per rank, balanced by patch count: largest first, each to the least-loaded rank (lowest rank
    on ties). Deterministic, so every rank computes the same assignment from host values."""
    loads = [0] * num_ranks
    owned: list[list[int]] = [[] for _ in range(num_ranks)]
    for image in sorted(range(len(patch_counts)), key=lambda i: (-int(patch_counts[i]), i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owned[rank].append(image)
        loads[rank] += int(patch_counts[image])
    return [sorted(images) for images in owned]


class Qwen35VLModel(nn.Module):
    """``visual`` (transformers' Qwen3.5 vision tower) and ``language_model`` (cp_models' text model)."""

    def __init__(self, config, attention_backend: AttentionBackend, recurrent_backend: RecurrentBackend):
        super().__init__()
        self.visual = build_vision_tower(config)
        self.language_model = Qwen35TextModel(load_text_config(config), attention_backend, recurrent_backend)


def build_vision_tower(config) -> nn.Module:
    """transformers' own vision model for ``config.vision_config`` (randomly initialized by transformers)."""
    from transformers import AutoModel

    vision = config.vision_config
    return AutoModel.from_config(vision, attn_implementation=getattr(vision, "_attn_implementation", None) or "sdpa")


class Qwen35VLForConditionalGeneration(nn.Module):
    """Qwen3.5-VL (dense or MoE text model) over one packed row, with or without context parallelism.

    ``forward(input_ids [S], seq_lens, pixel_values=..., image_grid_thw=..., labels=[S])`` takes the *whole* row on
    every CP rank (host tensors are best: the checks and positions are computed there) and returns this rank's shard
    of the outputs (``token_log_probs``, ``logits``, ``hidden_states``: its ``S / cp`` tokens). ``labels`` are
    already shifted (``labels[t]`` is the target of position ``t``; < 0 ignored). ``pixel_values``
    ``[num_patches, C * T * P * P]`` and ``image_grid_thw`` ``[num_images, 3]`` are what transformers' Qwen2-VL image
    processor returns, for the row's images in order. ``vision_cp`` ("shard" or "replicate") says how CP ranks
    share the vision work; ``vision_attention`` is the vision tower's transformers attention implementation.
    """

    cp_topology: CPTopology = CPTopology.single()  # set once by set_context_parallel_attributes
    loss_tile_kernels: TileKernels = "auto"  # the loss tiles' passes: Triton kernels on CUDA, else torch

    def __init__(
        self,
        config,
        attention_backend: AttentionBackend = "auto",
        recurrent_backend: RecurrentBackend = "auto",
        vision_cp: VisionCP = "shard",
        vision_attention: str = "sdpa",
    ):
        super().__init__()
        if vision_cp not in VISION_CP_MODES:
            raise ContextParallelError(f"unknown vision_cp {vision_cp!r}; choose one of {VISION_CP_MODES}")
        config = copy.deepcopy(load_vl_config(config))
        config.vision_config._attn_implementation = vision_attention
        self.config, self.vision_cp = config, vision_cp
        text = load_text_config(config)
        self.model = Qwen35VLModel(config, attention_backend, recurrent_backend)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        if config.tie_word_embeddings:  # transformers' VL model ties by the top-level flag
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        init_qwen35_weights(self.model.language_model, text.initializer_range)
        init_qwen35_weights(self.lm_head, text.initializer_range)

    def decoder_layers(self) -> nn.ModuleList:
        """The text decoder blocks (what activation checkpointing, compile and FSDP wrap one by one)."""
        return self.model.language_model.layers

    def vision_blocks(self) -> nn.ModuleList:
        """The vision tower's transformer blocks (activation checkpointing can wrap these too)."""
        return self.model.visual.blocks

    # -- forward -----------------------------------------------------------------------------------------------

    def check_row(
        self,
        input_ids: torch.Tensor,
        seq_lens: Sequence[int],
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> torch.Tensor:
        """Validate one packed row on the host and return its ``[3, S]`` MRoPE positions (raises
        :class:`ContextParallelError` naming the value and the rule)."""
        config = self.config
        if input_ids.dim() != 1:
            raise ContextParallelError(f"input_ids must be the whole row [S] (batch 1), got {tuple(input_ids.shape)}")
        check_divisible(input_ids.numel(), self.cp_topology.size, what="packed row length")
        if (pixel_values is None) != (image_grid_thw is None):
            raise ContextParallelError("pass pixel_values and image_grid_thw together (or neither, for no images)")
        positions = packed_mrope_positions(
            input_ids,
            seq_lens,
            image_grid_thw,
            image_token_id=config.image_token_id,
            vision_start_token_id=config.vision_start_token_id,
            spatial_merge_size=config.vision_config.spatial_merge_size,
            video_token_id=config.video_token_id,
        )
        if pixel_values is not None:
            patches = int(image_grid_thw.long().prod(-1).sum())
            if pixel_values.dim() != 2 or pixel_values.size(0) != patches:
                raise ContextParallelError(
                    f"pixel_values has shape {tuple(pixel_values.shape)} but image_grid_thw "
                    f"{image_grid_thw.tolist()} needs {patches} patch rows (sum of t*h*w)"
                )
        return positions

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged embeddings of the row's images, ``[image tokens, hidden]`` in image order, on every rank.

        "replicate": every rank runs every image. "shard": this rank runs its balanced share and the shares are
        all-gathered with autograd (a rank with no share runs nothing and sends nothing).
        """
        topology = self.cp_topology
        grids = image_grid_thw.detach().to("cpu", torch.long)
        merge = self.config.vision_config.spatial_merge_size**2
        patches = grids.prod(-1).tolist()
        device = self.lm_head.weight.device
        if self.vision_cp == "replicate" or not topology.enabled:
            return self._vision(pixel_values.to(device), grids)
        mine = balance_images(patches, topology.size)
        starts = [0, *torch.tensor(patches).cumsum(0).tolist()]
        counts = [sum(patches[i] // merge for i in images) for images in mine]
        own = mine[topology.rank]
        if own:
            rows = torch.cat([pixel_values[starts[i] : starts[i + 1]] for i in own]).to(device)
            local = self._vision(rows, grids[own])
        else:
            # Every rank must hand the all-gather the same dtype: the tower's output dtype (its last parameter's).
            dtype = list(self.model.visual.parameters())[-1].dtype
            local = torch.zeros(0, self.lm_head.in_features, device=device, dtype=dtype) + self._vision_anchor()
        gathered = gather_variable(local, counts, topology)
        # Back to image order: rank r's rows are its images in increasing index order.
        pieces, offset = {}, 0
        for images in mine:
            for i in images:
                pieces[i] = gathered[offset : offset + patches[i] // merge]
                offset += patches[i] // merge
        return torch.cat([pieces[i] for i in range(len(patches))])

    def _vision(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        out = self.model.visual(pixel_values, grid_thw=grids.to(pixel_values.device), return_dict=True)
        return out.pooler_output

    def _vision_anchor(self) -> torch.Tensor | int:
        """0, computed from every trainable vision parameter, for a rank that encodes no image: its vision
        parameters get a zero gradient, so every rank of an FSDP group reduces the same gradients, and no dummy
        image is run."""
        return 0 * sum(p.reshape(-1)[:1].sum() for p in self.model.visual.parameters() if p.requires_grad)

    def forward(
        self,
        input_ids: torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_logits: bool | None = None,
        loss_chunk_size: int | None = None,
    ) -> CausalLMOutput:
        """This rank's outputs for the whole packed row ``input_ids`` (see the class docstring)."""
        topology = self.cp_topology
        try:  # this rank's own checks; what they raise stops every rank below, not this one alone
            input_ids = input_ids[0] if input_ids.dim() == 2 and input_ids.size(0) == 1 else input_ids
            seq_lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
            positions = self.check_row(input_ids, seq_lens, pixel_values, image_grid_thw)
            if position_ids is not None:
                if position_ids.shape != positions.shape:
                    raise ContextParallelError(
                        f"position_ids {tuple(position_ids.shape)} must be the whole row's [3, S] = "
                        f"{tuple(positions.shape)}"
                    )
                positions = position_ids
            if labels is not None:
                labels = labels[0] if labels.dim() == 2 and labels.size(0) == 1 else labels
                if labels.shape != input_ids.shape:
                    raise ContextParallelError(
                        f"labels {tuple(labels.shape)} must be the whole row like input_ids {tuple(input_ids.shape)}"
                    )
            check_token_values(input_ids, labels, self.lm_head.out_features)
            problem = None
        except Exception as exc:
            problem = exc
        # First collective: every rank got the same row (lengths, shapes, image grids) and none failed its checks,
        # so every check after it fails alike.
        grids = image_grid_thw.flatten().tolist() if isinstance(image_grid_thw, torch.Tensor) else []
        row = (*tensor_shapes(input_ids, pixel_values, labels, position_ids), *grids)
        check_same_row_on_every_rank(seq_lens, topology, self.lm_head.weight.device, extra=row, problem=problem)
        start, end = topology.shard_range(input_ids.numel())
        device = self.lm_head.weight.device
        meta = build_packed_metadata(seq_lens, topology.rank, topology.size).to(device)

        local_ids = input_ids[start:end].to(device)
        embeds = self.model.language_model.embed_tokens(local_ids)
        if image_grid_thw is not None and image_grid_thw.numel():
            image_embeds = self.encode_images(pixel_values, image_grid_thw)
            # The placeholders are in image order, so this shard's slots take a contiguous run of the rows.
            is_image = input_ids == self.config.image_token_id
            first = int(is_image[:start].sum())
            here = is_image[start:end].to(device)
            take = image_embeds[first : first + int(here.sum())].to(embeds.dtype)
            embeds = embeds.masked_scatter(here[:, None], take)
        else:
            embeds = embeds + self._vision_anchor()

        hidden = self.model.language_model(embeds, positions[:, start:end].to(device), meta)
        local_labels = None if labels is None else labels[start:end].to(device)
        return causal_lm_output(
            hidden, self.lm_head, local_labels, return_logits, loss_chunk_size, self.loss_tile_kernels
        )

    # -- HF checkpoints --------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        attention_backend: AttentionBackend = "auto",
        recurrent_backend: RecurrentBackend = "auto",
        vision_cp: VisionCP = "shard",
        vision_attention: str = "sdpa",
    ) -> Qwen35VLForConditionalGeneration:
        """Load a transformers Qwen3.5-VL checkpoint folder (dense or MoE; single or sharded safetensors) in
        ``dtype``, or with None in transformers' ``"auto"`` dtype (the config's, else the checkpoint's)."""
        config = load_vl_config(str(path))
        with torch.device("meta"):
            model = cls(config, attention_backend, recurrent_backend, vision_cp, vision_attention)
        # The vision tower is transformers' module: build it for real, so that its non-persistent buffers (rotary
        # frequencies) exist; its weights are then replaced by the checkpoint's.
        model.model.visual = build_vision_tower(model.config)
        tied = ("lm_head.weight", "model.language_model.embed_tokens.weight")
        tied = tied if model.config.tie_word_embeddings else None
        to_ours = functools.partial(vl_hf_to_cp_state, config=model.config)
        config_dtype = getattr(model.config, "dtype", None)
        dtype = load_hf_checkpoint(model, path, to_ours, tied=tied, dtype=dtype, config_dtype=config_dtype)
        model.model.language_model.rotary_emb = Qwen35Rotary(load_text_config(model.config))  # was on meta
        return model.to(dtype)

    def save_pretrained(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write a checkpoint folder that transformers' Qwen3_5(Moe)ForConditionalGeneration loads.

        ``state_dict``: the weights to write instead of this module's own (e.g. gathered from FSDP shards).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(self.config)
        moe = bool(getattr(config.text_config, "num_experts", 0))
        config.architectures = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
        state = vl_cp_to_hf_state(unwrapped_names(self.state_dict() if state_dict is None else state_dict), config)
        config.dtype = config.text_config.dtype = written_dtype(state)
        config.save_pretrained(path)
        write_safetensors(state, path)


_TEXT, _VISUAL = "model.language_model.", "model.visual."


def vl_hf_to_cp_state(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """transformers VL checkpoint names -> ours: vision tensors as they are, the text model's through
    :func:`cp_models.qwen3_5.hf_to_cp_state` (per-expert weights stacked), MTP tensors dropped."""
    state = strip_prefixes(state, [("visual.", _VISUAL), ("language_model.", _TEXT)])  # older layouts
    visual = {n: t for n, t in state.items() if n.startswith(_VISUAL)}
    text = {n: t for n, t in state.items() if not n.startswith((_VISUAL, "mtp."))}
    text = strip_prefixes(hf_to_cp_state(text, load_text_config(config)), [("model.", _TEXT)])
    return {**visual, **text}


def vl_cp_to_hf_state(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Ours -> transformers VL checkpoint names (per-expert weights; the head dropped when tied)."""
    out = {n: t for n, t in state.items() if n.startswith(_VISUAL)}
    text = strip_prefixes({n: t for n, t in state.items() if not n.startswith(_VISUAL)}, [(_TEXT, "model.")])
    for name, tensor in cp_to_hf_state(text, load_text_config(config)).items():  # ties by the VL flag
        out[_TEXT + name[len("model.") :] if name.startswith("model.") else name] = tensor
    return out
