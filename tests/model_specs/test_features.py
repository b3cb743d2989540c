"""model_specs/features/ composed into families other than the shipped ones: what a declaration
gets wrong is refused by name, and a feature's option maps as its docstring says."""
from __future__ import annotations

import pytest

from model_specs.families import FAMILIES, Family
from model_specs.features.attention import GQA
from model_specs.features.mla import MLA
from model_specs.features.moe import MoE, SoftmaxRouter
from model_specs.features.rope import Rope
from model_specs.features.sigmoid_router import SigmoidRouter
from model_specs.features.sliding_window import SlidingWindow
from model_specs.hf.config import load_hf_config
from model_specs.hf.tiny import deepseek_v3, qwen3, qwen3_moe
from model_specs.shape import model_fields


def test_an_moe_family_needs_one_router():
    hf = qwen3_moe()
    for routers in ((), (SoftmaxRouter(), SigmoidRouter())):
        family = Family("qwen3_moe", ("qwen3_moe",), (GQA(), Rope(), MoE(), *routers))
        with pytest.raises(ValueError, match="an MoE family needs one router feature"):
            model_fields(family, hf)
    with pytest.raises(ValueError, match="shared_expert='gate'"):
        MoE(shared_expert="gate")


def test_features_needing_two_config_classes_are_refused():
    from model_specs.build import build_model_spec

    family = Family("deepseek_v3", ("deepseek_v3",),  # MLA and, wrongly, YaRN on GPTModel too
                    (MLA(), GQA(), Rope(), MoE(shared_expert="plain"), SigmoidRouter()))
    with pytest.raises(ValueError, match=r"2 TransformerConfig classes \(\['MLATransformerConfig', "
                                         r"'YarnTransformerConfig'\]\)"):
        build_model_spec(family, load_hf_config(deepseek_v3()), transformer_engine=False)


@pytest.mark.parametrize("window,every_layer,expected", [
    (8, True, [1, 1, 1, 1]), (None, True, None), (8, False, [1, 0, 1, 0])])
def test_sliding_window_on_every_layer_or_every_other(window, every_layer, expected):
    hf = qwen3(model_type="mistral", sliding_window=window)
    family = Family("mistral", ("mistral",), (GQA(), Rope(), SlidingWindow(every_layer)))
    fields = model_fields(family, hf).config
    assert fields.get("window_attn_skip_freq") == expected
    assert fields.get("window_size") == (None if expected is None else (window - 1, 0))


def test_every_shipped_family_starts_with_the_decoder_and_is_found_by_model_type():
    from model_specs.families import family_for
    from model_specs.features.decoder import Decoder

    for name, family in FAMILIES.items():
        assert isinstance(family.all_features[0], Decoder), name
        assert all(family_for({"model_type": m}) is family for m in family.model_types)
