"""Vision-language models (Qwen2.5-VL, Qwen2-VL): Megatron's GPTModel with multimodal
rotary positions for the language model, Hugging Face's own vision tower on the first
pipeline stage.

    model = VisionLanguageModel(config, ..., hf_config=args.hf_config)   # build_model does it
    logits = model(input_ids, position_ids, None,                 # position_ids [3, b, s]
                   pixel_values=pv, image_grid_thw=thw)           # [patches, C*T*P*P], [n, 3]

Why the HF tower (docs/vision-language.md, "Where the vision tower lives"): Qwen2.5-VL's
ViT (dynamic resolution, Conv3d over 2 frames, 2D rotary, windowed attention, 2x2 patch
merger) has no Megatron counterpart; it is small next to the language model, so it runs
replicated on every TP rank, wrapped in Megatron's `HuggingFaceModule`, which tags its
parameters `average_gradients_across_tp_domain` (finalize_model_grads averages their
gradients over TP: the ranks computed the same ones, the average keeps them equal).

The forward (first stage): word embeddings (vocab-parallel, then scattered to the
sequence-parallel region by Megatron's embedding when SP is on), the rows of image tokens
replaced by the tower's output in token order ([b, s] row-major: HF's `masked_scatter`
order), passed to GPTModel as `decoder_input`. Every stage needs `position_ids` [3, b, s]
(mrope angles are computed per stage); `model.mrope.mrope_positions` gives them as HF's
`get_rope_index` does.

Context parallelism: each CP rank holds its load-balanced chunks of the micro-batch
(train/batch.py cp_shard): the token ids, the image mask, `image_index` (each image token's
row of the tower's output, counted over the WHOLE micro-batch) and the 3 x S mrope
positions. The tower runs on every CP rank on the whole images (it is small; the images
of a micro-batch are not split), each rank scatters the rows of its own image tokens;
DDP's sum over DP x CP adds the ranks' partial tower gradients like every other
parameter's. The mrope module's own CP slicing is switched off (`rotary_pos_emb.cp_group
= None`): the positions a rank passes are already its own (padded micro-batches), or the
whole packed row [3, 1, T], from which Megatron's THD rotary code takes each sequence's
chunks (`_apply_rotary_pos_emb_thd`, packed micro-batches, train/packing.py).

Freezing (ms-swift's meaning): --freeze_vit (the tower without the merger), --freeze_aligner
(the merger), --freeze_llm (everything else): `apply_freeze`.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.huggingface.module import HuggingFaceModule

from bridge.mappings.vision import build_hf_vision_tower
from bridge.params import unwrap

from .mrope import image_rows, mrope_positions, sample_positions  # noqa: F401  (re-exported)

ALIGNER = "merger."          # the vision tower's patch merger (ms-swift's `aligner`)


class VisionTower(HuggingFaceModule):
    """The HF vision tower as a Megatron module; Megatron names its parameters
    `visual.model.<HF name after visual.>`."""

    def __init__(self, config, family: str, vision_config: dict):
        super().__init__(config)
        self.model = build_hf_vision_tower(family, vision_config, config.params_dtype)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """[patches, C*T*P*P] pixels -> [patches / merge^2, hidden] language-model rows."""
        out = self.model(pixel_values.to(self.config.params_dtype), grid_thw=image_grid_thw)
        return getattr(out, "pooler_output", out)


class VisionLanguageModel(GPTModel):
    """GPTModel (position_embedding_type="mrope") + the HF vision tower on the chunk that
    embeds (pre_process). Everything else (decoder, output layer, PP/VPP, TP, SP, the
    bridge's language rules) is GPTModel's."""

    def __init__(self, *args, hf_config: dict, family: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.image_token_id = int(hf_config["image_token_id"])
        if self.pre_process:
            self.visual = VisionTower(self.config, family, hf_config["vision_config"])
        # The positions we pass are already this CP rank's (module docstring): no second slice.
        self.rotary_pos_emb.cp_group = None

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                pixel_values: Optional[torch.Tensor] = None,
                image_grid_thw: Optional[torch.Tensor] = None,
                image_mask: Optional[torch.Tensor] = None,
                image_index: Optional[torch.Tensor] = None, **kwargs):
        """GPTModel.forward plus the images of the micro-batch, in token order:
        pixel_values [patches, C*T*P*P] and image_grid_thw [n_images, 3] (the processor's,
        images concatenated in the order their tokens appear in input_ids [b, s] row-major).
        image_mask [b, s] bool: which tokens the images fill (default: the image token ids;
        pass it when completions may contain that id as text). image_index [b, s] (CP
        shards, train/batch.py cp_shard): each image token's row of the tower's output,
        counted over the whole micro-batch; default: counted over input_ids, which must then
        be whole. position_ids [3, b, s]; a [b, s] ramp (text only) is used for all three
        sections."""
        if position_ids is not None and position_ids.dim() == 2:
            packed = kwargs.get("packed_seq_params")
            if packed is not None:   # a text-only packed micro-batch: the whole row's ramps
                cu = packed.cu_seqlens_q_padded.tolist()       # (train/packing.py: THD rope)
                position_ids = torch.cat([torch.arange(e - s) for s, e in zip(cu[:-1], cu[1:])]
                                         ).to(position_ids.device).unsqueeze(0)
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if self.pre_process and decoder_input is None and pixel_values is not None:
            decoder_input = self.embed_with_images(input_ids, pixel_values, image_grid_thw,
                                                   image_mask, image_index)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input,
                               *args, **kwargs)

    def embed_with_images(self, input_ids, pixel_values, image_grid_thw, image_mask=None,
                          image_index=None):
        """[s(/tp under SP), b, h] decoder input: word embeddings, image rows replaced
        (`forward` for image_mask / image_index)."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        emb = self.embedding(input_ids=input_ids, position_ids=None)     # [s_local, b, h]
        image = self.visual(pixel_values, image_grid_thw)                 # [n_image_tokens, h]
        mask = input_ids == self.image_token_id if image_mask is None else image_mask.bool()
        b, s = mask.shape
        if image_index is None:
            tokens = int(mask.sum())
            index = image_rows(mask)     # in [b, s] row-major order (HF's masked_scatter's)
        else:   # a CP shard: the rows were counted over the whole micro-batch
            index = image_index.to(mask.device)
            tokens = int(index[mask].max()) + 1 if mask.any() else 0
        mismatch = tokens > image.shape[0] if image_index is not None else tokens != image.shape[0]
        if mismatch:
            raise ValueError(f"the micro-batch has {tokens} image tokens but its images "
                             f"(image_grid_thw {image_grid_thw.tolist()}) give {image.shape[0]}: "
                             "pixel_values / image_grid_thw must be the processor's for exactly "
                             "these prompts, in token order")
        mask, index = mask.t(), index.t()                                 # [s, b]
        if emb.shape[0] != s:   # sequence parallel: this TP rank's slice of the sequence
            rank, n = ps.get_tensor_model_parallel_rank(), emb.shape[0]
            mask, index = mask[rank * n:(rank + 1) * n], index[rank * n:(rank + 1) * n]
            # Each rank's rows get gradients from its slice only: the tower's output
            # gradient is the sum over TP (identity forward, all-reduce backward), so
            # every rank's tower gradients are whole (then averaged over TP: unchanged).
            image = tensor_parallel.copy_to_tensor_model_parallel_region(image)
        rows = image[index[mask]].to(emb.dtype)                           # [local image tokens, h]
        return emb.masked_scatter(mask.unsqueeze(-1), rows)


def apply_freeze(chunks, *, freeze_vit: bool = True, freeze_aligner: bool = True,
                 freeze_llm: bool = False) -> None:
    """ms-swift's freeze options as requires_grad, before DDP wraps the chunks (its buffers
    hold only trainable parameters): freeze_vit the vision tower but its merger,
    freeze_aligner the merger, freeze_llm the language model (embedding, decoder, head)."""
    models = [unwrap(c) for c in chunks]
    if not any(isinstance(m, VisionLanguageModel) for m in models):
        if not (freeze_vit and freeze_aligner) or freeze_llm:
            raise ValueError(f"--freeze_vit {str(freeze_vit).lower()} / --freeze_aligner "
                             f"{str(freeze_aligner).lower()} / --freeze_llm "
                             f"{str(freeze_llm).lower()}: these options choose what trains in a "
                             "vision-language model; this model is text-only (keep the defaults "
                             "true / true / false)")
        return
    if freeze_vit and freeze_aligner and freeze_llm:
        raise ValueError("--freeze_vit true, --freeze_aligner true and --freeze_llm true leave "
                         "nothing to train; set one of them false")
    for model in models:
        for name, param in model.named_parameters():
            if name.startswith("visual.model."):
                aligner = name[len("visual.model."):].startswith(ALIGNER)
                frozen = freeze_aligner if aligner else freeze_vit
            else:
                frozen = freeze_llm
            param.requires_grad_(not frozen)
