"""Prompts from the config: presets (default, r1, base, dapo, none), system prompt / instruction / chat
template overrides, a task's own template rendered and tokenized, and the keys set from the command line."""

from __future__ import annotations

import pytest
from absl import flags
from ml_collections import config_flags

from tlt_jax.tasks import Problem
from tlt_jax.tasks.base import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM_PROMPT
from tlt_jax.tasks.datasets import ReasoningGymTask, task_config
from tlt_jax.tasks.prompts import (
    CHAT_TEMPLATES,
    R1_INSTRUCTION,
    encode_prompt,
    prompt_messages,
    resolve_prompt,
)

Q = Problem(uid="q", question="What is 2+3?", answer="5", entry={})


class FakeTokenizer:
    """Characters as token ids; its own chat template marks where it was used."""

    bos_token_id, eos_token_id = 1, 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode("MODEL:" + "|".join(m["content"] for m in messages))

    def id_to_token(self, token_id: int) -> str | None:
        return {1: "<s>", 2: "</s>"}[token_id]


def text(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_presets() -> None:
    default = prompt_messages(resolve_prompt("default"), Q.question)
    assert default == [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": f"What is 2+3?\n\n{DEFAULT_INSTRUCTION}"},
    ]
    r1 = resolve_prompt("r1")
    assert r1.think and r1.chat_template is None
    assert prompt_messages(r1, Q.question) == [
        {"role": "user", "content": f"What is 2+3?\n\n{R1_INSTRUCTION}"}
    ]
    dapo = prompt_messages(resolve_prompt("dapo"), Q.question)[0]["content"]
    assert dapo.startswith("Solve the following math problem") and "\n\nWhat is 2+3?\n\nRemember" in dapo
    base = resolve_prompt("base")
    rendered = text(encode_prompt(base, prompt_messages(base, Q.question), FakeTokenizer()))
    assert rendered.startswith("A conversation between User and Assistant.")
    assert rendered.endswith("\n\nUser: What is 2+3?\nAssistant: <think>\n") and base.think
    assert prompt_messages(resolve_prompt("none"), Q.question) == [
        {"role": "user", "content": "What is 2+3?"}
    ]
    with pytest.raises(ValueError, match=r"config.task.prompt='r3'.*'base', 'dapo', 'default', 'none', 'r1'"):
        resolve_prompt("r3")


def test_overrides_and_templates(tmp_path) -> None:
    spec = resolve_prompt("default", system_prompt="none", instruction="Solve: {question} Box it.")
    assert prompt_messages(spec, Q.question) == [{"role": "user", "content": "Solve: What is 2+3? Box it."}]
    assert resolve_prompt("r1", system_prompt="Sys").system == "Sys"
    assert resolve_prompt("default", system_prompt=None, instruction=None).instruction is None  # old API
    tok = FakeTokenizer()
    model = resolve_prompt("none")
    assert text(encode_prompt(model, prompt_messages(model, "hi"), tok)) == "MODEL:hi"
    plain = resolve_prompt("none", chat_template="plain")
    assert text(encode_prompt(plain, prompt_messages(plain, "hi"), tok)) == "User: hi\nAssistant:"
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ bos_token }}{{ messages[-1]['content'] }}{{ eos_token }}")
    custom = resolve_prompt("none", chat_template=str(jinja))
    assert text(encode_prompt(custom, prompt_messages(custom, "hi"), tok)) == "<s>hi</s>"
    assert resolve_prompt("none", chat_template="{{ 1 }}").chat_template == "{{ 1 }}"
    assert resolve_prompt("base", chat_template="model").chat_template is None
    assert set(CHAT_TEMPLATES) == {"plain", "r1_zero"}
    with pytest.raises(ValueError, match=r"config.task.chat_template='chatml'"):
        resolve_prompt("none", chat_template="chatml")


def test_reasoning_gym_task_takes_the_prompt_keys() -> None:
    task = ReasoningGymTask("chain_sum", size=2, prompt="r1", reward="math_verify")
    p = task.problem(0)
    assert task.messages(p)[-1]["content"].endswith(R1_INSTRUCTION)
    assert task.score(p, f"hmm \\boxed{{0}} </think> \\boxed{{{p.answer}}}").correct
    assert task.score(p, f"\\boxed{{{p.answer}}} still thinking").think_unterminated  # r1 opens <think>
    old = ReasoningGymTask("chain_sum", size=2)  # unchanged default prompt and checker
    assert old.messages(p)[0]["content"] == DEFAULT_SYSTEM_PROMPT
    assert old.score(p, f"Answer: {p.answer}").correct


def test_prompt_keys_from_the_command_line(tmp_path) -> None:
    cfg = tmp_path / "c.py"
    cfg.write_text(
        "import ml_collections as mlc\n"
        "from tlt_jax.tasks.datasets import task_config\n"
        "def get_config():\n"
        "    c = mlc.ConfigDict()\n"
        "    c.task = task_config('jsonl', path='train.jsonl')\n"
        "    return c\n"
    )
    argv = ["x", "--config", str(cfg), "--config.task.system_prompt=Be terse.", "--config.task.prompt=r1",
            "--config.task.reward=math_verify", "--config.task.chat_template=plain"]  # fmt: skip
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", None, "c", flag_values=values, sys_argv=argv)
    values(argv)
    task = holder.value.task
    assert (task.system_prompt, task.prompt, task.reward, task.chat_template) == (
        "Be terse.", "r1", "math_verify", "plain"
    )  # fmt: skip
    assert task_config("reasoning_gym", name="chain_sum")["instruction"] == ""
