"""The builder's args: validated once, before anything is bound; one home per option."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.engine import EngineSettings
from serve_app.app import BrownoutArgs, ModelArgs
from serve_app.ingress import IngressLimits

ROOT = Path(__file__).resolve().parents[2]


def shipped() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]


@pytest.mark.parametrize(("args", "pattern"), [
    ({"model": {"max_prompt_tokens": 2000}},
     r"max_prompt_tokens=2000 must be below max_model_len=1024"),
    ({"model": {"max_num_seqs": 0}}, r"model\.max_num_seqs\n.*greater than or equal to 1"),
    ({"model": {"model": "some/model"}}, r"model\.model\n.*Extra inputs are not permitted"),
    ({"model": {"dtype": "int3"}}, r"model\.dtype\n.*'auto', 'float32', 'bfloat16' or 'float16'"),
    ({"model": {"max_num_batched_tokens": 4}}, r"max_num_batched_tokens=4 is below max_num_seqs=16"),
    ({"model": {"stream_interval": 0}}, r"model\.stream_interval\n.*greater than or equal to 1"),
    ({"limits": {"default_max_tokens": 600}}, r"default_max_tokens=600 exceeds max_tokens_limit=512"),
    ({"pipeline": {"stage_timeout_s": 0}}, r"pipeline\.stage_timeout_s\n.*greater than 0"),
    ({"modle": {}}, r"modle\n.*Extra inputs are not permitted"),
])
def test_bad_args_fail_naming_key_and_value(args: dict, pattern: str) -> None:
    with pytest.raises(ValidationError, match=pattern):
        BrownoutArgs.model_validate(args)


def test_model_args_are_the_engine_settings_with_the_same_defaults() -> None:
    """ModelArgs adds where the model comes from; every engine option and default is EngineSettings'."""
    m = ModelArgs()
    for name, field in EngineSettings.model_fields.items():
        if name != "model":
            assert getattr(m, name) == field.default, name
    m = ModelArgs.model_validate({"source": "/models/llama", "max_num_seqs": 8, "dtype": "float32"})
    engine = m.engine()
    assert isinstance(engine, EngineSettings) and engine.model == "/models/llama"
    assert engine.max_num_seqs == 8 and engine.dtype == "float32" and engine.max_model_len == 1024
    assert m.source == "/models/llama"


def test_shipped_serve_config_args_validate_and_set_no_serve_option_twice() -> None:
    """Serve options live in serve_app/app.py only: the shipped config's deployments section
    carries the Ingress policy (its user_config, for hot reload) and nothing else."""
    app = shipped()
    args = BrownoutArgs.model_validate(app["args"])
    assert args.model.max_num_seqs == 16 and isinstance(args.limits, IngressLimits)
    assert [sorted(d) for d in app["deployments"]] == [["name", "user_config"]]
    assert app["deployments"][0]["name"] == "Ingress"
