"""Parity report: dgemma vs transformers' DiffusionGemmaForBlockDiffusion on tiny random checkpoints.

For each size (tiny: 6 layers, 4 experts top-2; medium: 12 layers, 16 experts top-4, 2k vocab), variant
(MoE, dense-only), dtype (fp32, bf16) and scenario (short prompt, prompt longer than the sliding window,
second canvas after a commit, batch of 2 with left padding), prints the maximum absolute difference of
encoder hidden states, KV cache and denoise logits (with and without self-conditioning).
Ends with one JSON line. Run: python benchmarks/parity.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch

from dgemma.testing import (
    MEDIUM_TEXT,
    dense_checkpoint_from_oracle,
    load_quiet,
    make_oracle_checkpoint,
    parity_case,
    parity_scenarios,
)

SIZES = {"tiny": ({}, 8), "medium": (MEDIUM_TEXT, 32)}  # text overrides, canvas length


def _worst(diffs: dict[str, float], kind: str) -> float:
    return max(v for k, v in diffs.items() if kind in k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "medium"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers import DiffusionGemmaForBlockDiffusion
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
            scenarios = parity_scenarios(overrides.get("sliding_window", 16))
            for variant, oracle_dir, ours_dir in (("moe", "moe", "moe"), ("dense", "dense", "dense_only")):
                oracles = {
                    dt: DiffusionGemmaForBlockDiffusion.from_pretrained(d / oracle_dir, dtype=dt).eval()
                    for dt in (torch.float32, torch.bfloat16)
                }
                ours = {dt: load_quiet(d / ours_dir, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
                for scenario, (lengths, commit) in scenarios.items():
                    for dtype_name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                        diffs = parity_case(
                            oracles[dt], ours[dt], prompt_lengths=lengths, commit=commit, seed=args.seed
                        )
                        row = {
                            "size": size,
                            "variant": variant,
                            "dtype": dtype_name,
                            "scenario": scenario,
                            "max_logit_diff": _worst(diffs, "logits"),
                            "max_hidden_diff": _worst(diffs, "hidden"),
                            "max_kv_diff": diffs["prefill_kv"],
                        }
                        if dt == torch.bfloat16:  # each bf16 model's distance from the fp32 result
                            kw = dict(prompt_lengths=lengths, commit=commit, seed=args.seed)
                            row["ours_vs_fp32"] = _worst(parity_case(oracles[torch.float32], ours[dt], **kw), "logits")
                            row["oracle_vs_fp32"] = _worst(
                                parity_case(oracles[dt], ours[torch.float32], **kw), "logits"
                            )
                        rows.append(row)
    header = (
        f"{'size':7s} {'variant':8s} {'dtype':5s} {'scenario':20s} {'max |logit diff|':>17s} "
        f"{'hidden':>10s} {'kv':>10s}   {'bf16: ours vs fp32':>18s} {'oracle vs fp32':>15s}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        extra = f"   {r['ours_vs_fp32']:18.3e} {r['oracle_vs_fp32']:15.3e}" if "ours_vs_fp32" in r else ""
        print(
            f"{r['size']:7s} {r['variant']:8s} {r['dtype']:5s} {r['scenario']:20s} {r['max_logit_diff']:17.3e} "
            f"{r['max_hidden_diff']:10.3e} {r['max_kv_diff']:10.3e}{extra}"
        )
    fp32 = max(r["max_logit_diff"] for r in rows if r["dtype"] == "fp32")
    bf16 = max(r["max_logit_diff"] for r in rows if r["dtype"] == "bf16")
    ours_err = max(r["ours_vs_fp32"] for r in rows if "ours_vs_fp32" in r)
    oracle_err = max(r["oracle_vs_fp32"] for r in rows if "oracle_vs_fp32" in r)
    print(f"\nfp32: worst logit diff vs the oracle {fp32:.3e} (tolerance 1e-4: {'PASS' if fp32 <= 1e-4 else 'FAIL'})")
    print(
        f"bf16: worst logit diff vs the bf16 oracle {bf16:.3e}; distance from fp32: dgemma {ours_err:.3e}, "
        f"oracle {oracle_err:.3e}; {time.time() - start:.1f} s"
    )
    print(
        json.dumps(
            {
                "benchmark": "parity",
                "oracle": "transformers==5.23.0",
                "fp32_max_logit_diff": fp32,
                "bf16_max_logit_diff": bf16,
                "bf16_ours_vs_fp32": ours_err,
                "bf16_oracle_vs_fp32": oracle_err,
                "fp32_pass": fp32 <= 1e-4,
                "cases": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
