import pytest

from gspo_megatron.parallel.layout import LayoutError, ParallelLayout

MODEL = dict(num_layers=4, num_attention_heads=4, num_query_groups=2, vocab_size=512, num_experts=4)


@pytest.mark.parametrize("layout, world, message", [
    (ParallelLayout(tensor=2, pipeline=2), 6, r"world size 6 is not divisible by tensor x pipeline = 2 x 2 = 4"),
    (ParallelLayout(expert=3), 3, r"num_experts 4 is not divisible by expert 3"),
    (ParallelLayout(tensor=4, expert=2), 4, r"world size 4 is not divisible by expert_tensor x expert x pipeline = 4 x 2 x 1 = 8"),
    (ParallelLayout(tensor=8), 8, r"num_attention_heads 4 is not divisible by tensor 8"),
    (ParallelLayout(pipeline=2, virtual_pipeline=4), 2, r"num_layers 4 is not divisible by pipeline x virtual_pipeline = 2 x 4 = 8"),
    (ParallelLayout(pipeline=3), 3, r"num_layers 4 is not divisible by pipeline x virtual_pipeline = 3 x 1 = 3"),
    (ParallelLayout(virtual_pipeline=2), 1, r"virtual_pipeline=2 needs pipeline > 1"),
    (ParallelLayout(tensor=0), 1, r"parallel.tensor must be >= 1, got 0"),
    (ParallelLayout(tensor=2, sequence_parallel=False), 2, r"needs sequence_parallel=True"),
])
def test_impossible_layouts_name_the_numbers(layout, world, message):
    with pytest.raises(LayoutError, match=message):
        layout.validate(world, **MODEL)


def test_kv_heads_and_vocab_must_divide_tp():
    with pytest.raises(LayoutError, match="num_key_value_heads .query groups. 1 is not divisible by tensor 2"):
        ParallelLayout(tensor=2).validate(2, **{**MODEL, "num_query_groups": 1})
    with pytest.raises(LayoutError, match="vocab_size 511 is not divisible by tensor 2"):
        ParallelLayout(tensor=2).validate(2, **{**MODEL, "vocab_size": 511})


def test_dense_model_rejects_expert_parallel():
    with pytest.raises(LayoutError, match="expert=2 but the model is dense"):
        ParallelLayout(expert=2).validate(2, **{**MODEL, "num_experts": None})


@pytest.mark.parametrize("layout, world, dp", [
    (ParallelLayout(tensor=2, pipeline=2, expert=2), 8, 2),
    (ParallelLayout(pipeline=2, virtual_pipeline=2), 2, 1),
    (ParallelLayout(), 2, 2),
])
def test_possible_layouts_pass_and_derive_dp(layout, world, dp):
    layout.validate(world, **MODEL)
    assert layout.data_parallel(world) == dp


def test_sequence_parallel_default_on_only_for_moe_with_tp():
    assert ParallelLayout(tensor=2).use_sequence_parallel(is_moe=True)
    assert not ParallelLayout(tensor=2).use_sequence_parallel(is_moe=False)
    assert not ParallelLayout().use_sequence_parallel(is_moe=True)
    assert ParallelLayout(tensor=2, sequence_parallel=True).use_sequence_parallel(is_moe=False)


@pytest.mark.parametrize("layout, world, message", [
    (ParallelLayout(pipeline=3, first_stage_layers=1), 3, r"num_layers 4 - first_stage_layers 1 = 3 middle layers are not divisible by middle stages x virtual_pipeline = 2 x 1 = 2"),
    (ParallelLayout(pipeline=2, first_stage_layers=4), 2, r"first_stage_layers 4 layers leave no layer of num_layers 4 for the 1 middle stage"),
    (ParallelLayout(pipeline=2, virtual_pipeline=2, last_stage_layers=1), 2, r"last_stage_layers=1 is not divisible by virtual_pipeline 2"),
    (ParallelLayout(last_stage_layers=4), 1, r"last_stage_layers=4 needs pipeline > 1"),
])
def test_impossible_uneven_pipelines_name_the_numbers(layout, world, message):
    with pytest.raises(LayoutError, match=message):
        layout.validate(world, **MODEL)


@pytest.mark.parametrize("layout, world, stages", [
    (ParallelLayout(pipeline=2, first_stage_layers=3), 2, [3, 1]),
    (ParallelLayout(pipeline=2, last_stage_layers=1), 2, [3, 1]),
    (ParallelLayout(pipeline=3, first_stage_layers=2), 3, [2, 1, 1]),
    (ParallelLayout(pipeline=3, first_stage_layers=1, last_stage_layers=1), 3, [1, 2, 1]),
    (ParallelLayout(tensor=2, pipeline=2, expert=2, first_stage_layers=1, last_stage_layers=3), 8, [1, 3]),
])
def test_uneven_pipelines_pass_with_their_stage_sizes(layout, world, stages):
    layout.validate(world, **MODEL)
    assert layout.stage_layers(MODEL["num_layers"]) == stages
