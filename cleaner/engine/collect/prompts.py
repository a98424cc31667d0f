"""The user messages the reference builds from each data source (docs/architecture.md §12).

The paper's figures come from prompts that Open-CLEANER's dataset class assembles per data source:
a preamble, the problem, a note on the tool, and an answer format. Evaluating with other prompts
measures another task, so `PromptStyle.REFERENCE` rebuilds them character for character; the
strings below are the reference's, quirks included (a stray `"` after the code fence, "sumbit").
`PromptStyle.BARE` is the problem text alone, which is how the tiny policies were trained.

Design decisions:
- One function per source family, pure string in, string out, so a test can compare each with the
  reference's expression on a sample row.
- Training files (verl layout): the reference picks one mapping per FILE from its first row's
  `data_source` (math_dapo and mega-science: a units note appended; anything else: the Skywork
  mapping, a math preamble or a code-submission note) and edits the first prompt message, whatever
  its role. `reference_training_messages` does the same, so a mixed file such as Open-AgentRL-30K
  gets exactly the prompts the paper trained on. A verl file of an evaluation source (whose
  prompts the reference never maps, it reads those sources in their own layouts) is left unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

ANSWER_FORMAT = (
    "\nRemember once you make sure the current answer is your final answer, do not call the tools again "
    "and directly output the final answer in the following text format, the answer format must be: "
    "\\boxed{'The final answer goes here.'}."
)
MATH_PREAMBLE = "Analyze and solve the following math problem step by step. \n\n"
TOOL_NOTE = (
    "\n\nThe tool could be used for more precise and efficient calculation and could help you to verify "
    "your result before you reach the final answer."
)
AGENT_NOTE = (
    "\n\n**Note: You should first analyze the problem and form a high-level solution strategy, then "
    "utilize the tools to help you solve the problem.**"
)
GPQA_LETTER_NOTE = "\n Here you need to put the final uppercase letter option of this problem into \\boxed{}"
CODE_PREAMBLE = (
    "You will be given a question (problem specification) and will generate a correct Python program "
    "that matches the specification and passes all tests.\n\n"
)
CODE_FORMAT = (
    "\n\nRead the inputs from stdin solve the problem and write the answer to stdout (do not directly "
    "test on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the "
    "python program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
    "```python\n# YOUR CODE HERE\n\""
)
CODE_SUBMIT_NOTE = (
    "\nBefore sumbit your code, you can utilize tools to check the correctness of your code, once you "
    "make sure the current code is correct, do not call the tools again and submit your code within "
    "```python\n# YOUR CODE HERE\n```."
)
CODE_SUBMIT_NOTE_NO_TOOLS = (  # the no-tool baseline's (CustomRLHFDataset_notool)
    "\nOnce you make sure the current code is correct, submit your code within ```python\n# YOUR CODE HERE\n```."
)
UNITS_NOTE_DAPO = (
    "\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be the "
    "numerical value of the final answer only, without any units."
)
UNITS_NOTE_SKYWORK = (
    "\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be the "
    "final numerical value of the final answer only, without any units."
)

# Training sources whose prompts only get the units note (the reference's map_fn2).
UNITS_ONLY_SOURCES = ("math_dapo", "mega-science")
# The evaluation sources, which the reference only reads in their own layouts (datasets.py). A verl
# file of one of them already holds built prompts; it is left as it is.
EVAL_SOURCES = ("AIME2024", "AIME2025", "gpqa_diamond", "LiveCodeBench_v6")


def _tool_notes(tools: bool) -> str:
    """What the tool prompts add after the problem; the no-tool baseline's drop both notes."""
    return TOOL_NOTE + AGENT_NOTE if tools else ""


def aime_prompt(problem: str, tools: bool = True) -> str:
    """AIME 2024 / 2025 (the reference's map_fn; without tools, its no-tool dataset's)."""
    return MATH_PREAMBLE + problem + _tool_notes(tools) + ANSWER_FORMAT


def gpqa_prompt(problem: str, domain: str, tools: bool = True) -> str:
    """GPQA-Diamond (map_fn_gpqa): the domain's preamble and the boxed-letter instruction."""
    preamble = f"Analyze and solve the following {domain} problem step by step. \n\n"
    return preamble + problem + _tool_notes(tools) + ANSWER_FORMAT + GPQA_LETTER_NOTE


def livecodebench_prompt(problem: str, inputs: Sequence[str], outputs: Sequence[str], tools: bool = True) -> str:
    """LiveCodeBench (map_lcb): the stored tests shown as the repr of their Python lists."""
    examples = ("\nHere are some input and output examples of the expected code:\nInput:" + str(list(inputs))
                + "\nOutput:\n" + str(list(outputs)))
    if not tools:
        return CODE_PREAMBLE + problem + examples + CODE_FORMAT
    return CODE_PREAMBLE + problem + examples + AGENT_NOTE + CODE_FORMAT + CODE_SUBMIT_NOTE


def training_content(content: str, file_source: str, row_source: str, tools: bool = True) -> str:
    """A training prompt's first message under the reference's mapping for its file.

    `file_source` is the data source of the file's first row (it picks the mapping); `row_source`
    is this row's (the Skywork mapping tells code rows from math rows by it). Without tools, the
    mapping of the reference's no-tool baseline (CustomRLHFDataset_notool).
    """
    if file_source in EVAL_SOURCES:
        return content
    if file_source in UNITS_ONLY_SOURCES:
        return content + UNITS_NOTE_DAPO
    if "code" in row_source:
        return content + (AGENT_NOTE + CODE_SUBMIT_NOTE if tools else CODE_SUBMIT_NOTE_NO_TOOLS)
    return MATH_PREAMBLE + content + _tool_notes(tools) + ANSWER_FORMAT + UNITS_NOTE_SKYWORK


def reference_training_messages(messages: tuple[dict, ...], file_source: str, row_source: str,
                                tools: bool = True) -> tuple[dict, ...]:
    """`messages` with the first one's content mapped by `training_content`."""
    first = {**messages[0], "content": training_content(messages[0]["content"], file_source, row_source, tools)}
    return (first, *messages[1:])
