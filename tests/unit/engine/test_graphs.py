"""Captured-step bookkeeping (disagg.engine.graphs): buckets, padding, static buffers. CPU only."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.graphs import (
    DEFAULT_BUCKETS,
    KEY,
    POSITION,
    SEQ_LEN,
    TABLE,
    TEMPERATURE,
    TOKEN,
    TOP_K,
    TOP_P,
    GraphConfig,
    StaticBuffers,
    StepInputs,
    unpad,
)

SCRATCH = 99


def _config(**overrides: object) -> GraphConfig:
    settings: dict = dict(max_batch_size=8, max_blocks=6, block_size=4, scratch_block=SCRATCH)
    settings.update(overrides)
    return GraphConfig(**settings)


def _inputs(n: int, width: int = 3, *, first_block: int = 0) -> StepInputs:
    """n rows: token 10 + row at position 4 * width - 1 - row, blocks first_block + row * width + ..."""
    table = torch.arange(n * width, dtype=torch.long).view(n, width) + first_block
    return StepInputs(
        tokens=torch.arange(n, dtype=torch.long) + 10,
        positions=4 * width - 1 - torch.arange(n, dtype=torch.long),
        block_table=table,
        temperature=torch.full((n,), 0.5),
        top_k=torch.full((n,), 7, dtype=torch.long),
        top_p=torch.full((n,), 0.9),
        keys=torch.arange(n, dtype=torch.long) + 1000,
    )


# ----------------------------------------------------------------- buckets


def test_buckets_are_capped_at_the_batch_limit():
    assert _config(max_batch_size=64).sizes == (1, 2, 4, 8, 16, 32, 64)
    assert _config(max_batch_size=48).sizes == (1, 2, 4, 8, 16, 32, 48)
    assert _config(max_batch_size=1).sizes == (1,)
    assert _config(max_batch_size=500).sizes == DEFAULT_BUCKETS
    assert _config(max_batch_size=500).rows == 128
    assert _config(max_batch_size=10, buckets=(2, 6)).sizes == (2, 6)


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    config = _config(max_batch_size=48)
    assert [config.bucket_for(n) for n in (1, 2, 3, 4, 5, 17, 32, 33, 48)] == [1, 2, 4, 4, 8, 32, 32, 48, 48]
    assert config.bucket_for(49) is None  # above every bucket: run eagerly
    assert _config(max_batch_size=10, buckets=(2, 6)).bucket_for(7) is None


@pytest.mark.parametrize("rows", [0, -1, 1.5, True])
def test_bucket_for_refuses_a_row_count_that_is_not_positive(rows):
    with pytest.raises(ValueError, match="rows"):
        _config().bucket_for(rows)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(buckets=()), "buckets"),
        (dict(buckets=(1, 4, 2)), "buckets"),
        (dict(buckets=(1, 1, 2)), "buckets"),
        (dict(buckets=(0, 2)), "buckets"),
        (dict(buckets=(1, True)), "buckets"),
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(max_blocks=0), "max_blocks"),
        (dict(block_size=-4), "block_size"),
        (dict(scratch_block=-1), "scratch_block"),
        (dict(scratch_block=1.0), "scratch_block"),
    ],
)
def test_a_bad_config_is_refused_naming_its_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        _config(**overrides)


def test_the_config_is_frozen():
    with pytest.raises(AttributeError):
        _config().max_blocks = 3  # type: ignore[misc]


# ----------------------------------------------------------------- static buffers


def _assert_padding(buffers: StaticBuffers, rows: range) -> None:
    ints, floats = buffers.ints, buffers.floats
    for row in rows:
        assert ints[row, TOKEN] == 0 and ints[row, POSITION] == 0 and ints[row, SEQ_LEN] == 1
        assert ints[row, TOP_K] == 0 and ints[row, KEY] == 0
        assert (ints[row, TABLE:] == SCRATCH).all(), "a padding row writes to the scratch block only"
        assert floats[row, TEMPERATURE] == 0.0 and floats[row, TOP_P] == 1.0  # greedy


def test_buffers_start_as_padding_so_a_capture_reads_valid_blocks():
    buffers = StaticBuffers(_config())
    assert buffers.ints.shape == (8, TABLE + 6) and buffers.floats.shape == (8, 2)
    _assert_padding(buffers, range(8))


def test_a_step_is_copied_in_and_padded_up_to_its_bucket():
    buffers = StaticBuffers(_config())
    inputs = _inputs(3)
    assert buffers.load(inputs) == 4
    view = buffers.view(4)
    assert view.tokens.tolist() == [10, 11, 12, 0]
    assert view.positions.tolist() == [11, 10, 9, 0]
    assert view.seq_lens.tolist() == [12, 11, 10, 1]
    assert view.top_k.tolist() == [7, 7, 7, 0]
    assert view.keys.tolist() == [1000, 1001, 1002, 0]
    assert view.temperature.tolist() == pytest.approx([0.5, 0.5, 0.5, 0.0])
    assert view.top_p.tolist() == pytest.approx([0.9, 0.9, 0.9, 1.0])
    assert view.block_table[:3, :3].tolist() == inputs.block_table.tolist()
    assert (view.block_table[:3, 3:] == SCRATCH).all()  # past a row's own blocks
    _assert_padding(buffers, range(3, 8))


def test_a_smaller_step_after_a_larger_one_leaves_no_stale_rows():
    buffers = StaticBuffers(_config())
    assert buffers.load(_inputs(7, width=6)) == 8
    assert buffers.load(_inputs(2, width=2, first_block=40)) == 2
    view = buffers.view(2)
    assert view.block_table.tolist() == [[40, 41, *[SCRATCH] * 4], [42, 43, *[SCRATCH] * 4]]
    assert buffers.load(_inputs(3, width=2)) == 4
    _assert_padding(buffers, range(3, 4))  # row 3 held a real row of the 7-row step


def test_views_are_fixed_addresses_in_the_buffers():
    buffers = StaticBuffers(_config())
    before = {size: buffers.view(size) for size in buffers.config.sizes}
    buffers.load(_inputs(5))
    for size, view in before.items():
        again = buffers.view(size)
        assert view.tokens.data_ptr() == again.tokens.data_ptr() == buffers.ints.data_ptr()
        assert view.block_table.data_ptr() == again.block_table.data_ptr()
        assert view.block_table.shape == (size, 6) and view.block_table.stride(1) == 1
    assert before[8].tokens.tolist()[:5] == [10, 11, 12, 13, 14]  # a view sees each load


def test_view_refuses_a_size_that_is_not_a_bucket():
    with pytest.raises(ValueError, match="size"):
        StaticBuffers(_config()).view(3)


def test_load_refuses_more_rows_than_the_largest_bucket():
    with pytest.raises(ValueError, match="rows"):
        StaticBuffers(_config()).load(_inputs(9))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("positions", torch.zeros(2, dtype=torch.long)),
        ("temperature", torch.zeros(3, 1)),
        ("top_k", torch.zeros(4, dtype=torch.long)),
        ("top_p", torch.zeros(1)),
        ("keys", torch.zeros(2, dtype=torch.long)),
        ("block_table", torch.zeros(3, 7, dtype=torch.long)),  # wider than max_blocks
        ("block_table", torch.zeros(2, 3, dtype=torch.long)),
        ("tokens", torch.zeros(3, 1, dtype=torch.long)),
    ],
)
def test_load_refuses_inputs_of_the_wrong_shape_naming_the_field(field, value):
    inputs = _inputs(3)
    bad = StepInputs(**{**inputs.__dict__, field: value})
    with pytest.raises(ValueError, match=field):
        StaticBuffers(_config()).load(bad)


def test_load_refuses_a_position_past_the_rows_blocks():
    inputs = _inputs(2, width=2)
    bad = StepInputs(**{**inputs.__dict__, "positions": torch.tensor([3, 8])})  # 2 blocks of 4: 0..7
    with pytest.raises(ValueError, match="positions"):
        StaticBuffers(_config()).load(bad)


def test_unpad_drops_the_padding_rows():
    ids = torch.tensor([5, 6, 7, 0])
    assert unpad(ids, 3).tolist() == [5, 6, 7]
    for rows in (0, 5):
        with pytest.raises(ValueError, match="rows"):
            unpad(ids, rows)
