"""The TRL side of tools/bench_peer.py: Hugging Face TRL's GRPOTrainer on a spec.

Runs inside the peer virtual environment (trl, transformers, torch; not megatron-core,
not vLLM), started by bench_peer.py as

    <peer-venv>/bin/python tools/peer_trl_grpo.py SPEC.json

SPEC.json (written by bench_peer.py from our own resolved config) names the model
folder, the dataset, the reward plugin, the GRPOConfig keyword arguments and where to
write the result. What is shared with megatron-grpo, imported from this checkout (pure
Python, no Megatron import): the prompt loading and chat rendering
(`megatron_grpo.data`), the prompt order (our `PromptSampler` with the same seed; TRL
then reads the rows in that order, `shuffle_dataset=False`), and the reward functions
themselves (`megatron_grpo.rewards` after loading the same plugin files). So both
sides score the same prompts at the same step with the same function.

Timings come from a subclass that only wraps two of GRPOTrainer's methods:

    generate_s  `_generate_single_turn` (transformers `generate`, padding, EOS masking)
    prepare_s   `_generate_and_score_completions` (the above, decoding, rewards,
                advantages, old log-probs when TRL needs them)

and a callback: step_s is the wall time between consecutive `on_step_end` calls (the
first from its `on_step_begin`), the same definition as our `timing/step`; TRL's
logging and checkpointing after a step fall into the next step, as ours do.

The result JSON: epoch times of the process start, first step begin and end; one row
per optimizer step (step_s, generate_s, prepare_s, reward, completions/mean_length);
the resolved GRPOConfig; torch threads; package versions.
"""
import time

T_START = time.time()   # before the imports: they are part of the start-up

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def load_rows(spec: dict, tokenizer) -> list:
    """Prompt rows in the order our trainer would draw them (one block per generation)."""
    from megatron_grpo.data import PromptSampler, load_prompt_dataset, render_prompt

    ds = load_prompt_dataset(spec["dataset"], seed=spec["seed"], system=spec.get("system"),
                             columns=spec.get("columns"))
    sampler = PromptSampler(len(ds), spec["prompts_per_generation"], seed=spec["seed"],
                            shuffle=spec["shuffle"])
    rows = []
    for _ in range(spec["generation_batches"]):
        for i in sampler.next_batch():
            row = {"prompt": render_prompt(tokenizer, ds.messages[i])}
            row.update({k: v[i] for k, v in ds.columns.items()})
            rows.append(row)
    return rows


def reward_functions(spec: dict) -> list:
    """Our registered reward functions, by name, after loading the same plugins."""
    from megatron_grpo.rewards import REWARDS, load_plugins

    load_plugins(spec.get("external_plugins") or [])
    funcs = []
    for name in spec["reward_funcs"]:
        fn = REWARDS.get(name)
        if fn is None or isinstance(fn, type):
            raise SystemExit(f"peer_trl_grpo: reward {name!r} is not a plain registered function; "
                             "the TRL side supports function rewards only")
        funcs.append(fn)
    return funcs


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    sys.path.insert(0, spec["repo_root"])
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    dataset = Dataset.from_list(load_rows(spec, tokenizer))
    funcs = reward_functions(spec)
    args = GRPOConfig(**spec["grpo_config"])

    class TimedGRPOTrainer(GRPOTrainer):
        generate_s = 0.0
        prepare_s = 0.0

        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                self.generate_s += time.perf_counter() - t0

        def _generate_and_score_completions(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                self.prepare_s += time.perf_counter() - t0

    timeline = {"first_begin": None, "first_end": None, "rows": []}

    class Timeline(TrainerCallback):
        last = None

        def on_step_begin(self, args, state, control, **kw):
            if self.last is None:
                timeline["first_begin"] = time.time()
                self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            if timeline["first_end"] is None:
                timeline["first_end"] = time.time()
            timeline["rows"].append({"step": state.global_step, "step_s": now - self.last,
                                     "generate_s": trainer.generate_s,
                                     "prepare_s": trainer.prepare_s})
            trainer.generate_s = trainer.prepare_s = 0.0
            self.last = now

        def on_log(self, args, state, control, logs=None, **kw):
            rows = timeline["rows"]
            if logs and rows and rows[-1]["step"] == state.global_step:
                for key in ("reward", "completions/mean_length"):
                    if key in logs:
                        rows[-1][key] = float(logs[key])

    trainer = TimedGRPOTrainer(model=spec["model"], reward_funcs=funcs, args=args,
                               train_dataset=dataset, processing_class=tokenizer,
                               callbacks=[Timeline()])
    trainer.train()
    t_train_end = time.time()
    trainer.save_model(os.path.join(spec["grpo_config"]["output_dir"], "final"))

    import transformers
    import trl

    resolved = json.loads(json.dumps(trainer.args.to_dict(), default=str))
    result = {"t_start": T_START, "t_first_step_begin": timeline["first_begin"],
              "t_first_step_end": timeline["first_end"], "t_train_end": t_train_end,
              "t_end": time.time(), "rows": timeline["rows"], "args": resolved,
              "threads": torch.get_num_threads(),
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                           "torch": torch.__version__}}
    with open(spec["result"], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: peer_trl_grpo.py SPEC.json")
    main(sys.argv[1])
