"""The real SmolLM2-135M-Instruct GGUF: it answers "Paris"; its greedy continuation equals transformers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models.llama import from_hf_tensors
from tlt_jax.models.loading import load_gguf
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm(smollm_gguf_path):
    loaded = load_gguf(smollm_gguf_path)
    return loaded, from_hf_tensors(loaded.config, loaded.tensors)


@pytest.fixture(scope="module")
def greedy_answer(smollm):
    loaded, model = smollm
    tok = loaded.tokenizer
    prompt = tok.encode_chat(QUESTION)
    # No EOS stop: 40 greedy tokens, compared with transformers' 40 (it also runs past EOS when told to).
    eng = RolloutEngine(model, EngineConfig(max_new_tokens=40, max_cache_len=256, chunk_steps=20), eos_ids=[])
    out = eng.generate([prompt], n=1, key=jax.random.key(0), sampling=SamplingParams(temperature=0.0))
    return prompt, out


def test_greedy_answer_is_paris(smollm, greedy_answer):
    loaded, _ = smollm
    _, out = greedy_answer
    ids = out.response(0)
    eos = [i for i, t in enumerate(ids) if t in loaded.tokenizer.eos_token_ids]
    text = loaded.tokenizer.decode(ids[: eos[0]] if eos else ids)
    assert "Paris" in text, text


@pytest.mark.extended  # the kernels' own tests and the engine's kernel test are make test's
def test_cpu_kernels_give_the_same_greedy_tokens(smollm, greedy_answer):
    """The real model on the CPU FFI kernels (small-M matmuls, tree attention): the same 40 greedy tokens."""
    loaded, _ = smollm
    prompt, ref = greedy_answer
    model = from_hf_tensors(loaded.config.replace(linear_impl="cpu_ffi"), loaded.tensors)
    ecfg = EngineConfig(max_new_tokens=40, max_cache_len=256, chunk_steps=20, attn_impl="cpu_ffi")
    eng = RolloutEngine(model, ecfg, eos_ids=[])
    out = eng.generate([prompt], n=1, key=jax.random.key(0), sampling=SamplingParams(temperature=0.0))
    assert out.response(0) == ref.response(0)


@pytest.mark.extended  # make test: "Paris" above, the tokenizer's parity, the export's logits vs transformers
def test_greedy_continuation_equals_transformers(smollm, smollm_gguf_path, greedy_answer):
    """Same GGUF, same prompt ids: our 32 greedy tokens equal HF transformers' generate (torch CPU, fp32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    prompt, ours = greedy_answer
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_gguf_path.parent), gguf_file=smollm_gguf_path.name, dtype=torch.float32
    )
    hf.eval()
    with torch.no_grad():
        ids = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=40,
            do_sample=False,
            min_new_tokens=40,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    n = int(ours.lengths[0])
    assert n == 40 and len(ids) == 40
    assert ours.response(0) == ids, (ours.response(0), ids)
    # and the last-position logits agree closely
    _, model = smollm
    seq = prompt + ids[:n]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0, -1].numpy()
    got = model(jnp.asarray([seq]), jnp.arange(len(seq))[None]).logits[0, -1]
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-3)
