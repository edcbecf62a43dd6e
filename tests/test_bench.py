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


def test_assumed_steps_per_canvas_scale_with_the_canvas_but_not_below_the_stop_rule():
    assert bench.assumed_steps_per_canvas(256) == pytest.approx(12.8)  # the released model: ~20 tokens per forward
    assert bench.assumed_steps_per_canvas(64) == pytest.approx(3.2)
    assert bench.assumed_steps_per_canvas(8) == 2.0  # the stop rule needs the argmax to hold for a step
    assert bench.assumed_steps_per_canvas(8, stability_threshold=0) == 1.0
    assert bench.assumed_steps_per_canvas(4096, max_steps=48) == 48.0


def _result(canvas: int, step_s: float, overhead_s: float, ar_tokens_per_s: float, **steps) -> bench.BenchResult:
    """A BenchResult with only what the recommendation reads set meaningfully."""
    r = bench.BenchResult(
        device="cpu", params=1, active_params=1, dtype="float32", quant=None, canvas=canvas, prompt_tokens=8,
        prefill_s=0.0, step_s=step_s, canvas_overhead_s=overhead_s, points=[], ar_tokens_per_s=ar_tokens_per_s,
        ar_time_to_first_token=0.0, crossover_steps=bench.crossover(canvas, step_s, overhead_s, ar_tokens_per_s),
        sampler_steps=None, sampler_tokens_per_s=None, expected_steps=0.0, expected_steps_source="assumed",
        step_bytes={}, step_flops=0.0, ar_token_bytes={}, ar_token_flops=0.0,
    )  # fmt: skip
    for key, value in steps.items():
        setattr(r, key, value)
    return r


def test_small_canvas_recommendation_follows_the_arithmetic():
    # 8-token canvas: AR makes it in 0.8 s; diffusion takes 0.4 s per step + 0.2 s: faster below 1.5 steps
    r = _result(8, 0.4, 0.2, 10.0, expected_steps=bench.assumed_steps_per_canvas(8))
    assert r.crossover_steps == pytest.approx(1.5)
    text = bench.recommend(r)
    assert text.startswith("autoregressive: at an assumed 2.0 steps per canvas (random weights: not measured")
    assert "below 1.5" in text and f"{r.tokens_per_s_at(2.0) / 10.0:.2f}x" in text
    given = bench.recommend(_result(8, 0.4, 0.2, 10.0, expected_steps=1.0, expected_steps_source="given"))
    assert given.startswith("diffusion: at the 1 steps per canvas given (--steps-per-canvas)")
    measured = bench.recommend(_result(256, 0.01, 0.0, 100.0, expected_steps=12.5, expected_steps_source="measured"))
    assert measured.startswith("diffusion: the sampler took 12.5 steps per canvas")
    slow = bench.recommend(_result(8, 1.0, 0.0, 10.0, expected_steps=2.0))  # a step costs more than 8 AR tokens
    assert slow.startswith("autoregressive: on this device a denoising step costs more")


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


def test_cpu_features_are_read_from_the_cpu_flags():
    info = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni avx512_bf16 amx_int8\nbogomips\t: 1\n"
    got = bench.cpu_features(info)
    assert got["bf16"] == ["avx512_bf16"] and got["int8"] == ["avx512_vnni", "amx_int8"]
    assert got["capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "NO AVX")  # what torch dispatches to
    assert bench.cpu_features("") == {"capability": got["capability"], "bf16": [], "int8": []}  # no flags known


def test_compute_defaults_follow_the_cpu_flags():
    from dgemma.runtime import cpu

    amx = "flags\t: avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8\n"
    zen4 = "flags\t: avx512f avx512_vnni avx512_bf16\n"
    avx2 = "flags\t: avx2 fma\n"
    assert cpu.native_bf16(amx) and cpu.native_bf16(zen4) and not cpu.native_bf16(avx2)
    assert cpu.int8_matmuls(amx) and cpu.int8_matmuls(zen4) and not cpu.int8_matmuls(avx2)
    assert cpu.preferred_dtype("cpu", zen4) == torch.bfloat16 and cpu.preferred_dtype("cpu", avx2) == torch.float32
    assert cpu.preferred_dtype("cpu", "") == torch.float32  # nothing known: nothing assumed
    assert cpu.preferred_dtype("cuda", avx2) == torch.bfloat16


# A step's allocation pattern: 1-2 MB temporaries, made and freed again. It prints the page faults of 20
# steps after a warm one, and the pages those steps touch.
ALLOCATING_STEPS = """
import resource, sys, torch
import torch.nn.functional as F
from dgemma.runtime.cpu import reuse_freed_memory
print(reuse_freed_memory() if sys.argv[1] == "reuse" else None)
h, w = torch.randn(256, 512), torch.randn(1024, 512)
def step():
    y = F.linear(h, w)
    return float(torch.cat([y * y, y.sigmoid()]).sum())
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, 20 * 4 * 256 * 1024 * 4 // 4096)
"""


def run_steps(mode: str, env: dict | None = None) -> tuple[str, int, int]:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")} | (env or {})
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATING_STEPS, mode], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1]), int(out[2])


def test_cpu_steps_reuse_their_freed_memory_instead_of_faulting_it_in_again():
    from dgemma.runtime.cpu import on_glibc

    if not on_glibc():
        pytest.skip("the allocator setting is glibc's")
    set_, faults, pages = run_steps("reuse")
    # Steady state: most pages are reused (0-6% faulted in again over runs on the CI's VMs, as the layout
    # of the heap varies from process to process).
    assert set_ == "True" and faults < pages // 4
    # A user's own malloc tuning is left alone. A fixed 128 KB mmap threshold (glibc's default value, without
    # its dynamic raise) faults the pages in again on every step, which shows the count sees faulting. Bare
    # defaults are no control: whether glibc has raised its thresholds by then depends on what the process
    # freed before (1 process in 6 faulted in a clean clone's venv, most in another).
    tuned, faulted, _ = run_steps("reuse", {"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert tuned == "False" and faulted > 2 * pages // 4
    assert run_steps("reuse", {"MALLOC_TRIM_THRESHOLD_": "1048576"})[0] == "False"
    assert run_steps("reuse", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"})[0] == "False"


def test_a_cpu_runner_sets_the_allocator_up(monkeypatch):
    import dgemma.runtime.runner

    calls = []
    monkeypatch.setattr(dgemma.runtime.runner, "reuse_freed_memory", lambda: calls.append(1))
    dgemma.accelerate(dgemma.build(dgemma.preset("tiny"), seed=0))
    assert calls == [1]


@pytest.mark.parametrize("has_int8", [True, False])
def test_cpu_fast_twin_runs_int8_as_integer_matmuls_where_the_cpu_has_them(monkeypatch, has_int8):
    import dgemma.runtime.fast
    from dgemma.quant import quantize_model

    monkeypatch.setattr(dgemma.runtime.fast, "int8_matmuls", lambda: has_int8)
    model = quantize_model(dgemma.build(dgemma.preset("tiny"), seed=0), "int8")
    twin = dgemma.runtime.fast.fast_twin(model)
    assert (twin.layers[0].self_attn.q_proj.kernel == "int_mm") == has_int8
    assert model.layers[0].self_attn.q_proj.kernel is None  # exact mode keeps the weight-only reference


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
    assert result["peaks"]["cpu"] == bench.cpu_features() and "this CPU: " in out
    assert "crossover" in out and "recommendation" in out and "diffusion, 4 steps/canvas" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # random weights: the steps are assumed (8-token canvas: the stop rule's 2), and said to be
    assert (result["expected_steps"], result["expected_steps_source"]) == (2.0, "assumed")
    assert "assumed 2.0 steps per canvas (random weights: not measured" in result["recommendation"]
    assert "steps per canvas compared with it: 2.0 (assumed)" in out


def test_bench_cli_takes_the_steps_per_canvas_to_recommend_for(tmp_path, capsys):
    args = ["bench", "--preset", "tiny", "--random-weights", "--steps", "1,2", "--repeats", "1", "--canvases", "1"]
    assert main([*args, "--steps-per-canvas", "3", "--plot", str(tmp_path / "b.png"), "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["expected_steps"], result["expected_steps_source"]) == (3.0, "given")
    assert "at the 3 steps per canvas given" in result["recommendation"]
    for bad in ("0.5", "many"):
        with pytest.raises(SystemExit) as e:
            main([*args, "--steps-per-canvas", bad])
        assert e.value.code == 2 and "--steps-per-canvas" in capsys.readouterr().err


def test_bench_cli_lets_a_trained_model_choose_its_steps(tmp_path, capsys):
    args = ["bench", "--steps", "1,2", "--repeats", "1", "--canvases", "1", "--plot", str(tmp_path / "b.png")]
    assert main([*args, "--quiet"]) == 0  # the shipped code model
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1 <= result["sampler_steps"] <= 48 and result["sampler_tokens_per_s"] > 0
    assert "sampler took" in result["recommendation"] and result["expected_steps_source"] == "measured"
    assert result["expected_steps"] == result["sampler_steps"]


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
