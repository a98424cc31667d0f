"""rStar2-Agent's resample-on-correct selection (microsoft/rStar `rstar2_agent/down_sample/roc.py`,
`resample_of_correct`) transcribed for the tests, so `cleaner.engine.purify.selection` is checked
against the reference's arithmetic rather than against itself.

The reference works on a verl DataProto: every row's uid (its prompt's group), its summed token
scores (the reward) and a penalty weight per row; it returns the batch filtered by a boolean mask.
This transcription takes those three columns and returns the mask, statement for statement, the
group-whole branch included; the penalty weights, which the reference computes from decoded text,
are the caller's (cleaner's come from tool statuses, selection.py says why).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np


def resample_of_correct_mask(uids: Sequence[str], rewards: Sequence[float], penalty_weights: Sequence[float],
                             down_sample_to_n: int, min_zero_reward_trace_num: int,
                             min_non_zero_reward_trace_num: int) -> list[bool]:
    """The reference's `valid_mask` over the rows."""
    assert min_zero_reward_trace_num + min_non_zero_reward_trace_num <= down_sample_to_n
    uids = np.array(uids, dtype=object)
    uid_rewards_all = np.array(rewards, dtype=np.float64)
    penalty_weights = np.array(penalty_weights, dtype=np.float64)
    valid_mask = [False] * len(uids)
    for uid in np.unique(uids):
        indices = np.where(uids == uid)[0]
        if len(indices) < down_sample_to_n:
            continue
        if len(indices) == down_sample_to_n:
            for index in indices:
                valid_mask[index] = True
            continue
        uid_mask = uids == uid
        uid_rewards = uid_rewards_all[uid_mask]
        zero_reward_pairs = [(i, w) for i, r, w in zip(indices, uid_rewards, penalty_weights[uid_mask], strict=True)
                             if r <= 0]
        non_zero_reward_pairs = [(i, w) for i, r, w in zip(indices, uid_rewards, penalty_weights[uid_mask],
                                                           strict=True) if r > 0]
        non_zero_reward_pairs.sort(key=lambda x: x[1])
        zero_num = round(len(zero_reward_pairs) * down_sample_to_n / len(indices))
        non_zero_num = round(len(non_zero_reward_pairs) * down_sample_to_n / len(indices))
        if zero_num < min_zero_reward_trace_num and non_zero_num < min_non_zero_reward_trace_num:
            for index in indices:
                valid_mask[index] = True
            continue
        if zero_num <= min(min_zero_reward_trace_num, len(zero_reward_pairs)):
            zero_num = min(min_zero_reward_trace_num, len(zero_reward_pairs))
            non_zero_num = down_sample_to_n - zero_num
        if non_zero_num <= min(min_non_zero_reward_trace_num, len(non_zero_reward_pairs)):
            non_zero_num = min(min_non_zero_reward_trace_num, len(non_zero_reward_pairs))
            zero_num = down_sample_to_n - non_zero_num
        choices = [pair[0] for pair in non_zero_reward_pairs[:non_zero_num]] + \
            [pair[0] for pair in zero_reward_pairs[:zero_num]]
        assert len(choices) == down_sample_to_n
        for index in choices:
            valid_mask[index] = True
    return valid_mask


def error_ratio(text: str) -> float:
    """The reference's error ratio of a decoded trajectory: responses containing "error"."""
    matches = re.findall(r"<tool_response>.*?</tool_response>", text, re.DOTALL)
    if not matches:
        return 0.5
    return len([match for match in matches if "error" in match.lower()]) / len(matches)
