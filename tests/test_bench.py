"""`dgemma bench`: the measurements, their accounting, the CLI (table, plot, JSON) and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from dgemma import bench
from dgemma.cli import main


def test_fit_line_and_crossover():
    slope, intercept = bench.fit_line([1, 2, 4, 8], [0.3, 0.5, 0.9, 1.7])
    assert slope == pytest.approx(0.2) and intercept == pytest.approx(0.1)
    # 64 tokens per canvas; AR at 32 tok/s takes 2 s per canvas; diffusion 0.2 s per step + 0.1 s.
    assert bench.crossover(64, 0.2, 0.1, 32.0) == pytest.approx(9.5)
    with pytest.raises(ValueError, match="two different step counts"):
        bench.fit_line([4, 4], [1.0, 1.1])


@torch.no_grad()
def test_step_bytes_count_routed_experts_and_embedding_uses():
    model = bench.random_model("tiny")  # MoE: 4 experts, top 2
    t = model.text_config
    tensor_bytes = sum(p.numel() * p.element_size() for p in [*model.parameters(), *model.buffers()])
    embedding = model.embed_tokens.weight.numel() * 4
    experts = sum(layer.experts.gate_up_proj.numel() + layer.experts.down_proj.numel() for layer in model.layers) * 4
    prompt = torch.randint(5, t.vocab_size, (1, 20))
    cache = model.new_cache(1, 64)
    model.encode(prompt, cache)

    canvas = torch.randint(0, t.vocab_size, (1, 32))
    many = bench.step_bytes(model, lambda: model.denoise(canvas, cache), 2, 0)["weights"]
    one = bench.step_bytes(model, lambda: model.encode(prompt[:, :1], cache), 1, 0)["weights"]
    # 32 tokens reach every expert (random router): all weights, the embedding counted twice.
    assert many == tensor_bytes + embedding
    # One token reaches top_k of the experts in every layer.
    assert one == tensor_bytes - experts + experts * t.top_k_experts // t.num_experts


def test_random_model_refuses_what_does_not_fit(monkeypatch):
    monkeypatch.setattr(bench, "_free_memory", lambda device: 10 * 2**20)
    with pytest.raises(ValueError, match="GiB free"):
        bench.random_model("small")


def test_bench_cli_on_a_preset(tmp_path, capsys):
    plot = tmp_path / "bench.png"
    saved = tmp_path / "bench.json"
    args = ["bench", "--preset", "tiny", "--random-weights", "--steps", "1,2,4", "--repeats", "1"]
    assert main([*args, "--plot", str(plot), "--json-out", str(saved), "--quiet"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["benchmark"] == "dgemma_bench" and json.loads(saved.read_text()) == result
    assert [p["steps"] for p in result["points"]] == [1, 2, 4]
    assert all(p["tokens_per_s"] > 0 and p["time_to_first_token"] > 0 for p in result["points"])
    assert result["ar_tokens_per_s"] > 0 and result["step_s"] > 0
    expected = bench.crossover(
        result["canvas"], result["step_s"], result["canvas_overhead_s"], result["ar_tokens_per_s"]
    )
    assert result["crossover_steps"] == pytest.approx(expected)
    assert result["step_bytes"]["weights"] > result["ar_token_bytes"]["weights"] > 0
    assert result["peaks"]["copy_gbps"] > 0 and result["peaks"]["matmul_tflops"] > 0
    assert "crossover" in out and "recommendation" in out and "diffusion, 4 steps/canvas" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_lets_a_trained_model_choose_its_steps(tmp_path, capsys):
    args = ["bench", "--steps", "1,2", "--repeats", "1", "--canvases", "1", "--plot", str(tmp_path / "b.png")]
    assert main([*args, "--quiet"]) == 0  # the shipped code model
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1 <= result["sampler_steps"] <= 48 and result["sampler_tokens_per_s"] > 0
    assert "sampler took" in result["recommendation"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "tiny"], "--random-weights"),
        (["--random-weights"], "goes with --preset"),
        (["--preset", "tiny", "--random-weights", "--device", "cuda"] if not torch.cuda.is_available() else [], "CUDA"),
    ],
)
def test_bench_cli_errors(argv, message, capsys):
    if not argv:
        pytest.skip("this machine has CUDA")
    assert main(["bench", *argv, "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_bench_cli_rejects_a_single_step_count(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--preset", "tiny", "--random-weights", "--steps", "4"])
    assert e.value.code == 2
    assert "two different step counts" in capsys.readouterr().err
