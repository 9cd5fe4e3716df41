"""ModelSpec.from_description is the inverse of describe, also through a trace's JSON metadata."""
from __future__ import annotations

import json

import pytest

from prefill_diff.engine.models.spec import ModelSpec

SPECS = [
    ModelSpec(),
    ModelSpec("seed-2.8", seed=3),
    ModelSpec("synthetic", 1, overrides=(("n_layers", 2), ("rope_scaling", (("factor", 8.0), ("rope_type", "linear"))),
                                         ("tie_embeddings", True))),
    ModelSpec("synthetic", 0, adapter=(("id", "lora"), ("rank", 2), ("scale", 0.5), ("seed", 4))),
    ModelSpec("gguf:/tmp/m.gguf"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.source)
def test_from_description_inverts_describe(spec):
    assert ModelSpec.from_description(spec.describe()) == spec
    through_json = json.loads(json.dumps(spec.describe()))  # as a trace stores it
    back = ModelSpec.from_description(through_json)
    assert back == spec
    assert hash(back) == hash(spec)  # usable as the snapshot cache key


def test_from_description_differs_when_the_description_does():
    d = SPECS[2].describe()
    d["overrides"]["n_layers"] = 3
    assert ModelSpec.from_description(d) != SPECS[2]


def test_from_description_accepts_rope_scaling_as_a_table():
    d = {"source": "synthetic", "seed": 0, "overrides": {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}}
    assert ModelSpec.from_description(d) == SPECS[2].__class__(
        overrides=(("rope_scaling", (("factor", 8.0), ("rope_type", "linear"))),))
