"""The tiny policy's tokenizer: a 512-token byte-level BPE with the ChatML/tool special tokens.

Design decisions:
- Digits are split one per token by a pre-tokenizer, so every number is spelt digit by digit
  (a 0.5M-parameter model copies digits far more reliably than it learns merged number pieces).
- The special tokens are single ids (`ChatFormat` requires `</tool_call>` and `<|im_end|>` to be),
  and the BPE never merges across them, so encoding a trajectory segment by segment gives the same
  ids as encoding it whole.
- The chat template renders a SHORT system line (unless the messages bring their own), each
  message as `<|im_start|>role\\ncontent<|im_end|>\\n`, and the generation prompt
  `<|im_start|>assistant\\n`. `tools` is accepted and ignored: the tiny model knows its one tool, and
  a rendered JSON schema would cost ~100 tokens of every prompt. An assistant message's
  `tool_calls` and a `tool` message render as Qwen's template renders them (the chat format of
  `model/chat.py`), so an exported conversation (`cleaner export`) renders back to the tokens the
  policy generated.
- A BPE rather than characters: sequences are several times shorter at the same vocabulary budget.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from cleaner.engine.model.chat import (
    IM_END,
    IM_START,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
)

ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE,
                  TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
DEFAULT_VOCAB_SIZE = 512
SYSTEM_LINE = "You solve problems with a Python tool."

CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + SYSTEM_LINE + "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set call = call['function'] or call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{ call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train the BPE on `texts` and wrap it as a PreTrainedTokenizerFast with the chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=IM_END, pad_token=ENDOFTEXT, bos_token=None,
        unk_token=None, additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
