"""The sampling settings are defined once (dgemma.generation.sampling): everything that takes them is generated from
their fields or checked against them here, so a new setting cannot be half-added."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from dgemma.generation.sampling import CHECKPOINT_DEFAULTED, SAMPLERS, SETTINGS, SamplingParams, check, validate
from dgemma.model.config import GenerationConfig

ROOT = Path(__file__).resolve().parent.parent


def test_every_setting_has_help_a_kind_and_a_finite_range_or_choices():
    assert set(SETTINGS) == {f.name for f in dataclasses.fields(SamplingParams)} - {"stop_token_ids"}
    for name, meta in SETTINGS.items():
        assert meta["help"] and meta["kind"] in (int, float, str, bool), name
        if meta["kind"] in (int, float):
            assert meta["low"] is not None and meta["high"] is not None and meta["high"] < float("inf"), name
        if meta["kind"] is str:
            assert meta["choices"], name
    assert set(SETTINGS["sampler"]["choices"]) == set(SAMPLERS)


def test_generation_config_follows_the_same_rules():
    defaults = GenerationConfig()
    for name in CHECKPOINT_DEFAULTED:
        assert getattr(defaults, name) is not None and check(name, getattr(defaults, name)) is None, name
    with pytest.raises(ValueError, match=r"t_min must be a number in \(0, 10\]"):  # 0 loaded, then every call failed
        GenerationConfig(t_min=0.0)
    with pytest.raises(ValueError, match=r"stability_threshold must be an integer in \[0, 1024\]"):
        GenerationConfig(stability_threshold=10**6)
    assert validate({"t_min": 0.9, "t_max": 0.5}) == ["need t_min < t_max (got t_min=0.9, t_max=0.5)"]


def test_the_server_request_fields_are_generated_from_the_settings():
    from dgemma.server.protocol import DiffusionSettings

    fields = DiffusionSettings.model_fields
    for name, meta in SETTINGS.items():
        if name == "max_new_tokens":  # the OpenAI name: max_tokens
            name = "max_tokens"
        if name == "early_commit":
            continue  # its default follows `stream`
        assert name in fields, name
        if meta["choices"]:
            assert set(typing.get_args(typing.get_args(fields[name].annotation)[0])) == set(meta["choices"]), name
            continue
        kinds = ("ge", "gt", "le")  # annotated_types' Ge(ge=...), Gt(gt=...), Le(le=...)
        bounds = {k: getattr(m, k) for m in fields[name].metadata for k in kinds if hasattr(m, k)}
        assert bounds.get("le") == meta["high"], name
        assert bounds.get("gt" if meta["open_low"] else "ge") == meta["low"], name


def test_the_command_line_has_a_flag_for_each_setting():
    import argparse

    from dgemma.cli.common import add_sampling_args

    p = argparse.ArgumentParser()
    add_sampling_args(p)
    dests = {a.dest: a for a in p._actions}
    for name, meta in SETTINGS.items():
        assert name in dests, name
        if meta["choices"]:
            assert set(dests[name].choices) == set(meta["choices"]), name


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*stage2*.yaml")), ids=lambda p: p.name)
def test_recipes_sampling_sections_name_valid_settings(recipe):
    stage2 = yaml.safe_load(recipe.read_text()).get("stage2") or {}
    for section in ("sampling", "teacher_sampling"):
        values = stage2.get(section) or {}
        assert set(values) <= set(SETTINGS), (recipe.name, section, set(values) - set(SETTINGS))
        assert validate(values) == [], (recipe.name, section)
