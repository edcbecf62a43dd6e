"""Parity report: dgemma vs transformers' DiffusionGemmaForBlockDiffusion on tiny random checkpoints.

For each size (tiny: 6 layers, 4 experts top-2; medium: 12 layers, 16 experts top-4, 2k vocab), variant
(MoE, dense-only), dtype (fp32, bf16) and scenario (short prompt, prompt longer than the sliding window,
second canvas after a commit, batch of 2 with left padding), prints the maximum absolute difference of
encoder hidden states, KV cache and denoise logits (with and without self-conditioning).

fp32 is held to `tests/helpers.fp32_tolerance` (fp32 rounding at the logits' scale, grown with the
depth; hidden states and KV at their own scale), the bound the tests use. The "1-ulp" column is the scale
of fp32 rounding noise on that model: how far the logits move when every dgemma weight is moved by one
ulp. bf16 rows also give each model's distance from the fp32 oracle. Ends with one JSON line.
Run: python benchmarks/parity.py (under a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test helpers (tests/helpers.py)
from helpers import (
    MEDIUM_TEXT,
    dense_checkpoint_from_oracle,
    fp32_tolerances,
    load_quiet,
    make_oracle_checkpoint,
    parity_case,
    parity_scenarios,
)

SIZES = {"tiny": ({}, 8), "medium": (MEDIUM_TEXT, 32)}  # text overrides, canvas length


def _worst(diffs: dict[str, float], kind: str) -> float:
    return max(v for k, v in diffs.items() if kind in k)


@torch.no_grad()
def _one_ulp_away(model, seed: int):
    """`model` with every weight moved one ulp up or down at random: what another rounding gives."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        up = torch.rand(p.shape, generator=g) < 0.5
        p.copy_(torch.nextafter(p, torch.where(up, float("inf"), float("-inf"))))
    return model


def _variant_rows(size: str, variant: str, oracle_dir: Path, ours_dir: Path, seed: int) -> list[dict]:
    """Every scenario of one (size, variant) in fp32 and bf16."""
    from transformers import DiffusionGemmaForBlockDiffusion

    fp32, bf16 = torch.float32, torch.bfloat16
    oracles = {dt: DiffusionGemmaForBlockDiffusion.from_pretrained(oracle_dir, dtype=dt).eval() for dt in (fp32, bf16)}
    ours = {dt: load_quiet(ours_dir, dtype=dt) for dt in (fp32, bf16)}
    noisy = _one_ulp_away(load_quiet(ours_dir, dtype=fp32), seed)
    tolerance, state_tolerance = fp32_tolerances(ours[fp32])
    rows = []
    for scenario, (lengths, commit) in parity_scenarios(SIZES[size][0].get("sliding_window", 16)).items():
        kw = dict(prompt_lengths=lengths, commit=commit, seed=seed)
        for dtype_name, dt in (("fp32", fp32), ("bf16", bf16)):
            diffs = parity_case(oracles[dt], ours[dt], **kw)
            row = {
                "size": size,
                "variant": variant,
                "dtype": dtype_name,
                "scenario": scenario,
                "max_logit_diff": _worst(diffs, "logits"),
                "max_hidden_diff": _worst(diffs, "hidden"),
                "max_kv_diff": diffs["prefill_kv"],
            }
            if dt == fp32:
                row["one_ulp_noise"] = _worst(parity_case(oracles[fp32], noisy, **kw), "logits")
                row["tolerance"], row["state_tolerance"] = tolerance, state_tolerance
            else:  # each bf16 model's distance from the fp32 result
                row["ours_vs_fp32"] = _worst(parity_case(oracles[fp32], ours[bf16], **kw), "logits")
                row["oracle_vs_fp32"] = _worst(parity_case(oracles[bf16], ours[fp32], **kw), "logits")
            rows.append(row)
    return rows


def _print_table(rows: list[dict]) -> None:
    header = (
        f"{'size':7s} {'variant':8s} {'dtype':5s} {'scenario':20s} {'max |logit diff|':>17s} "
        f"{'hidden':>10s} {'kv':>10s}   {'fp32: 1-ulp':>11s} {'tolerance':>10s}   "
        f"{'bf16: ours vs fp32':>18s} {'oracle vs fp32':>15s}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["dtype"] == "fp32":
            extra = f"   {r['one_ulp_noise']:11.3e} {r['tolerance']:10.3e}"
        else:
            extra = f"   {'':11s} {'':10s}   {r['ours_vs_fp32']:18.3e} {r['oracle_vs_fp32']:15.3e}"
        print(
            f"{r['size']:7s} {r['variant']:8s} {r['dtype']:5s} {r['scenario']:20s} {r['max_logit_diff']:17.3e} "
            f"{r['max_hidden_diff']:10.3e} {r['max_kv_diff']:10.3e}{extra}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "medium"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    start = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            overrides, canvas = SIZES[size]
            d = Path(tmp) / size
            kw = dict(seed=args.seed, canvas_length=canvas, **overrides)
            make_oracle_checkpoint(d / "moe", **kw)
            make_oracle_checkpoint(d / "dense", dense=True, **kw)
            dense_checkpoint_from_oracle(d / "dense", d / "dense_only")
            rows += _variant_rows(size, "moe", d / "moe", d / "moe", args.seed)
            rows += _variant_rows(size, "dense", d / "dense", d / "dense_only", args.seed)
    _print_table(rows)
    fp32_rows = [r for r in rows if r["dtype"] == "fp32"]
    fp32 = max(r["max_logit_diff"] for r in fp32_rows)
    fp32_pass = all(
        r["max_logit_diff"] <= r["tolerance"] and max(r["max_hidden_diff"], r["max_kv_diff"]) <= r["state_tolerance"]
        for r in fp32_rows
    )
    noise = max(r["one_ulp_noise"] for r in fp32_rows)
    bf16 = max(r["max_logit_diff"] for r in rows if r["dtype"] == "bf16")
    ours_err = max(r["ours_vs_fp32"] for r in rows if "ours_vs_fp32" in r)
    oracle_err = max(r["oracle_vs_fp32"] for r in rows if "oracle_vs_fp32" in r)
    verdict = "PASS" if fp32_pass else "FAIL"
    print(
        f"\nfp32: worst logit diff vs the oracle {fp32:.3e}, each case within its tolerance: {verdict} "
        f"(1-ulp noise up to {noise:.3e})"
    )
    print(
        f"bf16: worst logit diff vs the bf16 oracle {bf16:.3e}; distance from fp32: dgemma {ours_err:.3e}, "
        f"oracle {oracle_err:.3e}; {time.time() - start:.1f} s"
    )
    result = {
        "benchmark": "parity",
        "oracle": "transformers==5.23.0",
        "fp32_max_logit_diff": fp32,
        "fp32_max_one_ulp_noise": noise,
        "bf16_max_logit_diff": bf16,
        "bf16_ours_vs_fp32": ours_err,
        "bf16_oracle_vs_fp32": oracle_err,
        "fp32_pass": fp32_pass,
        "cases": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
