"""The CLI: error paths (one line on stderr, exit code 2) and a real generation."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from conftest import build, run
from kvpot.cli import main


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 96-token character-level tokenizer over printable ASCII (ids 3..), offline."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    for i, ch in enumerate(chr(c) for c in range(32, 125)):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build("llama3").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=96)).save_pretrained(path)
    return path



def assert_refused(code, err, fragment):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert fragment in lines[0]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--method", "nope", "--context", "x"], "unknown method 'nope'"),
        (["--method", "streaming", "--set", "color=red", "--context", "x"], "unknown parameter 'color'"),
        (["--method", "streaming", "--set", "window", "--context", "x"], "--set expects key=value"),
        (["--method", "streaming", "--budget", "0", "--context", "x"], "budget must be a positive"),
        (["--method", "streaming", "--budget", "-5", "--context", "x"], "budget must be a positive"),
        (["--method", "streaming", "--budget", "4", "--context", "x"], "cannot hold the 4 sink tokens"),
        (["--method", "snapkv", "--budget", "16", "--context", "x"], "cannot hold the 32-token observation window"),
        (["--method", "full", "--budget", "16", "--context", "x"], "takes no budget"),
        (["--method", "streaming", "--set", "window=lots", "--context", "x"], "not a valid int"),
        (["--method", "streaming", "--context-file", "/no/such/file.txt"], "no such file"),
        (["--method", "streaming", "--context", "   "], "context is empty"),
    ],
)
def test_generate_refuses_bad_input(capsys, model_dir, argv, fragment):
    code, _, err = run(capsys, "generate", "--model", str(model_dir), *argv)
    assert_refused(code, err, fragment)


def test_generate_refuses_unsupported_model(capsys, gpt2_dir):
    code, _, err = run(capsys, "generate", "--model", str(gpt2_dir), "--method", "full", "--context", "hello")
    assert_refused(code, err, "does not support GPT2Config")
    assert "LlamaConfig" in err


def test_generate_refuses_missing_model(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "absent"), "--method", "full", "--context", "hi")
    assert_refused(code, err, "cannot load a model config")


def test_argparse_errors_are_one_line_exit_2(capsys, model_dir):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(model_dir), "--method", "full"])  # no context source
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_generate_json_reports_text_and_stats(capsys, model_dir):
    context = "The grass is green. " * 20
    code, out, _ = run(capsys, "generate", "--model", str(model_dir), "--method", "streaming", "--budget", "64",
                       "--set", "chunk_size=16", "--context", context, "--question", "What?",
                       "--max-new-tokens", "5", "--json")
    assert code == 0
    payload = json.loads(out)
    assert payload["method"] == {"method": "streaming", "sinks": 4, "window": 60, "chunk_size": 16, "positions": "shift"}
    stats = payload["stats"]
    assert stats["context_tokens"] == len(context)  # one token per character, no BOS
    assert stats["max_kv_entries"] <= 64 + 16
    assert stats["compressions"] > 0 and len(payload["token_ids"]) == stats["new_tokens"]


def test_generate_reads_stdin_and_streams_text(capsys, model_dir, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time " * 10))
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--method", "full", "--max-new-tokens", "4", "-")
    assert code == 0 and "[full] context 170 tokens" in err


def test_methods_lists_every_method(capsys):
    code, out, _ = run(capsys, "methods", "--json")
    assert code == 0
    rows = {row["name"]: row for row in json.loads(out)}
    assert set(rows) >= {"full", "truncate", "streaming", "h2o", "tova", "snapkv"}
    assert rows["streaming"]["parameters"]["sinks"] == 4 and "Xiao" in rows["streaming"]["paper"]
    code, out, _ = run(capsys, "methods")
    assert code == 0 and "snapkv" in out and "heavy=512" in out


@pytest.mark.parametrize("spec, paper", [("pyramidkv:window=8,beta=2", "Cai"), ("scissorhands", "Liu"), ("roco", "Ren")])
def test_pyramidkv_scissorhands_and_roco_are_listed_and_run_from_the_cli(capsys, model_dir, spec, paper):
    name = spec.partition(":")[0]
    code, out, _ = run(capsys, "methods", "--json")
    row = {row["name"]: row for row in json.loads(out)}[name]
    assert code == 0 and paper in row["paper"] and row["parameters"]["budget"] == 1024 and row["bound"]
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--method", spec, "--budget", "48",
                         "--set", "chunk_size=16", "--context", "The grass is green. " * 20, "--question", "What?",
                         "--max-new-tokens", "5", "--json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["method"]["method"] == name and payload["method"]["budget"] == 48
    stats = payload["stats"]
    assert stats["compressions"] > 0 and stats["context_tokens"] == 400
    if name != "pyramidkv":  # memory-unconstrained prefill, as SnapKV's
        assert stats["max_kv_entries"] <= 48 + 16


def test_generate_takes_a_method_spec_as_every_command_does(capsys, model_dir):
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--method", "infinipot:pot_size=1024",
                         "--context", "Once upon a time " * 10, "--question", "What?", "--max-new-tokens", "2",
                         "--json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["method"]["pot_size"] == 1024 and payload["method_spec"] == "infinipot:pot_size=1024"
    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--method", "infinipot:pot_size=64",
                       "--budget", "128", "--context", "x")
    assert code == 2 and "not both" in err  # a spec and --budget that set the same thing: one line, exit 2


def test_generate_without_a_method_uses_a_bounded_default_and_names_it(capsys, model_dir):
    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--context", "Once upon a time " * 10,
                       "--question", "What?", "--max-new-tokens", "2")
    assert code == 0, err
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("[infinipot, pot_size=4096 (default method; choose with --method)] context")


def test_generate_decode_path_is_selectable_and_reported(capsys, model_dir):
    """`--decode static` runs the fixed-shape steps (on a CPU too) and gives the eager tokens."""
    context = "The grass is green. " * 20
    outs = {}
    for mode in ("eager", "static"):
        code, out, _ = run(capsys, "generate", "--model", str(model_dir), "--method", "streaming", "--budget", "64",
                           "--set", "chunk_size=16", "--context", context, "--question", "What?",
                           "--max-new-tokens", "6", "--json", "--decode", mode)
        assert code == 0
        outs[mode] = json.loads(out)
    # the default runner ("auto") takes fixed-shape steps through the core: a scheduler of one slot
    assert outs["static"]["stats"]["decode"]["mode"] == "batch-static"
    assert outs["static"]["stats"]["decode"]["runner"] == "core" and outs["eager"]["stats"]["decode"]["runner"] == "sequence"
    assert outs["static"]["token_ids"] == outs["eager"]["token_ids"]
    with pytest.raises(SystemExit) as exit_:
        run(capsys, "generate", "--model", str(model_dir), "--context", context, "--decode", "fast")
    assert exit_.value.code == 2 and "--decode" in capsys.readouterr().err
