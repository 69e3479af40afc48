"""The drafter family contract (models/family.py): every registered family declares a complete `FamilySpec`,
an unsupported loss fails at config time in one line, and a fifth (toy) family plugs in with one module: this
file is that module (`FAMILY` below), registered, built, trained one step and decoded losslessly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from specdraft.data.collate import Collator
from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.proposers import drafter_family, make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.eval.tree import DraftTree, ProposerSpec, pack_beams
from specdraft.models import registry
from specdraft.models.base_llm import forward_with_hidden
from specdraft.models.family import ALL_LOSSES, BUILTIN_PROPOSERS, FamilySpec
from specdraft.models.teacher_forced import compute_loss as teacher_forced_loss
from specdraft.testing import tiny_llama, tiny_target


# ---- every registered family ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(registry.FAMILY_MODULES))
def test_every_registered_family_declares_a_complete_spec(name: str) -> None:
    spec = registry.family_spec(name)
    assert spec.name == name and spec.config().architecture == name
    assert spec.model.config_class is spec.config
    assert registry.get_family(name).MODEL is spec.model  # the older names agree with the declaration
    assert callable(spec.build) and callable(spec.attach) and callable(spec.compute_loss)
    assert spec.proposer in BUILTIN_PROPOSERS
    assert spec.features in ("last", "layers") and set(spec.losses) <= set(ALL_LOSSES) and "ce" in spec.losses
    assert isinstance(spec.layers_for(spec.config()), tuple)
    for old in ("TARGET_LAYERS", "LOW_PRECISION_OUTPUTS", "USES_TOKEN_COUNTS"):  # replaced by the spec
        assert not hasattr(registry.get_family(name), old)


def test_declared_capabilities_of_the_four_families() -> None:
    spec = {name: registry.family_spec(name) for name in registry.FAMILY_MODULES}
    assert spec["eagle3"].features == "layers" and not spec["eagle3"].decode_last_hidden
    assert spec["eagle3"].layers_for(spec["eagle3"].config(target_layers=[2, 5])) == (2, 5)
    assert spec["medusa"].layers_for(spec["medusa"].config()) == ()
    assert spec["eagle"].losses == spec["eagle3"].losses == ("ce", "ce+lk")  # no kl variant
    assert spec["redrafter"].losses == spec["medusa"].losses == ALL_LOSSES
    assert spec["redrafter"].low_precision_outputs and not spec["eagle"].low_precision_outputs
    assert [n for n, s in spec.items() if s.uses_token_counts] == ["redrafter", "medusa", "eagle", "eagle3"]
    assert [n for n, s in spec.items() if s.tree_accept is not None] == ["medusa"]  # a static tree
    # the copy gate's lookup candidates: declared by every family with a gate (from its config; 0 without one)
    assert spec["redrafter"].copy_ngram_of(spec["redrafter"].config(copy_ngram=4)) == 4
    assert spec["redrafter"].copy_ngram_of(spec["redrafter"].config()) == 0
    gated = [n for n, s in spec.items() if s.copy_ngram is not None]
    assert gated == ["redrafter", "medusa", "eagle", "eagle3"]
    assert spec["eagle"].copy_ngram_of(spec["eagle"].config(copy_ngram=2)) == 2
    assert spec["eagle3"].copy_ngram_of(spec["eagle3"].config(copy_ngram=3)) == 3
    assert spec["eagle3"].copy_ngram_of(spec["eagle3"].config()) == 0
    assert spec["medusa"].copy_ngram_of(spec["medusa"].config()) == 0
    assert spec["medusa"].copy_ngram_of(spec["medusa"].config(copy_ngram=4)) == 4


def test_an_incomplete_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="proposer=.*nowhere.*losses=.*mse"):
        FamilySpec("toy", ToyDrafter, ToyConfig, build, attach, compute_loss, "nowhere", losses=("ce", "mse"))
    with pytest.raises(ValueError, match="config.architecture='toy' != name"):
        FamilySpec("other", ToyDrafter, ToyConfig, build, attach, compute_loss, "medusa_tree")
    with pytest.raises(ValueError, match="features='layers' needs target_layers"):
        FamilySpec(
            "toy", ToyDrafter, ToyConfig, build, attach, compute_loss, "medusa_tree", features="layers"
        )
    with pytest.raises(ValueError, match="tree_accept is not callable"):
        FamilySpec("toy", ToyDrafter, ToyConfig, build, attach, compute_loss, "medusa_tree", tree_accept=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="copy_ngram is not callable"):
        FamilySpec("toy", ToyDrafter, ToyConfig, build, attach, compute_loss, "medusa_tree", copy_ngram=4)  # type: ignore[arg-type]


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specdraft.conf.schema import register_configs

    GlobalHydra.instance().clear()
    register_configs()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_an_unsupported_loss_fails_at_config_time_in_one_line() -> None:
    from specdraft.conf.validate import validate_config

    with pytest.raises(ValueError) as err:
        validate_config(_compose("conf=eagle_smollm2", "train.loss=ce+kl"))
    msg = str(err.value)
    assert msg == "train.loss=ce+kl: drafter family eagle implements ce, ce+lk; pass e.g. train.loss=ce"
    validate_config(_compose("conf=medusa_smollm2", "train.loss=ce+kl"))  # teacher-forced: every loss


# ---- a fifth family in one module: this one ---------------------------------------------------------------------
class ToyConfig(PretrainedConfig):
    """A Medusa-like toy: slot k's logits from tanh(W h_t + e(root))."""

    model_type = "specdraft_toy"
    architecture: str = "toy"  # family name (models/registry.py)
    base_hidden_size: int = 32  # H
    vocab_size: int = 128  # V
    draft_len: int = 3  # D


class ToyDrafter(PreTrainedModel):
    """forward(hidden (B, L, H), root (B, L), targets (B, L, D)) -> logits (B, L, D, V) (targets unused)."""

    config_class = ToyConfig

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        h, v = config.base_hidden_size, config.vocab_size
        self.proj, self.embed = nn.Linear(h, h), nn.Embedding(v, h)
        self.heads = nn.Linear(h, config.draft_len * v)
        self.post_init()

    def forward(self, hidden: Tensor, root: Tensor, targets: Tensor) -> Tensor:
        """(B, L, H), (B, L), (B, L, D) -> (B, L, D, V)."""
        x = torch.tanh(self.proj(hidden.to(self.proj.weight)) + self.embed(root))  # (B, L, H)
        return self.heads(x).unflatten(-1, (self.config.draft_len, self.config.vocab_size))  # (B, L, D, V)


def build(schema: Any, target: PreTrainedModel, fingerprint: dict[str, Any], **_: Any) -> ToyDrafter:
    """A fresh toy drafter for `target`."""
    h, v = int(fingerprint["hidden_size"]), int(fingerprint["vocab_size"])
    return ToyDrafter(ToyConfig(base_hidden_size=h, vocab_size=v, draft_len=int(schema.draft_len)))


def attach(model: ToyDrafter, target: PreTrainedModel) -> ToyDrafter:
    """Nothing is borrowed."""
    return model


def compute_loss(
    model: nn.Module, batch: dict[str, Tensor], target_out: Any, opts: dict[str, Any] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The shared teacher-forced loss (ce / kl / lk on `forward(hidden, root, targets)`)."""
    return teacher_forced_loss(model, batch, target_out, opts)


class ToyChainProposer:
    """Drafts one chain: the root, then each slot's argmax."""

    last_compression: float | None = None

    def __init__(self, drafter: ToyDrafter, **_: Any) -> None:
        self.drafter, d = drafter, int(drafter.config.draft_len)
        self.spec = ProposerSpec(max_depth=d, node_budget=1 + d)

    def reset(self) -> None:
        """No state across prompts."""

    def fit_budget(self, nodes: int) -> None:
        """The decoder cuts the chain."""

    @torch.no_grad()
    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """hidden (n, H), tokens (n,) -> a chain tree of 1 + D nodes."""
        d = self.drafter.config.draft_len
        logits = self.drafter(
            hidden[-1][None, None], tokens[-1:][None], tokens.new_zeros(1, 1, d)
        )  # (1,1,D,V)
        chain = torch.cat([tokens[-1:], logits[0, 0].argmax(-1).to(tokens)])  # (1 + D,)
        return pack_beams(chain[None])[0]


FAMILY = FamilySpec(
    name="toy",
    model=ToyDrafter,
    config=ToyConfig,
    build=build,
    attach=attach,
    compute_loss=compute_loss,
    proposer=f"{__name__}:ToyChainProposer",
    features="last",
    decode_last_hidden=True,
    losses=("ce", "ce+lk"),
)


@pytest.fixture
def toy_family(monkeypatch: pytest.MonkeyPatch) -> FamilySpec:
    monkeypatch.setitem(registry.FAMILY_MODULES, "toy", __name__)  # = registry.register_family, undone after
    return registry.family_spec("toy")


def test_a_fifth_family_builds_trains_and_decodes(toy_family: FamilySpec) -> None:
    torch.manual_seed(0)
    target = tiny_llama(num_layers=2)
    fingerprint = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "abc"}
    model = toy_family.build(OmegaConf.create({"draft_len": 3}), target, fingerprint)
    model = toy_family.attach(model, target)
    assert drafter_family(model) == "toy" and registry.spec_of(model) is toy_family
    assert toy_family.layers_for(model.config) == ()

    # training steps through the declared compute_loss, as train/loop.py runs it
    items = []
    for n in (20, 16):
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 3 :] = 1
        items.append({"input_ids": torch.randint(5, 128, (n,)), "loss_mask": mask})
    batch = Collator(pad_id=0, draft_len=3)(items)
    tout = forward_with_hidden(target, batch["input_ids"], attention_mask=batch["attention_mask"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss, aux = toy_family.compute_loss(model, batch, tout, {"draft_len": 3, "loss": "ce+lk"})
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert aux["logits"].shape[1:] == (3, 128) and aux["targets"].shape[1] == 3
    assert losses[-1] < losses[0]

    # decoding: make_proposer resolves the declared builder; speculative greedy == AR greedy on both paths
    target64 = tiny_target()
    proposer = make_proposer(model.double().eval())
    assert isinstance(proposer, ToyChainProposer)
    prompt = torch.randint(5, 128, (9,), generator=torch.Generator().manual_seed(1))
    ref, _ = ar_generate(target64, None, prompt, 20, stop_ids=set())
    out, stats = speculative_generate(target64, None, prompt, proposer, 20, stop_ids=set())
    static, _ = StaticDecoder(target64, 128).speculative_generate(None, prompt, proposer, 20, stop_ids=set())
    assert out == ref == static and stats.steps <= 20
