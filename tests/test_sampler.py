"""DistributedSampler and DistributedBatchIterator (seed 004 names, Note [Sampler layout]).

The layout is a pure function of (dataset_size, world, rank, seed, epoch), so most checks
build every rank's sampler in one process with explicit num_replicas/rank; the multi-process
tests check that real ranks take their rank and world size from the process group and agree.
"""
import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed


def all_ranks(n, world, **kw):
    return [D.DistributedSampler(n, num_replicas=world, rank=r, **kw) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 1, 3, 10, 11, 100, 101])
@pytest.mark.parametrize("shuffle", [False, True])
def test_union_covers_the_data_set_and_only_padding_repeats(world, n, shuffle):
    samplers = all_ranks(n, world, shuffle=shuffle, seed=7)
    local = -(-n // world)  # ceil
    idx = [s.get_indices() for s in samplers]
    assert all(len(i) == local for i in idx)
    assert all(s.local_size() == local and s.total_size() == n and s.padded_size() == local * world
               for s in samplers)
    flat = np.concatenate([np.asarray(i, np.int64) for i in idx]) if n else np.zeros(0, np.int64)
    assert set(flat.tolist()) == set(range(n))
    counts = np.bincount(flat, minlength=n) if n else np.zeros(0)
    # padding wraps around: local*world - n extra samples, each index at most ceil(world/n)+1 times
    assert counts.sum() - n == local * world - n
    if n >= world:
        assert counts.max() <= 2
    if not shuffle:
        # rank r takes r, r+world, ... of the padded order 0..n-1, 0, 1, ...
        for r, i in enumerate(idx):
            assert i == [(k * world + r) % n for k in range(local)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [10, 11, 101])
def test_drop_last_drops_the_tail_and_nothing_repeats(world, n):
    samplers = all_ranks(n, world, shuffle=True, seed=3, drop_last=True)
    idx = [s.get_indices() for s in samplers]
    assert all(len(i) == n // world for i in idx)
    flat = sum(idx, [])
    assert len(flat) == len(set(flat)) == (n // world) * world == samplers[0].padded_size()
    assert set(flat) <= set(range(n))


def test_shuffle_is_the_same_for_a_seed_and_epoch_and_differs_across_epochs_and_seeds():
    a, b = all_ranks(1000, 4, seed=42), all_ranks(1000, 4, seed=42)
    for s in a + b:
        s.set_epoch(3)
    assert [s.get_indices() for s in a] == [s.get_indices() for s in b]
    before = a[0].get_indices()
    a[0].set_epoch(4)
    assert a[0].get_indices() != before
    c = D.DistributedSampler(1000, seed=43, num_replicas=4, rank=0)
    c.set_epoch(3)
    assert c.get_indices() != before
    assert all_ranks(50, 1, shuffle=False)[0].get_indices() == list(range(50))


def test_batch_iterator_cuts_the_indices_into_batches():
    s = D.DistributedSampler(23, shuffle=True, seed=1, num_replicas=2, rank=1)   # 12 samples
    it = D.DistributedBatchIterator(s, batch_size=5)
    assert it.num_batches() == 3 and len(it) == 3
    got = []
    while it.has_next():
        got.append(it.next())
    assert [len(b) for b in got] == [5, 5, 2]
    assert sum(got, []) == s.get_indices()
    assert [b for b in it] == got                       # Python iteration restarts the epoch
    it.reset(epoch=1)
    assert s.epoch == 1 and it.position() == 0
    assert sum(list(it), []) == s.get_indices() != sum(got, [])
    dl = D.DistributedBatchIterator(s, batch_size=5, drop_last=True)
    assert dl.num_batches() == 2 and [len(b) for b in dl] == [5, 5]
    it.reset(1)
    it.set_position(2)
    assert it.next() == s.get_indices()[10:]


def test_batch_iterator_past_the_end_says_to_reset():
    it = D.DistributedBatchIterator(D.DistributedSampler(4, num_replicas=1, rank=0), batch_size=4)
    it.next()
    with pytest.raises(ValueError, match=r"all 1 batches of epoch 0 have been returned; call reset\(epoch\)"):
        it.next()
    with pytest.raises(ValueError, match="position 5 is past the 1 batches"):
        it.set_position(5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dataset_size must be >= 0, got -1"):
        D.DistributedSampler(-1, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"rank 4 is out of range for 4 replicas \(valid: 0..3\)"):
        D.DistributedSampler(10, num_replicas=4, rank=4)
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        D.DistributedSampler(10, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        D.DistributedBatchIterator(D.DistributedSampler(10, num_replicas=1, rank=0), 0)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        D.DistributedSampler(10, num_replicas=1, rank=0).set_epoch(-2)


def test_without_a_process_group_rank_and_world_must_be_given():
    assert not D.is_initialized()
    with pytest.raises(ValueError, match=r"call cx.distributed.init\(\) first or pass num_replicas= and rank="):
        D.DistributedSampler(10)


# ---- real processes ---------------------------------------------------------------

def sampler_in_group(n, epochs):
    s = D.DistributedSampler(dataset_size=n, shuffle=True, seed=42, drop_last=False)
    it = D.DistributedBatchIterator(s, batch_size=8)
    out = []
    for e in range(epochs):
        it.reset(epoch=e)
        out.append((s.rank, s.num_replicas, it.num_batches(), [b for b in it]))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_take_their_share_from_the_process_group_and_agree(world):
    n = 101
    res = ranks.run(sampler_in_group, world, args=(n, 3))
    for e in range(3):
        per_rank = [res[r][e] for r in range(world)]
        assert [p[0] for p in per_rank] == list(range(world))
        assert all(p[1] == world for p in per_rank)
        assert len({p[2] for p in per_rank}) == 1          # every rank has the same number of batches
        union = set()
        for r, p in enumerate(per_rank):
            flat = sum(p[3], [])
            ref = D.DistributedSampler(n, seed=42, num_replicas=world, rank=r)
            ref.set_epoch(e)
            assert flat == ref.get_indices()               # identical to an independent process's layout
            union |= set(flat)
        assert union == set(range(n))
    assert res[0][0][3] != res[0][1][3]
