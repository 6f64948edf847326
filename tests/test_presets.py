"""The benchmark presets are the published configs (../shared/configs holds a copy of each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baryon.bench.presets import PRESETS, resolve_model
from conftest import STORIES_PATH

SHARED_CONFIGS = STORIES_PATH.parents[1] / "configs"


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_is_the_published_config(name):
    published = SHARED_CONFIGS / f"{name}.json"
    if not published.is_file():
        pytest.skip(f"{published} not found (../shared/configs)")
    shared = json.loads(published.read_text())
    preset = PRESETS[name]
    assert {k: v for k, v in preset.items() if shared.get(k) != v} == {}
    written = json.loads((Path(resolve_model(name)) / "config.json").read_text())
    assert written == preset
