"""The texts and chats test_tokenizer.py tokenizes and renders, shared with the script that recorded
transformers' results for them (tests/recorded/record_smollm2_tokenizer.py)."""

TEXTS = [
    "Hello world",
    "12345 + 678 = 7023, and 3.14159e-10",
    "a 1b22 c333 x0",
    "  leading spaces\tand\ttabs\n\n\nnewlines   ",
    "héllo wörld — ünïcode 日本語 Ελληνικά 🙂🚀",
    "<|im_start|>user\nhi<|im_end|>\n",
    "x<|endoftext|>y<repo_name>z",
    "don't I'll we're THEY'RE",
    "def f(x):\n    return x**2  # comment",
    "",
    " ",
]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "tool_calls": None},
]
# trim_blocks/lstrip_blocks, bos/eos variables, tojson and raise_exception
FEATURE_TEMPLATE = (
    "{{ bos_token }}\n"
    "{% for m in messages %}\n"
    "    {% if m['role'] not in ['user', 'assistant'] %}\n"
    "        {{ raise_exception('bad role ' + m['role']) }}\n"
    "    {% endif %}\n"
    "  {{ m['role'] | upper }}: {{ m['content'] }} {{ m | tojson }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
FEATURE_MESSAGES = [{"role": "user", "content": 'é <b>"q"</b>'}, {"role": "assistant", "content": "ok"}]
