"""Write a tiny visual counting task in ms-swift's multimodal format: each image holds
1..max_count red squares (and, with --distractors, blue ones that do not count) on
white; the answer is the number of red squares, one digit.

    python tools/make_vl_count_data.py --out_dir /tmp/vl_count --n 64
    # -> /tmp/vl_count/train.jsonl and /tmp/vl_count/images/0000.png ...
    megatron rlhf --rlhf_type grpo --model <Qwen2.5-VL> --dataset /tmp/vl_count/train.jsonl \
        --reward_funcs accuracy ...

A row: {"messages": [{"role": "user", "content": "<image>How many red squares ...?"}],
"images": ["images/0000.png"], "solution": "3"}; the image path is relative to the
jsonl's folder (data/vision.py looks there). `accuracy` compares the completion (or
its <answer>) with `solution`. Squares sit in distinct cells of a grid, so they never
touch and a count of red blobs equals the answer. The default 112x84 image is 6x8
patches of 14 px, 12 tokens for Qwen2.5-VL's 2x2 merger (tools/make_tiny_vl_model.py's
pixel budget keeps it whole). Deterministic: the same arguments write the same bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List

SQUARE = 12          # side of a square, pixels
CELL = 28            # grid cell; a square is placed inside one with a random offset
QUESTION = "<image>How many red squares are in the picture? Answer with a single digit."


def draw_counting_image(rng: random.Random, count: int, distractors: int, width: int,
                        height: int):
    """A white RGB image with `count` red and `distractors` blue squares in distinct cells."""
    from PIL import Image, ImageDraw

    cells = [(x, y) for y in range(0, height - CELL + 1, CELL)
             for x in range(0, width - CELL + 1, CELL)]
    if count + distractors > len(cells):
        raise ValueError(f"{count + distractors} squares do not fit a {width}x{height} image "
                         f"({len(cells)} cells of {CELL} px)")
    img = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(img)
    for k, (x, y) in enumerate(rng.sample(cells, count + distractors)):
        dx, dy = rng.randrange(CELL - SQUARE), rng.randrange(CELL - SQUARE)
        pen.rectangle([x + dx, y + dy, x + dx + SQUARE - 1, y + dy + SQUARE - 1],
                      fill=(255, 0, 0) if k < count else (0, 0, 255))
    return img


def make_count_rows(out_dir: str, n: int = 64, seed: int = 1234, max_count: int = 4,
                    distractors: bool = False, width: int = 112,
                    height: int = 84) -> List[Dict]:
    """Draw n images into out_dir/images and return the rows (not yet written)."""
    if not 1 <= max_count <= 9:
        raise ValueError(f"--max_count {max_count}: the answer is one digit, allowed 1..9")
    if n < 1:
        raise ValueError(f"--n {n} must be >= 1")
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    rows = []
    for i in range(n):
        count = rng.randint(1, max_count)
        extra = rng.randint(0, 2) if distractors else 0
        name = f"images/{i:04d}.png"
        draw_counting_image(rng, count, extra, width, height).save(os.path.join(out_dir, name))
        rows.append({"messages": [{"role": "user", "content": QUESTION}], "images": [name],
                     "solution": str(count)})
    return rows


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max_count", type=int, default=4)
    ap.add_argument("--distractors", action="store_true", help="add 0-2 blue squares per image")
    ap.add_argument("--width", type=int, default=112)
    ap.add_argument("--height", type=int, default=84)
    args = ap.parse_args(argv)
    rows = make_count_rows(args.out_dir, args.n, args.seed, args.max_count, args.distractors,
                           args.width, args.height)
    path = os.path.join(args.out_dir, "train.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {path}")
    return path


if __name__ == "__main__":
    main()
