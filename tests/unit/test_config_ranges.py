"""conf/validate.py: every schema field has a declared rule and a one-line comment; bad values fail in one line
naming the key, what is allowed and a value to pass; every shipped preset passes."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdraft.conf import validate
from specdraft.conf.schema import DRAFTER_SCHEMAS, RootConfig, register_configs
from specdraft.conf.validate import TABLES, validate_config

CONF = Path(__file__).resolve().parents[2] / "conf"
PRESETS = sorted(p.stem for p in (CONF / "conf").glob("*.yaml"))


def _compose(*overrides: str):
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _sections() -> set[str]:
    """RootConfig fields that are groups (checked with their own table), not values."""
    hints = typing.get_type_hints(RootConfig)
    return {f.name for f in dataclasses.fields(RootConfig) if hints[f.name] in TABLES} | {"drafter"}


@pytest.mark.parametrize("schema", list(TABLES), ids=lambda s: s.__name__)
def test_every_field_has_a_declared_rule(schema: type) -> None:
    """A new field must be given a range (or `ANY`) in conf/validate.py; a renamed one must not linger there."""
    fields = {f.name for f in dataclasses.fields(schema)} - (_sections() if schema is RootConfig else set())
    assert set(TABLES[schema]) == fields


def test_every_drafter_family_and_root_group_has_a_table() -> None:
    assert set(DRAFTER_SCHEMAS.values()) <= set(TABLES)
    assert set(validate.SECTIONS.values()) | {RootConfig} | set(DRAFTER_SCHEMAS.values()) == set(TABLES)


@pytest.mark.parametrize("schema", list(TABLES), ids=lambda s: s.__name__)
def test_every_field_has_a_one_line_comment(schema: type) -> None:
    """Every field's statement carries a `#` comment (on its line, or inside its parentheses when wrapped)."""
    source = textwrap.dedent(inspect.getsource(schema))
    comments = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef)
    missing = [
        node.target.id
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if not any(node.lineno <= line <= (node.end_lineno or node.lineno) for line in comments)
    ]
    assert not missing, f"{schema.__name__}: fields without a comment: {missing}"


def test_every_default_is_in_range() -> None:
    for schema, table in TABLES.items():
        instance = schema()
        for name, rule in table.items():
            if not (schema is RootConfig and name == "run_dir"):  # an interpolation
                assert rule.ok(getattr(instance, name)), f"{schema.__name__}.{name}"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_is_in_range(preset: str) -> None:
    validate_config(_compose(f"conf={preset}"))
    validate_config(_compose(f"conf={preset}", "debug=cpu"))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "train.batch_size=0",
            "train.batch_size=0: expected >= 1; pass e.g. train.batch_size=4 (the default)",
        ),
        ("drafter.draft_len=0", "drafter.draft_len=0: expected >= 1"),
        ("drafter.feature_dropout=1.0", "drafter.feature_dropout=1.0: expected in [0, 1)"),
        ("train.grad_accum=0", "train.grad_accum=0"),
        ("train.keep_last=-1", "train.keep_last=-1: expected >= 0"),
        ("train.eval_replay_rows=-1", "train.eval_replay_rows=-1: expected >= 0"),
        ("train.eval_replay_tokens=0", "train.eval_replay_tokens=0: expected >= 1"),
        ("train.loss=mse", "train.loss=mse: expected one of ce, kl, ce+kl"),
        ("train.seed=-1", "train.seed=-1"),
        ("train.slot_weights=[1.0,-1.0]", "train.slot_weights=[1.0,-1.0]"),
        ("train.mixed_precision=fp8", "train.mixed_precision=fp8: expected one of auto, no, bf16, fp16"),
        ("optim.scheduler=linear", "optim.scheduler=linear: expected one of cosine, constant"),
        ("optim.lr=0", "optim.lr=0.0: expected > 0"),
        ("optim.betas=[0.9,1.5]", "optim.betas=[0.9,1.5]"),
        ("logger.wandb_mode=cloud", "logger.wandb_mode=cloud: expected one of online, offline, disabled"),
        ("data.val_fraction=1.0", "data.val_fraction=1.0: expected in [0, 1)"),
        ("data.num_samples=0", "data.num_samples=0: expected null or >= 1"),
        ("base_model.dtype=fp8", "base_model.dtype=fp8: expected one of auto, fp32, bf16"),
        ("base_model.device=gpu", "base_model.device=gpu: expected auto, cpu, cuda, cuda:N or mps"),
        ("distill.T=0", "distill.T=0"),
        ("distill.top_p=0", "distill.top_p=0.0: expected in (0, 1]"),
        ("distill.feature_dtype=fp32", "distill.feature_dtype=fp32: expected one of bf16, fp16"),
        ("distill.capture_features=maybe", "distill.capture_features=maybe: expected auto | true | false"),
        ("eval.limit=0", "eval.limit=0: expected null or >= 1; pass e.g. eval.limit=10 (the default)"),
        ("eval.max_new_tokens=0", "eval.max_new_tokens=0: expected >= 1"),
        ("eval.max_new_tokens=-5", "eval.max_new_tokens=-5"),
        ("eval.acceptance=lossy", "eval.acceptance=lossy: expected one of exact, typical"),
        ("eval.baselines=[magic]", "eval.baselines=[magic]"),
        ("eval.benches=[]", "eval.benches=[]: expected a non-empty list"),
        ("eval.batch_min_prob=1.5", "eval.batch_min_prob=1.5: expected off, auto or a probability in (0, 1)"),
        ("eval.batch_min_prob=often", "eval.batch_min_prob=often: expected off, auto or a probability"),
        ("eval.batch_width=on", "eval.batch_width=on: expected one of off, auto"),
        ("eval.dtype=int8", "eval.dtype=int8"),
        ("eval.device=tpu", "eval.device=tpu"),
        ("eval.assistant_model=layers:0", "eval.assistant_model=layers:0"),
        ("name=../x", "name=../x: expected a plain folder name"),
        ("name=/etc", "name=/etc: expected a plain folder name"),
        ("name=a/b", "pass e.g. name=a_b, and output_root=<folder>"),
        ("name=..", "name=..: expected a plain folder name"),
    ],
)
def test_out_of_range_values_fail_in_one_line(override: str, expected: str) -> None:
    with pytest.raises(ValueError) as err:
        validate_config(_compose("conf=redrafter_smollm2", override))
    message = str(err.value)
    assert expected in message and "\n" not in message


@pytest.mark.parametrize(
    ("preset", "override", "expected"),
    [
        ("eagle_smollm2", "drafter.tree_depth=0", "drafter.tree_depth=0: expected >= 1"),
        ("eagle_smollm2", "drafter.noise=-0.1", "drafter.noise=-0.1: expected >= 0"),
        ("eagle3_smollm2", "drafter.ttt_decay=0", "drafter.ttt_decay=0.0: expected in (0, 1]"),
        ("medusa_smollm2", "drafter.topk=0", "drafter.topk=0"),
        (
            "redrafter_smollm2",
            "drafter.family=medusa",
            "drafter.family=medusa does not match the drafter group",
        ),
    ],
)
def test_the_drafter_is_checked_by_its_family(preset: str, override: str, expected: str) -> None:
    with pytest.raises(ValueError, match="^" + expected.replace("(", r"\(").replace("[", r"\[")):
        validate_config(_compose(f"conf={preset}", override))


def test_all_problems_are_listed_on_one_line() -> None:
    with pytest.raises(ValueError) as err:
        validate_config(_compose("conf=redrafter_smollm2", "train.batch_size=0", "drafter.draft_len=0"))
    assert str(err.value).count("expected") == 2 and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override",
    [
        *(f"base_model.dtype={d}" for d in validate.DTYPE_NAMES),
        *(f"base_model.device={d}" for d in ("auto", "cpu", "cuda", "cuda:3", "mps")),
        *(f"train.mixed_precision={m}" for m in ("auto", "no", "bf16", "fp16")),
        "eval.dtype=auto",
        "eval.device=cuda:0",
        "eval.limit=null",
        "eval.assistant_model=layers:2",
        "eval.baselines=[]",
        "name=my-run_2.1",
        "data.val_fraction=0",
        "optim.max_grad_norm=0",
        *(f"distill.capture_features={v}" for v in ("auto", "true", "false")),
    ],
)
def test_values_in_range_pass(override: str) -> None:
    validate_config(_compose("conf=redrafter_smollm2", override))


def test_choices_match_the_code_that_uses_them() -> None:
    """The tables name choices without importing torch; they must agree with the code that maps them."""
    from specdraft.data.features import FEATURE_DTYPES
    from specdraft.hardware import DTYPES

    assert set(validate.DTYPE_NAMES) == {"auto", *DTYPES}
    assert validate.DISTILL["feature_dtype"].allowed == f"one of {', '.join(FEATURE_DTYPES)}"
