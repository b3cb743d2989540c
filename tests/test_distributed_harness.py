import pytest
import torch

from distributed import run_distributed


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()  # rank 0 would hang here forever without the harness's kill


@pytest.mark.slow
def test_allreduce_two_ranks():
    assert run_distributed(_allreduce_rank, 2) == [3.0, 3.0]


@pytest.mark.slow
def test_failure_on_one_rank_is_reported_not_hung():
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed:.*boom on purpose"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)


def _return_tensor(rank, world_size):
    return {"t": torch.full((3,), float(rank))}


@pytest.mark.slow
def test_tensors_survive_the_rank_process():
    out = run_distributed(_return_tensor, 2)
    assert torch.equal(out[1]["t"], torch.ones(3))


def _return_unpicklable(rank, world_size):
    return lambda: None


@pytest.mark.slow
def test_unserialisable_result_fails_at_once():
    with pytest.raises(RuntimeError, match="rank 0 of 1 failed"):
        run_distributed(_return_unpicklable, 1, timeout=60)
