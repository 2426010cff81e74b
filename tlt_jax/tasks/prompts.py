"""Prompts from the config: a preset, and the system prompt, instruction and chat template overriding it.

Keys of every task kind that asks questions (`config.task.*`, all strings so the command line can set them):
- `prompt`: the preset (PROMPT_PRESETS): "default" (today's: a step-by-step system prompt and an `Answer:`
  line), "r1" (R1-style reasoning models: no system prompt, "reason step by step, and put your final answer
  within \\boxed{}", the answer read after `</think>`), "base" (base models without a chat template: the
  R1-Zero-style plain-text conversation that opens `<think>` itself), "dapo" (DAPO-Math's instruction around
  the question, an `Answer:` line), "none" (the question, or the data's own chat messages, as they are).
- `system_prompt`, `instruction`: "" = the preset's, "none" = no system message / no instruction, else the
  text. An instruction containing "{question}" is the whole user message with the question put there; any
  other instruction follows the question after a blank line.
- `chat_template`: "" = the preset's, "model" = the tokenizer's, a built-in name (CHAT_TEMPLATES), a jinja
  template (text containing "{{" or "{%") or a path to a .jinja file.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Sequence

import jinja2
import jinja2.sandbox

from tlt_jax.tasks.base import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM_PROMPT, ChatTokenizer, PromptTokenizer

NONE = "none"
MODEL_TEMPLATE = "model"
R1_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
R1_ZERO_SYSTEM = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the User with the "
    "answer. The reasoning process is enclosed within <think> </think> tags, and the final answer follows it "
    "within \\boxed{}."
)
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
# plain-text conversations for models without a chat template (no BOS: a template that wants one writes
# `{{ bos_token }}`, which render_chat provides)
_PLAIN = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
_R1_ZERO = _PLAIN.replace("Assistant:{% endif", "Assistant: <think>\n{% endif")
CHAT_TEMPLATES = {"plain": _PLAIN, "r1_zero": _R1_ZERO}


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """How a question becomes a prompt: system message and instruction (None: none), the chat template
    (None: the model's), and whether the prompt opens a think block the response must close."""

    system: str | None
    instruction: str | None
    chat_template: str | None
    think: bool


PROMPT_PRESETS = {
    "default": PromptSpec(DEFAULT_SYSTEM_PROMPT, DEFAULT_INSTRUCTION, None, False),
    "r1": PromptSpec(None, R1_INSTRUCTION, None, True),
    "base": PromptSpec(R1_ZERO_SYSTEM, None, CHAT_TEMPLATES["r1_zero"], True),
    "dapo": PromptSpec(None, DAPO_INSTRUCTION, None, False),
    NONE: PromptSpec(None, None, None, False),
}


def _template(value: str) -> str | None:
    if value == MODEL_TEMPLATE:
        return None
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    path = pathlib.Path(value).expanduser()
    if path.suffix == ".jinja" and path.is_file():
        return path.read_text(encoding="utf-8")
    raise ValueError(
        f"config.task.chat_template={value!r}: use '' (the preset's), 'model', one of "
        f"{sorted(CHAT_TEMPLATES)}, a jinja template or a path to a .jinja file"
    )


def resolve_prompt(
    prompt: str = "default",
    system_prompt: str | None = "",
    instruction: str | None = "",
    chat_template: str = "",
    think: bool = False,
) -> PromptSpec:
    """The preset `prompt` with the given overrides ("" = the preset's; None or "none" = nothing)."""
    if prompt not in PROMPT_PRESETS:
        raise ValueError(f"config.task.prompt={prompt!r}: use one of {sorted(PROMPT_PRESETS)}")
    preset = PROMPT_PRESETS[prompt]

    def pick(value: str | None, default: str | None) -> str | None:
        if value is None or value == NONE:
            return None
        return value or default

    template = _template(chat_template) if chat_template else preset.chat_template
    system, text = pick(system_prompt, preset.system), pick(instruction, preset.instruction)
    return PromptSpec(system, text, template, think or preset.think)


def user_content(question: str, instruction: str | None) -> str:
    """The user message: the question, then the instruction (or the question inside it at "{question}")."""
    if not instruction:
        return question
    if "{question}" in instruction:
        return instruction.replace("{question}", question)
    return f"{question}\n\n{instruction}"


def prompt_messages(
    spec: PromptSpec, question: str, messages: Sequence[dict[str, str]] | None = None
) -> list[dict[str, str]]:
    """Chat messages for one problem. Question data: the spec's system message, then the question with the
    instruction. Chat data (`messages`, e.g. VeRL's `prompt`): the data's messages, the spec's system
    message replacing theirs when set, the instruction applied to the last user message."""
    if messages is None:
        out = [{"role": "user", "content": user_content(question, spec.instruction)}]
        return ([{"role": "system", "content": spec.system}] if spec.system else []) + out
    out = [dict(m) for m in messages]
    if spec.system:
        out = [{"role": "system", "content": spec.system}] + [m for m in out if m["role"] != "system"]
    users = [i for i, m in enumerate(out) if m["role"] == "user"]
    if spec.instruction and users:
        out[users[-1]]["content"] = user_content(out[users[-1]]["content"], spec.instruction)
    return out


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, str]], tokenizer: PromptTokenizer) -> str:
    """`messages` through a task's own chat template (the variables transformers' templates use)."""
    bos = tokenizer.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None
    eos = tokenizer.id_to_token(tokenizer.eos_token_id)
    return _compiled(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos or "", eos_token=eos or ""
    )


def encode_prompt(spec: PromptSpec, messages: list[dict[str, str]], tokenizer: PromptTokenizer) -> list[int]:
    """Prompt token ids: the spec's chat template when it has one, else the tokenizer's."""
    if spec.chat_template is None:
        return tokenizer.encode_chat(messages)
    return tokenizer.encode(render_chat(spec.chat_template, messages, tokenizer), add_special_tokens=False)


def prompt_text(spec: PromptSpec, messages: list[dict[str, str]], tokenizer: ChatTokenizer) -> str:
    """The prompt as text, the one `encode_prompt` tokenizes (without special tokens added): for encoding
    many prompts in one `encode_batch` call."""
    if spec.chat_template is None:
        return tokenizer.apply_chat_template(messages)
    return render_chat(spec.chat_template, messages, tokenizer)
