"""Each reference prompt equals the text Open-CLEANER's dataset class builds for a sample row.

The expected strings are built here from the reference's own literals and expressions (its
`recipe/cleaner/reward.py`, `CustomRLHFDataset`), copied verbatim, not from cleaner's constants.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from cleaner.config import PromptStyle
from cleaner.engine.collect.datasets import load_dataset
from cleaner.engine.collect.tasks import load_rl_parquet

# ---- the reference's module-level strings, verbatim ------------------------------------------
answer_format = "\nRemember once you make sure the current answer is your final answer, do not call the tools again and directly output the final answer in the following text format, the answer format must be: \\boxed{'The final answer goes here.'}."  # noqa: E501
math_prompt_1 = "Analyze and solve the following math problem step by step. \n\n"
math_prompt_2 = "\n\nThe tool could be used for more precise and efficient calculation and could help you to verify your result before you reach the final answer."  # noqa: E501
agent_prompt = "\n\n**Note: You should first analyze the problem and form a high-level solution strategy, then utilize the tools to help you solve the problem.**"  # noqa: E501


def reference_map_fn(problem):
    return math_prompt_1 + problem + math_prompt_2 + agent_prompt + answer_format


def reference_map_fn_gpqa(problem, domain):
    prompt_1 = f"Analyze and solve the following {domain} problem step by step. \n\n"
    return prompt_1 + problem + math_prompt_2 + agent_prompt + answer_format + "\n Here you need to put the final uppercase letter option of this problem into \\boxed{}"  # noqa: E501


def reference_map_lcb(problem, reward_model_json):
    start_prompt = "You will be given a question (problem specification) and will generate a correct Python program that matches the specification and passes all tests.\n\n"  # noqa: E501
    code_prompt = "\n\nRead the inputs from stdin solve the problem and write the answer to stdout (do not directly test on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n```python\n# YOUR CODE HERE\n\""  # noqa: E501
    reward_model = json.loads(reward_model_json)
    inputs = reward_model['ground_truth']['inputs']
    outputs = reward_model['ground_truth']['outputs']
    public_examples = "\nHere are some input and output examples of the expected code:\nInput:" + str(inputs) + "\nOutput:\n" + str(outputs)  # noqa: E501
    return start_prompt + problem + public_examples + agent_prompt + code_prompt + "\nBefore sumbit your code, you can utilize tools to check the correctness of your code, once you make sure the current code is correct, do not call the tools again and submit your code within ```python\n# YOUR CODE HERE\n```."  # noqa: E501


def reference_map_fn2(content):
    return content + "\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be the numerical value of the final answer only, without any units."  # noqa: E501


def reference_map_fn_skywork(content, data_source):
    if "code" in data_source:
        return content + agent_prompt + "\nBefore sumbit your code, you can utilize tools to check the correctness of your code, once you make sure the current code is correct, do not call the tools again and submit your code within ```python\n# YOUR CODE HERE\n```."  # noqa: E501
    return math_prompt_1 + content + math_prompt_2 + agent_prompt + answer_format + "\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be the final numerical value of the final answer only, without any units."  # noqa: E501


# ---- sample rows -------------------------------------------------------------------------------

PROBLEM = "Find the number of ordered pairs $(x, y)$ with $x + y = 10$."
LCB_TESTS = json.dumps({"ground_truth": {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}})


def _write(tmp_path, name, rows):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _content(path, style=PromptStyle.REFERENCE):
    (task,) = load_dataset(path, style).tasks
    (message,) = task.messages
    assert message["role"] == "user"
    return message["content"]


def test_aime_prompts(tmp_path):
    aime24 = _write(tmp_path, "a24.parquet", [{"Problem": PROBLEM, "Answer": 45, "data_source": "AIME2024"}])
    aime25 = _write(tmp_path, "a25.parquet", [{"problem": PROBLEM, "answer": "45", "data_source": "AIME2025"}])
    assert _content(aime24) == _content(aime25) == reference_map_fn(PROBLEM)


def test_gpqa_prompt(tmp_path):
    path = _write(tmp_path, "gpqa.parquet", [{"problem": PROBLEM + "\nA) 1\nB) 2", "solution": "B",
                                              "domain": "Physics", "data_source": "gpqa_diamond"}])
    assert _content(path) == reference_map_fn_gpqa(PROBLEM + "\nA) 1\nB) 2", "Physics")


def test_livecodebench_prompt(tmp_path):
    path = _write(tmp_path, "lcb.parquet", [{"problem": "Add two numbers.", "ability": "Code",
                                             "reward_model": LCB_TESTS, "extra_info": json.dumps({"index": 0}),
                                             "data_source": "LiveCodeBench_v6"}])
    assert _content(path) == reference_map_lcb("Add two numbers.", LCB_TESTS)


def test_bare_prompts_are_the_problem_alone(tmp_path):
    path = _write(tmp_path, "a24.parquet", [{"Problem": PROBLEM, "Answer": 45, "data_source": "AIME2024"}])
    assert _content(path, PromptStyle.BARE) == PROBLEM


def _verl(question, source):
    return {"prompt": [{"role": "user", "content": question}], "reward_model": {"ground_truth": "1"},
            "data_source": source}


def test_training_sources_get_the_reference_additions_by_the_files_first_row(tmp_path):
    dapo_first = _write(tmp_path, "dapo.parquet", [_verl("Q1", "math_dapo"), _verl("Q2", "train-code-taco-1")])
    assert [t.messages[0]["content"] for t in load_rl_parquet(dapo_first)] == [
        reference_map_fn2("Q1"), reference_map_fn2("Q2")]
    science = _write(tmp_path, "science.parquet", [_verl("Q3", "mega-science")])
    assert load_rl_parquet(science)[0].messages[0]["content"] == reference_map_fn2("Q3")
    skywork = _write(tmp_path, "skywork.parquet", [_verl("Q4", "train-math-deepscaler"),
                                                    _verl("Q5", "train-code-leetcode-Easy")])
    assert [t.messages[0]["content"] for t in load_rl_parquet(skywork)] == [
        reference_map_fn_skywork("Q4", "train-math-deepscaler"),
        reference_map_fn_skywork("Q5", "train-code-leetcode-Easy")]
    assert [t.messages[0]["content"] for t in load_rl_parquet(skywork, prompt_style=PromptStyle.BARE)] == ["Q4", "Q5"]


# ---- the no-tool baseline: the reference's CustomRLHFDataset_notool, verbatim ----------------------

def reference_notool_map_fn(problem):
    return math_prompt_1 + problem + answer_format


def reference_notool_map_fn_gpqa(problem, domain):
    prompt_1 = f"Analyze and solve the following {domain} problem step by step. \n\n"
    return prompt_1 + problem + answer_format + "\n Here you need to put the final uppercase letter option of this problem into \\boxed{}"  # noqa: E501


def reference_notool_map_lcb(problem, reward_model_json):
    start_prompt = "You will be given a question (problem specification) and will generate a correct Python program that matches the specification and passes all tests.\n\n"  # noqa: E501
    code_prompt = "\n\nRead the inputs from stdin solve the problem and write the answer to stdout (do not directly test on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n```python\n# YOUR CODE HERE\n\""  # noqa: E501
    reward_model = json.loads(reward_model_json)
    inputs = reward_model['ground_truth']['inputs']
    outputs = reward_model['ground_truth']['outputs']
    public_examples = "\nHere are some input and output examples of the expected code:\nInput:" + str(inputs) + "\nOutput:\n" + str(outputs)  # noqa: E501
    return start_prompt + problem + public_examples + code_prompt


def reference_notool_map_fn_skywork(content, data_source):
    if "code" in data_source:
        return content + "\nOnce you make sure the current code is correct, submit your code within ```python\n# YOUR CODE HERE\n```."  # noqa: E501
    return math_prompt_1 + content + answer_format + "\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be the final numerical value of the final answer only, without any units."  # noqa: E501


def test_the_no_tool_baseline_gets_the_references_no_tool_prompts(tmp_path):
    """multi_turn off (the reference's qwen*_notool.sh) reads datasets as its no-tool dataset class does."""
    def contents(path):
        return [task.messages[0]["content"] for task in load_dataset(path, tools=False).tasks]

    aime24 = _write(tmp_path, "a24.parquet", [{"Problem": PROBLEM, "Answer": 45, "data_source": "AIME2024"}])
    gpqa = _write(tmp_path, "gpqa.parquet", [{"problem": PROBLEM, "solution": "B", "domain": "Physics",
                                              "data_source": "gpqa_diamond"}])
    lcb = _write(tmp_path, "lcb.parquet", [{"problem": "Add two numbers.", "ability": "Code", "reward_model": LCB_TESTS,
                                            "extra_info": json.dumps({"index": 0}), "data_source": "LiveCodeBench_v6"}])
    dapo = _write(tmp_path, "dapo.parquet", [_verl("Q1", "math_dapo")])
    skywork = _write(tmp_path, "skywork.parquet", [_verl("Q4", "train-math-deepscaler"),
                                                    _verl("Q5", "train-code-leetcode-Easy")])
    assert contents(aime24) == [reference_notool_map_fn(PROBLEM)]
    assert contents(gpqa) == [reference_notool_map_fn_gpqa(PROBLEM, "Physics")]
    assert contents(lcb) == [reference_notool_map_lcb("Add two numbers.", LCB_TESTS)]
    assert contents(dapo) == [reference_map_fn2("Q1")]  # the same edit with or without tools
    assert contents(skywork) == [reference_notool_map_fn_skywork("Q4", "train-math-deepscaler"),
                                 reference_notool_map_fn_skywork("Q5", "train-code-leetcode-Easy")]
    from cleaner.config import CollectConfig
    from cleaner.engine.collect.job import load_tasks
    (notool,) = load_tasks(CollectConfig(data=str(skywork), n_prompts=1, multi_turn=False))
    (tool,) = load_tasks(CollectConfig(data=str(skywork), n_prompts=1))
    assert (notool.messages[0]["content"], tool.messages[0]["content"]) == (
        reference_notool_map_fn_skywork("Q4", "train-math-deepscaler"),
        reference_map_fn_skywork("Q4", "train-math-deepscaler"))
