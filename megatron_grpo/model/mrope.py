"""Multimodal rotary positions (Qwen2-VL / Qwen2.5-VL "mrope"), in plain torch: the data
side computes them once per prompt without importing Megatron, the model reads them.

    positions, delta = mrope_positions(prompt_ids, image_grid_thw, image_token_id)  # [3, P]
    position_ids = sample_positions(positions, delta, length)                       # [3, length]
"""
from __future__ import annotations

import torch


def mrope_positions(input_ids, image_grid_thw, image_token_id: int, spatial_merge_size: int = 2):
    """Multimodal rotary positions of ONE prompt, as HF's `get_rope_index` computes them.

    input_ids [n] (image placeholders expanded), image_grid_thw [k, 3] of its images in
    order. Returns (positions [3, n] int64, rope_delta int). Text tokens get three equal
    ids counting on from the last position; an image's t*h*w/m^2 tokens get
    start + (t, row, col) of its merged grid (m = spatial_merge_size), after which text
    resumes at start + max(h, w)/m. rope_delta = max position + 1 - n (<= 0): token i
    after the prompt (a completion token) has position i + rope_delta in all three."""
    ids = torch.as_tensor(input_ids).tolist()
    grids = [tuple(int(x) for x in g) for g in torch.as_tensor(image_grid_thw).view(-1, 3)]
    out, pos, i, k = [], 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:   # a text run up to the next image token
            j = ids.index(image_token_id, i) if image_token_id in ids[i:] else len(ids)
            out.append(torch.arange(pos, pos + j - i).view(1, -1).expand(3, -1))
            pos, i = pos + j - i, j
            continue
        if k >= len(grids):
            raise ValueError(f"prompt has more image token runs than its {len(grids)} images")
        t, h, w = grids[k][0], grids[k][1] // spatial_merge_size, grids[k][2] // spatial_merge_size
        if ids[i:i + t * h * w] != [image_token_id] * (t * h * w):
            raise ValueError(f"image {k} (grid {grids[k]}) needs {t * h * w} image tokens at "
                             f"token {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                    indexing="ij")
        out.append(torch.stack([tt, hh, ww]).view(3, -1) + pos)
        pos, i, k = pos + max(h, w), i + t * h * w, k + 1
    if k != len(grids):
        raise ValueError(f"prompt has {k} images' tokens but image_grid_thw lists {len(grids)}")
    positions = torch.cat(out, dim=1) if out else torch.zeros((3, 0), dtype=torch.long)
    delta = int(positions.max()) + 1 - len(ids) if ids else 0
    return positions, delta


def sample_positions(prompt_positions: torch.Tensor, rope_delta: int, length: int) -> torch.Tensor:
    """[3, length] positions of prompt + completion: the prompt's, then i + rope_delta."""
    n = prompt_positions.shape[1]
    tail = (torch.arange(n, length) + rope_delta).view(1, -1).expand(3, -1)
    return torch.cat([prompt_positions[:, :length], tail], dim=1)


def image_rows(image_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] image-token mask -> [B, S] row of the tower's output each image token takes
    (the images fill their tokens in [B, S] row-major order; 0 on text tokens)."""
    return (image_mask.reshape(-1).long().cumsum(0) - 1).clamp(min=0).view(image_mask.shape)
