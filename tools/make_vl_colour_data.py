"""Write a tiny visual task that a tiny random Qwen2.5-VL learns by GRPO within minutes on
a CPU: each image is white with one large square of one of `--colours` colours (red,
green, blue); the answer is the colour's digit (1 red, 2 green, 3 blue). And warm-start
the tiny model so that it answers with one of those digits, at random.

    python tools/make_vl_colour_data.py --out_dir /tmp/vl_colour --model <tiny Qwen2.5-VL>
    # -> /tmp/vl_colour/{train,val}.jsonl, images/, and model/ (the warm-started copy)
    megatron rlhf --rlhf_type grpo --model /tmp/vl_colour/model \
        --dataset /tmp/vl_colour/train.jsonl --val_dataset /tmp/vl_colour/val.jsonl \
        --dataset_shuffle false --freeze_aligner false --reward_funcs accuracy ...

Why this task (tools/make_vl_count_data.py's counting did not learn, docs/vision-language.md):
- The colour of a large square is a global feature that survives a random frozen vision
  tower: a linear probe on the tower's merged output separates the colours perfectly,
  where counting small squares needs features a random tower does not give.
- The classes are balanced and interleaved (row i has colour i mod colours), so with
  `--dataset_shuffle false` every step's prompts hold the colours in equal shares. The
  best answer that ignores the image is then right on 1/colours of the prompts, the bar a
  learning run must clear by far (an imbalanced step pushes every image's answer toward
  that step's majority; that drift, not the images, decided the count runs).
- A random model writes a given digit with probability ~5e-4, so GRPO would wait long
  for a first right answer, and the first digit it happens to reinforce takes over every
  image (seen: accuracy = that digit's share). A pretrained model starts from a format
  it already follows; `warm_start` gives the tiny one that much: a few steps of
  supervised training on the mean log-likelihood of ALL the answer digits for every
  training image, whose optimum is the uniform distribution over them whatever the
  image. So it knows the answer set and nothing about which answer goes with which
  image: its accuracy is 1/colours, and only the reward can teach the mapping.

A row: {"messages": [{"role": "user", "content": "<image>Which colour ...?"}],
"images": ["images/0000.png"], "solution": "2"}; the image path is relative to the
jsonl's folder. `--blank` draws no square (every image white): the control run, which
must stay at 1/colours. Deterministic: the same arguments write the same bytes (the
warm start too, on one machine).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from typing import Dict, List, Sequence

# Run as a script (`python tools/make_vl_colour_data.py`), the repo root is not on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLOURS = (("red", (255, 0, 0)), ("green", (0, 160, 0)), ("blue", (0, 0, 255)))
WIDTH, HEIGHT = 112, 84


def question(colours: int) -> str:
    legend = ", ".join(f"{k + 1} {name}" for k, (name, _) in enumerate(COLOURS[:colours]))
    return f"<image>Which colour is the square? {legend}."


def draw_square_image(rng: random.Random, colour: int, blank: bool = False):
    """White WIDTHxHEIGHT RGB image with one square of side 48-64 px (a third of the image
    or more) of COLOURS[colour], at a random place."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    side = rng.randint(48, 64)
    x, y = rng.randint(0, WIDTH - side), rng.randint(0, HEIGHT - side)
    if not blank:
        ImageDraw.Draw(img).rectangle([x, y, x + side - 1, y + side - 1],
                                      fill=COLOURS[colour][1])
    return img


def make_rows(out_dir: str, n: int, colours: int, seed: int, prefix: str,
              blank: bool = False) -> List[Dict]:
    """Draw n images into out_dir/images (names prefix_NNNN.png); row i has colour
    i mod colours."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    rows = []
    for i in range(n):
        colour = i % colours
        name = f"images/{prefix}_{i:04d}.png"
        draw_square_image(rng, colour, blank).save(os.path.join(out_dir, name))
        rows.append({"messages": [{"role": "user", "content": question(colours)}],
                     "images": [name], "solution": str(colour + 1)})
    return rows


def warm_start(model_dir: str, out_dir: str, rows: Sequence[Dict], base_dir: str,
               answers: Sequence[str], steps: int = 30, lr: float = 1e-2,
               max_pixels: int = None, seed: int = 0) -> str:
    """Copy the model to out_dir after `steps` Adam steps (one prompt each, the rows in
    turn) on  L = -mean_a log p(a | prompt, image)  over the answer tokens a, the
    language model only (the vision tower and merger stay as they are). L is smallest
    at p(a) = 1/len(answers) for every a, the same for every image, so the copy follows
    the answer format without any hint of the right answer. Returns out_dir."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron_grpo.data.vision import VisionProcessor

    torch.manual_seed(seed)
    vp = VisionProcessor(model_dir, max_pixels)
    ids = [vp.tokenizer.convert_tokens_to_ids(a) for a in answers]
    if any(i is None or i == vp.tokenizer.unk_token_id for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"answers {list(answers)} must be distinct single tokens")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(".visual." not in f".{name}")
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr)
    encoded = [vp.encode(r["messages"], r["images"], base_dir) for r in rows]
    for step in range(steps):
        e = encoded[step % len(encoded)]
        logits = model(input_ids=torch.tensor([e.prompt_ids]), pixel_values=e.pixel_values,
                       image_grid_thw=e.image_grid_thw).logits[0, -1]
        loss = -logits.log_softmax(-1)[ids].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):       # tokenizer, processor and generation files
        src = os.path.join(model_dir, name)
        if os.path.isfile(src) and not name.endswith(".safetensors"):
            shutil.copyfile(src, os.path.join(out_dir, name))
    model.save_pretrained(out_dir)
    return out_dir


def main(argv=None) -> Dict[str, str]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--n", type=int, default=64, help="training rows")
    ap.add_argument("--n_val", type=int, default=12, help="validation rows (other images)")
    ap.add_argument("--colours", type=int, default=2, help="2 (red, green) or 3 (+ blue)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--blank", action="store_true",
                    help="white images without the square (the control: nothing to see)")
    ap.add_argument("--model", help="a tiny Qwen2.5-VL to warm-start into OUT_DIR/model")
    ap.add_argument("--warm_start_steps", type=int, default=30)
    ap.add_argument("--max_pixels", type=int, default=None,
                    help="the pixel budget the GRPO run will use (for the warm start)")
    args = ap.parse_args(argv)
    if not 2 <= args.colours <= len(COLOURS):
        raise ValueError(f"--colours {args.colours}: allowed 2..{len(COLOURS)}")
    if args.n < args.colours or args.n_val < 0:
        raise ValueError(f"--n {args.n} must be >= --colours, --n_val {args.n_val} >= 0")
    out = {}
    for split, n, seed in (("train", args.n, args.seed), ("val", args.n_val, args.seed + 1)):
        if n == 0:
            continue
        rows = make_rows(args.out_dir, n, args.colours, seed, split, args.blank)
        out[split] = os.path.join(args.out_dir, f"{split}.jsonl")
        with open(out[split], "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        if split == "train" and args.model:
            out["model"] = warm_start(args.model, os.path.join(args.out_dir, "model"), rows,
                                      args.out_dir, [str(k + 1) for k in range(args.colours)],
                                      args.warm_start_steps, max_pixels=args.max_pixels)
    print(" ".join(f"{k}={v}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
