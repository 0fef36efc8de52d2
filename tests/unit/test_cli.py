"""The ``disagg`` command line: generate, model resolution, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import comparable_prefix

from disagg.paths import default_model_dir, resolve_model_dir
from disagg_tools.cli import main


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_generate_json_matches_transformers(tiny_model_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "Once upon a time, naïve café 🙂"
    code = main(
        ["generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--max-tokens", "24", "--json"]
    )
    assert code == 0
    record = _last_json(capsys.readouterr().out)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert record["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
    assert record["prompt_token_ids"][0] == tokenizer.bos_token_id, "BOS comes from the post-processor"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([record["prompt_token_ids"]]),
            max_new_tokens=24,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[0, len(record["prompt_token_ids"]) :].tolist()
    gaps = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
    upto = comparable_prefix(gaps)
    assert upto >= 16
    assert record["token_ids"][:upto] == expected[:upto]
    assert record["text"] == tokenizer.decode(record["token_ids"], skip_special_tokens=True)
    assert len(set(record["token_ids"])) >= 10


def test_generate_sampling_is_reproducible(tiny_model_dir, capsys):
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "12", "--json"]
    args += ["--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--seed", "7"]
    main(args)
    first = _last_json(capsys.readouterr().out)
    main(args)
    assert _last_json(capsys.readouterr().out) == first


def test_generate_refuses_bad_parameters(tiny_model_dir, capsys):
    code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--top-p", "0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "top_p" in err and "Traceback" not in err


def test_model_resolution_order(monkeypatch, tmp_path):
    monkeypatch.delenv("MODEL_DIR", raising=False)
    assert resolve_model_dir() == default_model_dir()
    monkeypatch.setenv("MODEL_DIR", str(tmp_path))
    assert resolve_model_dir() == tmp_path
    assert resolve_model_dir(tmp_path / "cli") == tmp_path / "cli"


def test_console_script_logs_to_stderr(tiny_model_dir):
    exe = Path(sys.executable).with_name("disagg")
    env = {**os.environ, "MODEL_DIR": str(tiny_model_dir)}
    proc = subprocess.run(
        [str(exe), "generate", "--prompt", "abc", "--max-tokens", "4", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1 and "engine ready" in proc.stderr
    assert len(_last_json(proc.stdout)["token_ids"]) == 4


def test_unknown_command_prints_usage(capsys):
    assert main(["frobnicate"]) == 2
    assert "usage: disagg" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["make-model", "kvcalc"])
def test_subcommands_are_wired(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_serve_spec_refuses_an_invalid_spec_or_a_folder_it_did_not_write(tmp_path, monkeypatch, capsys):
    from disagg_tools.cli import SPEC_REPOSITORY, serve_main

    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: {decode: {cores: [0]}}\n")
    assert serve_main(["--spec", str(bad), "--openai-port", "0"]) == 2
    assert "pools.decode.cores: overlaps prefill.cores" in capsys.readouterr().err
    assert not (tmp_path / ".triton" / SPEC_REPOSITORY).exists()
    (tmp_path / ".triton" / SPEC_REPOSITORY / "mine").mkdir(parents=True)
    good = tmp_path / "good.yaml"
    good.write_text("dtype: float32\n")
    assert serve_main(["--spec", str(good), "--openai-port", "0"]) == 2
    assert "was not written by `disagg serve`" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / ".triton" / SPEC_REPOSITORY).iterdir()] == ["mine"]
    with pytest.raises(SystemExit):
        serve_main(["--spec", str(good), "--model-repository", "elsewhere"])


def test_serve_set_is_checked_like_a_spec_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """`disagg serve --set KEY=VALUE` on the defaults: an invalid value is refused with its key's path
    before the spec folder is made; with --role it needs a spec (the remote section)."""
    from disagg_tools.cli import SPEC_REPOSITORY, serve_main

    monkeypatch.chdir(tmp_path)
    assert serve_main(["--set", "pools.decode.cores=[0]", "--openai-port", "0"]) == 2
    assert "the default spec: pools.decode.cores: overlaps prefill.cores" in capsys.readouterr().err
    assert not (tmp_path / ".triton" / SPEC_REPOSITORY).exists()
    with pytest.raises(SystemExit):
        serve_main(["--set", "kv.prefix_cache=false", "--role", "decode"])
    assert "--set with --role goes on a spec" in capsys.readouterr().err
