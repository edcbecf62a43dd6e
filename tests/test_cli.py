"""The `dgemma` console script."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dgemma.cli import main


def test_info_preset_json(capsys):
    assert main(["info", "--preset", "26b-a4b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == "preset 26b-a4b"
    assert 25.1e9 < info["parameters_total"] < 25.3e9 and 3.75e9 < info["parameters_active"] < 3.9e9
    assert info["generation_defaults"]["max_denoising_steps"] == 48


def test_info_checkpoint_table(moe_ckpt, capsys):
    assert main(["info", str(moe_ckpt[0])]) == 0
    out = capsys.readouterr().out
    assert "4 experts (top-2" in out and "tokenizer.json           absent" in out


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dgemma info: error:") and "config.json" in err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "dgemma.cli", "--help"], capture_output=True, text=True, check=True)
    assert "DiffusionGemma" in out.stdout and "info" in out.stdout


import io  # noqa: E402

from helpers import make_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def ckpt_with_tokenizer(moe_ckpt, tmp_path_factory):
    import shutil

    d = tmp_path_factory.mktemp("cli") / "model"
    shutil.copytree(moe_ckpt[0], d)
    make_tokenizer(512).save(d)
    return d


FAST = ["--max-denoising-steps", "3", "--seed", "0"]


def _cli(command: str, ckpt, *args: str) -> int:
    return main([command, "-m", str(ckpt), *args])


def test_generate_prints_text_and_json(ckpt_with_tokenizer, capsys):
    assert _cli("generate", ckpt_with_tokenizer, "-p", "hello", "--max-new-tokens", "12", *FAST) == 0
    text = capsys.readouterr().out
    assert text.endswith("\n") and len(text) > 1
    args = ("-p", "hello", "--max-new-tokens", "12", "--json", "--mode", "exact", *FAST)
    assert _cli("generate", ckpt_with_tokenizer, *args) == 0
    info = json.loads(capsys.readouterr().out)
    # 12 tokens take two 8-token canvases unless the random model ends its text in the first
    assert info["tokens"] <= 12 and info["canvases"] in (1, 2)
    assert info["steps_per_canvas"] == [3] * info["canvases"]


def test_generate_ar_raw_and_show_canvas(ckpt_with_tokenizer, capsys):
    assert _cli("generate", ckpt_with_tokenizer, "-p", "x = ", "--raw", "--ar", "--max-new-tokens", "5", "--json") == 0
    assert json.loads(capsys.readouterr().out)["tokens"] <= 5
    args = ("-p", "x", "--show-canvas", "--early-commit", "--max-new-tokens", "8", "--stats", *FAST)
    assert _cli("generate", ckpt_with_tokenizer, *args) == 0
    err = capsys.readouterr().err
    assert "canvas 1, step" in err and "tokens_per_forward" in err


def test_infill_command(ckpt_with_tokenizer, capsys):
    args = ("--prefix", "a = (", "--suffix", ")", "--middle-length", "3", "--json", *FAST)
    assert _cli("infill", ckpt_with_tokenizer, *args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].startswith("a = (") and out["text"].endswith(")") and out["middle_length"] == 3
    scores = {}
    for how in ("encoder", "denoiser"):  # auto length: both ways of scoring the candidates
        args = ("--prefix", "a = (", "--suffix", ")", "--length-score", how, "--json", *FAST)
        assert _cli("infill", ckpt_with_tokenizer, *args) == 0
        scores[how] = json.loads(capsys.readouterr().out)["scores"]
    assert scores["encoder"].keys() == scores["denoiser"].keys() and scores["encoder"] != scores["denoiser"]


def test_chat_command(ckpt_with_tokenizer, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\nand again\n\n"))
    assert main(["chat", "-m", str(ckpt_with_tokenizer), "--max-new-tokens", "6", "--thinking", *FAST]) == 0
    out = capsys.readouterr().out
    assert out.count("> ") >= 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "-m", "/nonexistent", "-p", "x"], "does not exist"),
        (["generate", "-p", "x", "--t-min", "0.9"], "t_min < t_max"),
        (["generate", "-p", "x", "--max-new-tokens", "100000"], "fit in the context"),
        (["generate", "-p", "   "], "prompt is empty"),
        (["infill", "--prefix", "a"], "give the prefix"),
    ],
)
def test_generation_errors(ckpt_with_tokenizer, capsys, args, message):
    if "-m" not in args:
        args = [args[0], "-m", str(ckpt_with_tokenizer), *args[1:]]
    assert main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, stdin, message",
    [
        (["generate"], b"\xff\xfe", "the prompt: stdin is not UTF-8 text (byte 0xff at offset 0)"),
        (["generate", "-p", "-"], b"ok \xc3", "stdin is not UTF-8 text (byte 0xc3 at offset 3)"),
        (["generate", "-p", "ab\udcff"], b"", "--prompt is not valid Unicode: character 2 is a lone surrogate"),
        (["infill", "--prefix", "\udcff", "--suffix", "x"], b"", "--prefix is not valid Unicode: character 0"),
        (["infill", "--prefix", "x", "--suffix", "\ud800"], b"", "--suffix is not valid Unicode"),
        (["infill", "--prefix-file", "-", "--suffix", "x"], b"\xff", "--prefix-file: stdin is not UTF-8 text"),
    ],
)
def test_text_that_is_not_utf8_is_a_one_line_error(ckpt_with_tokenizer, capsys, monkeypatch, args, stdin, message):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert main([args[0], "-m", str(ckpt_with_tokenizer), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert err == f"dgemma {args[0]}: error: {err.split('error: ', 1)[1]}" and err.count("\n") == 1
    assert message in err


def test_non_utf8_argv_and_files_from_a_real_process(ckpt_with_tokenizer, tmp_path):
    # bytes in argv reach Python as lone surrogates (surrogateescape): the whole path, with no mocking
    (tmp_path / "prefix.py").write_bytes(b"x = \xe9\n")  # Latin-1, not UTF-8
    runs = [
        (["infill", "--prefix", b"\xff\xfe", "--suffix", "x"], "--prefix is not valid Unicode"),
        (["infill", "--prefix-file", tmp_path / "prefix.py", "--suffix", "x"], "is not UTF-8 text (byte 0xe9"),
        (["infill", "--prefix-file", tmp_path, "--suffix", "x"], "--prefix-file"),  # a directory
    ]
    for args, message in runs:
        argv = [sys.executable, "-m", "dgemma.cli", args[0], "-m", str(ckpt_with_tokenizer), *args[1:]]
        out = subprocess.run(argv, capture_output=True, input=b"")
        err = out.stderr.decode()
        assert out.returncode == 2 and message in err and "Traceback" not in err, err


def test_bad_flag_values_are_usage_errors(ckpt_with_tokenizer, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "-m", str(ckpt_with_tokenizer), "--tokens-per-step", "0"])
    assert exc.value.code == 2 and "positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["infill", "-m", str(ckpt_with_tokenizer), "--middle-length", "many"])


def test_help_is_complete(capsys):
    for command in ("generate", "chat", "infill"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        for flag in (
            "--model",
            "--max-denoising-steps",
            "--entropy-bound",
            "--t-min",
            "--t-max",
            "--seed",
            "--mode",
            "--sampler",
        ):
            assert flag in text, (command, flag)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--show-canvas" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "infill"])
def test_without_model_the_shipped_code_model_is_used_and_named_once(ckpt_with_tokenizer, capsys, monkeypatch, command):
    import dgemma.tasks.code

    monkeypatch.setattr(dgemma.tasks.code, "MODEL_DIR", ckpt_with_tokenizer)
    args = ["-p", "def f(x):", "--max-new-tokens", "4"] if command == "generate" else ["--prefix", "a", "--suffix", "b"]
    assert main([command, *args, *FAST]) == 0
    err = capsys.readouterr().err
    assert err.count("using the shipped code model") == 1 and str(ckpt_with_tokenizer) in err


def test_serve_defaults_to_the_shipped_code_model(tmp_path, monkeypatch, capsys):
    import dgemma.tasks.code

    monkeypatch.setattr(dgemma.tasks.code, "MODEL_DIR", tmp_path / "missing")
    assert main(["serve"]) != 0  # no model given and none shipped: a clear error, not a traceback
    err = capsys.readouterr().err
    assert "using the shipped code model" in err and "missing" in err


def test_infill_rejects_max_new_tokens(ckpt_with_tokenizer, capsys):
    assert _cli("infill", ckpt_with_tokenizer, "--prefix", "a", "--suffix", "b", "--max-new-tokens", "4") == 2
    assert "--middle-length" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("device", "message"),
    [("banana", "not a device name"), ("cuda:7" if torch.cuda.device_count() < 8 else "tpu", "--device")],
)
def test_bad_device_is_a_clear_error(device, message, capsys):
    assert main(["generate", "--device", device, "-p", "x", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _subcommands() -> dict:
    """{name: subparser} of the `dgemma` command."""
    import argparse

    from dgemma.cli import build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_one_flag_name_per_knob_in_every_command():
    import argparse

    flags_of: dict[str, set] = {}  # what each setting is called, across the commands
    for command, parser in _subcommands().items():
        for action in parser._actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            if action.help == argparse.SUPPRESS or not longs or longs == ["--help"]:
                continue
            flags_of.setdefault(action.dest.removesuffix("_option"), set()).add((longs[0], command))
    names = {dest: {flag for flag, _ in used} for dest, used in flags_of.items()}
    assert {dest: n for dest, n in names.items() if len(n) > 1} == {}
    # every command that loads a model takes it as --model (train reads it from its YAML config)
    takes_model = {command for _, command in flags_of["model"]}
    assert takes_model >= set(_subcommands()) - {"train"}
    assert {command for _, command in flags_of["json"]} >= {
        "info",
        "generate",
        "chat",
        "infill",
        "sudoku",
        "bench",
        "demo",
        "quantize",
    }


@pytest.mark.parametrize(
    "old, new",
    [
        (["generate", "--thinking"], ["generate", "--reasoning"]),
        (["chat", "--thinking", "--context", "64"], ["chat", "--reasoning", "--max-context", "64"]),
        (["sudoku", "--steps", "4"], ["sudoku", "--max-denoising-steps", "4"]),
        (["sudoku", "--stop-entropy", "0.01"], ["sudoku", "--confidence-threshold", "0.01"]),
        (["sudoku", "--file", "p.txt"], ["sudoku", "--puzzle-file", "p.txt"]),
        (
            ["bench", "--steps", "2,1", "--json-out", "b.json"],
            ["bench", "--fixed-steps", "1,2", "--save-json", "b.json"],
        ),
        (["info", "DIR"], ["info", "--model", "DIR"]),
        (["serve", "--mode", "exact"], ["serve", "--kernels", "reference"]),
        (["serve", "--mode", "fast"], ["serve", "--kernels", "fast"]),
        (["bench", "--no-accelerate"], ["bench", "--kernels", "reference"]),
        (["quantize", "DIR", "OUT", "--quant", "int8"], ["quantize", "-m", "DIR", "--out", "OUT", "--quant", "int8"]),
    ],
)
def test_old_flag_names_still_work_and_say_the_new_one(old, new, capsys):
    from dgemma.cli import build_parser

    before, after = build_parser().parse_args(old), build_parser().parse_args(new)
    err = capsys.readouterr().err
    renamed = [o for o in old if o.startswith("--") and o not in new]
    assert all(f"{o} is now" in err for o in renamed) and err.count("note:") == len(renamed)
    if old[0] == "info":  # the positional argument stays an alternative to --model
        assert before.directory == after.model_option
    elif old[0] == "quantize":
        assert (before.directory, before.out_dir) == (after.model_option, after.out)
    else:
        assert vars(before) == vars(after)
    with pytest.raises(SystemExit):
        main([old[0], "--help"])
    shown = capsys.readouterr().out
    assert not any(f"{o} " in shown or f"{o}\n" in shown for o in renamed), "old names are hidden from --help"


def test_generate_takes_reasoning_and_its_old_name(model_dir, capsys):
    for flag in ("--reasoning", "--thinking"):
        args = ["generate", "-m", str(model_dir), "-p", "hi", "--max-new-tokens", "4", "--json", flag, *FAST]
        assert main(args) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["tokens"] <= 4
        assert ("--thinking is now --reasoning" in captured.err) == (flag == "--thinking")


def test_quantize_takes_model_and_out_flags_and_prints_json(ckpt_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "q8"
    assert main(["quantize", "--model", str(ckpt_with_tokenizer), "--out", str(out), "--quant", "int8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["out"] == str(out) and info["quant"] == "int8" and 0 < info["bytes"] < info["source_bytes"]
    assert (out / "tokenizer.json").is_file()
    assert (
        main(["quantize", "-m", str(ckpt_with_tokenizer), str(tmp_path / "a"), str(tmp_path / "b"), "--quant", "int8"])
        == 2
    )
    assert "given as flags or as arguments, not both" in capsys.readouterr().err
    assert main(["quantize", str(ckpt_with_tokenizer), "--quant", "int8"]) == 2
    assert "--out OUT" in capsys.readouterr().err


def test_bench_json_prints_the_result_alone(tmp_path, capsys):
    argv = [
        "bench",
        "--preset",
        "tiny",
        "--random-weights",
        "--fixed-steps",
        "1,2",
        "--repeats",
        "1",
        "--canvases",
        "1",
    ]
    assert (
        main([*argv, "--plot", str(tmp_path / "b.png"), "--save-json", str(tmp_path / "b.json"), "--json", "--quiet"])
        == 0
    )
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # the whole of stdout: one JSON object
    assert result == json.loads((tmp_path / "b.json").read_text()) and [p["steps"] for p in result["points"]] == [1, 2]
    assert captured.out.count("\n") == 1 and "crossover: diffusion is faster" in captured.err


def test_demo_json_prints_the_statistics_alone(capsys):
    assert main(["demo", "--json", "--no-sudoku", "--plain"]) == 0  # the shipped code model
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # the whole of stdout: one JSON object
    assert [p["name"] for p in out["parts"]] == ["generate", "infill", "edit", "image"] and out["seconds"] > 0
    assert all(p["steps"] >= 1 and p["forwards"] >= 1 for p in out["parts"])
    assert "1. A canvas of random tokens" in captured.err and "== Statistics ==" in captured.err


def test_demo_shows_control_characters_a_model_writes_as_replacement_characters():
    from dgemma.cli.demo import _shown

    # a random model's draft can hold ESC: printed as is, it would drive the terminal
    assert _shown("a\x1b[2Jb\r\n\tc\x7f") == "a\ufffd[2Jb\ufffd\n\tc\ufffd"
