"""Multi-turn rollouts without vLLM: the scheduler contract and token-exact trajectories.

A scripted sampler stands in for vLLM's generate (what it "samples" is fixed text, so
the expected trajectory can be written down by hand); the tokenizer and chat template
are the tiny model's real ones. What is checked: the token ids of every turn's prompt
(prompt + everything so far, exactly), the loss mask (1 on the model's tokens only),
the rollout log-probs (one per model token), max_length truncation, the gym scheduler
with the number-guessing environment, and an ms-swift-style plugin scheduler.
"""
from __future__ import annotations

import copy
import os

import pytest

from megatron_grpo.data.template import render_chat
from megatron_grpo.multi_turn.builtin import calculate
from megatron_grpo.rollout.colocate import Completion
from megatron_grpo.multi_turn import RolloutInferRequest, build_scheduler, multi_turns
from megatron_grpo.rollout.trajectory import run_trajectories

SYSTEM = {"role": "system", "content": "Use the calculator."}
USER = {"role": "user", "content": "What is 2 * 3?"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", vocab_size=999)
    return AutoTokenizer.from_pretrained(str(path))


class Scripted:
    """A scripted engine: the next scripted reply of each trajectory, with made-up
    log-probs, decoded like an engine with continuous batching: every request in flight
    takes one token per step, and a finished turn's next prompt joins at once. Records
    every prompt, and `events`: (step, "done" | "submit", trajectory) in order."""
    tp_size = 1

    def __init__(self, tok, reply, stop=True):
        self.tok, self.reply, self.stop, self.prompts = tok, reply, stop, []
        self.counter, self.events = 0, []

    def _sample(self, p):
        self.prompts.append(list(p))
        text = self.reply(self.tok.decode(p, skip_special_tokens=False))
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if self.stop is True:                       # stopped at eos (else: a stop string)
            ids = ids + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        logps = [-(self.counter + k + 1) / 100 for k in range(len(ids))]
        self.counter += len(ids)
        return Completion(0, ids, text, not self.stop, logps,
                          "stop" if self.stop else "length")    # stop=False: cut

    def generate_turns(self, prompts, next_turn, **kw):
        running = {i: [self._sample(p), 0] for i, p in enumerate(prompts)}   # [turn, tokens]
        step = 0
        while running:
            step += 1
            for i in sorted(running):
                c, made = running[i]
                running[i][1] = made = made + 1
                if made < len(c.token_ids):
                    continue
                del running[i]
                self.events.append((step, "done", i))
                nxt = next_turn(i, c)
                if nxt is not None:
                    self.events.append((step, "submit", i))
                    running[i] = [self._sample(nxt), 0]


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def calculator_reply(prompt_text):
    return "The answer is 6" if "<|im_start|>tool" in prompt_text else "<tool_call>2*3</tool_call>"


def test_calculate():
    assert calculate("2*3") == "6" and calculate("(7 - 1) / 4") == "1.5"
    assert calculate("10/0").startswith("error") and calculate("__import__('os')").startswith("error")
    assert calculate("2**99999").startswith("error")       # no powers


def test_tool_call_trajectory_is_token_exact_with_masks(tok):
    engine = Scripted(tok, calculator_reply)
    sched = build_scheduler("calculator", max_turns=4, tokenizer=tok)
    [t] = run_trajectories(engine, tok, sched, [RolloutInferRequest([SYSTEM, USER])])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = ids(tok, render_chat(tok, [SYSTEM, USER], add_generation_prompt=True))
    turn1 = ids(tok, "<tool_call>2*3</tool_call>") + [eos]
    # by hand: the tool message, then the template's generation prompt (the tiny template
    # is a hybrid-thinking one: "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    gen = render_chat(tok, [USER], add_generation_prompt=True)[
        len(render_chat(tok, [USER], add_generation_prompt=False)):]
    assert gen.startswith("<|im_start|>assistant\n")
    tool = ids(tok, "\n<|im_start|>tool\n6<|im_end|>\n" + gen)
    turn2 = ids(tok, "The answer is 6") + [eos]
    assert t.prompt_ids == prompt
    assert t.completion_ids == turn1 + tool + turn2
    assert t.loss_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    # vLLM's log-prob of every model token, in order; none for the tool's tokens
    assert t.logprobs == [-(k + 1) / 100 for k in range(len(turn1) + len(turn2))]
    # each turn sampled from the exact ids so far
    assert engine.prompts == [prompt, prompt + turn1 + tool]
    assert t.num_turns == 2 and not t.truncated and t.text == "The answer is 6"
    assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool", "assistant"]
    # (not the template of the whole conversation re-rendered: this template drops the
    # empty think block of earlier turns, which the model did see)


# Qwen3's way with history: an assistant turn before the last user message loses its
# <think> block when the conversation is rendered again (the turns after it keep theirs).
THINK_DROPPING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and '</think>' in content and loop.index0 < ns.last_user %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_rewrites_history_keeps_the_tokens_the_model_saw(tok):
    """A scheduler appending user messages under a template that drops the <think> block
    of earlier assistant turns (Qwen3's): each turn samples from the exact ids so far,
    the earlier turn's <think> included, and the span between turns is what the template
    adds after the model's message."""
    from megatron_grpo.multi_turn import MultiTurnScheduler

    class GoOn(MultiTurnScheduler):
        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({"role": "user", "content": "go on"})
            return {"infer_request": infer_request}

    think = copy.copy(tok)
    think.chat_template = THINK_DROPPING_TEMPLATE
    reply = "<think>hm</think>\n4"
    engine = Scripted(think, lambda p: reply)
    [t] = run_trajectories(engine, think, GoOn(max_turns=3, tokenizer=think),
                           [RolloutInferRequest([USER])], max_turns=3)
    eos = think.convert_tokens_to_ids("<|im_end|>")
    turn = ids(think, reply) + [eos]
    between = ids(think, "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")
    prompt = ids(think, render_chat(think, [USER], add_generation_prompt=True))
    assert t.prompt_ids == prompt and t.num_turns == 3
    assert t.completion_ids == turn + between + turn + between + turn
    assert t.loss_mask == ([1] * len(turn) + [0] * len(between)) * 2 + [1] * len(turn)
    assert engine.prompts == [prompt, prompt + turn + between,
                              prompt + turn + between + turn + between]


def test_max_length_cuts_the_trajectory_and_max_turns_ends_it(tok):
    prompt = ids(tok, render_chat(tok, [SYSTEM, USER], add_generation_prompt=True))
    turn1 = ids(tok, "<tool_call>2*3</tool_call>") + [tok.convert_tokens_to_ids("<|im_end|>")]
    limit = len(prompt) + len(turn1) + 3                 # inside the tool's span
    sched = build_scheduler("calculator", max_turns=4, tokenizer=tok)
    [t] = run_trajectories(Scripted(tok, calculator_reply), tok, sched,
                           [RolloutInferRequest([SYSTEM, USER])], max_length=limit)
    assert t.truncated and len(t.prompt_ids) + len(t.completion_ids) == limit
    assert t.loss_mask == [1] * len(turn1) + [0] * 3 and len(t.logprobs) == len(turn1)
    # a model that always calls the tool stops at max_turns, not truncated
    always = Scripted(tok, lambda p: "<tool_call>1+1</tool_call>")
    ts = run_trajectories(always, tok, build_scheduler("calculator", max_turns=3, tokenizer=tok),
                          [RolloutInferRequest([SYSTEM, USER]) for _ in range(2)])
    assert [t.num_turns for t in ts] == [3, 3] and not any(t.truncated for t in ts)
    assert sum(ts[0].loss_mask) == len(ts[0].logprobs) == 3 * len(turn1)


def test_total_scope_cuts_everything_after_the_prompt_at_max_completion_length(tok):
    """--completion_length_limit_scope total: the model's turns and the tool's spans together
    stop at max_completion_length tokens after the prompt (cut, truncated); per_round (the
    default) lets each turn have them."""
    turn1 = ids(tok, "<tool_call>2*3</tool_call>") + [tok.convert_tokens_to_ids("<|im_end|>")]
    budget = len(turn1) + 5                                # inside the tool's span
    runs = {}
    for scope, total in (("per_round", None), ("total", budget)):
        [runs[scope]] = run_trajectories(
            Scripted(tok, calculator_reply), tok,
            build_scheduler("calculator", max_turns=4, tokenizer=tok),
            [RolloutInferRequest([SYSTEM, USER])], max_total_completion=total)
    cut, whole = runs["total"], runs["per_round"]
    assert cut.truncated and len(cut.completion_ids) == budget and cut.num_turns == 1
    assert cut.completion_ids == whole.completion_ids[:budget]
    assert cut.loss_mask == [1] * len(turn1) + [0] * 5 and len(cut.logprobs) == len(turn1)
    assert not whole.truncated and whole.num_turns == 2 and len(whole.completion_ids) > budget


def test_loss_scale_last_round_trains_the_last_model_message_only(tok):
    """--loss_scale last_round (ms-swift's mask for text schedulers): the calculator's tool
    call (message 1) leaves the loss, the answer (message 2) stays, with its log-probs; a
    message the scheduler lets the model continue (react_calculator) is one round."""
    runs = {}
    for scale in ("default", "last_round"):
        [runs[scale]] = run_trajectories(
            Scripted(tok, calculator_reply), tok,
            build_scheduler("calculator", max_turns=4, tokenizer=tok),
            [RolloutInferRequest([SYSTEM, USER])], loss_scale=scale)
    whole, last = runs["default"], runs["last_round"]
    turn1 = ids(tok, "<tool_call>2*3</tool_call>") + [tok.convert_tokens_to_ids("<|im_end|>")]
    answer = ids(tok, "The answer is 6") + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert whole.completion_ids == last.completion_ids and whole.num_turns == 2
    assert last.loss_mask == [0] * (len(whole.loss_mask) - len(answer)) + [1] * len(answer)
    assert whole.loss_mask[:len(turn1)] == [1] * len(turn1)
    assert last.logprobs == whole.logprobs[len(turn1):] and len(last.logprobs) == len(answer)
    from megatron_grpo.rewards.registry import load_plugins

    load_plugins([PLUGIN])                                 # registers react_calculator
    act = "Action: calculator\nAction Input: 2*3"
    continued = [run_trajectories(
        Scripted(tok, lambda p: "The answer is 6" if "Observation" in p else act, stop="string"),
        tok, build_scheduler("react_calculator", max_turns=3, tokenizer=tok),
        [RolloutInferRequest([USER])], loss_scale=scale)[0] for scale in ("default", "last_round")]
    assert continued[0].loss_mask == continued[1].loss_mask and continued[1].num_turns == 2


def test_a_short_trajectory_never_waits_for_a_long_one(tok):
    """Continuous batching across turns: with the scripted engine (one token per step), a
    trajectory with short turns runs all its turns while a long one is still in its first;
    each turn still samples from the exact ids of its own trajectory."""
    long_call = "<tool_call>" + "+".join(["1"] * 40) + "</tool_call>"
    engine = Scripted(tok, lambda p: long_call if "long" in p else "<tool_call>1</tool_call>")
    sched = build_scheduler("calculator", max_turns=3, tokenizer=tok)
    reqs = [RolloutInferRequest([{"role": "user", "content": w}]) for w in ("long", "short")]
    long_t, short_t = run_trajectories(engine, tok, sched, reqs)
    first_long_done = min(step for step, what, i in engine.events if what == "done" and i == 0)
    short_submits = [step for step, what, i in engine.events if what == "submit" and i == 1]
    assert len(short_submits) == 2 and max(short_submits) < first_long_done
    assert long_t.num_turns == short_t.num_turns == 3
    assert all(sum(t.loss_mask) == len(t.logprobs) for t in (long_t, short_t))
    # every prompt the engine saw is a prefix of its own trajectory
    full = [t.prompt_ids + t.completion_ids for t in (long_t, short_t)]
    assert all(any(f[:len(p)] == p for f in full) for p in engine.prompts)
    assert sum(1 for p in engine.prompts if full[1][:len(p)] == p) == 3


def test_gym_number_guessing(tok):
    def guesser(prompt_text):            # binary search on the feedback so far
        lo, hi = 1, 16
        guesses = [int(g) for g in __import__("re").findall(r"<guess>(\d+)</guess>", prompt_text)]
        for g, fb in zip(guesses, __import__("re").findall(r"user\n(higher|lower)", prompt_text)):
            lo, hi = (g + 1, hi) if fb == "higher" else (lo, g - 1)
        return f"<guess>{(lo + hi) // 2}</guess>"

    sched = build_scheduler("gym_scheduler", max_turns=8, tokenizer=tok, gym_env="guess_number")
    reqs = [RolloutInferRequest([USER], data_dict={"env_config": {"secret": s}}) for s in (8, 13, 1)]
    ts = run_trajectories(Scripted(tok, guesser), tok, sched, reqs)
    for t, secret in zip(ts, (8, 13, 1)):
        assert t.messages[0]["role"] == "system" and "between 1 and 16" in t.messages[1]["content"]
        assert t.rollout_infos["total_reward"] == 1.0 and t.rollout_infos["gym_done"]
        assert f"<guess>{secret}</guess>" in t.text
        feedback = [m["content"] for m in t.messages[2:] if m["role"] == "user"]
        assert len(feedback) == t.num_turns - 1 and set(feedback) <= {"higher", "lower"}
    assert ts[0].num_turns == 1 and ts[1].num_turns > 1
    with pytest.raises(ValueError, match="--gym_env 'nope' is not a registered environment"):
        run_trajectories(Scripted(tok, guesser), tok,
                         build_scheduler("gym_scheduler", max_turns=2, tokenizer=tok, gym_env="nope"),
                         [RolloutInferRequest([USER])])


def test_unknown_scheduler_names_the_registered_ones(tok):
    with pytest.raises(ValueError, match=r"--multi_turn_scheduler 'nope' .*calculator.*gym_scheduler"):
        build_scheduler("nope", max_turns=2, tokenizer=tok)


PLUGIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "examples", "plugins", "react_calculator.py")


def test_ms_swift_style_plugin(tok, tmp_path):
    """examples/plugins/react_calculator.py: a scheduler written to ms-swift's contract
    (async on_turn_end, check_finished, step returning response_token_ids with the
    observation masked, the `multi_turns` registry); with ms-swift's import line it is
    refused, naming the replacement."""
    from megatron_grpo.rewards.registry import load_plugins

    source = open(PLUGIN).read()
    ours = "from megatron_grpo.multi_turn import MultiTurnScheduler, multi_turns"
    assert ours in source
    swift = tmp_path / "swift_plugin.py"
    swift.write_text(source.replace(ours, "from swift.rollout.multi_turn import "
                                          "MultiTurnScheduler, multi_turns"))
    with pytest.raises(ValueError, match=f"replace it with `{ours}`"):
        load_plugins([str(swift)])
    load_plugins([PLUGIN])
    assert "react_calculator" in multi_turns

    # Turn 1 stops at a stop string (no eos): the observation continues the model's
    # message as tokens of mask 0, and turn 2 continues after it.
    act = "Action: calculator\nAction Input: 2*3"
    engine = Scripted(tok, lambda p: "The answer is 6" if "Observation" in p else act,
                      stop="string")
    sched = build_scheduler("react_calculator", max_turns=3, tokenizer=tok)
    [t] = run_trajectories(engine, tok, sched, [RolloutInferRequest([USER])])
    a, obs, done = ids(tok, act), ids(tok, "\nObservation: 6\n"), ids(tok, "The answer is 6")
    assert t.completion_ids == a + obs + done
    assert t.loss_mask == [1] * len(a) + [0] * len(obs) + [1] * len(done)
    assert t.logprobs == [-(k + 1) / 100 for k in range(len(a) + len(done))]
    assert engine.prompts[1] == t.prompt_ids + a + obs
    assert t.rollout_infos["tool_calls"] == 0 and t.num_turns == 2 and not t.truncated
    assert t.messages[-1] == {"role": "assistant",
                              "content": act + "\nObservation: 6\nThe answer is 6"}


def test_options(tmp_path):
    from megatron_grpo.config import parse_rlhf_args
    from tests.test_config_validate import args, error_of

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen2"}')
    cfg = parse_rlhf_args(args(str(d), "--multi_turn_scheduler", "calculator", "--max_turns", "3"))
    assert (cfg.rollout.multi_turn_scheduler, cfg.rollout.max_turns) == ("calculator", 3)
    assert error_of(args(str(d), "--multi_turn_scheduler", "calc", "--max_turns", "3")).startswith(
        "--multi_turn_scheduler 'calc' is not a registered scheduler; registered: [")
    assert "leaves trajectories unbounded" in error_of(args(str(d), "--multi_turn_scheduler",
                                                            "calculator"))
    # --gym_env implies --use_gym_env and gym_scheduler; its reward is one more column
    cfg = parse_rlhf_args(args(str(d), "--gym_env", "guess_number", "--max_turns", "4"))
    assert cfg.rollout.use_gym_env and cfg.rollout.multi_turn_scheduler == "gym_scheduler"
    assert cfg.reward.reward_funcs == ["countdown", "gym_reward"]
    assert error_of(args(str(d), "--gym_env", "chess", "--max_turns", "4")).startswith(
        "--gym_env 'chess' is not a registered environment; registered: ['guess_number']")
    assert error_of(args(str(d), "--max_turns", "0")).startswith("--max_turns 0 is not valid")
    assert "does not fit --vllm_max_model_len 256" in error_of(args(
        str(d), "--multi_turn_scheduler", "calculator", "--max_turns", "2", "--max_length", "250",
        "--max_completion_length", "16", "--vllm_max_model_len", "256"))
    # --completion_length_limit_scope total reaches the rollout loop as its total budget
    from megatron_grpo.train.run import build_multi_turn

    for scope, total in (("per_round", None), ("total", 48)):
        cfg = parse_rlhf_args(args(str(d), "--multi_turn_scheduler", "calculator", "--max_turns",
                                   "3", "--max_completion_length", "48",
                                   "--completion_length_limit_scope", scope,
                                   "--loss_scale", "last_round"))
        built = build_multi_turn(cfg, None)
        assert (built.max_total_completion, built.loss_scale) == (total, "last_round")
    assert "--loss_scale 'all' is an ms-swift value not supported yet" in error_of(
        args(str(d), "--loss_scale", "all"))
    assert "--completion_length_limit_scope 'all' is not a valid choice" in error_of(
        args(str(d), "--completion_length_limit_scope", "all"))


def test_example_format_rewards_score_hand_built_trajectories():
    """examples/plugins/{tool_call,guess}_reward.py: the tool ran (a tool message after a
    model turn) and answered a number 1, an error 0.75; a valid guess 1; otherwise 0.25 per
    marker the model wrote (not the system prompt's)."""
    from megatron_grpo.rewards.registry import REWARDS, load_plugins

    load_plugins([os.path.join(os.path.dirname(PLUGIN), "tool_call_reward.py"),
                  os.path.join(os.path.dirname(PLUGIN), "guess_reward.py")])
    tool, guess = REWARDS["tool_call_format"], REWARDS["guess_format"]
    system = {"role": "system", "content": "write <tool_call>EXPR</tool_call> or <guess>N</guess>"}

    def said(*turns):
        return [system, USER] + [{"role": r, "content": c} for r, c in turns]

    runs = [said(("assistant", "<tool_call>2*3</tool_call>"), ("tool", "6"), ("assistant", "6")),
            said(("assistant", "<tool_call></tool_call>"), ("tool", "error: invalid syntax")),
            said(("assistant", "x </tool_call> y <tool_call>")),      # both markers, no call
            said(("assistant", "<tool_call>2*3</tool_call> and on")),  # cut: the tool never ran
            said(("assistant", "nothing"))]
    assert tool([""] * 5, messages=runs) == [1.0, 0.75, 0.5, 0.5, 0.0]
    games = [said(("assistant", "<guess>3</guess>"), ("user", "higher")),
             said(("assistant", "<guess>x</guess>"), ("user", "Reply with <guess>N</guess>.")),
             said(("assistant", "<guess> hm"), ("user", "Reply with <guess>N</guess>.")),
             said(("assistant", "7"))]
    assert guess([""] * 4, messages=games) == [1.0, 0.5, 0.25, 0.0]


RUN_PLUGIN = """
from megatron_grpo.multi_turn import MultiTurnScheduler, multi_turns


class OwnLoop(MultiTurnScheduler):
    async def run(self, infer_request, request_config, **kwargs):
        return await self.infer_engine.infer_async(infer_request, request_config)


class Inherits(OwnLoop):
    def step(self, infer_request, response_choice, current_turn):
        return {"infer_request": infer_request}


multi_turns["own_loop"] = OwnLoop
multi_turns["inherits_own_loop"] = Inherits
"""


def test_a_scheduler_with_its_own_run_is_refused_by_name(tmp_path):
    """ms-swift lets a scheduler override run() (its own rollout loop over the engine);
    here the loop drives vLLM, so the options check refuses it, naming the class and what
    to override instead (also when run() comes from a base class)."""
    from tests.test_config_validate import args, error_of

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen2"}')
    plugin = tmp_path / "own_loop.py"
    plugin.write_text(RUN_PLUGIN)
    msg = error_of(args(str(d), "--external_plugins", str(plugin), "--multi_turn_scheduler",
                        "own_loop", "--max_turns", "2"))
    assert "--multi_turn_scheduler 'own_loop': OwnLoop overrides run()" in msg
    assert "put its logic in step()" in msg and "check_finished()" in msg
    with pytest.raises(ValueError, match=r"Inherits overrides run\(\) \(in its base OwnLoop\)"):
        build_scheduler("inherits_own_loop", max_turns=2, tokenizer=None)


def test_rollout_server_refuses_scheduler_flags_naming_the_trainer(tmp_path):
    """ms-swift's `swift rollout --multi_turn_scheduler ...` runs the scheduler on the server;
    here the trainer runs it in server mode too: `megatron rollout` refuses the flags by name,
    with their values, and says to pass them to `megatron rlhf`."""
    from megatron_grpo.config import parse_rollout_args
    from megatron_grpo.config.errors import ConfigError

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ConfigError) as e:
        parse_rollout_args(["--model", str(d), "--multi_turn_scheduler", "calculator",
                            "--max_turns=3", "--port", "8001", "--gym_env", "guess_number"])
    msg = str(e.value)
    assert "--multi_turn_scheduler calculator: --multi_turn_scheduler is not an option of " \
           "`megatron rollout`" in msg
    assert "Fix: pass --multi_turn_scheduler calculator to `megatron rlhf ... --vllm_mode " \
           "server`" in msg
    assert "pass --max_turns=3 to" in msg and "pass --gym_env guess_number to" in msg
    assert "unknown option" not in msg and "--port" not in msg      # the rest parses as usual
    assert parse_rollout_args(["--model", str(d), "--port", "8001"]).port == 8001


def test_collate_masks_tool_tokens_and_places_per_token_values():
    import torch

    from megatron_grpo.train.batch import Sample, collate, split_completion_values

    # prompt [1, 2]; completion: model 3 4 | tool 5 6 | model 7 (hand-built)
    s = Sample([1, 2], [3, 4, 5, 6, 7], rollout_logps=[-0.3, -0.4, -0.7],
               loss_mask=[1, 1, 0, 0, 1])
    plain = Sample([1, 2], [3, 4], rollout_logps=[-0.1, -0.2])
    b = collate([s, plain])
    # targets sit one to the left: completion token k at position P - 1 + k
    assert b["targets"][0].tolist() == [2, 3, 4, 5, 6, 7]
    assert b["completion_mask"][0].tolist() == [False, True, True, False, False, True]
    assert b["completion_mask"][1].tolist() == [False, True, True, False, False, False]
    assert b["rollout_logps"][0].tolist() == pytest.approx([0, -0.3, -0.4, 0, 0, -0.7])
    back = split_completion_values(b["rollout_logps"], b)
    assert back[0].tolist() == pytest.approx([-0.3, -0.4, -0.7])
    assert back[1].tolist() == pytest.approx([-0.1, -0.2])
    with pytest.raises(ValueError, match="rollout_logps has 2 values for 3 completion tokens"):
        collate([Sample([1], [3, 4, 5], rollout_logps=[0.0, 0.0], loss_mask=[1, 1, 1])])
    assert torch.equal(b["lengths"], torch.tensor([6, 3]))
