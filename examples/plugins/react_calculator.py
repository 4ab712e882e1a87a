"""An ms-swift-style multi-turn plugin: a ReAct calculator whose result continues the
model's own message (ms-swift's DeveloperGuide/multi_turn.md, "Loss mask").

Written against ms-swift's contract; for ms-swift the import line would be
`from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns`, the only change.

    megatron rlhf ... --external_plugins examples/plugins/react_calculator.py \
        --multi_turn_scheduler react_calculator --max_turns 3

The model writes `Action: calculator` / `Action Input: 2*3`; the scheduler appends
`Observation: 6` to the model's message and returns the turn's tokens with the
observation's tokens masked (response_loss_mask 0), so the next turn continues the same
assistant message and no loss falls on text the model did not write.
"""
import re
from typing import Dict

from megatron_grpo.multi_turn import MultiTurnScheduler, multi_turns

ACTION = re.compile(r"Action:\s*calculator\s*\nAction Input:\s*([0-9+\-*/(). ]+)")


class ReactCalculatorScheduler(MultiTurnScheduler):

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        calls = ACTION.findall(response_choice.message.content)
        return {'rollout_infos': {'tool_calls': len(calls)}}

    def check_finished(self, infer_request, response_choice, current_turn):
        if not ACTION.search(response_choice.message.content):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn) -> Dict:
        expression = ACTION.findall(response_choice.message.content)[-1].strip()
        if '**' in expression or len(expression) > 40:     # no powers: bounded work
            value = 'error: unsupported expression'
        else:
            try:    # only digits, + - * / ( ) . and spaces reach eval (the regex)
                value = eval(expression, {'__builtins__': {}}, {})  # noqa: S307
            except Exception as e:  # noqa: BLE001  (a bad expression is the model's mistake)
                value = f'error: {type(e).__name__}'
        observation = f'\nObservation: {value}\n'
        infer_request.messages[-1]['content'] += observation
        token_ids = list(response_choice.token_ids)
        loss_mask = [1] * len(token_ids)
        extra = self.tokenizer.encode(observation, add_special_tokens=False)
        token_ids.extend(extra)
        loss_mask.extend([0] * len(extra))
        return {'infer_request': infer_request, 'response_token_ids': token_ids,
                'response_loss_mask': loss_mask,
                'rollout_infos': {'num_turns': current_turn}}


multi_turns['react_calculator'] = ReactCalculatorScheduler
